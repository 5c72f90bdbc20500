"""The FastAPI application: `build_app(client)`, API-key auth, error handling, simple routes.

Owns the HTTP surface as a whole: which routes exist, who may call them, and that every
failure is an OpenAI-style JSON error. The generation endpoints live in
`server/openai_routes.py` (OpenAI) and `server/native_routes.py` (SGLang's /generate); this
file adds `/v1/models`, `/health`, `/get_server_info` (+ `/server_info`), `/get_model_info`,
`/metrics` and `/flush_cache`. It talks to the engine only through `EngineClient`, and does
not start or stop it (the launcher owns the client's lifetime).
"""
from __future__ import annotations

import hmac
import time
from typing import Any

from fastapi import APIRouter, FastAPI, Response
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from specserve.engine.protocol import EngineClient
from specserve.server import openapi
from specserve.server.body_guard import BodyGuardMiddleware
from specserve.server.errors import APIError, CatchAllMiddleware, install_error_handlers
from specserve.server.metrics import render_metrics
from specserve.server.native_routes import make_native_router
from specserve.server.openai_routes import make_openai_router
from specserve.server.responses import ModelCard, ModelList

# The classic text format, which is what generate_latest writes and every Prometheus parses.
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPEN_PATHS = frozenset({"/health"})  # liveness probes carry no credentials
SECRET_KEYS = frozenset({"api_key"})
REDACTED = "<redacted>"


class AuthMiddleware:
    """Pure ASGI (a BaseHTTPMiddleware would buffer streams and hide disconnects):
    every route except OPEN_PATHS needs `Authorization: Bearer <api_key>` (the scheme in
    any case, as HTTP says; the key compared in constant time)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"authorization")
        scheme, _, token = (given or b"").strip().partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected):
            await self.app(scope, receive, send)
            return
        message = (
            "You didn't provide an API key. Provide it in an Authorization header using Bearer "
            "auth (i.e. Authorization: Bearer YOUR_KEY)."
            if given is None
            else "Incorrect API key provided."
        )
        await APIError(401, message).response()(scope, receive, send)


def redact(info: Any) -> Any:
    """`info` with every secret (the API key) replaced: nothing echoes it back."""
    if isinstance(info, dict):
        return {k: REDACTED if k in SECRET_KEYS and v else redact(v) for k, v in info.items()}
    if isinstance(info, list):
        return [redact(v) for v in info]
    return info


def build_app(client: EngineClient) -> FastAPI:
    """The server's ASGI app over `client`; serve it with uvicorn."""
    app = FastAPI(title="specserve", version="0.1.0")
    install_error_handlers(app)
    openapi.install_openapi(app, bearer_auth=bool(client.config.server.api_key), open_paths=OPEN_PATHS)
    app.include_router(make_openai_router(client))
    app.include_router(make_native_router(client))
    app.include_router(_admin_router(client))
    app.add_middleware(BodyGuardMiddleware, max_bytes=int(client.config.server.max_request_mb * 2**20))
    app.add_middleware(CatchAllMiddleware)
    if client.config.server.api_key:
        app.add_middleware(AuthMiddleware, api_key=client.config.server.api_key)  # outermost
    return app


def _model_card(client: EngineClient) -> ModelCard:
    name = client.info.served_model_name
    return ModelCard(id=name, root=client.config.model.model_path, max_model_len=client.info.context_length)


def _admin_router(client: EngineClient) -> APIRouter:
    router = APIRouter()
    _add_model_routes(router, client)
    _add_ops_routes(router, client)
    return router


def _add_model_routes(router: APIRouter, client: EngineClient) -> None:
    started = int(time.time())

    @router.get("/v1/models", **openapi.MODELS)
    async def list_models() -> JSONResponse:
        card = _model_card(client).model_copy(update={"created": started})
        return JSONResponse(ModelList(data=[card]).model_dump(mode="json"))

    @router.get("/v1/models/{model_id:path}", **openapi.MODEL)
    async def get_model(model_id: str) -> JSONResponse:
        card = _model_card(client).model_copy(update={"created": started})
        if model_id not in (card.id, card.root):
            raise APIError(404, f"The model `{model_id}` does not exist.", "model")
        return JSONResponse(card.model_dump(mode="json"))


def _add_ops_routes(router: APIRouter, client: EngineClient) -> None:
    @router.get("/health", **openapi.HEALTH)
    async def health() -> Response:
        if client.is_alive():
            return Response(status_code=200)
        return APIError(503, "The engine is not running").response()

    @router.get("/get_server_info", **openapi.SERVER_INFO)
    @router.get("/server_info", **openapi.SERVER_INFO)
    async def server_info() -> JSONResponse:
        return JSONResponse(jsonable_encoder(redact(await client.control("server_info"))))

    @router.get("/get_model_info", **openapi.MODEL_INFO)
    @router.get("/model_info", **openapi.MODEL_INFO)
    async def model_info() -> JSONResponse:
        cfg = client.config.model
        info: dict[str, Any] = {
            "model_path": cfg.model_path,
            "tokenizer_path": cfg.tokenizer_path or cfg.model_path,
            "served_model_name": client.info.served_model_name,
            "context_length": client.info.context_length,
            "is_generation": True,
        }
        return JSONResponse(info)

    if client.config.server.enable_metrics:  # --enable-metrics, as SGLang: off means no route
        @router.get("/metrics", **openapi.METRICS)
        async def metrics() -> Response:
            values = await client.control("metrics")
            return Response(render_metrics(values or {}), media_type=METRICS_CONTENT_TYPE)

    @router.api_route("/flush_cache", methods=["GET", "POST"], **openapi.FLUSH_CACHE)
    async def flush_cache() -> JSONResponse:
        # Like SGLang, the engine refuses while requests are running or queued.
        if await client.control("flush_cache"):
            return JSONResponse({"success": True, "message": "Cache flushed."})
        raise APIError(400, "Cache not flushed: there are running or queued requests; retry when idle.")
