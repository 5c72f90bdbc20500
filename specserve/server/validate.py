"""Checks that need the model: served name, tokenization, vocabulary, context length, sampling.

Owns the rule "nothing reaches the engine unless it can be served": each function either
returns what the route needs or raises an `APIError` (400/404) whose message says what was
wrong, in the wording OpenAI and vLLM users know. Shapes and types were already checked by
`server/protocol.py`.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from specserve.core.sampling_params import Constraint, SamplingParams
from specserve.engine.protocol import EngineClient
from specserve.grammar.compiler import GrammarCompiler, GrammarError
from specserve.server.body_guard import PARSED_KEY
from specserve.server.errors import APIError, bad_request, from_pydantic

M = TypeVar("M", bound=BaseModel)


async def parse_body(request: Request, model: type[M]) -> M:
    """Read and validate a JSON body whatever its Content-Type (curl -d sends form type)."""
    data: Any = request.scope.get(PARSED_KEY)  # parsed and checked by server/body_guard.py
    if data is None:
        data = _parse_json(await request.body())
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_pydantic(exc) from None


def _parse_json(raw: bytes) -> Any:
    if not raw.strip():
        raise bad_request("The request body is empty; expected a JSON object")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"Malformed JSON in request body: {exc}") from None


def check_model(client: EngineClient, requested: str | None) -> str:
    """The name to report back. Any model is fine when the request names none."""
    served = client.info.served_model_name
    if requested is None or requested in (served, client.config.model.model_path):
        return served
    raise APIError(404, f"The model `{requested}` does not exist.", "model")


def check_choices(client: EngineClient, prompts: int, n: int, param: str = "n") -> None:
    """A 400 when one call asks for more engine requests (prompts x n) than
    --max-choices-per-request allows: one client must not flood the queue."""
    cap = client.config.server.max_choices_per_request
    if prompts * n > cap:
        raise bad_request(f"This request asks for {prompts * n} completions ({prompts} prompts x n={n}); "
                          f"this server allows at most {cap} per request", param)


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"Token ids out of vocabulary range [0, {vocab_size}) in '{param}': {bad[:8]}", param)


def tokenize_chat(client: EngineClient, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
    """The chat's prompt; `template_kwargs` are template variables (e.g. `tools`)."""
    try:
        text = client.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs)
    except ValueError as exc:
        raise bad_request(f"Invalid messages: {exc}", "messages") from None
    ids = tokenize_text(client, text, "messages")
    if not ids:
        raise bad_request("The messages produced an empty prompt", "messages")
    return ids


def tokenize_prompt(client: EngineClient, prompt: str | list[int], param: str) -> list[int]:
    """Text is tokenized with special tokens (BOS); token ids are checked, not altered."""
    if isinstance(prompt, str):
        ids = tokenize_text(client, prompt, param)
        if not ids:
            raise bad_request("The prompt is empty after tokenization", param)
        return ids
    check_token_ids(prompt, client.info.vocab_size, param)
    return list(prompt)


# A text far longer than the context is refused from a prefix's token count, without
# tokenizing all of it: the prefix's tokens, but for the few of the word cut at its end,
# are tokens of the whole text too (the pre-tokenizer splits words independently).
PREFIX_CHARS_PER_TOKEN = 16
CUT_WORD_TOKENS = 64


def tokenize_text(client: EngineClient, text: str, param: str) -> list[int]:
    """`text`'s token ids with special tokens, or a 400 at once when a prefix of it is
    already longer than the context (a 10 MB prompt costs milliseconds, not a full pass)."""
    ctx = client.info.context_length
    cut = ctx * PREFIX_CHARS_PER_TOKEN
    if len(text) > cut:
        at_least = len(client.tokenizer.encode(text[:cut], add_special_tokens=False)) - CUT_WORD_TOKENS
        if at_least > ctx:
            raise bad_request(f"This model's maximum context length is {ctx} tokens. However, your {param} "
                              f"resulted in more than {at_least} tokens. Please reduce the length of the "
                              f"{param}.", param)
    return list(client.tokenizer.encode(text, add_special_tokens=True))


def resolve_max_tokens(client: EngineClient, prompt_len: int, requested: int | None, where: str = "messages",
                       names: tuple[str, str] | None = None) -> int:
    """Completion budget: `requested`, or all the context the prompt leaves (OpenAI/vLLM rule).

    `where` is what the messages call the prompt; `names` the wire names of the prompt and
    the budget fields for `param` (default: `where` and OpenAI's `max_tokens`)."""
    ctx = client.info.context_length
    prompt_param, max_param = names or (where, "max_tokens")
    if requested is not None and requested < 0:
        raise bad_request(f"max_tokens must be non-negative, got {requested}", max_param)
    if prompt_len > ctx or (requested is None and prompt_len >= ctx):
        raise bad_request(
            f"This model's maximum context length is {ctx} tokens. However, your {where} "
            f"resulted in {prompt_len} tokens. Please reduce the length of the {where}.",
            prompt_param,
        )
    if requested is None:
        return ctx - prompt_len
    if prompt_len + requested > ctx:
        raise bad_request(
            f"This model's maximum context length is {ctx} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the {where}, {requested} in the "
            f"completion). Please reduce the length of the {where} or completion.",
            max_param,
        )
    return requested


_FIELD_RE = re.compile(r"^(?:at most \d+ )?([a-z_]+)")  # "top_p must be ..." -> top_p


def validate_params(client: EngineClient, params: SamplingParams, names: Mapping[str, str] | None = None) -> None:
    """Run `SamplingParams.validate` and turn its ValueError into a 400 naming the field.

    `names` maps SamplingParams' field names to the wire name where the API differs
    (completions' `logprobs`, the native API's `sampling_params.max_new_tokens`, ...).
    """
    try:
        params.validate(client.info.vocab_size)
    except ValueError as exc:
        match = _FIELD_RE.match(str(exc))
        name = match.group(1) if match else None
        if name is not None and names:
            name = names.get(name, name)
        raise bad_request(str(exc), name) from None
    if params.constraint is not None:
        check_constraint(client, params.constraint, (names or {}).get("constraint", "response_format"))


_COMPILERS: dict[int, GrammarCompiler] = {}  # id(tokenizer) -> its compiler: one per served model


def grammar_compiler(client: EngineClient) -> GrammarCompiler:
    """The front end's grammar compiler, built at the first constrained request (~0.5 s)."""
    key = id(client.tokenizer)
    if key not in _COMPILERS:
        _COMPILERS[key] = GrammarCompiler(client.tokenizer.to_json(), client.info.vocab_size,
                                          sorted(client.tokenizer.eos_token_ids))
    return _COMPILERS[key]


def check_constraint(client: EngineClient, constraint: Constraint, param: str) -> None:
    """400 naming the problem when `constraint` does not compile or matches no text. The
    engine builds the same grammar again (from its own cache): nothing invalid reaches it."""
    try:
        grammar_compiler(client).check(constraint)
    except GrammarError as exc:
        raise bad_request(str(exc), param) from None
