"""What a request body must be before any route sees it: bounded in size, shallow, valid Unicode.

Owns the checks that protect the server itself rather than the model: a body larger than
--max-request-mb is answered 413 as soon as that is known (from Content-Length, or while
reading), before it is parsed; a JSON body nested deeper than MAX_JSON_DEPTH (which would
otherwise end in a RecursionError) and a string holding a lone UTF-16 surrogate (valid
JSON, `"\\ud800"`, but not text: no tokenizer can encode it) are 400s naming where they
are. Bodies that are not JSON pass through untouched: the routes report those.

Pure ASGI: the body is read once here and replayed to the app, and every later `receive`
goes to the client, so routes still see a disconnect. A body that parsed is left in the
scope under PARSED_KEY for `validate.parse_body`, which then does not parse it again.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specserve.server.errors import APIError, bad_request, loc_to_param

THREAD_PARSE_BYTES = 1 << 20
MAX_JSON_DEPTH = 64  # OpenAI allows 5 levels in a structured-output schema
PARSED_KEY = "specserve.json"


class BodyGuardMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read(scope, receive)
            # a large body is parsed on a thread: the loop keeps its turns at the GIL meanwhile
            big = len(body) > THREAD_PARSE_BYTES
            scope[PARSED_KEY] = await asyncio.to_thread(check_json, body) if big else check_json(body)
        except APIError as err:
            await err.response()(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, scope: Scope, receive: Receive) -> bytes:
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            raise self._too_large()
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)

    def _too_large(self) -> APIError:
        limit = self.max_bytes / 2**20
        return APIError(413, f"The request body is larger than this server's limit of {limit:g} MiB "
                             "(--max-request-mb)", type_="invalid_request_error")


def check_json(body: bytes) -> Any:
    """The parsed body (None when it is not JSON); APIError 400 when it nests too deeply or
    holds a string that is not valid Unicode."""
    try:
        data = json.loads(body)
    except RecursionError:
        raise _too_deep() from None
    except ValueError:  # not JSON (or not UTF-8): the route says so in its own words
        return None
    _walk(data)
    return data


def _too_deep() -> APIError:
    return bad_request(f"The JSON body is nested more than {MAX_JSON_DEPTH} levels deep")


_NESTED = (str, dict, list)


def _walk(data: Any) -> None:
    """Depth and Unicode checks without recursion (the body may be 100k levels deep)."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if len(path) > MAX_JSON_DEPTH:
            raise _too_deep()
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, path)
                stack.append((item, (*path, key)))
        elif isinstance(value, list):
            stack.extend((item, (*path, i)) for i, item in enumerate(value) if isinstance(item, _NESTED))


def _check_text(text: str, path: tuple[Any, ...]) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        param = loc_to_param(path)
        where = f" in '{param}'" if param else ""
        raise bad_request(f"Invalid Unicode{where}: a lone surrogate (\\u{ord(text[exc.start]):04x}) at "
                          f"character {exc.start} is not text", param) from None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands the app the body already read, then listens to the client."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
