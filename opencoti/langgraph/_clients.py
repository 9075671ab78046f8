"""One sync and one async PolyKV client from whatever a node or tool was given.

Nodes and tools take a ``PolyKVClient``, an ``AsyncPolyKVClient``, an in-process ``Engine`` or an
``OpencotiChatModel``, and run in sync graphs (``invoke``) and async graphs (``ainvoke``) alike:
the missing twin is made on the same transport (same engine, or same URL / key / timeout). A
client built around a caller's own ``http_client`` has no twin (its transport cannot be copied):
such a client serves its own kind of graph only.
"""

from __future__ import annotations

from typing import Any

from ..client import AsyncPolyKVClient, PolyKVClient


class ClientPair:
    """A sync client and an async client on one transport (either made on first use)."""

    def __init__(self, sync: PolyKVClient | None, aio: AsyncPolyKVClient | None, source: Any = None):
        self._sync, self._async, self._source = sync, aio, source

    @property
    def sync(self) -> PolyKVClient:
        if self._sync is None:
            self._sync = _twin(self._async, PolyKVClient)
        return self._sync

    @property
    def aio(self) -> AsyncPolyKVClient:
        if self._async is None:
            self._async = _twin(self._sync, AsyncPolyKVClient)
        return self._async


def _twin(client: Any, cls: type) -> Any:
    kind = "sync" if cls is PolyKVClient else "async"
    retries = getattr(getattr(client, "retry", None), "max_retries", 2)
    wait = getattr(getattr(client, "retry", None), "max_wait_s", 30.0)
    if getattr(client, "engine", None) is not None:
        return cls(engine=client.engine, max_retries=retries, max_retry_wait_s=wait)
    if not getattr(client, "_owns_http", False):
        raise TypeError(f"this {type(client).__name__} uses a caller's http_client, so no {kind} twin can be made: "
                        f"give a {cls.__name__} (or an OpencotiChatModel / Engine) to use it in a {kind} graph")
    auth = (getattr(client, "headers", None) or {}).get("Authorization", "")
    api_key = auth[len("Bearer "):] if auth.startswith("Bearer ") else None
    return cls(client.base_url, api_key=api_key, timeout=getattr(client, "timeout", 60.0), max_retries=retries,
               max_retry_wait_s=wait)


def client_pair(client: Any) -> ClientPair:
    """The ``ClientPair`` for a PolyKVClient, AsyncPolyKVClient, Engine or OpencotiChatModel."""
    from .chat_model import OpencotiChatModel
    if isinstance(client, ClientPair):
        return client
    if isinstance(client, OpencotiChatModel):
        return _ModelPair(client)
    if isinstance(client, PolyKVClient):
        return ClientPair(client, None)
    if isinstance(client, AsyncPolyKVClient):
        return ClientPair(None, client)
    if hasattr(client, "create_pool") and hasattr(client, "capacity") and hasattr(client, "tps_snapshot"):
        return ClientPair(PolyKVClient(engine=client), AsyncPolyKVClient(engine=client))
    raise TypeError(f"need a PolyKVClient, AsyncPolyKVClient, Engine or OpencotiChatModel, got {type(client).__name__}")


class _ModelPair(ClientPair):
    """The model's own clients (made lazily by the model, so a lazily loaded engine stays lazy)."""

    def __init__(self, model: Any):
        super().__init__(None, None, model)

    @property
    def sync(self) -> PolyKVClient:
        return self._source.polykv_client

    @property
    def aio(self) -> AsyncPolyKVClient:
        return self._source.async_polykv_client

