"""OpenAI ``n > 1`` and lists of prompts for ``/v1/chat/completions`` and ``/v1/completions``,
and the several prompts of llama.cpp's ``/completion`` (``Runs``, ``start_runs``, ``stream_runs``).

Each prompt runs through ``Choices`` (below; with ``n > 1`` the prompt is computed once in a
temporary pool, the choices decoding side by side). Answers follow OpenAI:
``choices[i]`` with ``index`` i, choice j of prompt p being ``p * n + j``; usage counts every
prompt once and the completion tokens of every choice; in a stream each chunk carries one
choice's delta (its ``index``), each choice ends with its own ``finish_reason`` chunk as soon as
it is done, then the usage chunk (when asked) and ``[DONE]``. The choices run in temporary
sessions, released at the end (no ``x-session-id`` to continue from).

``Choices`` (``n`` choices of one prompt):
The prompt (all but its last token, whose logits each choice needs) is materialized once as a
temporary pool; the n choices are sessions attached to it, so each computes only the last prompt
token and then decodes on its own, batched with the others. When the request names a pool, the
choices attach to that pool instead. Choice i samples with ``seed + i`` when a seed is given (so
seeded choices differ from each other and are reproducible). At the end the choices' sessions and
the temporary pool are released.

If the pool budget is exhausted the choices run without the shared prefix (same results, the
prompt computed n times); every other error is raised.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ..engine.config import SamplingParams
from ..engine.errors import CapacityError, InvalidRequestError
from ..engine.results import PromptProgress
from ..ops.generation import FINISH_OPENAI, ChatTurn, Prepared, opencoti_block
from ..ops.schemas import MAX_CHOICES
from .errors import SafeJSONResponse, error_event
from .state import ServerState
from .streaming import (DONE, SSE_HEADERS, ClientDisconnected, OpenAIChunks, Tracker, openai_head, or_499, sse,
                        until_disconnect)
from .tenants import request_tenant

_MASK64 = (1 << 64) - 1


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """Per-choice parameters: choice i uses ``seed + i`` (unseeded choices draw fresh seeds)."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise InvalidRequestError(f"n must be an integer in [1, {MAX_CHOICES}], got {n!r}")
    if params.seed is None:
        return [params] * n
    out = []
    for i in range(n):
        seed = (params.seed + i) & _MASK64
        if seed >= 2**63 and params.seed < 0:
            seed -= 2**64
        out.append(dataclasses.replace(params, seed=seed))
    return out


class Choices:
    """Run n choices: ``await start()``, then iterate ``(index, TokenDelta)`` events as they come;
    ``results[i]`` / ``streams[i].info`` afterwards; always ``await aclose()`` (releases the
    temporary pool and the choices' sessions, cancels what is still running)."""

    def __init__(self, engine, tokens: list[int], params: SamplingParams, n: int, *, pool_id: int | None = None,
                 session_id: str | None = None, **kwargs: Any):
        if n > 1 and session_id is not None:
            raise InvalidRequestError("n > 1 cannot be combined with session_id (each choice is its own session)")
        if n > 1 and kwargs.get("shared_prefix_n_tokens") is not None:
            raise InvalidRequestError("n > 1 cannot be combined with shared_prefix_n_tokens")
        self.engine, self.tokens, self.n = engine, tokens, n
        self.params = choice_params(params, n)
        self.pool_id, self.session_id, self.kwargs = pool_id, session_id, kwargs
        self.temp_pool: int | None = None
        self.streams: list = []
        self.results: list = [None] * n

    async def start(self) -> None:
        pool_id = self.pool_id
        if self.n > 1 and pool_id is None and len(self.tokens) > 1:
            try:
                info = await asyncio.to_thread(self.engine.create_pool, tokens=self.tokens[:-1], label="n-choices")
                self.temp_pool = pool_id = info.pool_id
            except CapacityError:
                pool_id = None  # no pool slot left: the choices compute the prompt themselves
        try:
            for p in self.params:
                self.streams.append(await self.engine.astream(
                    self.tokens, params=p, pool_id=pool_id, session_id=self.session_id, **self.kwargs))
        except BaseException:
            await self.aclose()
            raise

    @property
    def info(self):
        """The first choice's RequestInfo (what the response headers describe)."""
        return self.streams[0].info

    async def events(self, ends: bool = False) -> AsyncIterator[tuple[int, Any]]:
        """(choice index, TokenDelta) in arrival order; ``results`` is filled as choices end.
        ``ends``: also yield (index, None) when a choice ends (its result is then in ``results``)."""
        async for i, d in merge_streams(self.streams):
            if d is None:
                self.results[i] = self.streams[i].result
                if not ends:
                    continue
            yield i, d

    async def collect(self) -> list:
        async for _ in self.events():
            pass
        return self.results

    async def aclose(self) -> None:
        for s in self.streams:
            if s.result is None:
                await s.aclose()
        if self.n > 1:
            for s in self.streams:
                await asyncio.to_thread(quietly, self.engine.release_session, s.info.session_id)
        if self.temp_pool is not None:
            pool, self.temp_pool = self.temp_pool, None
            await asyncio.to_thread(quietly, self.engine.release_pool, pool, immediate=True)


async def merge_streams(streams: list) -> AsyncIterator[tuple[int, Any]]:
    """(stream index, TokenDelta) from several engine streams in arrival order, and (index, None)
    when stream ``index`` has ended (its ``result`` is set). The first error of any stream is
    raised; the streams themselves are left to the caller to close."""
    if len(streams) == 1:
        async for d in streams[0]:
            yield 0, d
        yield 0, None
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream) -> None:
        try:
            async for d in stream:
                await queue.put((i, d, None))
            await queue.put((i, None, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, None, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, d, err = await queue.get()
            if err is not None:
                raise err
            if d is None:
                left -= 1
            yield i, d
    finally:
        for t in tasks:
            t.cancel()


def quietly(fn, *args, **kw) -> None:
    """Best-effort cleanup: ``fn(*args, **kw)``, its error ignored (the session or pool may be gone)."""
    try:
        fn(*args, **kw)
    except Exception:  # noqa: BLE001 - best-effort cleanup (already gone)
        pass


class Runs:
    """The choices of every prompt of a request: one ``Choices`` per prompt, each of ``n`` choices.
    Choice ``p * n + j`` is choice j of prompt p (OpenAI's numbering for a list of prompts)."""

    def __init__(self, runs: list[Choices], temporary: bool = True):
        self.runs = runs
        self.temporary = temporary  # release every choice's session at the end (n > 1 always does)
        self.streams = [s for c in runs for s in c.streams]
        self.results: list = [None] * len(self.streams)
        self.tracker: Tracker | None = None

    @property
    def info(self):
        """The first choice's RequestInfo (what the response headers describe)."""
        return self.runs[0].info

    def usage(self) -> dict:
        """OpenAI's usage: every prompt counted once, the completion tokens of every choice."""
        prompt = sum(c.info.prompt_tokens for c in self.runs)
        cached = sum(c.info.cached_prefix_tokens for c in self.runs)
        n = sum(len(r.token_ids) for r in self.results if r is not None)
        return {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n,
                "prompt_tokens_details": {"cached_tokens": cached}}

    async def events(self):
        """(choice index, TokenDelta) in arrival order, and (index, None) when a choice ends."""
        async for i, d in merge_streams(self.streams):
            if d is None:
                self.results[i] = self.streams[i].result
            yield i, d

    async def collect(self) -> list:
        async for _ in self.events():
            pass
        return self.results

    def done(self) -> None:
        whole = all(r is not None for r in self.results)
        if whole:
            self.tracker.also(self.results[1:])
        self.tracker.done(self.results[0] if whole else None)

    async def aclose(self) -> None:
        for c in self.runs:
            await c.aclose()
            if self.temporary and c.n == 1 and c.streams:
                await asyncio.to_thread(quietly, c.engine.release_session, c.streams[0].info.session_id)


async def start_runs(request: Request, state: ServerState, prepared: list[Prepared], n: int,
                     temporary: bool = True) -> Runs | Response:
    """Submit every prompt's choices (the 499 response when the client goes away first; on an
    error, what was started is stopped). ``temporary``: release the sessions at the end."""
    tracker = Tracker(state)
    eng = state.context(request_tenant(request)).require_open()
    runs: list[Choices] = []

    async def start_all() -> None:
        for p in prepared:
            c = Choices(eng, p.tokens, p.params, n, **p.kwargs)
            await c.start()
            runs.append(c)

    try:
        await until_disconnect(request, start_all())
    except BaseException as e:
        tracker.done(None)
        await Runs(runs, temporary=True).aclose()  # nothing of a refused request stays
        if isinstance(e, ClientDisconnected):
            return Response(status_code=499)
        raise
    out = Runs(runs, temporary)
    out.tracker = tracker
    return out


async def collect_runs(request: Request, runs: Runs) -> list:
    """Every choice's result (prompt-major order); raises ClientDisconnected."""
    try:
        return await until_disconnect(request, runs.collect())
    finally:
        runs.done()
        await runs.aclose()


def _headers(runs: Runs) -> dict[str, str]:
    return {"x-cached-prefix-tokens": str(runs.info.cached_prefix_tokens)}


def stream_runs(runs: Runs, first: list[bytes], on_delta: Callable, on_end: Callable, last: Callable,
                headers: dict[str, str] | None = None) -> StreamingResponse:
    """The SSE loop of several choices: ``first`` events, ``on_delta(i, delta)`` per token,
    ``on_end(i, result)`` as each choice ends, then ``last()``; an error becomes an in-band event."""
    async def events():
        try:
            for ev in first:
                yield ev
            async for i, d in runs.events():
                if d is None:
                    for ev in on_end(i, runs.results[i]):
                        yield ev
                    continue
                if not isinstance(d, PromptProgress):  # (streams that were asked for progress: report_progress)
                    runs.tracker.token()
                for ev in on_delta(i, d):
                    yield ev
            for ev in last():
                yield ev
        except Exception as e:  # noqa: BLE001 - reported in-band
            yield sse(error_event(e))
        finally:
            runs.done()
            await runs.aclose()

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={**SSE_HEADERS, **(_headers(runs) if headers is None else headers)})


def _openai_last(runs: Runs, chunk: OpenAIChunks) -> Callable:
    def last():
        if chunk.include_usage:
            yield chunk([], usage=runs.usage(), timings=[r.timings for r in runs.results])
        yield DONE
    return last


async def chat_choices(request: Request, state: ServerState, prepared: Prepared, body, model: str,
                       logprob: Callable[[Any], dict]) -> Response:
    """``/v1/chat/completions`` with ``n > 1`` (``logprob``: the route's per-token formatter)."""
    runs = await start_runs(request, state, [prepared], body.n)
    if isinstance(runs, Response):
        return runs
    cid, created = "chatcmpl-" + uuid.uuid4().hex, int(time.time())
    turns = [ChatTurn(prepared) for _ in range(body.n)]
    if not body.stream:
        results = await or_499(collect_runs(request, runs))
        if isinstance(results, Response):
            return results
        out = []
        for i, (turn, r) in enumerate(zip(turns, results)):
            content, calls, finish = turn.whole(r)
            message: dict[str, Any] = {"role": "assistant", "content": content if (content or not calls) else None}
            if calls:
                message["tool_calls"] = [c.as_openai() for c in calls]
            lp = {"content": [logprob(d) for d in r.logprobs or []]} if body.logprobs else None
            out.append({"index": i, "message": message, "logprobs": lp, "finish_reason": finish})
        return SafeJSONResponse({
            **openai_head("chat.completion", cid, created, model), "choices": out, "usage": runs.usage(),
            "timings": [r.timings for r in results], "opencoti": opencoti_block(runs.info)},
            headers=_headers(runs))
    chunk = OpenAIChunks.of("chat.completion.chunk", cid, created, model, body)

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
    return stream_runs(runs, first, on_delta, on_end, _openai_last(runs, chunk))


async def completion_choices(request: Request, state: ServerState, prepared: list[Prepared], body, model: str,
                             logprobs: Callable[[list, int], dict]) -> Response:
    """``/v1/completions`` with several prompts and / or ``n > 1`` (``logprobs``: the route's
    formatter of a token list): choice ``p * n + j`` is choice j of prompt p, as OpenAI numbers them."""
    runs = await start_runs(request, state, prepared, body.n)
    if isinstance(runs, Response):
        return runs
    cid, created = "cmpl-" + uuid.uuid4().hex, int(time.time())
    echoes = [(p.prompt_text or "") if body.echo else "" for p in prepared for _ in range(body.n)]
    want_lp = body.logprobs is not None
    if not body.stream:
        results = await or_499(collect_runs(request, runs))
        if isinstance(results, Response):
            return results
        out = [{"text": echoes[i] + r.text, "index": i,
                "logprobs": logprobs(r.logprobs or [], len(echoes[i])) if want_lp else None,
                "finish_reason": FINISH_OPENAI.get(r.stop_reason, "stop")} for i, r in enumerate(results)]
        return SafeJSONResponse({
            **openai_head("text_completion", cid, created, model), "choices": out,
            "usage": runs.usage(), "timings": [r.timings for r in results],
            "opencoti": opencoti_block(runs.info)}, headers=_headers(runs))
    chunk = OpenAIChunks.of("text_completion", cid, created, model, body)
    offsets = [len(e) for e in echoes]

    def on_delta(i, d):
        lp = logprobs([d], offsets[i]) if want_lp else None
        offsets[i] += len(d.text)
        if not d.text and lp is None:
            return []
        return [chunk([{"text": d.text, "index": i, "logprobs": lp, "finish_reason": None}])]

    def on_end(i, r):
        yield chunk([{"text": "", "index": i, "logprobs": None,
                      "finish_reason": FINISH_OPENAI.get(r.stop_reason, "stop")}], timings=r.timings)

    first = [chunk([{"text": e, "index": i, "logprobs": None, "finish_reason": None}])
             for i, e in enumerate(echoes) if e]
    return stream_runs(runs, first, on_delta, on_end, _openai_last(runs, chunk))
