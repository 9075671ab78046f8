"""HTTP errors in llama.cpp's shape: ``{"error": {"code": <status>, "message": ..., "type": ...}}``.

Engine exceptions carry their own ``status_code`` / ``error_type`` (``engine/errors.py``);
request validation problems become 400 (never 422), unknown routes 404, anything unexpected 500.
429 and 503 carry ``Retry-After`` (whole seconds, RFC 9110) when the engine says when to retry.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.errors import OpencotiError, PoolSaturatedError

log = logging.getLogger("opencoti.server")

_HTTP_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
               413: "invalid_request_error", 429: "rate_limit_error", 501: "not_supported_error",
               503: "unavailable_error"}


class ApiError(Exception):
    """An error raised by the server itself (not the engine)."""

    def __init__(self, status_code: int, message: str, error_type: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.error_type = error_type or _HTTP_TYPES.get(status_code, "server_error")
        self.headers = headers or {}


def error_body(status: int, message: str, error_type: str) -> dict:
    return {"error": {"code": status, "message": message, "type": error_type}}


def retry_after_header(seconds: float | None) -> dict[str, str]:
    if seconds is None:
        return {}
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def describe_exception(exc: BaseException) -> tuple[int, str, str, dict[str, str]]:
    """(status, message, type, headers) for any exception (used for responses and SSE error events)."""
    if isinstance(exc, ApiError):
        return exc.status_code, exc.message, exc.error_type, dict(exc.headers)
    if isinstance(exc, OpencotiError):
        headers = retry_after_header(getattr(exc, "retry_after", None))
        if isinstance(exc, PoolSaturatedError):
            cap = exc.capacity or {}
            headers["X-Sessions-Remaining"] = str(int(cap.get("sessions_remaining") or 0))
            if exc.reason:
                headers["X-Admission-Reason"] = exc.reason
        return exc.status_code, str(exc), exc.error_type, headers
    return 500, f"internal server error: {type(exc).__name__}: {exc}", "server_error", {}


def error_event(exc: BaseException) -> dict:
    status, message, etype, _ = describe_exception(exc)
    return error_body(status, message, etype)


def error_response(exc: BaseException) -> JSONResponse:
    status, message, etype, headers = describe_exception(exc)
    return JSONResponse(error_body(status, message, etype), status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> str:
    parts: list[str] = []
    unions: dict[str, tuple[list[str], object]] = {}
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x not in ("body", "query", "path")]
        etype = err.get("type")
        if etype == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            parts.append(f"the request body is not valid JSON{': ' + str(detail) if detail else ''}")
            continue
        if etype == "missing" and not loc:
            parts.append("a JSON request body is required")
            continue
        if len(loc) >= 2 and ("[" in loc[-1] or loc[-1] in ("str", "int", "float", "bool", "dict", "list")):
            # one error per member of a union type: report them as one "expected one of"
            field = ".".join(loc[:-1])
            kinds, given = unions.setdefault(field, ([], err.get("input")))
            kinds.append(loc[-1])
            continue
        where = ".".join(loc) if loc else "request body"
        text = f"{where}: {err.get('msg', 'invalid value')}"
        given = err.get("input")
        if etype not in ("missing", "extra_forbidden") and not isinstance(given, (dict, list)):
            text += f" (got {_short(given)})"
        parts.append(text)
    for field, (kinds, given) in unions.items():
        parts.append(f"{field}: expected one of {' | '.join(kinds)} (got {_short(given)})")
    return "; ".join(parts) or "invalid request"


def _short(value: Any) -> str:
    try:
        s = json.dumps(value)
    except (TypeError, ValueError):
        s = repr(value)
    return s if len(s) <= 60 else s[:57] + "..."


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return JSONResponse(error_body(400, _validation_message(exc), "invalid_request_error"), status_code=400)

    @app.exception_handler(OpencotiError)
    async def _engine(request: Request, exc: OpencotiError):
        return error_response(exc)

    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError):
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        status = exc.status_code
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if status == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}"
        return JSONResponse(error_body(status, message, _HTTP_TYPES.get(status, "server_error")), status_code=status,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(exc)
