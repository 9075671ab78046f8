"""Resumable generation streams (llama.cpp's ``X-Conversation-Id``): a streaming generation sent
with an ``X-Conversation-Id`` header keeps running when its client goes away (a page reload), its
events are kept, and

* ``GET /v1/stream?conv_id=<id>&from=<byte offset>`` replays them from that offset and follows the
  live ones until the generation ends (404 for an unknown or expired id; 400 when the offset was
  dropped from a full buffer);
* ``DELETE /v1/stream?conv_id=<id>`` stops the generation and forgets its events (204, also for an
  id that is already gone).

The id travels in the query string because it may hold a model name with slashes. A finished
stream is kept ``TTL_S`` seconds; a stream keeps its last ``CAP_BYTES`` bytes. Ids are per tenant
(an API keys file): a tenant sees only the streams it started. A new stream under an id that is
still running stops the old one.
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse

from .errors import ApiError, error_responses
from .tenants import request_tenant

TTL_S = 300.0
CAP_BYTES = 8 << 20
HEADER = "x-conversation-id"


class StreamBuffer:
    """The events of one generation: appended by its producer task, read from any offset."""

    def __init__(self):
        self.data = bytearray()
        self.dropped = 0  # bytes dropped from the front (the cap)
        self.done_at: float | None = None
        self.task: asyncio.Task | None = None
        self._changed = asyncio.Condition()

    @property
    def total(self) -> int:
        return self.dropped + len(self.data)

    async def append(self, chunk: bytes) -> None:
        async with self._changed:
            self.data += chunk
            if len(self.data) > CAP_BYTES:
                cut = len(self.data) - CAP_BYTES
                del self.data[:cut]
                self.dropped += cut
            self._changed.notify_all()

    async def finish(self) -> None:
        async with self._changed:
            self.done_at = time.monotonic()
            self._changed.notify_all()

    async def read_from(self, offset: int) -> AsyncIterator[bytes]:
        while True:
            async with self._changed:
                while self.total <= offset and self.done_at is None:
                    await self._changed.wait()
                if offset < self.dropped:
                    return
                chunk = bytes(self.data[offset - self.dropped:])
                done = self.done_at is not None
            if chunk:
                offset += len(chunk)
                yield chunk
            elif done:
                return


_streams: dict[tuple[str | None, str], StreamBuffer] = {}


def _expire() -> None:
    now = time.monotonic()
    for key in [k for k, b in _streams.items() if b.done_at is not None and now - b.done_at > TTL_S]:
        del _streams[key]


def conversation_id(request: Request) -> str | None:
    value = request.headers.get(HEADER)
    return value.strip() if value and value.strip() else None


def resumable_response(request: Request, conv_id: str, events: AsyncIterator[bytes], media_type: str,
                       headers: dict[str, str]) -> StreamingResponse:
    """Run ``events`` in a task of its own (it outlives the client) into the stream's buffer, and
    answer with the buffer from its start."""
    _expire()
    key = (request_tenant(request), conv_id)
    old = _streams.get(key)
    if old is not None and old.task is not None:
        old.task.cancel()
    buf = _streams[key] = StreamBuffer()

    async def pump() -> None:
        try:
            async for chunk in events:
                await buf.append(chunk)
        finally:
            await events.aclose()
            await buf.finish()

    buf.task = asyncio.get_running_loop().create_task(pump())
    return StreamingResponse(buf.read_from(0), media_type=media_type, headers=headers)


router = APIRouter()


@router.get("/v1/stream", tags=["llama.cpp"], summary="replay a resumable stream (X-Conversation-Id) from a byte "
                                                       "offset, then follow it live",
            responses={200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}},
                       **error_responses((400, 404))})
async def stream_get(request: Request, conv_id: str = Query(..., description="the X-Conversation-Id", min_length=1),
                     offset: int = Query(0, alias="from", ge=0, description="byte offset to start from")):
    if not conv_id:
        raise ApiError(400, "Missing conversation id (conv_id)", "invalid_request_error")
    _expire()
    buf = _streams.get((request_tenant(request), conv_id))
    if buf is None:
        raise ApiError(404, "Stream not found or expired", "not_found_error")
    if offset < buf.dropped:
        raise ApiError(400, "Stream offset lost, please restart", "invalid_request_error")
    return StreamingResponse(buf.read_from(offset), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@router.delete("/v1/stream", tags=["llama.cpp"], status_code=204, responses=error_responses((400,)),
               summary="stop a resumable stream's generation and forget its events")
async def stream_delete(request: Request, conv_id: str = Query(..., description="the X-Conversation-Id", min_length=1)):
    if not conv_id:
        raise ApiError(400, "Missing conversation id (conv_id)", "invalid_request_error")
    buf = _streams.pop((request_tenant(request), conv_id), None)
    if buf is not None and buf.task is not None:
        buf.task.cancel()
    return Response(status_code=204)
