"""What `/openapi.json` says: request bodies, success shapes and error responses of every route.

Owns the documentation of the HTTP surface, not its behaviour. The generation routes read
their bodies themselves (`validate.parse_body`: any Content-Type, a 400 rather than FastAPI's
422), so FastAPI cannot see their request models: `request_body(Model)` documents one through
a route's `openapi_extra`. Nor can it see the chunks of a stream: `stream_ok` documents each
SSE event by reference. `install_openapi` puts those models (REQUEST_MODELS, EVENT_MODELS) in
`components`. Every error is one `ErrorResponse` body. `route(ok, *statuses, body=...)` builds
a route's keywords; the route modules pass the sets at the bottom
(`@router.post("/generate", **openapi.GENERATE)`), so that the documentation is read in one
place and each decorator stays one line.

Invariant: a status a route can send is documented on it (401 and 500 on every route, which the
auth and catch-all middlewares can answer anywhere; 400 and 413 wherever a body is read), and
FastAPI's 422 is documented nowhere, since `server/errors.py` turns it into a 400.
tests/unit/test_openapi_fuzz.py holds the server to the document with schemathesis.
"""
from __future__ import annotations

import re
import warnings
from collections.abc import Collection
from typing import Any

from fastapi import FastAPI, Response
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from specserve.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from specserve.server.responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    ErrorResponse,
    FlushCacheResult,
    GenerateOutput,
    ModelCard,
    ModelList,
    ServedModelInfo,
)

REQUEST_MODELS: tuple[type[BaseModel], ...] = (ChatCompletionRequest, CompletionRequest, GenerateRequest)
EVENT_MODELS: tuple[type[BaseModel], ...] = (ChatCompletionChunk, CompletionResponse, GenerateOutput)  # SSE data
REF = "#/components/schemas/{model}"
_METHOD_SUFFIX = re.compile(r"_(get|put|post|delete|options|head|patch|trace)$")

ERROR_DESCRIPTIONS = {
    400: "Invalid request: malformed JSON, a field of the wrong type or value, a prompt that does not fit "
         "the context, or a request the engine refused",
    401: "Missing or wrong API key (only when the server was started with --api-key)",
    404: "Unknown model",
    409: "A request with this rid is already in flight",
    413: "Request body too large",
    500: "Internal error (the server keeps serving)",
    503: "The engine is not running, or the server is shutting down",
}
ALWAYS = (401, 500)  # AuthMiddleware and CatchAllMiddleware stand in front of every route
BODY_ERRORS = (400, 413)  # BodyGuardMiddleware (size, depth, Unicode) and parse_body (shape)


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route that parses `model` from its JSON body itself."""
    assert model in REQUEST_MODELS, f"{model.__name__} must be in REQUEST_MODELS to reach components"
    schema = {"$ref": REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def json_ok(model: Any, description: str) -> dict[str, Any]:
    """A 200 whose JSON body is `model` (a pydantic model or a type such as `dict[str, Any]`)."""
    return {"model": model, "description": description}


def stream_ok(model: Any, event: type[BaseModel], description: str) -> dict[str, Any]:
    """A 200 that is `model` as JSON, or Server-Sent Events when the request asked to stream:
    `data: <event JSON>` each, an ErrorResponse if the request fails after the headers went
    out, and `data: [DONE]` last. (Before OpenAPI 3.2 a stream's `schema` describes one event.)"""
    assert event in EVENT_MODELS, f"{event.__name__} must be in EVENT_MODELS to reach components"
    payload = {"anyOf": [{"$ref": REF.format(model=event.__name__)}, {"$ref": REF.format(model="ErrorResponse")}]}
    data = {"anyOf": [{"const": "[DONE]"},
                      {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}]}
    events = {"type": "object", "properties": {"data": data}, "required": ["data"]}
    return {**json_ok(model, description), "content": {"text/event-stream": {"schema": events}}}


def text_ok(media_type: str, description: str) -> dict[str, Any]:
    """A 200 whose body is text of `media_type`."""
    return {"description": description, "content": {media_type: {"schema": {"type": "string"}}}}


def empty_ok(description: str) -> dict[str, Any]:
    """A 200 without a body."""
    return {"description": description}


def responses(ok: dict[str, Any], *statuses: int, auth: bool = True) -> dict[int | str, dict[str, Any]]:
    """A route's `responses=`: 200 `ok`, and ErrorResponse for `statuses` plus ALWAYS (less 401
    on a route `auth` does not guard)."""
    codes = sorted({*statuses, *ALWAYS} - (set() if auth else {401}))
    out: dict[int | str, dict[str, Any]] = {200: ok}
    for code in codes:
        out[code] = {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[code]}
    return out


def route(ok: dict[str, Any], *statuses: int, body: type[BaseModel] | None = None, auth: bool = True) -> dict[str, Any]:
    """The documentation keywords of one route: `responses=`, and `openapi_extra=` for a `body`."""
    doc: dict[str, Any] = {"responses": responses(ok, *statuses, *(BODY_ERRORS if body else ()), auth=auth)}
    if "model" not in ok:  # not JSON: else FastAPI documents application/json too (the endpoints
        # return Response objects, so response_class changes only the document)
        doc["response_class"] = Response
    if body is not None:
        doc["openapi_extra"] = request_body(body)
    return doc


def install_openapi(app: FastAPI, bearer_auth: bool = False, open_paths: Collection[str] = ()) -> None:
    """Make `app.openapi()` carry REQUEST_MODELS and EVENT_MODELS in components, no FastAPI 422,
    one operationId per method, and (`bearer_auth`: --api-key) the Bearer scheme on every
    operation but those of `open_paths`."""
    base = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            with warnings.catch_warnings():  # FastAPI gives each method of one route the same id: fixed below
                warnings.filterwarnings("ignore", "Duplicate Operation ID", UserWarning)
                schema = base()  # FastAPI's document, cached on the app: completed once, here
            _add_models(schema)
            _drop_422(schema)
            _one_id_per_method(schema)
            if bearer_auth:
                _declare_bearer(schema, open_paths)
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]


def _add_models(schema: dict[str, Any]) -> None:
    """REQUEST_MODELS and EVENT_MODELS, and what they refer to, in components (once each)."""
    modes = [(m, "validation") for m in REQUEST_MODELS] + [(m, "serialization") for m in EVENT_MODELS]
    _, defs = models_json_schema(modes, ref_template=REF)  # type: ignore[arg-type]
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name, definition in defs.get("$defs", {}).items():
        have = components.setdefault(name, definition)  # a model FastAPI has already: its rendering stays
        if set(have.get("properties", {})) != set(definition.get("properties", {})):
            raise ValueError(f"two different models are both named {name!r} in components")


def _one_id_per_method(schema: dict[str, Any]) -> None:
    """`<name>_<path>_<method>` with the operation's own method (/flush_cache has GET and POST)."""
    for path in schema.get("paths", {}).values():
        for method, operation in path.items():
            if "operationId" in operation:
                operation["operationId"] = f"{_METHOD_SUFFIX.sub('', operation['operationId'])}_{method}"


def _declare_bearer(schema: dict[str, Any], open_paths: Collection[str]) -> None:
    schemes = schema.setdefault("components", {}).setdefault("securitySchemes", {})
    schemes["bearer"] = {"type": "http", "scheme": "bearer", "description": "The server's --api-key"}
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            if path not in open_paths:
                operation["security"] = [{"bearer": []}]


def _drop_422(schema: dict[str, Any]) -> None:
    """FastAPI documents a 422 for any route with parameters; the server answers those 400."""
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            operation.get("responses", {}).pop("422", None)
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)


# -- the routes' documentation ------------------------------------------------------------------
CHAT_COMPLETIONS = route(stream_ok(ChatCompletionResponse, ChatCompletionChunk,
                                   "The completion; chat.completion.chunk events if stream"),
                         404, 503, body=ChatCompletionRequest)
COMPLETIONS = route(stream_ok(CompletionResponse, CompletionResponse,
                              "The completion; text_completion events if stream"),
                    404, 503, body=CompletionRequest)
GENERATE = route(stream_ok(GenerateOutput | list[GenerateOutput], GenerateOutput,
                           "One output (a list for a batch); cumulative outputs as events if stream"),
                 409, 503, body=GenerateRequest)
HEALTH_GENERATE = route(empty_ok("The engine generated a token in time"), 503)
MODELS = route(json_ok(ModelList, "The served model"))
MODEL = route(json_ok(ModelCard, "The served model"), 404)
HEALTH = route(empty_ok("The engine is running"), 503, auth=False)
SERVER_INFO = route(json_ok(dict[str, Any], "The engine's configuration and internal state"))
MODEL_INFO = route(json_ok(ServedModelInfo, "The served model's paths and context length"))
METRICS = route(text_ok("text/plain", "Prometheus metrics, text format 0.0.4"))
FLUSH_CACHE = route(json_ok(FlushCacheResult, "The prefix cache was flushed"), 400, 413)  # POST's body is guarded
