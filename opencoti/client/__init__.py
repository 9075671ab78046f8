"""PolyKV client: one interface, two transports.

    from opencoti.client import PolyKVClient, AsyncPolyKVClient
    client = PolyKVClient(base_url="http://127.0.0.1:8080", api_key="...")  # a remote `opencoti serve`
    client = PolyKVClient(engine=engine)                                    # an in-process Engine

Both transports run the same operations (``opencoti.ops``: the table the HTTP routes are built
from) with the same typed (pydantic) results and the same exceptions (``opencoti.engine.errors``:
``PoolSaturatedError(retry_after)``, ``PoolContractError``, ``PoolNotFoundError``, ... plus the
HTTP-only ``AuthenticationError``, ``APIConnectionError``, ``APITimeoutError`` and
``APIStatusError`` defined in ``client.errors``). Chat requests are rendered by the engine's one
chat chain on both (tool definitions injected into the system prompt when the model's template
ignores them, ``tool_choice`` by prefill, tool-call parsing), so a pool created from messages +
tools is a token-exact prefix of the chat requests that use them, whichever transport made it.

Retries: requests refused with ``PoolSaturatedError`` (429) or a ``Retry-After``-carrying 503, and
HTTP connection failures, are retried up to ``max_retries`` times, waiting ``Retry-After`` when the
server (or engine) gives one, else an exponential backoff with jitter. A stream is never retried
once its first event has been yielded.

Modules: ``sync`` / ``aio`` (the two shells), ``transport`` (HTTP and in-process), ``calls``
(request bodies), ``events`` (answers -> results), ``errors`` (HTTP errors, retry policy).
"""

from ..engine.errors import (CapacityError, ConflictError, ContextLengthError, EngineClosedError,
                             InvalidRequestError, NotFoundError, OpencotiError, PoolBusyError, PoolContractError,
                             PoolNotFoundError, PoolSaturatedError, SessionBusyError, SessionNotFoundError)
from ..ops.results import (AdmissionPolicy, Capacity, ChatChunk, ChatCompletion, CompactionResult, Completion,
                           GenerationInfo, Pool, PoolTree, SessionStatus, TpsSnapshot, ToolCall, Usage)
from .aio import AsyncPolyKVClient
from .errors import APIConnectionError, APIStatusError, APITimeoutError, AuthenticationError, error_from_response
from .events import aggregate_chat
from .sync import PolyKVClient

__all__ = [
    "PolyKVClient", "AsyncPolyKVClient",
    "Pool", "PoolTree", "Capacity", "AdmissionPolicy", "SessionStatus", "TpsSnapshot", "CompactionResult",
    "GenerationInfo", "Usage", "ToolCall", "ChatChunk", "ChatCompletion", "Completion", "aggregate_chat",
    "error_from_response",
    "OpencotiError", "InvalidRequestError", "ContextLengthError", "NotFoundError", "PoolNotFoundError",
    "SessionNotFoundError", "ConflictError", "PoolContractError", "PoolBusyError", "SessionBusyError",
    "CapacityError", "PoolSaturatedError", "EngineClosedError", "AuthenticationError", "APIConnectionError",
    "APITimeoutError", "APIStatusError",
]
