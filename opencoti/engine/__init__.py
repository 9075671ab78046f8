"""The opencoti inference engine: usable in-process, no HTTP needed.

    from opencoti.engine import Engine, SamplingParams
    eng = Engine.from_default()
    print(eng.generate("Hello!", params=SamplingParams.greedy(16)).text)
"""

from .config import EngineConfig, SamplingParams
from .engine import AsyncTokenStream, Engine, TokenStream
from .errors import (CapacityError, ConflictError, ContextLengthError, EngineClosedError, InvalidRequestError,
                     ModelLoadError, NotFoundError, OpencotiError, PoolBusyError, PoolContractError,
                     PoolNotFoundError, PoolSaturatedError, SessionBusyError, SessionNotFoundError)
from .results import GenerationResult, PoolInfo, RequestInfo, TokenDelta

__all__ = [
    "Engine", "EngineConfig", "SamplingParams", "TokenStream", "AsyncTokenStream",
    "GenerationResult", "PoolInfo", "RequestInfo", "TokenDelta",
    "OpencotiError", "InvalidRequestError", "ContextLengthError", "NotFoundError", "SessionNotFoundError",
    "PoolNotFoundError", "ConflictError", "PoolContractError", "PoolBusyError", "SessionBusyError",
    "CapacityError", "EngineClosedError", "ModelLoadError", "PoolSaturatedError",
]
