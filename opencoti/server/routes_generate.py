"""Generation routes: llama.cpp ``POST /completion``, OpenAI ``POST /v1/completions`` and
``POST /v1/chat/completions`` (non-streaming and SSE), all with the PolyKV fields.

Every answer carries ``x-session-id``, ``x-cached-prefix-tokens`` and (when attached)
``x-pool-id``: the engine knows them when it accepts the request, before the first token, so
streaming answers carry them too. An enforced pool adds ``X-Sessions-Remaining`` (and
``x-admission-warning`` when admitted under ``on_saturation: warn``).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response

from ..engine import SamplingParams
from ..engine.chat import normalize_tools
from ..engine.errors import InvalidRequestError
from ..engine.results import GenerationResult, RequestInfo
from .app import ServerState
from .errors import error_event
from .schemas import ChatCompletionRequest, CompletionRequest, OpenAICompletionRequest, SamplingFields
from .sse import DONE, ClientDisconnected, sse, sse_response, until_disconnect
from .tools import ToolStreamFilter, parse_tool_choice, render_chat_prompt, resolve_tool_output, tool_choice_prefill, \
    tool_names

router = APIRouter()

FINISH_OPENAI = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}
STOP_TYPE_LLAMA = {"eos": "eos", "stop": "word", "length": "limit", "cancelled": "none"}


def _state(request: Request) -> ServerState:
    return request.app.state.server


# ============================================================================ request -> engine
def _check_polykv(body) -> None:
    sid = body.session_id
    if sid is not None and (not sid or not sid.isascii() or not sid.isprintable()):
        raise InvalidRequestError("session_id must be a non-empty string of printable ASCII characters "
                                  "(it is echoed in the x-session-id header)")


def sampling_params(state: ServerState, body: SamplingFields, max_tokens: int | None,
                    logprobs: int | None) -> SamplingParams:
    """Map request fields onto SamplingParams (unset fields keep the engine's llama.cpp-like defaults)."""
    for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0), ("repeat_penalty", 1)):
        v = getattr(body, name)
        if v is not None and v != neutral:
            raise InvalidRequestError(f"{name} is not supported (only {neutral} is accepted)")
    if body.logit_bias:
        raise InvalidRequestError("logit_bias is not supported")
    kw: dict[str, Any] = {}
    for name in ("temperature", "top_k", "top_p", "min_p"):
        v = getattr(body, name)
        if v is not None:
            kw[name] = v
    if body.seed is not None and body.seed != -1:
        kw["seed"] = body.seed
    if body.stop is not None:
        kw["stop"] = [body.stop] if isinstance(body.stop, str) else list(body.stop)
    if max_tokens is None:
        max_tokens = state.config.default_max_tokens
    elif max_tokens == -1:
        max_tokens = None
    return SamplingParams(max_tokens=max_tokens, ignore_eos=body.ignore_eos, logprobs=logprobs, **kw)


def _prompt_tokens(state: ServerState, prompt) -> tuple[list[int], str | None]:
    """(tokens, text) of a completion prompt: a string, token ids, or a one-element list of either."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise InvalidRequestError(f"one prompt per request is supported, got {len(prompt)}; "
                                      "send one request per prompt")
        prompt = prompt[0]
    eng = state.require_engine()
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt is empty")
        return eng.tokenize(prompt), prompt
    return list(prompt), None


def info_headers(info: RequestInfo) -> dict[str, str]:
    h = {"x-session-id": info.session_id, "x-cached-prefix-tokens": str(info.cached_prefix_tokens)}
    if info.pool_id is not None:
        h["x-pool-id"] = str(info.pool_id)
    adm = getattr(info, "admission", None)  # set by the admission controller on enforced pools
    if isinstance(adm, dict):
        if adm.get("sessions_remaining") is not None:
            h["X-Sessions-Remaining"] = str(int(adm["sessions_remaining"]))
        if adm.get("warning"):
            h["x-admission-warning"] = str(adm["warning"]).encode("ascii", "replace").decode()
    return h


def _opencoti_block(info: RequestInfo) -> dict:
    out = {"session_id": info.session_id, "pool_id": info.pool_id, "cached_prefix_tokens": info.cached_prefix_tokens}
    adm = getattr(info, "admission", None)
    if isinstance(adm, dict):
        out["admission"] = adm
    return out


async def _start_tracked(request, state: ServerState, tokens, params, body):
    """Start a generation with its latency tracker: (stream, tracker), or the 499 response when
    the client went away before the request was accepted."""
    tracker = _Tracker(state)
    try:
        stream = await _start(request, state, tokens, params, body)
    except ClientDisconnected:
        tracker.done(None)
        return Response(status_code=499)
    except BaseException:
        tracker.done(None)
        raise
    return stream, tracker


class _Tracker:
    """Per-request latency metrics (TTFT, inter-token latency, end-to-end)."""

    def __init__(self, state: ServerState):
        self.m = state.metrics
        self.t0 = time.perf_counter()
        self.last: float | None = None
        self.m.in_flight += 1
        self.open = True

    def token(self) -> None:
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


async def _start(request: Request, state: ServerState, tokens: list[int], params: SamplingParams, body):
    """Submit to the engine (held requests wait here, bounded by the admission policy)."""
    _check_polykv(body)
    eng = state.require_engine()
    return await until_disconnect(request, eng.astream(
        tokens, params=params, session_id=body.session_id, pool_id=body.pool_id,
        shared_prefix_n_tokens=body.shared_prefix_n_tokens, overcommit=body.overcommit))


async def _collect(request: Request, stream, tracker: _Tracker) -> GenerationResult:
    async def run() -> GenerationResult:
        try:
            async for _ in stream:
                tracker.token()
            return stream.result
        finally:
            if stream.result is None:
                await stream.aclose()  # cancelled (client gone) or failed: stop the request

    try:
        result = await until_disconnect(request, run())
    except BaseException:
        tracker.done(None)
        raise
    tracker.done(result)
    return result


def _usage(info: RequestInfo, result: GenerationResult) -> dict:
    n = len(result.token_ids)
    return {"prompt_tokens": info.prompt_tokens, "completion_tokens": n, "total_tokens": info.prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": info.cached_prefix_tokens}}


# ============================================================================ logprobs formats
def _chat_logprob(state: ServerState, d) -> dict:
    tok = state.piece(d.token_id)
    return {"token": tok, "logprob": d.logprob, "bytes": list(tok.encode()),
            "top_logprobs": [{"token": state.piece(i), "logprob": lp, "bytes": list(state.piece(i).encode())}
                             for i, lp in (d.top_logprobs or [])]}


def _completion_logprobs(state: ServerState, deltas, offset0: int = 0) -> dict:
    tokens, lps, tops, offsets = [], [], [], []
    off = offset0
    for d in deltas:
        tok = state.piece(d.token_id)
        tokens.append(tok)
        lps.append(d.logprob)
        tops.append({state.piece(i): lp for i, lp in (d.top_logprobs or [])})
        offsets.append(off)
        off += len(d.text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _llama_probs(state: ServerState, d) -> dict:
    tok = state.piece(d.token_id)
    return {"id": d.token_id, "token": tok, "logprob": d.logprob, "bytes": list(tok.encode()),
            "top_logprobs": [{"id": i, "token": state.piece(i), "logprob": lp, "bytes": list(state.piece(i).encode())}
                             for i, lp in (d.top_logprobs or [])]}


# ============================================================================ POST /completion (llama.cpp)
def _generation_settings(state: ServerState, params: SamplingParams) -> dict:
    eng = state.engine
    return {"n_ctx": eng.max_context if eng else None, "n_predict": -1 if params.max_tokens is None else params.max_tokens,
            "model": state.model_name, "temperature": params.temperature, "top_k": params.top_k,
            "top_p": params.top_p, "min_p": params.min_p, "seed": params.seed if params.seed is not None else -1,
            "stop": list(params.stop), "ignore_eos": params.ignore_eos,
            "n_probs": params.logprobs or 0, "stream": False}


def _llama_final(state, body, params, info, result: GenerationResult, prompt_text, content: str) -> dict:
    out = {
        "index": 0, "content": content, "tokens": list(result.token_ids) if body.return_tokens else [],
        "id_slot": -1, "stop": True, "model": state.model_name,
        "tokens_predicted": len(result.token_ids), "tokens_evaluated": info.prompt_tokens,
        "generation_settings": {**_generation_settings(state, params), "stream": body.stream},
        "prompt": prompt_text if prompt_text is not None else "",
        "has_new_line": "\n" in result.text, "truncated": result.truncated,
        "stop_type": STOP_TYPE_LLAMA.get(result.stop_reason, "none"), "stopping_word": result.stopping_word,
        "tokens_cached": info.cached_prefix_tokens, "timings": result.timings,
        "session_id": info.session_id, "pool_id": info.pool_id, "opencoti": _opencoti_block(info),
    }
    return out


@router.post("/completion", tags=["llama.cpp"], summary="llama.cpp completion (streaming with stream=true)")
@router.post("/completions", include_in_schema=False)
async def completion(request: Request, body: CompletionRequest):
    state = _state(request)
    tokens, prompt_text = await run_in_threadpool(_prompt_tokens, state, body.prompt)
    n_predict = body.n_predict if body.n_predict is not None else body.max_tokens
    params = sampling_params(state, body, n_predict, body.n_probs or None)
    started = await _start_tracked(request, state, tokens, params, body)
    if isinstance(started, Response):
        return started
    stream, tracker = started
    info = stream.info
    headers = info_headers(info)
    if not body.stream:
        try:
            result = await _collect(request, stream, tracker)
        except ClientDisconnected:
            return Response(status_code=499)
        out = _llama_final(state, body, params, info, result, prompt_text, result.text)
        if body.n_probs:
            out["completion_probabilities"] = [_llama_probs(state, d) for d in result.logprobs or []]
        return JSONResponse(out, headers=headers)

    async def events():
        n = 0
        try:
            async for d in stream:
                tracker.token()
                state.check_stream()
                n += 1
                chunk = {"index": 0, "content": d.text, "tokens": [d.token_id] if body.return_tokens else [],
                         "stop": False, "id_slot": -1, "tokens_predicted": n, "tokens_evaluated": info.prompt_tokens}
                if body.n_probs:
                    chunk["completion_probabilities"] = [_llama_probs(state, d)]
                yield sse(chunk)
            result = stream.result
            yield sse(_llama_final(state, body, params, info, result, prompt_text, ""))
        except Exception as e:  # noqa: BLE001 - reported in-band: the status line is gone
            yield sse(error_event(e))
        finally:
            if stream.result is None:
                await stream.aclose()
            tracker.done(stream.result)

    return sse_response(events(), headers)


# ============================================================================ POST /v1/completions
def _check_openai_common(body) -> None:
    if body.n != 1:
        raise InvalidRequestError("n must be 1 (one choice per request is supported)")


@router.post("/v1/completions", tags=["OpenAI"], summary="OpenAI text completion")
async def v1_completions(request: Request, body: OpenAICompletionRequest):
    state = _state(request)
    _check_openai_common(body)
    if body.best_of not in (None, 1):
        raise InvalidRequestError("best_of must be 1")
    if body.suffix:
        raise InvalidRequestError("suffix (insertion) is not supported")
    tokens, prompt_text = await run_in_threadpool(_prompt_tokens, state, body.prompt)
    params = sampling_params(state, body, body.max_tokens, body.logprobs)
    if body.echo and prompt_text is None:
        prompt_text = await run_in_threadpool(state.require_engine().detokenize, tokens)
    started = await _start_tracked(request, state, tokens, params, body)
    if isinstance(started, Response):
        return started
    stream, tracker = started
    info = stream.info
    headers = info_headers(info)
    cid, created, model = "cmpl-" + uuid.uuid4().hex, int(time.time()), state.model_name
    echo = prompt_text if body.echo else ""

    def choice(text: str, finish, logprobs=None) -> dict:
        return {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}

    if not body.stream:
        try:
            result = await _collect(request, stream, tracker)
        except ClientDisconnected:
            return Response(status_code=499)
        lp = _completion_logprobs(state, result.logprobs or [], len(echo)) if body.logprobs is not None else None
        return JSONResponse({
            "id": cid, "object": "text_completion", "created": created, "model": model,
            "choices": [choice(echo + result.text, FINISH_OPENAI.get(result.stop_reason, "stop"), lp)],
            "usage": _usage(info, result), "timings": result.timings, "opencoti": _opencoti_block(info),
        }, headers=headers)

    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(choices, **extra) -> bytes:
        d = {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": choices}
        if include_usage:
            d["usage"] = None
        d.update(extra)
        return sse(d)

    async def events():
        try:
            if echo:
                yield chunk([choice(echo, None)])
            offset = len(echo)
            async for d in stream:
                tracker.token()
                state.check_stream()
                lp = _completion_logprobs(state, [d], offset) if body.logprobs is not None else None
                offset += len(d.text)
                if d.text or lp is not None:
                    yield chunk([choice(d.text, None, lp)])
            result = stream.result
            yield chunk([choice("", FINISH_OPENAI.get(result.stop_reason, "stop"))], timings=result.timings)
            if include_usage:
                yield chunk([], usage=_usage(info, result))
            yield DONE
        except Exception as e:  # noqa: BLE001
            yield sse(error_event(e))
        finally:
            if stream.result is None:
                await stream.aclose()
            tracker.done(stream.result)

    return sse_response(events(), headers)


# ============================================================================ POST /v1/chat/completions
def _chat_prompt(state: ServerState, body: ChatCompletionRequest):
    eng = state.require_engine()
    tools = normalize_tools(body.tools)
    choice = parse_tool_choice(body.tool_choice, tools)
    text = render_chat_prompt(eng.apply_chat_template, state.caps(), body.messages, tools, add_generation_prompt=True)
    prefill = tool_choice_prefill(choice)
    return eng.tokenize(text + prefill), choice, prefill, tool_names(tools)


@router.post("/v1/chat/completions", tags=["OpenAI"], summary="OpenAI chat completion (tools, streaming)")
@router.post("/chat/completions", include_in_schema=False)
async def chat_completions(request: Request, body: ChatCompletionRequest):
    state = _state(request)
    _check_openai_common(body)
    rf = body.response_format
    if rf is not None and rf.get("type", "text") != "text":
        raise InvalidRequestError(f"response_format {rf.get('type')!r} is not supported (no constrained decoding); "
                                  "use 'text'")
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs: true")
    tokens, tchoice, prefill, names = await run_in_threadpool(_chat_prompt, state, body)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = sampling_params(state, body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
    started = await _start_tracked(request, state, tokens, params, body)
    if isinstance(started, Response):
        return started
    stream, tracker = started
    info = stream.info
    headers = info_headers(info)
    cid, created, model = "chatcmpl-" + uuid.uuid4().hex, int(time.time()), state.model_name
    single_call = body.parallel_tool_calls is False

    def finish_reason(result: GenerationResult, calls) -> str:
        if calls and result.stop_reason != "length":
            return "tool_calls"
        return FINISH_OPENAI.get(result.stop_reason, "stop")

    if not body.stream:
        try:
            result = await _collect(request, stream, tracker)
        except ClientDisconnected:
            return Response(status_code=499)
        content, calls = resolve_tool_output(result.text, prefill, tchoice, names)
        if single_call:
            calls = calls[:1]
        message: dict[str, Any] = {"role": "assistant", "content": content if (content or not calls) else None}
        if calls:
            message["tool_calls"] = [c.as_openai() for c in calls]
        lp = {"content": [_chat_logprob(state, d) for d in result.logprobs or []]} if body.logprobs else None
        return JSONResponse({
            "id": cid, "object": "chat.completion", "created": created, "model": model,
            "system_fingerprint": f"opencoti-{state.model_name}",
            "choices": [{"index": 0, "message": message, "logprobs": lp,
                         "finish_reason": finish_reason(result, calls)}],
            "usage": _usage(info, result), "timings": result.timings, "opencoti": _opencoti_block(info),
        }, headers=headers)

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    filt = ToolStreamFilter(tchoice, names, prefill)

    def chunk(delta: dict | None, finish=None, logprobs=None, **extra) -> bytes:
        d = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
             "system_fingerprint": f"opencoti-{state.model_name}",
             "choices": [] if delta is None else [{"index": 0, "delta": delta, "logprobs": logprobs,
                                                   "finish_reason": finish}]}
        if include_usage:
            d["usage"] = None
        d.update(extra)
        return sse(d)

    async def events():
        try:
            yield chunk({"role": "assistant", "content": ""})
            async for d in stream:
                tracker.token()
                state.check_stream()
                text = filt.feed(d.text)
                lp = {"content": [_chat_logprob(state, d)]} if body.logprobs else None
                if text or lp is not None:
                    yield chunk({"content": text} if text else {}, logprobs=lp)
            result = stream.result
            content, calls = filt.finish()
            if single_call:
                calls = calls[:1]
            if content:
                yield chunk({"content": content})
            if calls:
                yield chunk({"tool_calls": [c.as_openai(index=i) for i, c in enumerate(calls)]})
            yield chunk({}, finish_reason(result, calls), timings=result.timings)
            if include_usage:
                yield chunk(None, usage=_usage(info, result))
            yield DONE
        except Exception as e:  # noqa: BLE001
            yield sse(error_event(e))
        finally:
            if stream.result is None:
                await stream.aclose()
            tracker.done(stream.result)

    return sse_response(events(), headers)
