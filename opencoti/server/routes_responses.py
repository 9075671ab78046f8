"""OpenAI's Responses API: ``POST /v1/responses`` (also ``/responses``), whole or streamed with the
Responses event types, and ``GET /v1/responses/{id}`` for a stored response.

A Responses request runs as the chat completion it translates to (``opencoti.ops.responses``):
the same prefix reuse, pools (``pool_id`` / ``session_id`` fields, the ``x-pool-id`` header),
admission, constraints (``text.format``), tenants and metrics. ``previous_response_id`` puts the
stored conversation before the input; its KV is found by the prefix cache.

Stream: ``response.created``, ``response.in_progress``, then per output item
``response.output_item.added`` ... ``response.output_item.done`` (a message: ``content_part.added``,
``output_text.delta`` per token, ``output_text.done``, ``content_part.done``; a function call:
``function_call_arguments.delta`` / ``.done``), then ``response.completed`` (or
``response.incomplete`` when ``max_output_tokens`` cut it). Every event has ``sequence_number``
and an ``event:`` line. llama.cpp's ``return_progress`` adds ``response.in_progress`` events with
``prompt_progress``, and ``timings_per_token`` adds ``timings`` to each delta.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from ..ops import Context
from ..ops.headers import generation_headers
from ..ops.responses import (ResponseNotFoundError, ResponsesRequest, assistant_message, call_item, chat_request,
                             finished, message_item, new_ids, output_items, response_object, response_usage,
                             store_of)
from .chat_runs import ChatTurn, LiveTimings, named_event, pool_header, start_chat
from .errors import ApiError, SafeJSONResponse, error_responses
from .routing import JsonRoute
from .state import ServerState, get_ctx, get_state
from .streaming import or_499

router = APIRouter(route_class=JsonRoute)

_SSE = {"content": {"text/event-stream": {"schema": {"type": "string"},
                                         "example": "event: response.created\ndata: {...}\n\n"}},
        "description": "a Response, or server-sent events when stream is true"}


@router.post("/v1/responses", tags=["OpenAI"], summary="OpenAI Responses (tools, structured output, streaming, "
                                                        "previous_response_id)",
             responses={200: _SSE, **error_responses((400, 404, 409, 429, 503))})
@router.post("/responses", include_in_schema=False)
async def responses(request: Request, body: ResponsesRequest, ctx: Context = Depends(get_ctx),
                    state: ServerState = Depends(get_state)):
    store = store_of(ctx)
    history = store.get(body.previous_response_id)["messages"] if body.previous_response_id else []
    chat, conversation = chat_request(body, history, pool_header(request))
    prepared, gen = await start_chat(request, state, ctx, chat)
    if isinstance(gen, Response):
        return gen
    info = gen.info
    rid, mid, created = new_ids()
    model = body.model or ctx.model_name
    turn = ChatTurn(prepared)

    def done(result, content: str, calls) -> dict:
        status, incomplete = finished(result)
        out = response_object(rid, model, body, created, status=status, output=output_items(mid, content, calls),
                              usage=response_usage(info, len(result.token_ids)), incomplete=incomplete)
        if body.store:
            store.put(rid, [*conversation, assistant_message(content, calls)], out)
        return out

    if not body.stream:
        result = await or_499(gen.collect())
        if isinstance(result, Response):
            return result
        content, calls, _ = turn.whole(result)
        return SafeJSONResponse(done(result, content, calls), headers=generation_headers(info, result.timings))

    seq = 0
    text: list[str] = []
    msg_open = False
    live = LiveTimings(info.prompt_tokens, info.cached_prefix_tokens)

    def event(kind: str, **data: Any) -> bytes:
        nonlocal seq
        seq += 1
        return named_event(kind, {"type": kind, "sequence_number": seq - 1, **data})

    def open_message() -> list[bytes]:
        nonlocal msg_open
        if msg_open:
            return []
        msg_open = True
        item = {**message_item(mid, "", "in_progress"), "content": []}
        return [event("response.output_item.added", output_index=0, item=item),
                event("response.content_part.added", item_id=mid, output_index=0, content_index=0,
                      part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    def text_delta(piece: str) -> bytes:
        text.append(piece)
        extra = {"timings": live.as_dict()} if body.timings_per_token else {}
        return event("response.output_text.delta", item_id=mid, output_index=0, content_index=0, delta=piece,
                     logprobs=[], **extra)

    def on_delta(d):
        live.token()
        piece = turn.feed(d.text)
        return [*open_message(), text_delta(piece)] if piece else []

    def on_end(result):
        content, calls, _ = turn.finish(result)
        out: list[bytes] = []
        if content or not calls:
            out += open_message()
        if content:
            out.append(text_delta(content))
        whole = "".join(text)
        if msg_open:
            item = message_item(mid, whole)
            out += [event("response.output_text.done", item_id=mid, output_index=0, content_index=0, text=whole,
                          logprobs=[]),
                    event("response.content_part.done", item_id=mid, output_index=0, content_index=0,
                          part=item["content"][0]),
                    event("response.output_item.done", output_index=0, item=item)]
        for i, call in enumerate(calls, start=1 if msg_open else 0):
            item = call_item(call)
            out += [event("response.output_item.added", output_index=i, item={**call_item(call, "in_progress"),
                                                                                "arguments": ""}),
                    event("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                          delta=call.arguments),
                    event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                          name=call.name, arguments=call.arguments),
                    event("response.output_item.done", output_index=i, item=item)]
        response = done(result, whole, calls)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        out.append(event(kind, response=response, timings=result.timings))
        return out

    start = response_object(rid, model, body, created, status="in_progress")
    t_start = time.perf_counter()

    def progress(processed: int) -> bytes:  # llama.cpp: the prompt's progress on a response.in_progress event
        ms = (time.perf_counter() - t_start) * 1e3 if processed > info.cached_prefix_tokens else 0.0
        return event("response.in_progress", response=start, prompt_progress={
            "total": info.prompt_tokens, "cache": info.cached_prefix_tokens, "processed": processed, "time_ms": ms})

    first = [event("response.created", response=start), event("response.in_progress", response=start)]
    if body.return_progress:  # its cached part (done at once), then after each computed chunk of the prompt
        first.append(progress(info.cached_prefix_tokens))
    return gen.sse(on_delta, on_end, first=first, headers=generation_headers(info),
                   on_progress=(lambda p: [progress(p.processed)]) if body.return_progress else None,
                   on_error=lambda err: event("error", code=err["error"].get("type"), message=err["error"].get("message"),
                                              param=None))


@router.get("/v1/responses/{response_id}", tags=["OpenAI"], summary="a stored response",
            responses=error_responses((404,)))
async def get_response(response_id: str, ctx: Context = Depends(get_ctx)):
    try:
        return SafeJSONResponse(store_of(ctx).get(response_id)["response"])
    except ResponseNotFoundError:
        raise ApiError(404, f"no stored response with id {response_id!r}", "not_found_error") from None
