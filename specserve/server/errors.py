"""OpenAI-style errors: one exception type, one body shape, and the handlers that use them.

Owns how *every* failure leaves the server: `{"error": {"message", "type", "param", "code"}}`
with a 4xx/5xx status. Handlers raise `APIError`; pydantic and FastAPI validation errors
(FastAPI's default 422) become 400s naming the field; unknown routes become JSON 404s; any
other exception becomes a 500 without taking the server down. It knows nothing about
routes or the engine.
"""
from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {401: "authentication_error", 404: "not_found_error", 409: "conflict_error",
                   503: "service_unavailable"}


class APIError(Exception):
    """A request failure with an HTTP status; `param` names the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or _TYPE_BY_STATUS.get(status) or (
            "invalid_request_error" if status < 500 else "internal_server_error"
        )

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def loc_to_param(loc: Sequence[Any]) -> str | None:
    """('messages', 0, 'content') -> 'messages[0].content'; FastAPI's 'body' prefix dropped."""
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def from_validation_errors(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """Turn the first pydantic/FastAPI error into a 400 that names the field and the problem."""
    if not errors:
        return bad_request("Invalid request")
    err = errors[0]
    if err.get("type") == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return bad_request(f"Malformed JSON in request body: {detail}".rstrip(": "))
    param = loc_to_param(err.get("loc", ()))
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if err.get("type") == "missing":
        return bad_request(f"Missing required parameter: '{param}'", param)
    if param is None:
        return bad_request(f"Invalid request body: {msg}")
    return bad_request(f"Invalid value for '{param}': {msg}", param)


def from_pydantic(exc: ValidationError) -> APIError:
    return from_validation_errors(exc.errors(include_url=False))


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that turn known exception types into OpenAI error bodies."""

    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return exc.response()

    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return from_validation_errors(exc.errors()).response()

    async def on_http(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        message = "Not found" if exc.status_code == 404 else str(exc.detail)
        response = APIError(exc.status_code, message).response()
        response.headers.update(exc.headers or {})  # e.g. a 405's Allow: the methods the route has
        return response

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)


class CatchAllMiddleware:
    """Pure ASGI middleware: an exception no handler claimed becomes a JSON 500.

    Starlette's own 500 path re-raises after responding (noisy, and fatal under some test
    transports); this one logs and answers, so the server keeps serving. If the response
    has already started (a stream), nothing more can be sent and the connection is closed.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:  # noqa: BLE001 - the point is to catch everything
            err = internal_error(f"unhandled error on {scope.get('method')} {scope.get('path')}", exc)
            if not started:
                await err.response()(scope, receive, send)


def internal_error(what: str, exc: BaseException) -> APIError:
    """A 500 that tells the client nothing of the server's internals: `exc` goes to the
    log under an id, and the body names only that id."""
    error_id = uuid.uuid4().hex[:12]
    logger.error("%s (error id %s)", what, error_id, exc_info=exc)
    return APIError(500, f"Internal server error (error id {error_id}); the server log has the details")
