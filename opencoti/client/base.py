"""What the sync and async clients share: argument checks, the transport choice, the public attributes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import RetryPolicy

if TYPE_CHECKING:
    from ..engine import Engine


class ClientBase:
    """``engine``: the in-process Engine (None over HTTP); ``base_url`` / ``headers`` / ``timeout``: the
    HTTP settings (None / {} in-process); ``retry``: the retry policy."""

    def __init__(self, engine: "Engine | None", base_url: str | None, api_key: str | None, timeout: float | None,
                 max_retries: int, max_retry_wait_s: float, http_client: Any, http_cls: type, local_cls: type):
        if engine is not None and (base_url is not None or http_client is not None):
            raise ValueError("give engine= (in-process) or base_url= (HTTP), not both")
        if engine is None and base_url is None and http_client is None:
            raise ValueError("give engine= (an in-process Engine) or base_url= (a running `opencoti serve`)")
        if not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be a non-negative integer, got {max_retries!r}")
        self.engine = engine
        self.retry = RetryPolicy(max_retries, max_retry_wait_s)
        self.timeout = timeout
        if engine is not None:
            self.transport: Any = local_cls(engine)
            self.base_url, self.headers, self._owns_http = None, {}, False
        else:
            self.transport = http_cls(base_url, api_key, timeout, http_client)
            self.base_url, self.headers = self.transport.base_url, self.transport.headers
            self._owns_http = self.transport.owns_http

    @property
    def is_http(self) -> bool:
        return self.engine is None
