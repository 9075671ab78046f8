"""Running a generation over HTTP: start it (bounded by admission), collect it, or stream it as
server-sent events through one loop shared by the three generation routes.

SSE framing is llama.cpp's / OpenAI's: each event is ``data: <json>\\n\\n``; OpenAI-compatible
streams end with ``data: [DONE]\\n\\n``; an error during a stream is sent as
``data: {"error": {...}}`` and the stream ends.

A client that goes away cancels its request: while the request is held by admission or being
collected for a non-streaming answer, ``until_disconnect`` races the work against the ASGI
``http.disconnect`` message; during a streaming answer Starlette cancels the body iterator and the
loop's ``finally`` cancels the engine request (its session keeps what was computed).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, TypeVar

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response, StreamingResponse

from ..engine.results import GenerationResult, PromptProgress, TokenDelta
from ..ops.generation import Prepared
from .errors import error_event
from .resumable import conversation_id, resumable_response
from .state import ServerState
from .tenants import request_tenant

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: Any) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def openai_head(kind: str, cid: str, created: int, model: str) -> dict:
    """The fields an OpenAI answer and each of its stream's chunks open with (``kind``: the ``object``)."""
    return {"id": cid, "object": kind, "created": created, "model": model, "system_fingerprint": f"opencoti-{model}"}


@dataclass(frozen=True)
class OpenAIChunks:
    """The chunks of one OpenAI stream (``kind``: ``chat.completion.chunk`` or ``text_completion``):
    ``chunks(choices, **extra)`` is one SSE event. ``include_usage`` (the request's
    ``stream_options.include_usage``): every chunk carries ``usage: null``, and the stream's last
    one, before ``[DONE]``, the usage."""

    kind: str
    cid: str
    created: int
    model: str
    include_usage: bool

    @classmethod
    def of(cls, kind: str, cid: str, created: int, model: str, body: Any) -> "OpenAIChunks":
        return cls(kind, cid, created, model, bool(body.stream_options and body.stream_options.include_usage))

    def __call__(self, choices: list, **extra: Any) -> bytes:
        d = {**openai_head(self.kind, self.cid, self.created, self.model), "choices": choices}
        if self.include_usage:
            d["usage"] = None
        d.update(extra)
        return sse(d)


class ClientDisconnected(Exception):
    """The client went away before the answer was ready."""


async def wait_disconnect(request: Request) -> None:
    """Returns when the ASGI server reports ``http.disconnect`` (the body has been read already)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return
        await asyncio.sleep(0.05)  # a stray http.request message: don't spin


async def or_499(work: Awaitable[T]) -> T | Response:
    """A non-streaming answer's ``work`` (``Generation.collect``), or the 499 response when the
    client went away first (ClientDisconnected)."""
    try:
        return await work
    except ClientDisconnected:
        return Response(status_code=499)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        watcher.cancel()
        raise
    if task.done():
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:  # noqa: BLE001 - cancelled, or failed while cancelling
        pass
    raise ClientDisconnected()


class Tracker:
    """Per-request latency metrics (TTFT, inter-token latency, end-to-end); does nothing with
    metrics off (``--no-metrics``)."""

    def __init__(self, state: ServerState):
        self.m = state.metrics
        self.t0 = time.perf_counter()
        self.last: float | None = None
        self.open = self.m is not None
        if self.open:
            self.m.in_flight += 1

    def token(self) -> None:
        if self.m is None:
            return
        now = time.perf_counter()
        if self.last is None:
            self.m.ttft.observe(now - self.t0)
        else:
            self.m.itl.observe(now - self.last)
        self.last = now

    def done(self, result: GenerationResult | None) -> None:
        if not self.open:
            return
        self.open = False
        self.m.in_flight -= 1
        if result is not None:
            self.m.e2e.observe(time.perf_counter() - self.t0)
            self.m.request_success.labels(result.stop_reason).inc()
            self.m.llamacpp.add(result.timings)

    def also(self, results) -> None:
        """Other generations of the same request (its other choices or prompts): llama.cpp's series count
        each one's tokens."""
        if self.open:
            for r in results:
                self.m.llamacpp.add(r.timings)


class Generation:
    """A started generation: its engine stream, its latency tracker and the request it belongs to."""

    def __init__(self, request: Request, state: ServerState, stream, tracker: Tracker):
        self.request, self.state, self.stream, self.tracker = request, state, stream, tracker
        self.info = stream.info

    @classmethod
    async def start(cls, request: Request, state: ServerState, prepared: Prepared) -> "Generation | Response":
        """Submit to the engine (held requests wait here, bounded by the admission policy); the 499
        response when the client went away before the request was accepted."""
        tracker = Tracker(state)
        stream = None
        try:
            eng = state.context(request_tenant(request)).require_open()
            stream = await until_disconnect(request, eng.astream(prepared.tokens, params=prepared.params,
                                                                 **prepared.kwargs))
            # the headers carry the cached prefix the request reuses: known once it starts computing
            await until_disconnect(request, stream.started())
        except ClientDisconnected:
            if stream is not None:
                await stream.aclose()
            tracker.done(None)
            return Response(status_code=499)
        except BaseException:
            tracker.done(None)
            raise
        return cls(request, state, stream, tracker)

    @classmethod
    async def prepare_and_start(cls, request: Request, state: ServerState, ctx: Any,
                                prepare: Callable[[Any, Any], Prepared],
                                body: Any) -> "tuple[Prepared, Generation | Response]":
        """A route's start: ``prepare(ctx, body)`` in a worker thread (the prompt tokenized, the
        template rendered), then :meth:`start`."""
        prepared = await run_in_threadpool(prepare, ctx, body)
        return prepared, await cls.start(request, state, prepared)

    async def collect(self) -> GenerationResult:
        """The whole result (non-streaming answers); raises ClientDisconnected."""
        stream, tracker = self.stream, self.tracker

        async def run() -> GenerationResult:
            try:
                async for _ in stream:
                    tracker.token()
                return stream.result
            finally:
                if stream.result is None:
                    await stream.aclose()  # cancelled (client gone) or failed: stop the request

        try:
            result = await until_disconnect(self.request, run())
        except BaseException:
            tracker.done(None)
            raise
        tracker.done(result)
        return result

    def sse(self, on_delta: Callable[[TokenDelta], Iterable[bytes]],
            on_end: Callable[[GenerationResult], Iterable[bytes]], first: Iterable[bytes] = (),
            headers: dict[str, str] | None = None,
            on_error: Callable[[dict], bytes] | None = None,
            on_progress: Callable[[PromptProgress], Iterable[bytes]] | None = None) -> StreamingResponse:
        """The one SSE loop: ``first`` events, then ``on_delta`` per token, then ``on_end``; an error
        becomes an in-band error event (the status line is gone; ``on_error`` frames the error body
        when the route's API has its own error event); the request is cancelled when the stream
        stops early. ``on_progress``: events after each computed chunk of the prompt (llama.cpp's
        ``return_progress``)."""
        stream, tracker, state = self.stream, self.tracker, self.state
        if on_progress is not None:
            stream.report_progress()

        async def events() -> AsyncIterator[bytes]:
            try:
                for ev in first:
                    yield ev
                async for d in stream:
                    if isinstance(d, PromptProgress):
                        for ev in on_progress(d):  # type: ignore[misc]  # only asked for with on_progress
                            yield ev
                        continue
                    tracker.token()
                    state.check_stream()
                    for ev in on_delta(d):
                        yield ev
                for ev in on_end(stream.result):
                    yield ev
            except Exception as e:  # noqa: BLE001 - reported in-band
                yield (on_error or sse)(error_event(e))
            finally:
                if stream.result is None:
                    await stream.aclose()
                tracker.done(stream.result)

        conv_id = conversation_id(self.request)
        if conv_id is not None:  # X-Conversation-Id: the generation outlives its client (resumable.py)
            return resumable_response(self.request, conv_id, events(), "text/event-stream",
                                      {**SSE_HEADERS, **(headers or {})})
        return StreamingResponse(events(), media_type="text/event-stream", headers={**SSE_HEADERS, **(headers or {})})
