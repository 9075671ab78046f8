"""Token streams: what ``Engine.stream`` / ``astream`` return (events from the step thread)."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Iterator

from .results import GenerationResult, RequestInfo, TokenDelta


class TokenStream:
    """Iterator over a request's TokenDelta events; ``.info`` is known at once, ``.result`` at the end."""

    def __init__(self, engine, job, q):
        self._engine, self._job, self._q = engine, job, q
        self.info: RequestInfo = job.info
        self.result: GenerationResult | None = None
        self._done = False
        first = q.get()
        assert first[0] == "start"

    def __iter__(self) -> Iterator[TokenDelta]:
        return self

    def __next__(self) -> TokenDelta:
        if self._done:
            raise StopIteration
        kind, payload = self._q.get()
        if kind == "token":
            return payload
        self._done = True
        if kind == "error":
            raise payload
        self.result = payload
        raise StopIteration

    def close(self) -> None:
        """Stop early (e.g. the client disconnected): the request is cancelled."""
        if not self._done:
            self._done = True
            self._engine.cancel(self._job)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class AsyncTokenStream:
    def __init__(self, engine, job, q: asyncio.Queue):
        self._engine, self._job, self._q = engine, job, q
        self.info: RequestInfo = job.info
        self.result: GenerationResult | None = None
        self._done = False
        self._started = False

    def __aiter__(self) -> AsyncIterator[TokenDelta]:
        return self

    async def __anext__(self) -> TokenDelta:
        if self._done:
            raise StopAsyncIteration
        while True:
            kind, payload = await self._q.get()
            if kind == "start":
                continue
            break
        if kind == "token":
            return payload
        self._done = True
        if kind == "error":
            raise payload
        self.result = payload
        raise StopAsyncIteration

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._engine.cancel(self._job)
