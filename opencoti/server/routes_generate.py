"""Generation routes: llama.cpp ``POST /completion``, OpenAI ``POST /v1/completions`` and
``POST /v1/chat/completions`` (non-streaming and SSE), all with the PolyKV fields.

Each route: ``opencoti.ops.generation.prepare_*`` (validate, render, tokenize; in a worker thread)
-> ``Generation.start`` -> ``collect`` (one JSON answer) or ``sse`` (the shared SSE loop) with the
route's own event shapes.

Every answer carries ``x-session-id``, ``x-cached-prefix-tokens`` and (when attached)
``x-pool-id``: the engine knows them when it accepts the request, before the first token, so
streaming answers carry them too. An enforced pool adds ``X-Sessions-Remaining`` (and
``x-admission-warning`` when admitted under ``on_saturation: warn``).
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from ..engine.persist.slots import slot_number
from ..engine.errors import InvalidRequestError
from ..engine.results import PromptProgress, RequestInfo
from ..ops import Context
from ..ops.headers import generation_headers
from ..ops.generation import (FINISH_OPENAI, ChatTurn, generation_settings, llama_final, opencoti_block,
                              prepare_chat_request, prepare_completion, prepare_openai_completion, usage)
from ..ops.schemas import MAX_PROMPTS, ChatCompletionRequest, CompletionRequest, OpenAICompletionRequest
from .choices import chat_choices, collect_runs, completion_choices, start_runs, stream_runs
from .errors import ApiError, SafeJSONResponse, error_responses
from .routing import JsonRoute
from .state import ServerState, get_ctx, get_state
from .streaming import DONE, Generation, OpenAIChunks, openai_head, or_499, sse

router = APIRouter(route_class=JsonRoute)

_ERRORS = error_responses((400, 404, 409, 429, 503))
_SSE = {"content": {"text/event-stream": {"schema": {"type": "string"},
                                         "example": "data: {...}\n\ndata: [DONE]\n\n"}},
        "description": "JSON, or server-sent events when stream is true"}
# llama.cpp's own routes end a stream with the chunk that says "stop": true, never "data: [DONE]"
_LLAMA_SSE = {"content": {"text/event-stream": {"schema": {"type": "string"},
                                               "example": "data: {...}\n\ndata: {..., \"stop\": true}\n\n"}},
              "description": "JSON, or server-sent events when stream is true: one data: line per chunk, the "
                             "last with \"stop\": true (no data: [DONE], as llama.cpp's server)"}


def info_headers(info: RequestInfo) -> dict[str, str]:
    """The headers of a stream (written before its first token); ``generation_headers(info,
    result.timings)`` for an answer sent whole (``opencoti.ops.headers``)."""
    return generation_headers(info)


# ============================================================================ logprobs formats
def _chat_logprob(ctx: Context, d) -> dict:
    tok = ctx.piece(d.token_id)
    return {"token": tok, "logprob": d.logprob, "bytes": list(tok.encode()),
            "top_logprobs": [{"token": ctx.piece(i), "logprob": lp, "bytes": list(ctx.piece(i).encode())}
                             for i, lp in (d.top_logprobs or [])]}


def _completion_logprobs(ctx: Context, deltas, offset0: int = 0) -> dict:
    tokens, lps, tops, offsets = [], [], [], []
    off = offset0
    for d in deltas:
        tokens.append(ctx.piece(d.token_id))
        lps.append(d.logprob)
        tops.append({ctx.piece(i): lp for i, lp in (d.top_logprobs or [])})
        offsets.append(off)
        off += len(d.text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _llama_probs(ctx: Context, d, post: bool = False) -> dict:
    tok = ctx.piece(d.token_id)
    if post:  # post_sampling_probs: probabilities after the sampling filters (llama.cpp's shape)
        return {"id": d.token_id, "token": tok, "bytes": list(tok.encode()), "prob": math.exp(d.logprob),
                "top_probs": [{"id": i, "token": ctx.piece(i), "bytes": list(ctx.piece(i).encode()),
                               "prob": math.exp(lp)} for i, lp in (d.top_logprobs or [])]}
    return {"id": d.token_id, "token": tok, "logprob": d.logprob, "bytes": list(tok.encode()),
            "top_logprobs": [{"id": i, "token": ctx.piece(i), "logprob": lp, "bytes": list(ctx.piece(i).encode())}
                             for i, lp in (d.top_logprobs or [])]}


# ============================================================================ POST /completion (llama.cpp)
@router.post("/completion", tags=["llama.cpp"], summary="llama.cpp completion (streaming with stream=true)",
             responses={200: _LLAMA_SSE, **_ERRORS})
@router.post("/completions", include_in_schema=False)
async def completion(request: Request, body: CompletionRequest, ctx: Context = Depends(get_ctx),
                     state: ServerState = Depends(get_state)):
    return await _completion(request, body, ctx, state)


async def _completion(request: Request, body: CompletionRequest, ctx: Context, state: ServerState, index: int = 0):
    prompts = split_prompts(body.prompt)
    if len(prompts) > 1:
        return await _completion_many(request, body, ctx, state, prompts)
    if prompts[0] is not body.prompt:
        body = body.model_copy(update={"prompt": prompts[0]})
    t_start = time.perf_counter()
    prepared, gen = await Generation.prepare_and_start(request, state, ctx, prepare_completion, body)
    if isinstance(gen, Response):
        return gen
    info = gen.info
    headers = info_headers(info)

    def final(result, content: str) -> dict:
        out = llama_final(ctx, body, prepared, info, result, content)
        out["index"] = index
        return pick_fields(out, body.response_fields) if body.response_fields else out

    if not body.stream:
        result = await or_499(gen.collect())
        if isinstance(result, Response):
            return result
        out = llama_final(ctx, body, prepared, info, result, result.text)
        out["index"] = index
        if body.n_probs:
            out["completion_probabilities"] = [_llama_probs(ctx, d, body.post_sampling_probs) for d in result.logprobs or []]
        return SafeJSONResponse(pick_fields(out, body.response_fields) if body.response_fields else out,
                                headers=generation_headers(info, result.timings))

    n = 0

    def progress(processed: int) -> bytes:
        return sse({"index": index, "content": "", "tokens": [], "stop": False,
                    **prompt_progress(info, processed, t_start)})

    def on_delta(d):
        nonlocal n
        n += 1
        chunk = {"index": index, "content": d.text, "tokens": [d.token_id],
                 "stop": False, "id_slot": slot_number(info.session_id), "tokens_predicted": n,
                 "tokens_evaluated": info.prompt_tokens}
        if body.n_probs:
            chunk["completion_probabilities"] = [_llama_probs(ctx, d, body.post_sampling_probs)]
        return [sse(chunk)]

    # llama.cpp's return_progress: one event before the prompt is computed (its cached part is done),
    # then one after each chunk of it the engine computes (the last: the whole prompt)
    first = [progress(info.cached_prefix_tokens)] if body.return_progress else []
    return gen.sse(on_delta, lambda result: [sse(final(result, ""))], first=first, headers=headers,
                   on_progress=(lambda p: [progress(p.processed)]) if body.return_progress else None)


def prompt_progress(info: RequestInfo, processed: int, t_start: float) -> dict:
    """llama.cpp's ``prompt_progress`` (with ``timings``) after ``processed`` prompt tokens (the cached
    ones are done at once, in no time)."""
    ms = (time.perf_counter() - t_start) * 1e3 if processed > info.cached_prefix_tokens else 0.0
    return {"prompt_progress": {"total": info.prompt_tokens, "cache": info.cached_prefix_tokens,
                                "processed": processed, "time_ms": ms},
            "timings": progress_timings(info, processed, ms)}


def progress_timings(info: RequestInfo, processed: int, prompt_ms: float) -> dict:
    """llama.cpp's ``timings`` on a prompt-progress event: the prompt so far, nothing predicted yet."""
    n = processed - info.cached_prefix_tokens
    return {"cache_n": info.cached_prefix_tokens, "prompt_n": n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / n if n else 0.0, "prompt_per_second": 1e3 * n / prompt_ms if prompt_ms else 0.0,
            "predicted_n": 0, "predicted_ms": 0.0, "predicted_per_token_ms": 0.0, "predicted_per_second": 0.0}


def split_prompts(prompt) -> list:
    """llama.cpp's prompt forms -> one prompt (text, token ids, or ids and texts mixed) per result: a
    list of prompts, token ids, ids and texts mixed, or ``{"prompt_string": text}`` (multimodal data is
    not supported)."""
    def one(p):
        if isinstance(p, dict):
            if p.get("multimodal_data"):
                raise ApiError(400, "multimodal_data is not supported (the model takes text only)",
                               "invalid_request_error")
            text = p.get("prompt_string")
            if not isinstance(text, str):
                raise ApiError(400, "a prompt object needs a \"prompt_string\" string", "invalid_request_error")
            return text
        return p
    if isinstance(prompt, list) and prompt and not any(type(p) is int for p in prompt):
        return [one(p) for p in prompt]  # a list holding no number is a list of prompts (llama.cpp's rule)
    return [one(prompt)]  # text, token ids, or ids and texts mixed: one prompt


def pick_fields(out: dict, fields: list[str]) -> dict:
    """llama.cpp's response_fields: each path ('a/b' walks into objects) that exists, keyed by the path."""
    picked = {}
    for path in fields:
        cur, ok = out, True
        for key in path.split("/"):
            if isinstance(cur, dict) and key in cur:
                cur = cur[key]
            else:
                ok = False
                break
        if ok:
            picked[path] = cur
    return picked


def prepare_each(prepare, ctx: Context, body, prompts: list) -> list:
    """Prepare every prompt of a request before any is submitted (a bad one fails the request
    with nothing started; the message names its index)."""
    if len(prompts) > MAX_PROMPTS:
        raise ApiError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", "invalid_request_error")
    out = []
    for i, p in enumerate(prompts):
        try:
            prepared = prepare(ctx, body.model_copy(update={"prompt": p}))
            if not prepared.tokens:
                raise InvalidRequestError("prompt is empty")
            out.append(prepared)
        except InvalidRequestError as e:
            if type(e) is not InvalidRequestError or len(prompts) == 1:
                raise
            raise InvalidRequestError(f"prompt[{i}]: {e}") from None
    if len(out) > 1 and out[0].kwargs.get("session_id") is not None:
        raise ApiError(400, "several prompts cannot share one session (session_id / id_slot)", "invalid_request_error")
    return out


async def _completion_many(request: Request, body: CompletionRequest, ctx: Context, state: ServerState,
                           prompts: list) -> Response:
    """Several prompts (llama.cpp): one result each, with its ``index``, computed side by side;
    answered as a JSON array, or streamed with each event carrying its prompt's ``index`` (each
    prompt ends with its own ``stop: true`` event). Every prompt keeps its session
    (``session_id`` in its result)."""
    t_start = time.perf_counter()
    prepared = await run_in_threadpool(prepare_each, prepare_completion, ctx, body, prompts)
    runs = await start_runs(request, state, prepared, 1, temporary=False)
    if isinstance(runs, Response):
        return runs
    infos = [s.info for s in runs.streams]

    def final(i: int, result, content: str, probs: bool = False) -> dict:
        out = llama_final(ctx, body, prepared[i], infos[i], result, content)
        out["index"] = i
        if probs and body.n_probs:
            out["completion_probabilities"] = [_llama_probs(ctx, d, body.post_sampling_probs)
                                               for d in result.logprobs or []]
        return pick_fields(out, body.response_fields) if body.response_fields else out

    if not body.stream:
        results = await or_499(collect_runs(request, runs))
        if isinstance(results, Response):
            return results
        return SafeJSONResponse([final(i, r, r.text, probs=True) for i, r in enumerate(results)])

    counts = [0] * len(prompts)

    def progress(i: int, processed: int) -> bytes:
        return sse({"index": i, "content": "", "tokens": [], "stop": False,
                    **prompt_progress(infos[i], processed, t_start)})

    def on_delta(i: int, d):
        if isinstance(d, PromptProgress):  # a computed chunk of prompt i (return_progress)
            return [progress(i, d.processed)]
        counts[i] += 1
        chunk = {"index": i, "content": d.text, "tokens": [d.token_id], "stop": False,
                 "id_slot": slot_number(infos[i].session_id), "tokens_predicted": counts[i],
                 "tokens_evaluated": infos[i].prompt_tokens}
        if body.n_probs:
            chunk["completion_probabilities"] = [_llama_probs(ctx, d, body.post_sampling_probs)]
        return [sse(chunk)]

    first = []
    if body.return_progress:
        first = [progress(i, infos[i].cached_prefix_tokens) for i in range(len(prompts))]
        for s in runs.streams:
            s.report_progress()
    return stream_runs(runs, first, on_delta, lambda i, r: [sse(final(i, r, ""))], lambda: [], headers={})


# ============================================================================ POST /v1/completions
@router.post("/v1/completions", tags=["OpenAI"], summary="OpenAI text completion", responses={200: _SSE, **_ERRORS})
async def v1_completions(request: Request, body: OpenAICompletionRequest, ctx: Context = Depends(get_ctx),
                         state: ServerState = Depends(get_state)):
    prompts = split_prompts(body.prompt)
    if len(prompts) > 1 or body.n > 1:
        many = await run_in_threadpool(prepare_each, prepare_openai_completion, ctx, body, prompts)
        return await completion_choices(request, state, many, body, ctx.model_name,
                                        lambda deltas, off: _completion_logprobs(ctx, deltas, off))
    prepared, gen = await Generation.prepare_and_start(request, state, ctx, prepare_openai_completion, body)
    if isinstance(gen, Response):
        return gen
    info = gen.info
    headers = info_headers(info)
    cid, created, model = "cmpl-" + uuid.uuid4().hex, int(time.time()), ctx.model_name
    echo = prepared.prompt_text if body.echo else ""
    want_lp = body.logprobs is not None

    def choice(text: str, finish, logprobs=None) -> dict:
        return {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}

    if not body.stream:
        result = await or_499(gen.collect())
        if isinstance(result, Response):
            return result
        lp = _completion_logprobs(ctx, result.logprobs or [], len(echo)) if want_lp else None
        return SafeJSONResponse({
            **openai_head("text_completion", cid, created, model),
            "choices": [choice(echo + result.text, FINISH_OPENAI.get(result.stop_reason, "stop"), lp)],
            "usage": usage(info, result), "timings": result.timings, "opencoti": opencoti_block(info),
        }, headers=generation_headers(info, result.timings))

    chunk = OpenAIChunks.of("text_completion", cid, created, model, body)
    offset = len(echo)

    def on_delta(d):
        nonlocal offset
        lp = _completion_logprobs(ctx, [d], offset) if want_lp else None
        offset += len(d.text)
        return [chunk([choice(d.text, None, lp)])] if d.text or lp is not None else []

    def on_end(result):
        yield chunk([choice("", FINISH_OPENAI.get(result.stop_reason, "stop"))], timings=result.timings)
        if chunk.include_usage:
            yield chunk([], usage=usage(info, result), timings=result.timings)
        yield DONE

    return gen.sse(on_delta, on_end, first=[chunk([choice(echo, None)])] if echo else [], headers=headers)


# ============================================================================ POST /v1/chat/completions
@router.post("/v1/chat/completions", tags=["OpenAI"], summary="OpenAI chat completion (tools, streaming)",
             responses={200: _SSE, **_ERRORS})
@router.post("/chat/completions", include_in_schema=False)
async def chat_completions(request: Request, body: ChatCompletionRequest, ctx: Context = Depends(get_ctx),
                           state: ServerState = Depends(get_state)):
    t_start = time.perf_counter()
    prepared = await run_in_threadpool(prepare_chat_request, ctx, body)
    if body.n > 1:
        return await chat_choices(request, state, prepared, body, ctx.model_name, lambda d: _chat_logprob(ctx, d))
    gen = await Generation.start(request, state, prepared)
    if isinstance(gen, Response):
        return gen
    info = gen.info
    headers = info_headers(info)
    cid, created, model = "chatcmpl-" + uuid.uuid4().hex, int(time.time()), ctx.model_name
    turn = ChatTurn(prepared)

    if not body.stream:
        result = await or_499(gen.collect())
        if isinstance(result, Response):
            return result
        content, calls, finish = turn.whole(result)
        message: dict[str, Any] = {"role": "assistant", "content": content if (content or not calls) else None}
        if calls:
            message["tool_calls"] = [c.as_openai() for c in calls]
        lp = {"content": [_chat_logprob(ctx, d) for d in result.logprobs or []]} if body.logprobs else None
        out = {**openai_head("chat.completion", cid, created, model),
               "choices": [{"index": 0, "message": message, "logprobs": lp, "finish_reason": finish}],
               "usage": usage(info, result), "timings": result.timings, "opencoti": opencoti_block(info)}
        if body.verbose:  # llama.cpp's __verbose: what the model was given and how it sampled
            out["__verbose"] = {"prompt": prepared.chat.full_text, "content": result.text,
                                "generation_settings": generation_settings(ctx, prepared.params)}
        return SafeJSONResponse(out, headers=generation_headers(info, result.timings))

    chunks = OpenAIChunks.of("chat.completion.chunk", cid, created, model, body)

    def chunk(delta: dict | None, finish=None, logprobs=None, **extra) -> bytes:
        return chunks([] if delta is None else [{"index": 0, "delta": delta, "logprobs": logprobs,
                                                 "finish_reason": finish}], **extra)

    def on_delta(d):
        text = turn.feed(d.text)
        lp = {"content": [_chat_logprob(ctx, d)]} if body.logprobs else None
        return [chunk({"content": text} if text else {}, logprobs=lp)] if text or lp is not None else []

    def on_end(result):
        content, calls, finish = turn.finish(result)
        if content:
            yield chunk({"content": content})
        if calls:
            yield chunk({"tool_calls": [c.as_openai(index=i) for i, c in enumerate(calls)]})
        yield chunk({}, finish, timings=result.timings)
        if chunks.include_usage:
            yield chunk(None, usage=usage(info, result), timings=result.timings)
        yield DONE

    def progress(processed: int) -> bytes:  # llama.cpp: progress chunks carry no choices
        return chunk(None, **prompt_progress(info, processed, t_start))

    first = [chunk({"role": "assistant", "content": None})]
    if body.return_progress:  # before the prompt is computed, then after each chunk of it
        first.append(progress(info.cached_prefix_tokens))
    return gen.sse(on_delta, on_end, first=first, headers=headers,
                   on_progress=(lambda p: [progress(p.processed)]) if body.return_progress else None)


# ============================================================================ POST /infill (llama.cpp)
_FIM_TOKENS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
               ("<PRE>", "<SUF>", "<MID>"))


def fim_tokens(ctx: Context) -> tuple[int, int, int] | None:
    """The model's fill-in-the-middle special tokens (prefix, suffix, middle), if its vocabulary has them."""
    tok = ctx.engine.tokenizer
    for names in _FIM_TOKENS:
        ids = [tok.encode(n) for n in names]
        if all(len(i) == 1 and i[0] in tok.special_token_ids for i in ids):
            return ids[0][0], ids[1][0], ids[2][0]
    return None


@router.post("/infill", tags=["llama.cpp"], summary="llama.cpp fill-in-the-middle (models with FIM tokens)",
             responses={200: _LLAMA_SSE, **error_responses((400, 501))})
async def infill(request: Request, ctx: Context = Depends(get_ctx), state: ServerState = Depends(get_state)):
    fim = fim_tokens(ctx)
    if fim is None:
        raise ApiError(501, f"the model {ctx.model_name!r} has no fill-in-the-middle tokens (<fim_prefix>, "
                            "<fim_suffix>, <fim_middle>), so /infill is not available; use /completion",
                       "not_supported_error")
    raw = await request.json()
    if not isinstance(raw, dict):
        raise ApiError(400, "the body must be a JSON object", "invalid_request_error")
    parts = {}
    for name in ("input_prefix", "input_suffix", "prompt"):
        v = raw.get(name, "")
        if not isinstance(v, str):
            raise ApiError(400, f"{name} must be a string", "invalid_request_error")
        parts[name] = ctx.engine.tokenize(v) if v else []
    tokens = [fim[0], *parts["input_prefix"], fim[1], *parts["input_suffix"], fim[2], *parts["prompt"]]
    body = CompletionRequest(**{**raw, "prompt": tokens})
    return await _completion(request, body, ctx, state)


# ============================================================================ POST /slots/{id}?action= (llama.cpp)
SLOT_ACTIONS = ("save", "restore", "erase")


@router.post("/slots/{slot_id}", tags=["llama.cpp"], responses=error_responses((400, 404, 409, 501)),
             openapi_extra={"requestBody": {"required": False, "content": {"application/json": {"schema": {
                 "type": "object", "properties": {"filename": {
                     "type": "string", "maxLength": 128, "pattern": "^[A-Za-z0-9](\\.?[A-Za-z0-9_-])*\\.?$",
                     "description": "1-128 characters of A-Z a-z 0-9 . _ - (no paths: no '..'), starting with a "
                                    "letter or digit"}},
                 # (a rule across the query and the body, which JSON Schema cannot state: filename is
                 # required by save and restore, erase takes none)
                 "x-required-when": {"action": ["save", "restore"], "required": ["filename"]},
                 "description": "save / restore: {\"filename\": ...}, required (erase: no body)"}}}}},
             summary="save / restore / erase a session's KV cache by file name (llama.cpp slot actions; "
                     "the slot id is a session id, slot number N the session named \"N\")")
async def slot_action(request: Request, slot_id: str,
                      action: str = Query(..., json_schema_extra={"enum": list(SLOT_ACTIONS)}),
                      ctx: Context = Depends(get_ctx)):
    from ..engine.persist.slots import erase_session, restore_session, save_session, slot_session_id

    slot_id = slot_session_id(slot_id)  # /slots/3 is the session "3" (400 for a negative number)
    if action not in SLOT_ACTIONS:
        raise ApiError(400, f"action must be save, restore or erase, got {action!r}", "invalid_request_error")
    filename = None
    if action != "erase":
        try:
            raw = await request.json()
        except ValueError:
            raw = None
        filename = raw.get("filename") if isinstance(raw, dict) else None
        if not isinstance(filename, str) or not filename:
            raise ApiError(400, "the body must be {\"filename\": ...}", "invalid_request_error")
    if action == "save":
        out = await run_in_threadpool(save_session, ctx.engine, slot_id, filename)
    elif action == "restore":
        out = await run_in_threadpool(restore_session, ctx.engine, slot_id, filename)
    else:
        out = await run_in_threadpool(erase_session, ctx.engine, slot_id)
    number = slot_number(slot_id)
    return SafeJSONResponse({"id_slot": number if number >= 0 else slot_id, "session_id": slot_id, **out})
