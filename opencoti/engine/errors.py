"""Typed exceptions of the engine API. Each carries the HTTP status the server maps it to.

Where LangChain has a type for the same condition, the exception is also that type
(``langchain_core.exceptions``): a context overflow is a ``ContextOverflowError`` (what
``SummarizationMiddleware`` recovers from), a refused admission a ``ModelRateLimitError``, a bad
request a ``ModelInvalidRequestError``, so LangChain code that catches those catches ours."""

from __future__ import annotations

from langchain_core.exceptions import ContextOverflowError, ModelInvalidRequestError, ModelRateLimitError


class OpencotiError(Exception):
    """Base class of every error the engine raises on purpose."""

    status_code = 500
    error_type = "server_error"


class InvalidRequestError(OpencotiError, ValueError, ModelInvalidRequestError):
    """The request is malformed or a value is out of range (HTTP 400)."""

    status_code = 400
    error_type = "invalid_request_error"


class ContextLengthError(InvalidRequestError, ContextOverflowError):
    """Prompt plus max_tokens does not fit the model's context (HTTP 400). ``n_prompt_tokens`` and
    ``n_ctx`` are reported in the error body, like llama.cpp's; on the OpenAI routes the body also
    carries OpenAI's ``code: "context_length_exceeded"`` and wording, on the Anthropic routes the
    message is Anthropic's (``prompt is too long: ...``), so each API's clients recognise it."""

    error_type = "exceed_context_size_error"

    def __init__(self, message: str, n_prompt_tokens: int | None = None, n_ctx: int | None = None,
                 max_tokens: int | None = None):
        super().__init__(message)
        self.n_prompt_tokens = n_prompt_tokens
        self.n_ctx = n_ctx
        self.max_tokens = max_tokens
        """The tokens the request set aside for the answer (each API words the overflow its own way)."""


class NotFoundError(OpencotiError, KeyError):
    """An unknown session or pool id (HTTP 404)."""

    status_code = 404
    error_type = "not_found_error"

    def __str__(self) -> str:  # KeyError quotes its message; we don't want that
        return str(self.args[0]) if self.args else "not found"


class SessionNotFoundError(NotFoundError):
    """No session with this id."""


class PoolNotFoundError(NotFoundError):
    """No pool with this id."""


class ConflictError(OpencotiError):
    """The request conflicts with the current state (HTTP 409)."""

    status_code = 409
    error_type = "conflict_error"


class PoolContractError(ConflictError):
    """The declared prefix does not token-match the parent pool / shared prefix."""


class PoolBusyError(ConflictError):
    """The pool cannot be changed now (has children, is pinned, ...)."""


class SessionBusyError(ConflictError):
    """The session is serving another request."""


class CapacityError(OpencotiError):
    """A budget is exhausted (pools, KV pages) and waiting would not help (HTTP 503)."""

    status_code = 503
    error_type = "unavailable_error"

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class PoolSaturatedError(OpencotiError, ModelRateLimitError):
    """A new session does not fit a pool whose admission policy is enforced (HTTP 429 + Retry-After).

    ``retry_after``: seconds after which trying again may succeed; ``reason``: the capacity reason
    (e.g. "projected mean tps below floor"); ``capacity``: the capacity report that decided it."""

    status_code = 429
    error_type = "pool_saturated_error"

    def __init__(self, message: str, retry_after: float | None = None, *, pool_id: int | None = None,
                 reason: str | None = None, capacity: dict | None = None):
        super().__init__(message)
        self.retry_after = retry_after
        self.pool_id = pool_id
        self.reason = reason
        self.capacity = capacity


class EngineClosedError(OpencotiError):
    """The engine has been shut down (HTTP 503)."""

    status_code = 503
    error_type = "unavailable_error"


class ModelLoadError(OpencotiError):
    """The model could not be found or loaded."""

    status_code = 500
    error_type = "model_load_error"
