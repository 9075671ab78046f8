"""The opencoti inference engine: usable in-process, no HTTP needed.

    from opencoti.engine import Engine, SamplingParams
    eng = Engine.from_default()
    print(eng.generate("Hello!", params=SamplingParams.greedy(16)).text)
"""

from .config import EngineConfig, SamplingParams
from .errors import (CapacityError, ConflictError, ContextLengthError, EngineClosedError, InvalidRequestError,
                     ModelLoadError, NotFoundError, OpencotiError, PoolBusyError, PoolContractError,
                     PoolNotFoundError, PoolSaturatedError, SessionBusyError, SessionNotFoundError)
from .results import GenerationResult, PoolInfo, RequestInfo, TokenDelta

_LAZY = ("Engine", "TokenStream", "AsyncTokenStream")  # torch is imported with them, on first use


def __getattr__(name: str):
    if name in _LAZY:
        from .api import engine as _engine_module
        return getattr(_engine_module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Engine", "EngineConfig", "SamplingParams", "TokenStream", "AsyncTokenStream",
    "GenerationResult", "PoolInfo", "RequestInfo", "TokenDelta",
    "OpencotiError", "InvalidRequestError", "ContextLengthError", "NotFoundError", "SessionNotFoundError",
    "PoolNotFoundError", "ConflictError", "PoolContractError", "PoolBusyError", "SessionBusyError",
    "CapacityError", "EngineClosedError", "ModelLoadError", "PoolSaturatedError",
]
