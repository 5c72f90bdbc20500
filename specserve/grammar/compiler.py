"""Constraint -> llguidance grammar -> matcher, with a compile cache.

Owns the one `llguidance.LLTokenizer` of a process (built from the model's tokenizer.json,
its vocabulary widened to the logits' width, the model's EOS ids as the grammar's end) and
the mapping of each constraint kind onto llguidance's grammar formats. `check` is the
front end's validation: a bad schema, regex or grammar, or one no text can satisfy, raises
`GrammarError` naming the problem. Matchers of a grammar seen before are deep copies of a
cached one (microseconds); a new grammar costs one build.

Invariant: a matcher this returns has consumed nothing.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict

import llguidance

from specserve.core.sampling_params import Constraint
from specserve.grammar.matcher import GrammarMatcher

CACHE_SIZE = 256  # compiled grammars kept per process
_JSON_OBJECT = json.dumps({"type": "object"})
# Whitespace between JSON tokens: free, as a pretty-printing model writes it, but at most 16
# characters a gap, so a sampled model cannot loop on whitespace until max_tokens.
JSON_OPTIONS = {"whitespace_pattern": r"[\n\t ]{0,16}"}
_FORMATS = {"regex": "regex", "ebnf": "ebnf", "lark": "lark"}


class GrammarError(ValueError):
    """A constraint that cannot be compiled or matched by any text."""


class GrammarCompiler:
    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=self.eos_ids)
        self._cache: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # the scheduler's builder thread and the caller may share it

    def grammar(self, c: Constraint) -> str:
        """llguidance's grammar text for `c` (not yet checked)."""
        try:
            if c.kind in ("json_schema", "json_object"):
                schema = _JSON_OBJECT if c.kind == "json_object" else c.source
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)  # type: ignore
            if c.kind not in _FORMATS:
                raise GrammarError(f"unknown constraint kind {c.kind!r}")
            return llguidance.grammar_from(_FORMATS[c.kind], c.source)  # type: ignore[arg-type]
        except ValueError as e:
            raise GrammarError(f"invalid {c.kind}: {e}") from None

    def check(self, c: Constraint) -> None:
        """Raise GrammarError if `c` does not compile or no text satisfies it."""
        self.matcher(c)

    def matcher(self, c: Constraint) -> GrammarMatcher:
        """A fresh matcher for `c` (GrammarError when it does not compile)."""
        with self._lock:
            template = self._cache.get(c)
            if template is not None:
                self._cache.move_to_end(c)
                return GrammarMatcher(template.deep_copy(), self.vocab_size, self.eos_ids)
        template = self._build(c)  # outside the lock: llguidance releases the GIL while it builds
        with self._lock:
            self._cache[c] = template
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return GrammarMatcher(template.deep_copy(), self.vocab_size, self.eos_ids)

    def _build(self, c: Constraint) -> llguidance.LLMatcher:
        grammar = self.grammar(c)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise GrammarError(f"invalid {c.kind}: {_first_lines(error)}")
        ll = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if ll.is_error():
            raise GrammarError(f"invalid {c.kind}: {_first_lines(ll.get_error())}")
        probe = ll.deep_copy()
        GrammarMatcher(probe, self.vocab_size, self.eos_ids).mask()
        if probe.is_error():  # llguidance finds no byte that can start a match
            raise GrammarError(f"the {c.kind} matches no text")
        return ll


def _first_lines(message: str) -> str:
    """llguidance's message on one line: its first line and its `error:` lines (the source
    excerpts and carets between them read badly in a JSON error body)."""
    lines = [line.strip() for line in message.strip().splitlines()]
    return " ".join(lines[:1] + [line for line in lines[1:] if line.startswith("error:")])
