"""The client's errors: the HTTP-only kinds, the mapping of an HTTP error answer to the engine's
typed exceptions (the ones an in-process transport raises directly), and the retry policy."""

from __future__ import annotations

import random
from typing import Any

from langchain_core.exceptions import ModelAuthenticationError, ModelConnectionError, ModelTimeoutError

from ..engine.errors import (CapacityError, ConflictError, ContextLengthError, EngineClosedError,
                             InvalidRequestError, NotFoundError, OpencotiError, PoolBusyError, PoolContractError,
                             PoolNotFoundError, PoolSaturatedError, SessionBusyError, SessionNotFoundError)


class AuthenticationError(OpencotiError, ModelAuthenticationError):
    """The server refused the API key (HTTP 401)."""

    status_code = 401
    error_type = "authentication_error"


class APIConnectionError(OpencotiError, ModelConnectionError):
    """The server could not be reached (connection refused, DNS, reset before an answer).

    ``retryable``: the request was certainly not sent (a connect error), so sending it again is safe
    (also LangChain's ``is_retryable``). ``url``: the URL that was asked."""

    status_code = 0
    error_type = "connection_error"

    def __init__(self, message: str, retryable: bool = False, url: str | None = None):
        super().__init__(message)
        self.retryable = retryable
        self.url = url

    @property
    def is_retryable(self) -> bool:  # type: ignore[override]
        return self.retryable


class APITimeoutError(APIConnectionError, ModelTimeoutError):
    """The request timed out."""

    error_type = "timeout_error"


class APIStatusError(OpencotiError):
    """An HTTP error status with no more specific exception (e.g. 500, 413)."""

    def __init__(self, message: str, status_code: int, error_type: str = "server_error"):
        super().__init__(message)
        self.status_code = status_code
        self.error_type = error_type



def error_from_response(status: int, body: Any, headers: Any = None, pool_id: int | None = None) -> OpencotiError:
    """Map an HTTP error (llama.cpp's ``{"error": {code, message, type}}``) to a typed exception.

    The 404 and 409 kinds share one ``type`` on the wire; the message tells them apart."""
    headers = headers or {}
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        message = str(err.get("message", "")) or f"HTTP {status}"
        etype = str(err.get("type", ""))
        code = err.get("code")
        if isinstance(code, int) and not isinstance(code, bool):  # llama.cpp: the status; OpenAI: a name
            status = code
        elif code == "context_length_exceeded":
            etype = "exceed_context_size_error"
    else:
        message = body if isinstance(body, str) and body else f"HTTP {status}"
        etype = ""
    low = message.lower()
    retry_after = _retry_after(headers.get("retry-after"))
    if status == 400:
        if etype == "exceed_context_size_error":
            info = err if isinstance(err, dict) else {}
            return ContextLengthError(message, info.get("n_prompt_tokens"), info.get("n_ctx"))
        return InvalidRequestError(message)
    if status == 401:
        return AuthenticationError(message)
    if status == 404:
        if low.startswith("pool"):
            return PoolNotFoundError(message)
        if low.startswith("session"):
            return SessionNotFoundError(message)
        return NotFoundError(message)
    if status == 409:
        if "contract" in low or "differ" in low:
            return PoolContractError(message)
        if low.startswith("session"):
            return SessionBusyError(message)
        if low.startswith("pool"):
            return PoolBusyError(message)
        return ConflictError(message)
    if status == 429:
        return PoolSaturatedError(message, retry_after, pool_id=pool_id, reason=headers.get("x-admission-reason"))
    if status == 503:
        if "shutting down" in low or "shut down" in low:
            return EngineClosedError(message)
        if headers.get("x-opencoti-resource") == "pools":
            retry_after = None  # the pool budget frees only when someone releases a pool: not worth a retry
        return CapacityError(message, retry_after=retry_after)
    return APIStatusError(message, status, etype or "server_error")


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None



RETRYABLE = (PoolSaturatedError, CapacityError, APIConnectionError)


class RetryPolicy:
    def __init__(self, max_retries: int, max_wait_s: float):
        self.max_retries, self.max_wait_s = max_retries, max_wait_s

    def delay(self, error: BaseException, attempt: int) -> float | None:
        """Seconds to wait before retry ``attempt`` (0-based), or None to give up."""
        if attempt >= self.max_retries or not isinstance(error, RETRYABLE):
            return None
        if isinstance(error, APIConnectionError) and not error.retryable:
            return None  # a timeout or a broken connection: the request may have been applied
        if isinstance(error, CapacityError) and not isinstance(error, PoolSaturatedError) \
                and getattr(error, "retry_after", None) is None:
            return None  # a budget that waiting would not free (e.g. pool budget)
        ra = getattr(error, "retry_after", None)
        if ra is not None:
            return min(float(ra), self.max_wait_s)
        return min(0.5 * 2 ** attempt, 8.0, self.max_wait_s) * (0.75 + 0.5 * random.random())

    def wait_or_raise(self, error: BaseException, attempt: int) -> float:
        """``delay``, raising ``error`` again where it gives up."""
        wait = self.delay(error, attempt)
        if wait is None:
            raise error
        return wait


