"""What the routes that speak other chat APIs (Anthropic Messages, OpenAI Responses) share: they
translate their body into a chat completion (``opencoti.ops.anthropic`` / ``opencoti.ops.responses``)
and run it here, through the same preparation, admission and engine stream as
``/v1/chat/completions``."""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from ..ops import Context
from ..ops.generation import ChatTurn, Prepared, prepare_chat_request
from ..ops.schemas import ChatCompletionRequest
from .errors import ApiError
from .state import ServerState
from .streaming import Generation


def pool_header(request: Request) -> int | None:
    """The ``x-pool-id`` request header: the pool to attach to when the body names none."""
    raw = request.headers.get("x-pool-id")
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw.strip())
    except ValueError:
        raise ApiError(400, f"the x-pool-id header must be an integer pool id, got {raw!r}",
                       "invalid_request_error") from None


async def start_chat(request: Request, state: ServerState, ctx: Context,
                     body: ChatCompletionRequest) -> tuple[Prepared, Generation | Response]:
    """Prepare the chat (in a worker thread) and start it (held by admission when the pool is full)."""
    return await Generation.prepare_and_start(request, state, ctx, prepare_chat_request, body)


def named_event(kind: str, data: dict[str, Any]) -> bytes:
    """One server-sent event with an ``event:`` line (Anthropic's and the Responses API's framing)."""
    return (f"event: {kind}\ndata: ".encode() + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()
            + b"\n\n")


class LiveTimings:
    """llama.cpp's ``timings`` while a stream runs (``timings_per_token``): prompt time up to the first
    token, decode time since."""

    def __init__(self, prompt_tokens: int, cached: int):
        self.t0 = time.perf_counter()
        self.t_first: float | None = None
        self.prompt_n = prompt_tokens - cached
        self.cached = cached
        self.n = 0

    def token(self) -> None:
        self.n += 1
        if self.t_first is None:
            self.t_first = time.perf_counter()

    def as_dict(self) -> dict:
        now = time.perf_counter()
        prompt_ms = ((self.t_first or now) - self.t0) * 1e3
        predicted_ms = (now - self.t_first) * 1e3 if self.t_first is not None else 0.0
        return {"cache_n": self.cached, "prompt_n": self.prompt_n, "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_ms / self.prompt_n if self.prompt_n else 0.0,
                "prompt_per_second": 1e3 * self.prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
                "predicted_n": self.n, "predicted_ms": predicted_ms,
                "predicted_per_token_ms": predicted_ms / (self.n - 1) if self.n > 1 else 0.0,
                "predicted_per_second": 1e3 * (self.n - 1) / predicted_ms if predicted_ms > 0 and self.n > 1 else 0.0}


__all__ = ["ChatTurn", "LiveTimings", "named_event", "pool_header", "start_chat"]
