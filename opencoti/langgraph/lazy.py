"""An in-process engine built in the background, and the models made from the environment.

``model_from_env()`` is what graph files served by ``langgraph dev`` call at import time: it
returns at once (the graph is registered, the server starts) while the engine loads in a
background thread; the first request waits for it.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from typing import Any, Callable


class LazyEngine:
    """An ``Engine`` being built in a background thread. Construction returns at once; any use
    (an attribute of the engine) waits until it is built and re-raises a failed build."""

    def __init__(self, factory: Callable[[], Any], name: str = "engine"):
        self._future: Future = Future()
        self._name = name

        def build():
            try:
                self._future.set_result(factory())
            except BaseException as e:  # noqa: BLE001 - handed to whoever uses the engine
                self._future.set_exception(e)

        threading.Thread(target=build, name=f"opencoti-load-{name}", daemon=True).start()

    def result(self, timeout: float | None = None) -> Any:
        """The engine (waits for the build)."""
        return self._future.result(timeout)

    @property
    def ready(self) -> bool:
        """True once the build is over (done or failed)."""
        return self._future.done()

    @property
    def is_closed(self) -> bool:
        if not self._future.done():
            return False
        if self._future.exception() is not None:
            return True
        return self._future.result().is_closed

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_future", "_name"):
            raise AttributeError(name)
        return getattr(self._future.result(), name)

    def __repr__(self) -> str:
        state = "ready" if self.ready else "loading"
        return f"LazyEngine({self._name!r}, {state})"


_ENGINES: dict[str, Any] = {}
_LOCK = threading.Lock()


def shared_engine(name: str | None = None, kv_budget_tokens: int | None = None) -> LazyEngine:
    """The process-wide engine on ``name`` (default ``OPENCOTI_MODEL``, else the bundled model;
    ``OPENCOTI_KV_BUDGET_TOKENS`` sizes its KV cache), started in the background on first call."""
    name = name or os.environ.get("OPENCOTI_MODEL") or "default"
    if kv_budget_tokens is None and os.environ.get("OPENCOTI_KV_BUDGET_TOKENS"):
        kv_budget_tokens = int(os.environ["OPENCOTI_KV_BUDGET_TOKENS"])
    with _LOCK:
        eng = _ENGINES.get(name)
        if eng is None or eng.is_closed:
            def factory():
                from ..engine import Engine, EngineConfig
                return Engine(EngineConfig(model=None if name == "default" else name,
                                           kv_budget_tokens=kv_budget_tokens))
            eng = _ENGINES[name] = LazyEngine(factory, name)
    return eng


def model_from_env(**fields: Any):
    """An ``OpencotiChatModel`` chosen by the environment, for graphs served by ``langgraph dev``:
    ``OPENCOTI_BASE_URL`` set -> over HTTP (with ``OPENCOTI_API_KEY``); otherwise the process-wide
    in-process engine on ``OPENCOTI_MODEL`` (default: the bundled model; ``tiny:llama`` for
    tests), loaded in the background and shared by every graph."""
    from .chat_model import OpencotiChatModel
    if os.environ.get("OPENCOTI_BASE_URL"):
        return OpencotiChatModel(**fields)
    return OpencotiChatModel(engine=shared_engine(), **fields)
