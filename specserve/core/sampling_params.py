"""Per-request sampling parameters and their validation.

Owns what a client may ask of the sampler (temperature, top-p/k, min-p, penalties, logit
bias, a grammar constraint, seed, stops, logprobs) and the rules that make a request valid.
It does not know how sampling is done (`runner/sampler.py`, `runner/logits_process.py`),
how a grammar is compiled (`grammar/`) or how HTTP fields map onto it (`server/protocol.py`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries per request (OpenAI's limit)
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "ebnf", "lark")


@dataclass(frozen=True)
class Constraint:
    """A grammar the output must match: `kind` one of CONSTRAINT_KINDS, `source` its text
    (a JSON schema serialized, a regex, an EBNF/GBNF or Lark grammar; "" for json_object)."""

    kind: str
    source: str = ""


@dataclass
class SamplingParams:
    max_new_tokens: int | None = 128  # None: until EOS or the context is full
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) means the whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM/HF semantics: over prompt and output tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    constraint: Constraint | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether penalties read the request's history (its token counts)."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0)

    @property
    def processed(self) -> bool:
        """Whether the logits pass through per-request processors before sampling
        (runner/logits_process.py): penalties, logit bias or a grammar."""
        return self.penalized or bool(self.logit_bias) or self.constraint is not None

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the first bad field; called before a request is queued."""
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise ValueError(f"max_tokens must be non-negative, got {self.max_new_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k > vocab_size:
            raise ValueError(f"top_k must be -1, 0 or in [1, {vocab_size}], got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        self._validate_bias(vocab_size)
        if self.constraint is not None and self.constraint.kind not in CONSTRAINT_KINDS:
            raise ValueError(f"unknown constraint kind {self.constraint.kind!r}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if len(self.stop) > 16:
            raise ValueError(f"at most 16 stop strings are allowed, got {len(self.stop)}")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids out of range [0, {vocab_size}): {bad[:4]}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")

    def _validate_bias(self, vocab_size: int) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        for token, bias in self.logit_bias.items():
            if not 0 <= token < vocab_size:
                raise ValueError(f"logit_bias: token id {token} is out of range [0, {vocab_size})")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias: the bias of token {token} must be in [-100, 100], got {bias}")
