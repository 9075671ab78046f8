"""``AsyncPolyKVClient``: the asynchronous shell over a transport (HTTP or in-process); the same
methods as ``PolyKVClient`` (see its docstrings), as coroutines."""

from __future__ import annotations

import asyncio
import itertools
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Sequence, Unpack

import httpx

from ..engine.errors import OpencotiError
from ..ops.results import (AdmissionPolicy, Capacity, ChatChunk, ChatCompletion, CompactionResult, Completion, Pool,
                           PoolTree, SessionStatus, TpsSnapshot)
from .base import ClientBase
from .calls import ChatArgs, CompletionArgs, chat_request, checked_str, completion_request, prefix_body, release_query
from .events import aggregate_chat, completion_from_dict
from .transport import AsyncHttpTransport, AsyncInProcessTransport

if TYPE_CHECKING:
    from ..engine import Engine


class AsyncPolyKVClient(ClientBase):
    """Asynchronous PolyKV client: the same operations as ``PolyKVClient``, as coroutines.

    ``http_client``: an ``httpx.AsyncClient`` (e.g. with ``httpx.ASGITransport(app)``).
    """

    def __init__(self, base_url: str | None = None, *, engine: "Engine | None" = None, api_key: str | None = None,
                 timeout: float | None = 60.0, max_retries: int = 2, max_retry_wait_s: float = 30.0,
                 http_client: httpx.AsyncClient | None = None):
        super().__init__(engine, base_url, api_key, timeout, max_retries, max_retry_wait_s, http_client,
                         AsyncHttpTransport, AsyncInProcessTransport)

    async def aclose(self) -> None:
        """Close the HTTP connection pool."""
        if self.is_http:
            await self.transport.aclose()

    async def __aenter__(self) -> "AsyncPolyKVClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    # ---------------------------------------------------------------- plumbing
    async def _with_retries(self, fn: Callable[[], Awaitable[Any]]) -> Any:
        for attempt in itertools.count():
            try:
                return await fn()
            except OpencotiError as e:
                await asyncio.sleep(self.retry.wait_or_raise(e, attempt))

    async def _call(self, name: str, path: dict | None = None, query: dict | None = None, body: Any = None) -> Any:
        return await self._with_retries(lambda: self.transport.call(name, path, query, body))

    async def _stream(self, body: dict) -> AsyncIterator[ChatChunk]:
        opened = await self._with_retries(lambda: _opened(self.transport.chat(body)))
        if opened is None:
            return
        gen, first = opened
        try:
            yield first
            async for c in gen:
                yield c
        finally:
            await gen.aclose()

    # ---------------------------------------------------------------- model & tokens
    async def health(self) -> dict:
        return await self._call("health")

    async def model_name(self) -> str:
        return (await self._call("models"))["data"][0]["id"]

    async def model_info(self) -> dict:
        return (await self._call("models"))["data"][0]

    async def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        return (await self._call("tokenize", body={"content": text, "add_special": add_special}))["tokens"]

    async def detokenize(self, tokens: Sequence[int]) -> str:
        return (await self._call("detokenize", body={"tokens": list(tokens)}))["content"]

    async def apply_template(self, messages: list[dict], tools: list[dict] | None = None,
                             add_generation_prompt: bool = True) -> str:
        return (await self._call("apply_template", body={"messages": messages, "tools": tools,
                                                         "add_generation_prompt": add_generation_prompt}))["prompt"]

    # ---------------------------------------------------------------- generation
    def chat_stream(self, messages: list[dict], **kw: Unpack[ChatArgs]) -> AsyncIterator[ChatChunk]:
        return self._stream(chat_request(messages, kw))

    async def chat(self, messages: list[dict], **kw: Unpack[ChatArgs]) -> ChatCompletion:
        return aggregate_chat([c async for c in self.chat_stream(messages, **kw)])

    async def complete(self, prompt: str | Sequence[int], **kw: Unpack[CompletionArgs]) -> Completion:
        return completion_from_dict(await self._call("complete", body=completion_request(prompt, kw)))

    # ---------------------------------------------------------------- pools
    async def create_pool(self, *, tokens: Sequence[int] | None = None, text: str | None = None,
                          messages: list[dict] | None = None, tools: list[dict] | None = None,
                          from_session: str | None = None, add_generation_prompt: bool = False, pinned: bool = False,
                          label: str = "", as_root: bool = False) -> Pool:
        return Pool(**await self._call("create_pool", body=prefix_body(
            tokens, text, messages, tools, from_session, add_generation_prompt, pinned=pinned or None,
            label=label or None, as_root=as_root or None)))

    async def fork_pool(self, parent_id: int, *, branch_pos: int | None = None, tokens: Sequence[int] | None = None,
                        text: str | None = None, messages: list[dict] | None = None, tools: list[dict] | None = None,
                        from_session: str | None = None, add_generation_prompt: bool = False, pinned: bool = False,
                        label: str = "") -> Pool:
        return Pool(**await self._call("fork_pool", {"pool_id": parent_id}, body=prefix_body(
            tokens, text, messages, tools, from_session, add_generation_prompt, branch_pos=branch_pos,
            pinned=pinned or None, label=label or None)))

    async def pool(self, pool_id: int) -> Pool:
        return Pool(**await self._call("pool", {"pool_id": pool_id}))

    async def pools(self) -> PoolTree:
        return PoolTree(**await self._call("pools"))

    async def release_pool(self, pool_id: int, *, immediate: bool = False, cascade_sessions: bool = False) -> list[str]:
        got = await self._call("release_pool", {"pool_id": pool_id}, release_query(immediate, cascade_sessions))
        return list((got or {}).get("ended_sessions") or []) if isinstance(got, dict) else []

    async def pin_pool(self, pool_id: int) -> Pool:
        return Pool(**await self._call("pin_pool", {"pool_id": pool_id}))

    async def unpin_pool(self, pool_id: int) -> Pool:
        return Pool(**await self._call("unpin_pool", {"pool_id": pool_id}))

    async def evict_pool(self, pool_id: int) -> Pool:
        return Pool(**await self._call("evict_pool", {"pool_id": pool_id}))

    async def flush_pool(self, pool_id: int) -> int:
        return (await self._call("flush_pool", {"pool_id": pool_id}))["flushed_sessions"]

    # ---------------------------------------------------------------- admission & tps
    async def admission(self, pool_id: int) -> AdmissionPolicy:
        return AdmissionPolicy(**await self._call("admission", {"pool_id": pool_id}))

    async def set_admission(self, pool_id: int, **policy: Any) -> AdmissionPolicy:
        return AdmissionPolicy(**await self._call("set_admission", {"pool_id": pool_id}, body=policy))

    async def capacity(self, pool_id: int, expected_tokens: int | None = None,
                       session_id: str | None = None) -> Capacity:
        return Capacity(**await self._call("capacity", {"pool_id": pool_id},
                                     {"expected_tokens": expected_tokens, "session_id": session_id}))

    async def events(self, pool_id: int | None = None, since: float | None = None) -> list[dict]:
        return (await self._call("events", query={"pool_id": pool_id, "since": since}))["events"]

    async def tps(self) -> TpsSnapshot:
        return TpsSnapshot(**await self._call("tps"))

    async def session_status(self, session_id: str) -> SessionStatus | None:
        return (await self.tps()).session(checked_str("session_id", session_id))

    # ---------------------------------------------------------------- sessions
    async def release_session(self, session_id: str) -> None:
        await self._call("release_session", {"session_id": checked_str("session_id", session_id)})

    async def compact_session(self, session_id: str, ancestor_pool_id: int, *, tokens: Sequence[int] | None = None,
                              text: str | None = None, messages: list[dict] | None = None,
                              tools: list[dict] | None = None,
                              branch_pos: int | None = None, release_old: bool = True) -> CompactionResult:
        body = prefix_body(tokens, text, messages, tools, None, False, ancestor_pool_id=ancestor_pool_id,
                           branch_pos=branch_pos, release_old=release_old)
        sid = checked_str("session_id", session_id)
        return CompactionResult(**await self._call("compact_session", {"session_id": sid}, body=body))

    async def integrity(self) -> dict:
        return await self._call("integrity")


async def _opened(gen: AsyncIterator[ChatChunk]) -> tuple[AsyncIterator[ChatChunk], ChatChunk] | None:
    """``sync._opened`` for async streams (a refused stream is closed before the retry)."""
    try:
        return gen, await gen.__anext__()
    except StopAsyncIteration:
        return None
    except OpencotiError:
        await gen.aclose()
        raise
