"""Generated ids -> text, as it streams: stable text deltas, and stop strings held back.

`IncrementalDetokenizer` turns a growing list of generated ids into text deltas that never
change once sent (a partial UTF-8 character waits for its next token); `StopChecker` holds
back text that may still turn out to be the start of a stop string. The scheduler pushes
ids and gets text back; neither knows about requests or HTTP.
"""
from __future__ import annotations

from specserve.tokenizer.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"  # what a lossy UTF-8 decode gives for an incomplete character


class IncrementalDetokenizer:
    """Turns generated ids, pushed a few at a time, into text deltas that never change later.

    The prefix/read offset trick (vLLM, TGI): decode only ids[prefix:] and ids[prefix:read],
    and emit the difference. `prefix` and `read` only move to a point where the decoded text
    did not end in U+FFFD, i.e. a character boundary, so decoding from `prefix` yields exactly
    the tail of the full decode, and each push costs O(ids since the last stable point).
    Invariant: "".join(pushes) + flush() == tok.decode(all ids).
    """

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tok
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window (first id of the last emitted chunk)
        self._read = 0  # everything before this has been emitted

    def push(self, ids: list[int]) -> str:
        """Append ids; return the newly stable text (possibly "")."""
        self._ids.extend(ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Text still held back at the end of a request (a trailing partial character)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        done = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix:], self._skip)
        if len(text) <= len(done) or (text.endswith(_REPLACEMENT) and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(done):]


class StopChecker:
    """Finds stop strings in streamed text, holding back only what could still start one.

    A match is the stop string that *ends* earliest (ties: the longest), which is what a
    reader of the stream sees first; the result is therefore independent of how the text
    was split into deltas. After a match every later push returns ("", None).
    """

    def __init__(self, stops: list[str]) -> None:
        self._stops = sorted({s for s in stops if s}, key=len, reverse=True)
        self._held = ""
        self._done = False

    @property
    def active(self) -> bool:
        """Whether there is a stop string to look for (else `push` releases all it is given)."""
        return bool(self._stops)

    def push(self, text_delta: str) -> tuple[str, str | None]:
        """(text safe to release now, the matched stop string or None)."""
        if self._done:
            return "", None
        buf = self._held + text_delta
        match = None  # (end, -len, start, stop): earliest end, then longest
        for stop in self._stops:
            start = buf.find(stop)
            if start >= 0:
                cand = (start + len(stop), -len(stop), start, stop)
                match = cand if match is None or cand < match else match
        if match is not None:
            self._done, self._held = True, ""
            return buf[:match[2]], match[3]
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], None

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        for n in range(min(len(buf), max((len(s) for s in self._stops), default=1) - 1), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0
