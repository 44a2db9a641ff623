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

from pagoda.engine.request_stream import (
    EngineFailedError,
    EngineStoppedError,
    QueueFullError,
    RequestAbortedError,
    RequestFailedError,
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
        if ollama:  # Ollama's shape; the code (an extension) when there is one
            return {"error": self.message} if self.code is None else {"error": self.message, "code": self.code}
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def to_api_error(exc: BaseException) -> APIError:
    """Map any exception raised while serving a request to its HTTP error."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestError):
        return APIError(400, str(exc), param=exc.field, code=exc.code)
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), code="queue_full", headers={"Retry-After": "1"})
    if isinstance(exc, RequestFailedError):  # pinned to this request; the engine serves on
        return APIError(500, str(exc), code="request_failed")
    if isinstance(exc, EngineFailedError):
        return APIError(503, str(exc), code="engine_failed")
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


def _field_path(loc: tuple, body: object) -> tuple[list, int]:
    """The parts of a pydantic error location that name something in the request body, and how
    deep they reach. Union member labels ('list[constrained-int]') and discriminator tags
    ('user') are not keys of the body, so following the body leaves them out."""
    parts: list = []
    node = body
    for part in loc:
        if part == "body" and not parts:
            continue
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif isinstance(node, (dict, list)) or node is body:
            if isinstance(part, str) and not isinstance(node, (dict, list)):
                parts.append(part)
            continue
        else:
            continue
        parts.append(part)
    return parts, len(parts)


def _render(parts: list) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "body"


def _best_error(errors: list[dict], body: object) -> tuple[dict, str]:
    """Of the errors pydantic reports (several per union member tried), the one most likely meant."""
    def branch(err: dict) -> tuple:  # the location up to the first union member label
        loc = tuple(err.get("loc", ()))
        for k in range(len(loc)):
            if isinstance(loc[k], str) and not loc[k].isidentifier():
                return loc[:k + 1]
        return loc

    per_branch: dict[tuple, int] = {}
    for err in errors:
        per_branch[branch(err)] = per_branch.get(branch(err), 0) + 1

    def rank(err: dict) -> tuple:
        # a wrong value in the right shape before a wrong shape; then the union member with the
        # fewest complaints (the closest match); then the error deepest in the body
        depth = _field_path(tuple(err.get("loc", ())), body)[1]
        return not err.get("type", "").endswith("_type"), -per_branch[branch(err)], depth

    best = max(errors, key=rank)
    loc = tuple(best.get("loc", ()))
    parts = _field_path(loc, body)[0]
    if best.get("type") == "missing" and loc and loc[-1] not in parts:
        parts = [*parts, loc[-1]]  # the missing field itself is not in the body
    param = _render(parts)
    if best.get("type") in ("union_tag_not_found", "union_tag_invalid"):
        param += "." + str((best.get("ctx") or {}).get("discriminator", "")).strip("'\"")
    return best, param


def install_error_handlers(app: FastAPI) -> None:
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors()) or [{"loc": (), "msg": "invalid request", "type": ""}]
        first, param = _best_error(errors, getattr(exc, "body", None))
        if first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON: {first.get('msg')}"
            param = "body"
        elif first.get("type") == "missing":
            message = f"missing required field {param!r}"
        else:
            got = repr(first.get("input"))
            got = got if len(got) <= 200 else got[:197] + "..."
            message = f"invalid value for {param!r}: {first.get('msg')} (got {got})"
        return error_response(request, bad_request(message, param=param))

    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        code = None
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path} (see /docs for the API)"
        elif exc.status_code == 413:  # a chunked body over the limit, found while reading it
            code = "request_too_large"
        elif exc.status_code == 405:
            code = "method_not_allowed"
        return error_response(request, APIError(exc.status_code, message, code=code, headers=exc.headers))

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(request, to_api_error(exc))

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    for cls in (APIError, PagodaError, Exception):
        app.add_exception_handler(cls, on_api_error)
