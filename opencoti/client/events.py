"""Chat and completion answers -> the client's typed results: OpenAI SSE events (HTTP), engine
results (in-process, through ``opencoti.ops.generation.ChatTurn``), and folding a stream."""

from __future__ import annotations

import json
import math
from typing import Any, Sequence

from ..engine.results import GenerationResult, RequestInfo
from ..ops.generation import ChatTurn, usage
from ..ops.headers import admission_retry_after
from ..ops.results import ChatChunk, ChatCompletion, Completion, GenerationInfo, ToolCall, Usage
from .errors import APIStatusError, error_from_response


def aggregate_chat(chunks: Sequence[ChatChunk]) -> ChatCompletion:
    """Fold a chat stream into one ChatCompletion (pure; used by ``chat`` on both transports)."""
    content, calls, info, last = [], [], None, None
    for c in chunks:
        content.append(c.content)
        calls.extend(c.tool_calls)
        info = c.info or info
        if c.finish_reason is not None or c.usage is not None:
            last = c
    if info is None:
        raise APIStatusError("the chat stream ended without a start event", 502)
    return ChatCompletion(content="".join(content), tool_calls=calls,
                          finish_reason=(last.finish_reason if last and last.finish_reason else "stop"),
                          usage=(last.usage if last and last.usage else Usage()),
                          timings=(last.timings if last and last.timings else {}), info=info,
                          model=last.model if last else None)



def info_from_headers(headers: Any) -> GenerationInfo:
    def num(name: str) -> int | None:
        v = headers.get(name)
        try:
            return int(v) if v is not None else None
        except ValueError:
            return None

    def remaining(v: str | None) -> int | str | None:
        return "unknown" if v == "unknown" else num("x-sessions-remaining")

    def seconds(name: str) -> float | None:
        v = headers.get(name)
        try:
            x = float(v) if v is not None else None
        except ValueError:
            return None
        return x if x is not None and math.isfinite(x) and x >= 0 else None

    return GenerationInfo(session_id=headers.get("x-session-id") or "", pool_id=num("x-pool-id"),
                          cached_prefix_tokens=num("x-cached-prefix-tokens") or 0,
                          sessions_remaining=remaining(headers.get("x-sessions-remaining")),
                          admission_warning=headers.get("x-admission-warning"),
                          admission_retry_after_s=seconds("x-admission-retry-after"))


def usage_from_openai(u: dict | None) -> Usage | None:
    if not u:
        return None
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Usage(prompt_tokens=u.get("prompt_tokens", 0), completion_tokens=u.get("completion_tokens", 0),
                 total_tokens=u.get("total_tokens", 0), cached_tokens=cached)


def _calls_from_openai(calls: list[dict] | None) -> list[ToolCall]:
    out = []
    for i, c in enumerate(calls or ()):
        fn = c.get("function") or {}
        out.append(ToolCall(id=c.get("id") or f"call_{i}", name=fn.get("name", ""),
                            arguments=fn.get("arguments") or "", index=c.get("index", i)))
    return out


class ChatEventParser:
    """OpenAI ``chat.completion.chunk`` SSE events -> ChatChunk (pure; one per stream)."""

    def __init__(self, info: GenerationInfo, pool_id: int | None):
        self.info, self.pool_id = info, pool_id
        self.finish: str | None = None
        self.timings: dict | None = None
        self.model: str | None = None
        self.started = False

    def start(self) -> ChatChunk:
        self.started = True
        return ChatChunk(info=self.info)

    def feed(self, data: str) -> list[ChatChunk]:
        if data == "[DONE]":
            return [self.end(None)] if self.finish is not None else []
        ev = json.loads(data)
        if "error" in ev:
            raise error_from_response(int(ev["error"].get("code") or 500), ev, pool_id=self.pool_id)
        self.model = ev.get("model") or self.model
        out = []
        for ch in ev.get("choices") or ():
            delta = ch.get("delta") or {}
            text = delta.get("content") or ""
            calls = _calls_from_openai(delta.get("tool_calls"))
            if text or calls:
                out.append(ChatChunk(content=text, tool_calls=calls))
            if ch.get("finish_reason") is not None:
                self.finish = ch["finish_reason"]
                self.timings = ev.get("timings") or self.timings
        if ev.get("usage"):
            out.append(self.end(usage_from_openai(ev["usage"])))
        return out

    def end(self, usage: Usage | None) -> ChatChunk:
        chunk = ChatChunk(info=self.info, finish_reason=self.finish or "stop", usage=usage or Usage(),
                          timings=self.timings or {}, model=self.model)
        self.finish = None  # emitted
        return chunk


def sse_data(line: str) -> str | None:
    return line[5:].lstrip() if line.startswith("data:") else None


# ============================================================================ in-process answers
def generation_info(info: RequestInfo) -> GenerationInfo:
    adm = info.admission or {}
    return GenerationInfo(session_id=info.session_id, pool_id=info.pool_id,
                          cached_prefix_tokens=info.cached_prefix_tokens,
                          sessions_remaining=adm.get("sessions_remaining"), admission_warning=adm.get("warning"),
                          admission_retry_after_s=admission_retry_after(adm))


def chat_end_chunks(turn: ChatTurn, gi: GenerationInfo, info: RequestInfo, result: GenerationResult,
                    model: str) -> list[ChatChunk]:
    """The last chunks of an in-process chat stream (the same fields the SSE stream carries)."""
    content, calls, finish = turn.finish(result)
    out = []
    if content:
        out.append(ChatChunk(content=content))
    if calls:
        out.append(ChatChunk(tool_calls=[ToolCall(id=c.id, name=c.name, arguments=c.arguments, index=i)
                                         for i, c in enumerate(calls)]))
    out.append(ChatChunk(info=gi, finish_reason=finish, usage=usage_from_openai(usage(info, result)),
                         timings=result.timings, model=model))
    return out


def completion_from_dict(d: dict) -> Completion:
    """llama.cpp's ``/completion`` answer -> Completion (both transports produce that answer)."""
    finish = "length" if d.get("stop_type") == "limit" else "stop"
    n_in, n_out, cached = d.get("tokens_evaluated", 0), d.get("tokens_predicted", 0), d.get("tokens_cached", 0)
    return Completion(text=d.get("content", ""), finish_reason=finish, timings=d.get("timings") or {},
                      usage=Usage(prompt_tokens=n_in, completion_tokens=n_out, total_tokens=n_in + n_out,
                                  cached_tokens=cached),
                      info=GenerationInfo(session_id=d.get("session_id") or "", pool_id=d.get("pool_id"),
                                          cached_prefix_tokens=cached))
