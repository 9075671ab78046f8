"""Server-sent events and client-disconnect handling.

SSE framing is llama.cpp's / OpenAI's: each event is ``data: <json>\\n\\n``; OpenAI-compatible
streams end with ``data: [DONE]\\n\\n``; an error during a stream is sent as
``data: {"error": {...}}`` and the stream ends.

A client that goes away cancels its request: while the request is held by admission or being
collected for a non-streaming answer, ``until_disconnect`` races the work against the ASGI
``http.disconnect`` message; during a streaming answer Starlette cancels the body iterator and the
iterator's ``finally`` cancels the engine request (its session keeps what was computed).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Awaitable, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: Any) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def sse_response(body, headers: dict[str, str] | None = None) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream", headers={**SSE_HEADERS, **(headers or {})})


class ClientDisconnected(Exception):
    """The client went away before the answer was ready."""


async def wait_disconnect(request: Request) -> None:
    """Returns when the ASGI server reports ``http.disconnect`` (the body has been read already)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return
        await asyncio.sleep(0.05)  # a stray http.request message: don't spin


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
