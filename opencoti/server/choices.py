"""OpenAI ``n > 1`` for ``/v1/chat/completions`` and ``/v1/completions``.

The choices run through ``engine.sampling_choices.Choices`` (the prompt computed once in a
temporary pool, the choices decoding side by side). Answers follow OpenAI: ``choices[i]`` with
``index`` i; usage counts the prompt once and the completion tokens of every choice; in a stream
each chunk carries one choice's delta (its ``index``), each choice ends with its own
``finish_reason`` chunk, then the usage chunk (when asked) and ``[DONE]``. The choices run in
temporary sessions, released at the end (no ``x-session-id`` to continue from).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ..engine.sampling_choices import Choices
from ..ops.generation import FINISH_OPENAI, ChatTurn, Prepared, opencoti_block
from .errors import SafeJSONResponse, error_event
from .state import ServerState
from .streaming import DONE, SSE_HEADERS, ClientDisconnected, Tracker, sse, until_disconnect
from .tenants import request_tenant


def _usage(choices: Choices) -> dict:
    info = choices.info
    n = sum(len(r.token_ids) for r in choices.results if r is not None)
    return {"prompt_tokens": info.prompt_tokens, "completion_tokens": n, "total_tokens": info.prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": info.cached_prefix_tokens}}


async def _start(request: Request, state: ServerState, prepared: Prepared, n: int) -> Choices | Response:
    tracker = Tracker(state)
    eng = state.context(request_tenant(request)).require_open()
    choices = Choices(eng, prepared.tokens, prepared.params, n, **prepared.kwargs)
    try:
        await until_disconnect(request, choices.start())
    except ClientDisconnected:
        tracker.done(None)
        await choices.aclose()
        return Response(status_code=499)
    except BaseException:
        tracker.done(None)
        raise
    choices.tracker = tracker
    return choices


async def _collect(request: Request, choices: Choices) -> list:
    try:
        return await until_disconnect(request, choices.collect())
    finally:
        choices.tracker.done(choices.results[0] if all(r is not None for r in choices.results) else None)
        await choices.aclose()


def _headers(choices: Choices) -> dict[str, str]:
    return {"x-cached-prefix-tokens": str(choices.info.cached_prefix_tokens)}


def _stream(choices: Choices, first: list[bytes], on_delta: Callable, on_end: Callable,
            include_usage: bool, chunk: Callable) -> StreamingResponse:
    async def events():
        try:
            for ev in first:
                yield ev
            async for i, d in choices.events():
                choices.tracker.token()
                for ev in on_delta(i, d):
                    yield ev
            for i, r in enumerate(choices.results):
                for ev in on_end(i, r):
                    yield ev
            if include_usage:
                yield chunk([], usage=_usage(choices), timings=[r.timings for r in choices.results])
            yield DONE
        except Exception as e:  # noqa: BLE001 - reported in-band
            yield sse(error_event(e))
        finally:
            choices.tracker.done(choices.results[0] if all(r is not None for r in choices.results) else None)
            await choices.aclose()

    return StreamingResponse(events(), media_type="text/event-stream", headers={**SSE_HEADERS, **_headers(choices)})


async def chat_choices(request: Request, state: ServerState, prepared: Prepared, body, model: str,
                       logprob: Callable[[Any], dict]) -> Response:
    """``/v1/chat/completions`` with ``n > 1`` (``logprob``: the route's per-token formatter)."""
    choices = await _start(request, state, prepared, body.n)
    if isinstance(choices, Response):
        return choices
    cid, created = "chatcmpl-" + uuid.uuid4().hex, int(time.time())
    fingerprint = f"opencoti-{model}"
    turns = [ChatTurn(prepared) for _ in range(body.n)]
    if not body.stream:
        try:
            results = await _collect(request, choices)
        except ClientDisconnected:
            return Response(status_code=499)
        out = []
        for i, (turn, r) in enumerate(zip(turns, results)):
            content, calls, finish = turn.whole(r)
            message: dict[str, Any] = {"role": "assistant", "content": content if (content or not calls) else None}
            if calls:
                message["tool_calls"] = [c.as_openai() for c in calls]
            lp = {"content": [logprob(d) for d in r.logprobs or []]} if body.logprobs else None
            out.append({"index": i, "message": message, "logprobs": lp, "finish_reason": finish})
        return SafeJSONResponse({
            "id": cid, "object": "chat.completion", "created": created, "model": model,
            "system_fingerprint": fingerprint, "choices": out, "usage": _usage(choices),
            "timings": [r.timings for r in results], "opencoti": opencoti_block(choices.info)},
            headers=_headers(choices))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(chs, **extra) -> bytes:
        d = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
             "system_fingerprint": fingerprint, "choices": chs}
        if include_usage:
            d["usage"] = None
        d.update(extra)
        return sse(d)

    def one(i, delta, finish=None, logprobs=None) -> list:
        return [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]

    def on_delta(i, d):
        text = turns[i].feed(d.text)
        lp = {"content": [logprob(d)]} if body.logprobs else None
        return [chunk(one(i, {"content": text} if text else {}, logprobs=lp))] if text or lp is not None else []

    def on_end(i, r):
        content, calls, finish = turns[i].finish(r)
        if content:
            yield chunk(one(i, {"content": content}))
        if calls:
            yield chunk(one(i, {"tool_calls": [c.as_openai(index=k) for k, c in enumerate(calls)]}))
        yield chunk(one(i, {}, finish), timings=r.timings)

    first = [chunk(one(i, {"role": "assistant", "content": None})) for i in range(body.n)]
    return _stream(choices, first, on_delta, on_end, include_usage, chunk)


async def completion_choices(request: Request, state: ServerState, prepared: Prepared, body, model: str,
                             logprobs: Callable[[list, int], dict]) -> Response:
    """``/v1/completions`` with ``n > 1`` (``logprobs``: the route's formatter of a token list)."""
    choices = await _start(request, state, prepared, body.n)
    if isinstance(choices, Response):
        return choices
    cid, created = "cmpl-" + uuid.uuid4().hex, int(time.time())
    echo = prepared.prompt_text if body.echo else ""
    want_lp = body.logprobs is not None
    if not body.stream:
        try:
            results = await _collect(request, choices)
        except ClientDisconnected:
            return Response(status_code=499)
        out = [{"text": echo + r.text, "index": i,
                "logprobs": logprobs(r.logprobs or [], len(echo)) if want_lp else None,
                "finish_reason": FINISH_OPENAI.get(r.stop_reason, "stop")} for i, r in enumerate(results)]
        return SafeJSONResponse({
            "id": cid, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": f"opencoti-{model}", "choices": out,
            "usage": _usage(choices), "timings": [r.timings for r in results],
            "opencoti": opencoti_block(choices.info)}, headers=_headers(choices))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    offsets = [len(echo)] * body.n

    def chunk(chs, **extra) -> bytes:
        d = {"id": cid, "object": "text_completion", "created": created, "model": model,
             "system_fingerprint": f"opencoti-{model}", "choices": chs}
        if include_usage:
            d["usage"] = None
        d.update(extra)
        return sse(d)

    def on_delta(i, d):
        lp = logprobs([d], offsets[i]) if want_lp else None
        offsets[i] += len(d.text)
        if not d.text and lp is None:
            return []
        return [chunk([{"text": d.text, "index": i, "logprobs": lp, "finish_reason": None}])]

    def on_end(i, r):
        yield chunk([{"text": "", "index": i, "logprobs": None,
                      "finish_reason": FINISH_OPENAI.get(r.stop_reason, "stop")}], timings=r.timings)

    first = [chunk([{"text": echo, "index": i, "logprobs": None, "finish_reason": None}]) for i in range(body.n)] \
        if echo else []
    return _stream(choices, first, on_delta, on_end, include_usage, chunk)
