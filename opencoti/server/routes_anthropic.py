"""Anthropic's Messages API: ``POST /v1/messages`` (whole, or streamed with Anthropic's event
sequence) and ``POST /v1/messages/count_tokens``; and llama.cpp's token count of a chat request,
``POST /v1/chat/completions/input_tokens``.

A Messages request runs as the chat completion it translates to (``opencoti.ops.anthropic``): the
same prefix reuse, pools (``pool_id`` / ``session_id`` fields, the ``x-pool-id`` header), admission,
constraints, tenants and metrics. Errors on these routes take Anthropic's shape
(``{"type": "error", "error": {"type", "message"}}``, ``errors.py``).

Stream: ``message_start``, ``ping``, then per content block ``content_block_start``,
``content_block_delta`` (``text_delta`` / ``input_json_delta``) and ``content_block_stop`` with
indices 0, 1, ... in order (text first, then one block per tool call), ``message_delta``
(``stop_reason``, ``stop_sequence`` and the whole usage: input, cache read / creation and output
tokens, as Anthropic sends it) and ``message_stop``; each event has an ``event:`` line naming its
type. An error after the first event is an ``error`` event.
"""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from ..ops import Context
from ..ops.anthropic import (CountTokensRequest, MessagesRequest, chat_request, message, message_usage, stop_reason,
                             tool_use_block)
from ..ops.chat_continue import chat_prompt
from ..ops.headers import generation_headers
from ..ops.schemas import ChatCompletionRequest
from .chat_runs import ChatTurn, named_event, pool_header, start_chat
from .errors import SafeJSONResponse, anthropic_error, error_responses
from .routing import JsonRoute
from .state import ServerState, get_ctx, get_state
from .streaming import or_499

router = APIRouter(route_class=JsonRoute)

_SSE = {"content": {"text/event-stream": {"schema": {"type": "string"},
                                         "example": "event: message_start\ndata: {...}\n\n"}},
        "description": "a Message, or server-sent events when stream is true"}


@router.post("/v1/messages", tags=["Anthropic"], summary="Anthropic Messages (tools, streaming)",
             responses={200: _SSE, **error_responses((400, 404, 409, 429, 503))})
async def messages(request: Request, body: MessagesRequest, ctx: Context = Depends(get_ctx),
                   state: ServerState = Depends(get_state)):
    chat = chat_request(body, pool_header(request))
    prepared, gen = await start_chat(request, state, ctx, chat)
    if isinstance(gen, Response):
        return gen
    info = gen.info
    mid, model = "msg_" + uuid.uuid4().hex[:24], body.model or ctx.model_name
    turn = ChatTurn(prepared)
    stops = body.stop_sequences

    if not body.stream:
        result = await or_499(gen.collect())
        if isinstance(result, Response):
            return result
        content, calls, _ = turn.whole(result)
        return SafeJSONResponse(message(mid, model, info, result, content, calls, stops),
                                headers=generation_headers(info, result.timings))

    n_out = 0
    text_open = False

    def open_text() -> list[bytes]:
        nonlocal text_open
        if text_open:
            return []
        text_open = True
        return [named_event("content_block_start", {"type": "content_block_start", "index": 0,
                                                    "content_block": {"type": "text", "text": ""}})]

    def text_delta(text: str) -> bytes:
        return named_event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                   "delta": {"type": "text_delta", "text": text}})

    def on_delta(d):
        nonlocal n_out
        n_out += 1
        text = turn.feed(d.text)
        return [*open_text(), text_delta(text)] if text else []

    def on_end(result):
        content, calls, _ = turn.finish(result)
        out = []
        if content or not calls:
            out += open_text()
        if content:
            out.append(text_delta(content))
        if text_open:
            out.append(named_event("content_block_stop", {"type": "content_block_stop", "index": 0}))
        first = 1 if text_open else 0
        for i, call in enumerate(calls, start=first):
            block = tool_use_block(call)
            args = call.arguments or "{}"
            out += [named_event("content_block_start", {"type": "content_block_start", "index": i,
                                                        "content_block": {**block, "input": {}}}),
                    named_event("content_block_delta", {"type": "content_block_delta", "index": i,
                                                        "delta": {"type": "input_json_delta", "partial_json": args}}),
                    named_event("content_block_stop", {"type": "content_block_stop", "index": i})]
        reason, seq = stop_reason(result, calls, stops)
        out.append(named_event("message_delta", {"type": "message_delta",
                                                 "delta": {"stop_reason": reason, "stop_sequence": seq},
                                                 # the whole usage, as Anthropic sends it (ChatAnthropic
                                                 # reads a stream's usage from this event only)
                                                 "usage": message_usage(info, len(result.token_ids))}))
        out.append(named_event("message_stop", {"type": "message_stop"}))
        return out

    start = {"type": "message_start", "message": {
        "id": mid, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": message_usage(info, 0)}}
    first = [named_event("message_start", start), named_event("ping", {"type": "ping"})]
    return gen.sse(on_delta, on_end, first=first, headers=generation_headers(info),
                   on_error=lambda body: named_event("error", anthropic_error(body)))


def _count(ctx: Context, chat: ChatCompletionRequest) -> dict:
    prompt = chat_prompt(ctx.engine.tokenizer, chat.messages, chat.tools, chat.tool_choice,
                         chat.add_generation_prompt, chat.continue_final_message)
    return {"input_tokens": len(ctx.engine.tokenize(prompt.full_text))}


@router.post("/v1/messages/count_tokens", tags=["Anthropic"], responses=error_responses((400,)),
             summary="Anthropic token count: the prompt tokens a Messages request would use")
async def count_tokens(body: CountTokensRequest, ctx: Context = Depends(get_ctx)):
    return SafeJSONResponse(await run_in_threadpool(_count, ctx, chat_request(body)))


@router.post("/v1/chat/completions/input_tokens", tags=["llama.cpp"], responses=error_responses((400,)),
             summary="the prompt tokens a chat completion request would use (llama.cpp)")
@router.post("/chat/completions/input_tokens", include_in_schema=False)
async def chat_input_tokens(body: ChatCompletionRequest, ctx: Context = Depends(get_ctx)):
    return SafeJSONResponse(await run_in_threadpool(_count, ctx, body))
