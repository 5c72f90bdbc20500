"""Text <-> token ids: a model directory's tokenizer and its chat template.

This file owns loading the tokenizer files of a local Hugging Face-layout directory,
rendering its chat template (sandboxed jinja2, as Hugging Face does) and deciding when to
add BOS. Turning generated ids into text deltas and stop strings is streaming.py. It knows
nothing about models, requests or HTTP.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Used when a model ships no chat template (what HF used as its default ChatML template).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LONG_TEXT_CHARS = 4096


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the model's special-token policy and chat template."""

    def __init__(self, tok: tokenizers.Tokenizer, *, bos_token_id: int | None, eos_token_ids: frozenset[int],
                 add_bos_token: bool, chat_template: str | None, special_tokens: dict[str, str]) -> None:
        self._tok = tok
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template or CHATML_TEMPLATE
        self.special_tokens = special_tokens  # {"bos_token": "<s>", ...}: template variables
        self._token_strs: dict[int, str] = {}

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer:
        """Load `tokenizer.json` (+ `tokenizer_config.json`, `generation_config.json`) from `path`."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"{path} has no tokenizer.json (only fast tokenizers are supported)")
        tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        cfg = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json") or _read_json(path / "config.json")
        special = {k: s for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                   if (s := _token_text(cfg.get(k))) is not None}
        bos = tok.token_to_id(special["bos_token"]) if "bos_token" in special else gen.get("bos_token_id")
        eos = gen.get("eos_token_id")
        eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if "eos_token" in special and tok.token_to_id(special["eos_token"]) is not None:
            eos_ids.add(tok.token_to_id(special["eos_token"]))
        add_bos = cfg.get("add_bos_token")
        if add_bos is None:  # no flag: BOS iff the tokenizer's own post-processor adds it
            add_bos = bos is not None and tok.encode("", add_special_tokens=True).ids[:1] == [bos]
        return cls(tok, bos_token_id=bos, eos_token_ids=frozenset(eos_ids), add_bos_token=bool(add_bos),
                   chat_template=_chat_template(path, cfg), special_tokens=special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; BOS is prepended iff add_bos_token, and never twice. A long
        text goes through `encode_batch`, which releases the GIL while it works (`encode`
        holds it), so a thread tokenizing a huge prompt does not stall the event loop."""
        if len(text) > LONG_TEXT_CHARS:
            ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if ids[:1] != [self.bos_token_id]:  # e.g. a chat template that writes BOS itself
                ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **template_kwargs: Any) -> str:
        """Render the chat template; invalid messages or template errors raise ValueError."""
        variables = {"tools": None, "documents": None, **self.special_tokens, **template_kwargs}
        try:
            return _compile(self.chat_template).render(
                messages=normalize_messages(messages), add_generation_prompt=add_generation_prompt, **variables)
        except ValueError:
            raise
        except Exception as e:  # jinja errors, raise_exception(), type errors inside the template
            raise ValueError(f"chat template failed: {e}") from None

    def encode_chat(self, messages: list[dict], **template_kwargs: Any) -> list[int]:
        """The prompt of a chat; `template_kwargs` are template variables (e.g. `tools`)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs))

    def to_json(self) -> str:
        """The tokenizer serialized as tokenizer.json (what a grammar engine reads)."""
        return self._tok.to_str()

    def token_str(self, token_id: int) -> str:
        """The text of one token, special tokens included (logprobs' `token` field)."""
        s = self._token_strs.get(token_id)
        if s is None:
            s = self._token_strs[token_id] = self._tok.decode([token_id], skip_special_tokens=False)
        return s


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Validate OpenAI-style messages; content parts become one string (text parts joined by newlines)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object, got {type(m).__name__}")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise ValueError(f"messages[{i}].role must be a non-empty string")
        content = m.get("content")
        if isinstance(content, list):
            content = _join_text_parts(content, i)
        elif content is None and m["role"] == "assistant" and m.get("tool_calls"):
            content = ""
        elif not isinstance(content, str):
            what = "missing" if content is None else f"a {type(content).__name__}"
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts, got {what}")
        out.append({**m, "content": content})
    return out


def _join_text_parts(parts: list[Any], i: int) -> str:
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"messages[{i}].content[{j}] must be {{\"type\": \"text\", \"text\": <string>}} "
                             "(only text content is supported)")
        texts.append(part["text"])
    return "\n".join(texts)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's built-in tojson escapes HTML and non-ASCII; HF templates expect neither.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or as a serialized AddedToken."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(path: Path, cfg: dict[str, Any]) -> str | None:
    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    if template is None:
        template = _read_json(path / "chat_template.json").get("chat_template")
    return template


def read_chat_template(path: str | Path) -> str:
    """A jinja chat template file (--chat-template); ValueError with one line if it is
    missing or does not compile."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"chat template {path} does not exist")
    text = path.read_text(encoding="utf-8")
    try:
        _compile(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template {path} is not valid jinja: {e.message} (line {e.lineno})") from None
    return text


def load_tokenizer(tokenizer_dir: Path) -> Tokenizer:
    """The tokenizer of a local Hugging Face-layout directory (the model's own, or the
    one --tokenizer-path resolved to: preflight.py)."""
    return Tokenizer.from_dir(Path(tokenizer_dir))
