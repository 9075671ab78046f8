"""Transports: how an operation reaches the engine.

* ``HttpTransport`` / ``AsyncHttpTransport``: the request is built from the operation's row of the
  table (``opencoti.ops.OPERATIONS``: method, path, query) and sent with httpx; error answers are
  mapped to the engine's typed exceptions.
* ``InProcessTransport``: the operation runs through ``opencoti.ops.call`` (the code the HTTP
  routes run), chat through ``opencoti.ops.generation`` (the code the chat route runs).

Every transport offers ``call(name, path, query, body)`` and ``chat(body)`` (an iterator of
ChatChunk); the async ones as coroutines / async iterators.
"""

from __future__ import annotations

import asyncio
import urllib.parse
import weakref
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterator

import httpx

from ..engine.errors import OpencotiError
from ..ops import OPERATIONS, Context, call
from ..ops.generation import ChatTurn, Prepared, prepare_chat_request
from ..ops.results import ChatChunk
from ..ops.schemas import ChatCompletionRequest
from ..ops.validation import validate_json
from .errors import APIConnectionError, APITimeoutError, error_from_response
from .events import ChatEventParser, chat_end_chunks, generation_info, info_from_headers, sse_data
from .loop_clients import LoopClients

if TYPE_CHECKING:
    from ..engine import Engine


# ============================================================================ HTTP
def _request(name: str, path: dict | None, query: dict | None, body: Any) -> tuple[str, str, Any, dict | None]:
    op = OPERATIONS[name]
    url = op.path.format(**{k: urllib.parse.quote(str(v), safe="") for k, v in (path or {}).items()})
    params = {**op.query_fixed, **{k: v for k, v in (query or {}).items() if v is not None}} or None
    return op.method, url, body, params


def _map_response_error(r: httpx.Response, pool_id: int | None) -> OpencotiError:
    try:
        body = r.json()
    except ValueError:
        body = r.text
    return error_from_response(r.status_code, body, r.headers, pool_id=pool_id)


def _pool_id(path: dict | None, body: Any) -> int | None:
    """The pool a request is about (named in a 429's PoolSaturatedError)."""
    if path and "pool_id" in path:
        return path["pool_id"]
    return body.get("pool_id") if isinstance(body, dict) else None


def _map_transport_error(e: Exception, base_url: str, method: str, url: str) -> OpencotiError:
    where = f"{method} {base_url}{url}"
    if isinstance(e, httpx.TimeoutException):
        return APITimeoutError(f"request timed out: {where}: {e or type(e).__name__} (raise timeout= if the "
                               "server is busy)", url=base_url + url)
    connect = isinstance(e, httpx.ConnectError)
    hint = (f"; is `opencoti serve` running at {base_url}? Start it (e.g. `opencoti serve --port "
            f"{urllib.parse.urlsplit(base_url).port or 80}`), give the right base_url=, or use an in-process "
            "engine with engine=Engine.from_default()") if connect else ""
    return APIConnectionError(f"cannot reach the server: {where}: {e or type(e).__name__}{hint}",
                              retryable=connect, url=base_url + url)


def normalize_base_url(base_url: str) -> str:
    """The server's root URL: a trailing ``/`` and an OpenAI-style ``/v1`` (the ChatOpenAI habit) are
    dropped, as every route path (``/v1/chat/completions``, ``/polykv/...``) is absolute."""
    url = base_url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3].rstrip("/")
    return url


class _HttpBase:
    def __init__(self, base_url: str | None, api_key: str | None, timeout: float | None, http_client: Any):
        if base_url is None:
            base_url = str(http_client.base_url)
        self.base_url = normalize_base_url(base_url)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # a caller's http client keeps its own timeout settings
        self.timeout_kw = {"timeout": timeout} if http_client is None else {}
        self.owns_http = http_client is None

    def chat_body(self, body: dict) -> dict:
        return {**body, "stream": True, "stream_options": {"include_usage": True}}


class HttpTransport(_HttpBase):
    def __init__(self, base_url: str | None, api_key: str | None, timeout: float | None,
                 http_client: httpx.Client | None):
        super().__init__(base_url, api_key, timeout, http_client)
        self.http = http_client if http_client is not None else httpx.Client(timeout=timeout)
        if self.owns_http:  # a client dropped without close() still closes its sockets (no ResourceWarning)
            weakref.finalize(self, self.http.close)

    def close(self) -> None:
        if self.owns_http:
            self.http.close()

    def call(self, name: str, path: dict | None = None, query: dict | None = None, body: Any = None,
             timeout: float | None = None) -> Any:
        """One request (``timeout``: seconds for this one, instead of the client's)."""
        method, url, json_body, params = _request(name, path, query, body)
        try:
            r = self.http.request(method, self.base_url + url, json=json_body, params=params, headers=self.headers,
                                  **({"timeout": timeout} if timeout is not None else self.timeout_kw))
        except httpx.TransportError as e:
            raise _map_transport_error(e, self.base_url, method, url) from e
        if r.status_code >= 400:
            raise _map_response_error(r, _pool_id(path, body))
        return r.json()

    def chat(self, body: dict) -> Iterator[ChatChunk]:
        method, url, _, _ = _request("chat", None, None, None)
        try:
            with self.http.stream(method, self.base_url + url, json=self.chat_body(body), headers=self.headers,
                                  **self.timeout_kw) as r:
                if r.status_code >= 400:
                    r.read()
                    raise _map_response_error(r, body.get("pool_id"))
                parser = ChatEventParser(info_from_headers(r.headers), body.get("pool_id"))
                yield parser.start()
                for line in r.iter_lines():
                    data = sse_data(line)
                    if data is not None:
                        yield from parser.feed(data)
        except httpx.TransportError as e:
            raise _map_transport_error(e, self.base_url, method, url) from e


class AsyncHttpTransport(_HttpBase):
    """An httpx.AsyncClient's connections belong to the event loop that opened them, so the
    transport keeps one client per running loop, closed with that loop or when the transport is
    dropped (``LoopClients``); a caller's ``http_client`` is used as given: a client used under
    one ``asyncio.run`` keeps working under the next."""

    def __init__(self, base_url: str | None, api_key: str | None, timeout: float | None,
                 http_client: httpx.AsyncClient | None):
        super().__init__(base_url, api_key, timeout, http_client)
        self._given = http_client
        self._clients = LoopClients(lambda: httpx.AsyncClient(timeout=timeout))

    @property
    def http(self) -> httpx.AsyncClient:
        return self._given if self._given is not None else self._clients.current()

    async def aclose(self) -> None:
        if self.owns_http:
            await self._clients.aclose()

    async def call(self, name: str, path: dict | None = None, query: dict | None = None, body: Any = None) -> Any:
        method, url, json_body, params = _request(name, path, query, body)
        try:
            r = await self.http.request(method, self.base_url + url, json=json_body, params=params,
                                        headers=self.headers, **self.timeout_kw)
        except httpx.TransportError as e:
            raise _map_transport_error(e, self.base_url, method, url) from e
        if r.status_code >= 400:
            raise _map_response_error(r, _pool_id(path, body))
        return r.json()

    async def chat(self, body: dict) -> AsyncIterator[ChatChunk]:
        method, url, _, _ = _request("chat", None, None, None)
        try:
            async with self.http.stream(method, self.base_url + url, json=self.chat_body(body),
                                        headers=self.headers, **self.timeout_kw) as r:
                if r.status_code >= 400:
                    await r.aread()
                    raise _map_response_error(r, body.get("pool_id"))
                parser = ChatEventParser(info_from_headers(r.headers), body.get("pool_id"))
                yield parser.start()
                async for line in r.aiter_lines():
                    data = sse_data(line)
                    if data is not None:
                        for c in parser.feed(data):
                            yield c
        except httpx.TransportError as e:
            raise _map_transport_error(e, self.base_url, method, url) from e


# ============================================================================ in-process
class InProcessTransport:
    """Operations on an Engine in this process."""

    def __init__(self, engine: "Engine"):
        self.engine = engine
        self.ctx = Context(engine)

    def call(self, name: str, path: dict | None = None, query: dict | None = None, body: Any = None) -> Any:
        return call(self.ctx, name, path, query, body)

    def _prepare(self, body: dict) -> Prepared:
        return prepare_chat_request(self.ctx, validate_json(ChatCompletionRequest, body))

    def chat(self, body: dict) -> Iterator[ChatChunk]:
        prepared = self._prepare(body)
        stream = self.ctx.require_open().stream(prepared.tokens, params=prepared.params, **prepared.kwargs)
        stream.started()  # its info then counts the cached prefix it reuses (as the HTTP headers do)
        turn, gi = ChatTurn(prepared), generation_info(stream.info)
        try:
            yield ChatChunk(info=gi)
            for d in stream:
                text = turn.feed(d.text)
                if text:
                    yield ChatChunk(content=text)
            yield from chat_end_chunks(turn, gi, stream.info, stream.result, self.ctx.model_name)
        finally:
            if stream.result is None:
                stream.close()


class AsyncInProcessTransport(InProcessTransport):
    """The same as coroutines: operations run in a worker thread, chat streams with ``Engine.astream``."""

    async def call(self, name: str, path: dict | None = None, query: dict | None = None, body: Any = None) -> Any:
        return await asyncio.to_thread(call, self.ctx, name, path, query, body)

    async def chat(self, body: dict) -> AsyncIterator[ChatChunk]:
        prepared = await asyncio.to_thread(self._prepare, body)
        stream = await self.ctx.require_open().astream(prepared.tokens, params=prepared.params, **prepared.kwargs)
        await stream.started()
        turn, gi = ChatTurn(prepared), generation_info(stream.info)
        try:
            yield ChatChunk(info=gi)
            async for d in stream:
                text = turn.feed(d.text)
                if text:
                    yield ChatChunk(content=text)
            for c in chat_end_chunks(turn, gi, stream.info, stream.result, self.ctx.model_name):
                yield c
        finally:
            if stream.result is None:
                await stream.aclose()
