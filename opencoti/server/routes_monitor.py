"""Monitoring routes that are not plain operations: ``GET /metrics`` (Prometheus text; a router of
its own, left out with ``--no-metrics``) and ``GET /polykv/tps`` (an SSE stream every interval;
``?once=1`` answers the ``tps`` operation)."""

from __future__ import annotations

import asyncio
from typing import Annotated

import anyio
from fastapi import APIRouter, Depends, Query
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic.json_schema import SkipJsonSchema

from ..ops import OPERATIONS, Context
from ..ops.results import TpsSnapshot
from .errors import ApiError, error_responses
from .state import ServerState, get_ctx, get_state
from .streaming import SSE_HEADERS, sse

router = APIRouter()
metrics_router = APIRouter()  # only with ServerConfig.metrics (``--no-metrics`` leaves it out)
metrics_off_router = APIRouter()  # with --no-metrics: GET /metrics answers 501, as llama.cpp without --metrics


@metrics_router.get("/metrics", tags=["llama.cpp"], summary="Prometheus text exposition",
                    response_class=PlainTextResponse)
def metrics(state: ServerState = Depends(get_state)):
    # llama.cpp's header: when the server started (Unix seconds), so a scraper can tell a restart
    return PlainTextResponse(state.metrics.render(state.engine if state.is_ready else None),
                             media_type=CONTENT_TYPE_LATEST,
                             headers={"Process-Start-Time-Unix": str(state.metrics.t_start)})


@metrics_off_router.get("/metrics", include_in_schema=False)
def metrics_off():
    raise ApiError(501, "metrics are off: the server was started with --no-metrics", "not_supported_error")


@router.get("/polykv/tps", tags=["PolyKV"], summary="live tps: SSE every interval (?once=1: one JSON snapshot)",
            responses={200: {"model": TpsSnapshot, "content": {"text/event-stream": {"schema": {
                "type": "string", "contentMediaType": "text/event-stream",
                "description": "server-sent events, one per interval: each `data:` line is a TpsSnapshot",
                "x-item-schema": {"$ref": "#/components/schemas/TpsSnapshot"}}}},
                "description": "server-sent TpsSnapshot events, or one TpsSnapshot (application/json) with once=1"},
                **error_responses((400, 503))})
async def tps(once: bool = False,
              interval_ms: Annotated[float, Query(ge=50, le=60000)] | SkipJsonSchema[None] = None,
              count: Annotated[int, Query(ge=1, description="end the stream after this many events")]
              | SkipJsonSchema[None] = None,
              ctx: Context = Depends(get_ctx), state: ServerState = Depends(get_state)):
    eng = ctx.engine
    if once:
        return JSONResponse(await anyio.to_thread.run_sync(OPERATIONS["tps"].run, ctx))
    period = (interval_ms if interval_ms is not None else ctx.tps_interval_ms) / 1e3

    async def stream():
        n = 0
        while not state.stopping.is_set() and not eng.is_closed:
            try:
                snap = await anyio.to_thread.run_sync(eng.tps_snapshot)
            except Exception:  # noqa: BLE001 - the engine closed under us: end the stream
                return
            yield sse(snap)
            n += 1
            if count is not None and n >= count:
                return
            t_end = asyncio.get_running_loop().time() + period
            while not state.stopping.is_set():  # wake up promptly on shutdown
                left = t_end - asyncio.get_running_loop().time()
                if left <= 0:
                    break
                await asyncio.sleep(min(left, 0.1))

    return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)
