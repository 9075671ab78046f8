"""Token streams: what ``Engine.stream`` / ``astream`` return (events from the step thread)."""

from __future__ import annotations

from typing import AsyncIterator, Iterator

from ..results import GenerationResult, PromptProgress, RequestInfo, TokenDelta


_NOTICES = ("start", "started")  # accepted; started computing (its reuse of cached KV is known then)


class _Stream:
    """What both streams do with the step thread's events; only the waiting for one differs."""

    def __init__(self, engine, job, q):
        self._engine, self._job, self._q = engine, job, q
        self.info: RequestInfo = job.info
        self.result: GenerationResult | None = None
        self._done = False

    _pending: tuple | None = None  # an event read while waiting for the start, not yet handed out
    _started = False
    _wants_progress = False  # hand out PromptProgress events too (report_progress)

    def report_progress(self) -> None:
        """Also yield a ``PromptProgress`` after each computed chunk of the prompt (llama.cpp's
        ``return_progress``); without it a stream yields only TokenDelta."""
        self._wants_progress = True

    def _skip(self, kind: str) -> bool:
        return kind in _NOTICES or (kind == "progress" and not self._wants_progress)

    def _notice(self, ev: tuple) -> None:
        """An event read while waiting for the start (``started``)."""
        if ev[0] == "started":
            self._started = True
        elif ev[0] != "start":
            self._pending = ev

    def _waiting(self) -> bool:
        return not (self._started or self._pending is not None or self._done)

    def _take(self, kind: str, payload) -> TokenDelta | PromptProgress | None:
        """One event: its TokenDelta (or PromptProgress), or None at the end (``result`` is set); raises
        the request's error."""
        if kind in ("token", "progress"):
            return payload
        self._done = True
        if kind == "error":
            raise payload
        self.result = payload
        return None

    def _cancel(self) -> None:
        if not self._done:
            self._done = True
            self._engine.cancel(self._job)


class TokenStream(_Stream):
    """Iterator over a request's TokenDelta events; ``.info`` is known at once, ``.result`` at the end."""

    def __init__(self, engine, job, q):
        super().__init__(engine, job, q)
        first = q.get()
        assert first[0] == "start"

    def __iter__(self) -> Iterator[TokenDelta | PromptProgress]:
        return self

    def started(self) -> None:
        """Wait until the request's first step has been computed — ``info.cached_prefix_tokens`` is then the
        prompt tokens it reuses, no longer the reuse expected at accept time — or has ended."""
        while self._waiting():
            self._notice(self._q.get())

    def __next__(self) -> TokenDelta | PromptProgress:
        if self._done:
            raise StopIteration
        kind, payload = self._pending or self._q.get()
        self._pending = None
        while self._skip(kind):
            kind, payload = self._q.get()
        delta = self._take(kind, payload)
        if delta is None:
            raise StopIteration
        return delta

    def close(self) -> None:
        """Stop early (e.g. the client disconnected): the request is cancelled."""
        self._cancel()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class AsyncTokenStream(_Stream):
    """``TokenStream`` for asyncio: an async iterator; ``aclose`` cancels the request."""

    def __aiter__(self) -> AsyncIterator[TokenDelta | PromptProgress]:
        return self

    async def started(self) -> None:
        """``TokenStream.started`` as a coroutine."""
        while self._waiting():
            self._notice(await self._q.get())

    async def __anext__(self) -> TokenDelta | PromptProgress:
        if self._done:
            raise StopAsyncIteration
        kind, payload = self._pending or await self._q.get()
        self._pending = None
        while self._skip(kind):
            kind, payload = await self._q.get()
        delta = self._take(kind, payload)
        if delta is None:
            raise StopAsyncIteration
        return delta

    async def aclose(self) -> None:
        self._cancel()
