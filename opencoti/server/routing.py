"""``JsonRoute``: every route's JSON body is parsed, and checked for lone surrogates, in a worker
thread before FastAPI validates it, so a large body never stalls the event loop (``/health`` and
live streams keep answering while a 15 MB request is read)."""

from __future__ import annotations

import json
from typing import Any, Callable

import anyio
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

from ..ops.schemas import SURROGATE_MESSAGE, lone_surrogate_path, surrogates_checked

INLINE_BYTES = 64 * 1024  # smaller bodies are parsed on the loop: a thread hop costs more than they do


def _parse(body: bytes) -> Any:
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return _Invalid  # FastAPI parses it again and reports the error in its usual shape
    except RecursionError:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body",), "input": None,
                                       "ctx": {"error": "nested too deeply"}}]) from None
    where = lone_surrogate_path(data)
    if where is not None:
        raise RequestValidationError([{"type": "invalid_unicode", "loc": ("body",), "input": None,
                                       "msg": SURROGATE_MESSAGE.format(where=where)}])
    return data


class _Invalid:
    pass


class JsonRoute(APIRoute):
    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler

        async def parse_then_handle(request: Request):
            body = await request.body()
            if body:
                data = _parse(body) if len(body) <= INLINE_BYTES else await anyio.to_thread.run_sync(_parse, body)
                if data is not _Invalid:
                    request._json = data  # Starlette's cache: FastAPI's request.json() returns it
                    token = surrogates_checked.set(True)
                    try:
                        return await handler(request)
                    finally:
                        surrogates_checked.reset(token)
            return await handler(request)

        return parse_then_handle
