"""HTTP errors in llama.cpp's shape: ``{"error": {"code": <status>, "message": ..., "type": ...}}``.

Engine exceptions carry their own ``status_code`` / ``error_type`` (``engine/errors.py``);
request validation problems become 400 (never 422), unknown routes 404, anything unexpected 500.
429 and 503 carry ``Retry-After`` (whole seconds, RFC 9110) when the engine says when to retry.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.errors import ContextLengthError, EngineClosedError, OpencotiError, PoolSaturatedError
from ..ops.headers import sessions_remaining_header
from ..ops.validation import validation_message
from . import json_steps

log = logging.getLogger("opencoti.server")

_HTTP_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
               413: "invalid_request_error", 429: "rate_limit_error", 501: "not_supported_error",
               503: "unavailable_error"}


class ErrorDetail(BaseModel):
    code: int = Field(description="the HTTP status")
    message: str
    type: str = Field(description="e.g. invalid_request_error, not_found_error, rate_limit_error")


class ErrorResponse(BaseModel):
    """Every error answer (llama.cpp's shape), but on the Anthropic routes."""

    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str = Field(description="Anthropic's error type: invalid_request_error, authentication_error, "
                                  "not_found_error, rate_limit_error, overloaded_error, api_error, ...")
    message: str


class AnthropicErrorResponse(BaseModel):
    """An error answer on the Anthropic routes (/v1/messages*): Anthropic's shape, exactly."""

    type: Literal["error"]
    error: AnthropicErrorDetail


_DESCRIPTIONS = {400: "invalid request", 401: "missing or wrong API key", 404: "unknown id",
                 405: "method not allowed", 409: "conflicts with the current state",
                 413: "request body too large", 429: "pool saturated (Retry-After)",
                 500: "internal error", 503: "model loading, shutting down or a budget exhausted (Retry-After)"}


def error_responses(statuses) -> dict:
    """OpenAPI ``responses`` for these error statuses (the error schema)."""
    return {s: {"model": ErrorResponse, "description": _DESCRIPTIONS.get(s, "error")} for s in statuses}


class ApiError(Exception):
    """An error raised by the server itself (not the engine)."""

    def __init__(self, status_code: int, message: str, error_type: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.error_type = error_type or _HTTP_TYPES.get(status_code, "server_error")
        self.headers = headers or {}


class SafeJSONResponse(JSONResponse):
    """JSON that always encodes: text that is not valid Unicode (a lone surrogate that reached the
    engine some other way) is sent \\u-escaped instead of failing the whole answer."""

    def render(self, content) -> bytes:
        # a large answer is encoded in steps: the GIL is never held for long (json_steps)
        return json_steps.dumps_bytes(content)


def error_body(status: int, message: str, error_type: str) -> dict:
    return {"error": {"code": status, "message": message, "type": error_type}}


# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors)
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error", 529: "overloaded_error"}
ANTHROPIC_PATHS = ("/v1/messages",)


def anthropic_error(body: dict) -> dict:
    """An error body (llama.cpp's shape, ``error.code`` the status) in Anthropic's shape, exactly
    ``{"type": "error", "error": {"type", "message"}}``: Anthropic's type for the status, no other
    field (the status is the response's; llama.cpp's ``code`` and context fields are left out)."""
    err = body.get("error", {})
    status = err.get("code") if isinstance(err.get("code"), int) else 400
    etype = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": etype, "message": str(err.get("message", ""))}}


def shaped(path: str, body: dict) -> dict:
    """``body`` in the shape the API of ``path`` uses (Anthropic's on /v1/messages*, else as it is)."""
    return anthropic_error(body) if path.startswith(ANTHROPIC_PATHS) else body


def retry_after_header(seconds: float | None) -> dict[str, str]:
    if seconds is None:
        return {}
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


# What a 429 / 503 is short of (the X-Opencoti-Resource header), and the Retry-After it gets when
# the engine gave none: a pool budget frees only when a client releases a pool.
RESOURCE_RETRY_S = {"model": 5, "server": 5, "pools": 5, "kv_cache": 1, "pool_sessions": 1, "capacity": 1}


def short_resource(exc: BaseException) -> str:
    """The resource a refused request is short of: model (loading), server (shutting down), pools (the
    pool budget), kv_cache, pool_sessions (an enforced admission floor) or capacity (anything else)."""
    message = str(exc).lower()
    if isinstance(exc, PoolSaturatedError):
        return "pool_sessions"
    if isinstance(exc, EngineClosedError) or "shutting down" in message:
        return "server"
    if "loading model" in message:
        return "model"
    if "pool budget" in message:
        return "pools"
    if "kv" in message:
        return "kv_cache"
    return "capacity"


def describe_exception(exc: BaseException) -> tuple[int, str, str, dict[str, str]]:
    """(status, message, type, headers) for any exception (used for responses and SSE error events).
    Every 429 / 503 carries Retry-After and X-Opencoti-Resource."""
    if isinstance(exc, ApiError):
        status, message, etype, headers = exc.status_code, exc.message, exc.error_type, dict(exc.headers)
    elif isinstance(exc, OpencotiError):
        status, message, etype = exc.status_code, str(exc), exc.error_type
        headers = retry_after_header(getattr(exc, "retry_after", None))  # only some kinds carry one
        if isinstance(exc, PoolSaturatedError):
            cap = exc.capacity or {}
            headers["X-Sessions-Remaining"] = sessions_remaining_header(cap.get("sessions_remaining"))
            if exc.reason:
                headers["X-Admission-Reason"] = exc.reason
    else:
        return 500, f"internal server error: {type(exc).__name__}: {exc}", "server_error", {}
    if status in (429, 503):
        resource = short_resource(exc)
        headers["X-Opencoti-Resource"] = resource
        headers.setdefault("Retry-After", str(RESOURCE_RETRY_S[resource]))
    return status, message, etype, headers


def _exception_body(exc: BaseException, status: int, message: str, etype: str, openai: bool = False,
                    path: str = "") -> dict:
    body = error_body(status, message, etype)
    if isinstance(exc, ContextLengthError):
        if exc.n_ctx is not None:  # llama.cpp's extra fields
            body["error"].update(n_prompt_tokens=exc.n_prompt_tokens, n_ctx=exc.n_ctx)
        if path.startswith(ANTHROPIC_PATHS):  # Anthropic's words (what langchain-anthropic looks for)
            body["error"]["message"] = anthropic_context_message(exc, message)
        elif openai:  # OpenAI's error code, param "messages" and words; the code also ends the message, as
            # the OpenAI SDKs put only the message in the exception's text (what langchain-openai reads)
            body["error"].update(code=OPENAI_CONTEXT_CODE, param="messages",
                                 message=f"{openai_context_message(exc, message, path)} ({OPENAI_CONTEXT_CODE})")
    return body


OPENAI_CONTEXT_CODE = "context_length_exceeded"


def anthropic_context_message(exc: ContextLengthError, fallback: str) -> str:
    """Anthropic's context overflow: ``prompt is too long: N tokens > M maximum`` (the room left for
    the prompt once ``max_tokens`` is set aside, when the prompt alone would fit)."""
    n, ctx, out = exc.n_prompt_tokens, exc.n_ctx, exc.max_tokens or 0
    if n is None or ctx is None:
        return f"prompt is too long: {fallback}"
    if n > ctx or out <= 0:
        return f"prompt is too long: {n} tokens > {ctx} maximum"
    return (f"prompt is too long: {n} tokens > {max(0, ctx - out)} maximum (a context of {ctx} tokens less "
            f"max_tokens {out})")


def openai_context_message(exc: ContextLengthError, fallback: str, path: str = "") -> str:
    """OpenAI's context overflow: ``This model's maximum context length is N tokens. However, ...``."""
    n, ctx, out = exc.n_prompt_tokens, exc.n_ctx, exc.max_tokens or 0
    if n is None or ctx is None:
        return fallback
    what = "prompt" if path.startswith(("/v1/completions", "/v1/embeddings")) else "messages"
    if out <= 0:
        return (f"This model's maximum context length is {ctx} tokens. However, your {what} resulted in {n} "
                f"tokens. Please reduce the length of the {what}.")
    return (f"This model's maximum context length is {ctx} tokens. However, you requested {n + out} tokens "
            f"({n} in the {what}, {out} in the completion). Please reduce the length of the {what} or completion.")


def is_openai_path(path: str) -> bool:
    """The OpenAI-compatible routes (``/v1/...``), whose context errors carry OpenAI's error code."""
    return path.startswith("/v1/")


def error_event(exc: BaseException, openai: bool = False) -> dict:
    status, message, etype, _ = describe_exception(exc)
    return _exception_body(exc, status, message, etype, openai)


def error_response(exc: BaseException, openai: bool = False, path: str = "") -> JSONResponse:
    """The error answer for ``exc`` (``path``: the request's, for the shape of its API)."""
    status, message, etype, headers = describe_exception(exc)
    return SafeJSONResponse(shaped(path, _exception_body(exc, status, message, etype, openai, path)), status_code=status,
                            headers=headers)


def allowed_methods(request: Request) -> list[str]:
    path = request.scope["path"]
    methods: set[str] = set()
    for regex, route_methods in request.app.state.route_methods:
        if regex.match(path):
            methods.update(route_methods)
    if "GET" in methods:
        methods.add("HEAD")
    return sorted(methods)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return SafeJSONResponse(shaped(request.url.path, error_body(400, validation_message(exc.errors()),
                                                                    "invalid_request_error")), status_code=400)

    @app.exception_handler(OpencotiError)
    async def _engine(request: Request, exc: OpencotiError):
        return error_response(exc, openai=is_openai_path(request.url.path), path=request.url.path)

    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError):
        return error_response(exc, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        status = exc.status_code
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        headers = dict(exc.headers or {})
        if status == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}"
        if status == 405:  # every method of every route on this path (Starlette names only the first route's)
            allowed = allowed_methods(request)
            headers["Allow"] = ", ".join(allowed)
            message = f"method {request.method} is not allowed on {request.url.path} (allowed: {', '.join(allowed)})"
        return SafeJSONResponse(shaped(request.url.path, error_body(status, message,
                                                                    _HTTP_TYPES.get(status, "server_error"))),
                                status_code=status, headers=headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(exc, path=request.url.path)
