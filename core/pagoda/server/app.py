"""The FastAPI application: routes, API keys, request size limit, CORS, health and metrics.

``create_app(async_engine, server_config)`` builds one app over one AsyncEngine; the app's
lifespan starts the engine loop and stops it (aborting what is left) at shutdown.
"""

from __future__ import annotations

import hmac
import json
import time
from contextlib import asynccontextmanager
from datetime import datetime, timezone

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagoda.engine.async_engine import AsyncEngine
from pagoda.server import chat_routes, ollama_routes, openai_routes, pooling_routes, tokenize_routes
from pagoda.server.config import ServerConfig
from pagoda.server.errors import APIError, install_error_handlers, is_ollama_path
from pagoda.server.frontend import Frontend
from pagoda.server.metrics import CONTENT_TYPE, ServerMetrics
from pagoda.server.openapi import (
    PROTECTED_PREFIXES,  # noqa: E402  (/health, /metrics, /docs stay open)
    served_document,
)
from pagoda.server.responses import Health


class RequestGuard:
    """Pure ASGI middleware (streaming-safe): refuses requests while draining (503), without a
    valid API key (401) or with a body over ``max_request_bytes`` (413); counts every
    request by route and status."""

    def __init__(self, app: ASGIApp, config: ServerConfig, metrics: ServerMetrics, async_engine: AsyncEngine,
                 routes: list):
        self.app = app
        self.routes = routes  # the app's routes, to label requests refused before routing
        self.keys = [k.encode() for k in config.api_keys]
        self.max_bytes = config.max_request_bytes
        self.metrics = metrics
        self.async_engine = async_engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            refusal = self.refusal(scope)
            if refusal is not None:
                await self.reply(scope, refusal, counting_send)
                return
            await self.app(_json_body(scope), self.limited(receive), counting_send)
        finally:
            self.metrics.http_requests.labels(scope["method"], self.route_label(scope), str(status["code"])).inc()

    def route_label(self, scope: Scope) -> str:
        """The route's path template (bounded label values), or 'other'."""
        route = scope.get("route")
        if route is None:
            route = next((r for r in self.routes if r.matches(scope)[0] is Match.FULL), None)
        return getattr(route, "path", None) or "other"

    def refusal(self, scope: Scope) -> APIError | None:
        path = scope["path"]
        if not path.startswith(PROTECTED_PREFIXES):
            return None
        if self.keys:
            token = _bearer(scope)
            if token is None or not any(hmac.compare_digest(token, k) for k in self.keys):
                why = "missing API key" if token is None else "invalid API key"
                return APIError(401, f"{why}: send 'Authorization: Bearer <key>'", code="invalid_api_key",
                                headers={"WWW-Authenticate": "Bearer"})
        failure = self.async_engine.error
        if failure is not None:
            return APIError(503, f"the engine failed ({type(failure).__name__}: {failure}); the server is exiting",
                            code="engine_failed")
        if not self.async_engine.accepting:
            return APIError(503, "the server is shutting down", code="unavailable")
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return APIError(413, BodyTooLarge(self.max_bytes).detail, code="request_too_large")
        return None

    def limited(self, receive: Receive) -> Receive:
        seen = 0

        async def wrapped() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:  # a chunked body without Content-Length
                    raise BodyTooLarge(self.max_bytes)
            return message

        return wrapped

    @staticmethod
    async def reply(scope: Scope, err: APIError, send: Send) -> None:
        body = json.dumps(err.body(ollama=is_ollama_path(scope["path"]))).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in (err.headers or {}).items()]
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class BodyTooLarge(StarletteHTTPException):
    """Raised while the app reads the body; an HTTPException, so FastAPI passes it through."""

    def __init__(self, max_bytes: int):
        super().__init__(413, f"the request body is larger than max_request_bytes={max_bytes}")


def _json_body(scope: Scope) -> Scope:
    """Ollama reads a body as JSON whatever its Content-Type (curl -d sends form encoding): so
    does /api/ here; a body that is no JSON is then a 400 saying so."""
    if scope["method"] != "POST" or not is_ollama_path(scope["path"]):
        return scope
    content_type = (_header(scope, b"content-type") or "").split(";")[0].strip().lower()
    if content_type == "application/json":
        return scope
    headers = [(k, v) for k, v in scope.get("headers", []) if k != b"content-type"]
    return {**scope, "headers": [*headers, (b"content-type", b"application/json")]}


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return value.decode("latin-1")
    return None


def _bearer(scope: Scope) -> bytes | None:
    value = _header(scope, b"authorization")
    if value is None:
        return None
    scheme, _, token = value.partition(" ")
    return token.strip().encode() if scheme.lower() == "bearer" and token.strip() else None


def model_info(async_engine: AsyncEngine) -> dict:
    engine = async_engine.engine
    path = engine.source.path
    files = [path] if path.is_file() else [p for p in path.iterdir() if p.is_file()]
    params = engine.parameter_count  # (data parallel: replica 0's count)
    size = next((f"{params / scale:.{digits}f}{unit}" for scale, unit, digits in
                 ((1e9, "B", 1), (1e6, "M", 0), (1e3, "K", 0)) if params >= scale), str(params))
    mtime = max((p.stat().st_mtime for p in files), default=time.time())
    return {"format": engine.source.kind if engine.source.kind == "gguf" else "safetensors",
            "family": getattr(engine.hf_config, "model_type", "unknown"), "parameter_size": size,
            "parameter_count": params,
            "size": sum(p.stat().st_size for p in files),
            "modified_at": datetime.fromtimestamp(mtime, timezone.utc).isoformat().replace("+00:00", "Z")}


def create_app(async_engine: AsyncEngine, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    metrics = ServerMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            # uvicorn has already let in-flight responses finish (shutdown_timeout); abort the rest
            await async_engine.shutdown(drain_timeout=0.0)

    app = FastAPI(title="pagoda", version=_version(), lifespan=lifespan)
    app.state.async_engine = async_engine
    app.state.config = config
    app.state.metrics = metrics
    app.state.frontend = Frontend(async_engine, config, metrics)
    app.state.model_info = model_info(async_engine)
    install_error_handlers(app)
    app.include_router(openai_routes.router)
    app.include_router(chat_routes.router)
    app.include_router(tokenize_routes.router)
    app.include_router(ollama_routes.router)
    app.include_router(pooling_routes.router)  # embeddings, score, rerank (runner: pooling)
    extra_routes = []
    if config.enable_lora_runtime_updates:
        from pagoda.server import lora_adapters

        app.include_router(lora_adapters.router)
        extra_routes = lora_adapters.router.routes

    @app.get("/health", response_model=Health, responses={
        503: {"model": Health, "description": "shutting down (`stopping`), or the engine failed (`error`, with "
                                               "the reason; the process exits non-zero moments later)"}})
    async def health() -> Response:
        failure = async_engine.error
        if failure is not None:
            return JSONResponse({"status": "error", "error": f"the engine failed ({type(failure).__name__}: "
                                 f"{failure}); the server is exiting"}, status_code=503)
        if not async_engine.accepting or not async_engine.is_running:
            return JSONResponse({"status": "stopping"}, status_code=503)
        return JSONResponse({"status": "ok", "model": app.state.frontend.model_name})

    @app.get("/metrics", response_class=Response, responses={
        200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def prometheus_metrics(request: Request) -> Response:
        stats = await async_engine.get_stats()
        return Response(metrics.render(stats), media_type=CONTENT_TYPE)

    limits = app.state.frontend.limits

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = served_document(FastAPI.openapi(app), limits, api_keys=bool(config.api_keys))
        return app.openapi_schema

    app.openapi = openapi
    # (FastAPI keeps included routers as wrappers in app.routes: list their routes directly)
    routes = [r for r in (*openai_routes.router.routes, *chat_routes.router.routes, *ollama_routes.router.routes,
                          *tokenize_routes.router.routes, *pooling_routes.router.routes, *extra_routes, *app.routes)
              if hasattr(r, "path")]
    app.add_middleware(RequestGuard, config=config, metrics=metrics, async_engine=async_engine, routes=routes)
    if config.cors_allow_origins:
        app.add_middleware(CORSMiddleware, allow_origins=config.cors_allow_origins, allow_methods=["*"],
                           allow_headers=["*"], allow_credentials="*" not in config.cors_allow_origins)
    return app


def _version() -> str:
    import pagoda

    return pagoda.__version__
