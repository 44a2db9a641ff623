"""HTTP errors: one exception type, rendered in OpenAI's error format (or Ollama's on /api/).

OpenAI: ``{"error": {"message", "type", "param", "code"}}``; Ollama: ``{"error": "message"}``.
Every error a client can cause names the request field at fault in ``param``.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagoda.engine.async_engine import (
    EngineStoppedError,
    QueueFullError,
    RequestAbortedError,
    RequestTimeoutError,
)
from pagoda.errors import PagodaError, RequestError

logger = logging.getLogger("pagoda.server")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self, ollama: bool = False) -> dict:
        if ollama:
            return {"error": self.message}
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def to_api_error(exc: BaseException) -> APIError:
    """Map any exception raised while serving a request to its HTTP error."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestError):
        return APIError(400, str(exc), param=exc.field)
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), code="queue_full", headers={"Retry-After": "1"})
    if isinstance(exc, (EngineStoppedError, RequestAbortedError)):
        return APIError(503, str(exc), code="unavailable")
    if isinstance(exc, RequestTimeoutError):
        return APIError(504, str(exc), code="timeout")
    if isinstance(exc, PagodaError):
        return APIError(400, str(exc))
    logger.exception("internal error while serving a request", exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}: {exc}")


def is_ollama_path(path: str) -> bool:
    return path.startswith("/api/")


def error_response(request: Request, err: APIError) -> JSONResponse:
    return JSONResponse(err.body(ollama=is_ollama_path(request.url.path)), status_code=err.status,
                        headers=err.headers)


def _validation_param(loc: tuple) -> str:
    parts = [str(p) for p in loc if p != "body"]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or "body"


def install_error_handlers(app: FastAPI) -> None:
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
        param = _validation_param(tuple(first.get("loc", ())))
        if first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON: {first.get('msg')}"
            param = "body"
        elif first.get("type") == "missing":
            message = f"missing required field {param!r}"
        else:
            got = first.get("input")
            message = f"invalid value for {param!r}: {first.get('msg')} (got {got!r})"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problem(s))"
        return error_response(request, bad_request(message, param=param))

    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path} (see /docs for the API)"
        return error_response(request, APIError(exc.status_code, message, headers=exc.headers))

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(request, to_api_error(exc))

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    for cls in (APIError, PagodaError, Exception):
        app.add_exception_handler(cls, on_api_error)
