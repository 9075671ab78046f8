"""OpenAI's Responses API (``POST /v1/responses``), translated onto the chat operation: a Responses
request becomes a ``ChatCompletionRequest`` (rendered, constrained, admitted, cached and measured
as a chat completion), and a chat turn's result becomes a Response object.

Translated: ``input`` (a string, or items: messages with ``input_text`` / ``output_text`` parts,
``function_call`` and ``function_call_output`` items; ``reasoning`` items are skipped),
``instructions`` (a system message, not carried to the next turn, as OpenAI does), function
``tools`` and ``tool_choice``, ``parallel_tool_calls``, ``max_output_tokens``, ``temperature``,
``top_p``, ``text.format`` (``json_schema`` / ``json_object``: the constraint engine), ``include``
(OpenAI's values are accepted; none adds anything, the model has no tools or reasoning to show), and
``previous_response_id``: the conversation of a stored response (``store``, default true) is put
before the new input, so its KV, still in the prefix cache, is reused (``usage.input_tokens_details
.cached_tokens`` says how much). Image and file inputs are refused (400): the model reads text only.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from typing import Any, Literal, Union

from pydantic import ConfigDict, Field

from ..engine.checks import check_schema_depth
from ..engine.errors import InvalidRequestError
from ..engine.results import GenerationResult, RequestInfo
from ..engine.chat.tool_calls import ToolCall
from .schemas import SHARED_PREFIX_NEEDS_POOL, ChatCompletionRequest, PolyKVFields, field_range

_POLYKV = tuple(PolyKVFields.model_fields)

# The request as input_messages / _tools / _tool_choice / _response_format accept it (the OpenAPI schemas)
_NAME = {"type": "string", "minLength": 1}
_PART = {"anyOf": [{"type": "string"}, {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"enum": ["input_text", "output_text", "text"]}, "text": {"type": "string"}}},
    {"type": "object", "required": ["type", "refusal"], "properties": {"type": {"const": "refusal"},
                                                                       "refusal": {"type": "string"}}}]}
_PARTS = {"anyOf": [{"type": "string"}, {"type": "array", "items": _PART}]}
INPUT_ITEM_SCHEMA = {"anyOf": [
    {"type": "object", "required": ["role"], "properties": {
        "type": {"const": "message"}, "role": {"enum": ["user", "assistant", "system", "developer"]}, "content": _PARTS}},
    {"type": "object", "required": ["type", "name"], "properties": {
        "type": {"const": "function_call"}, "name": _NAME, "arguments": {"type": "string"}}},
    {"type": "object", "required": ["type", "call_id"], "properties": {
        "type": {"const": "function_call_output"}, "call_id": _NAME, "output": _PARTS}},
    {"type": "object", "required": ["type"], "properties": {"type": {"const": "reasoning"}}}]}
# at least one item that is not reasoning (reasoning items are skipped: nothing else is no input)
_NOT_ONLY_REASONING = {"not": {"required": ["type"], "properties": {"type": {"const": "reasoning"}}}}
INPUT_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": INPUT_ITEM_SCHEMA,
                                                "contains": _NOT_ONLY_REASONING}]}
TOOL_SCHEMA = {"type": "object", "required": ["type", "name"], "properties": {
    "type": {"const": "function"}, "name": _NAME, "description": {"type": ["string", "null"]},
    "parameters": {"type": ["object", "null"]}}}
TOOL_CHOICE_SCHEMA = {"anyOf": [{"enum": ["none", "auto", "required"]}, {"type": "null"}, {
    "type": "object", "required": ["type", "name"], "properties": {"type": {"const": "function"}, "name": _NAME}}]}
_FORMATS = {"anyOf": [{"type": "null"},
                      {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
                      {"type": "object", "required": ["type", "schema"],
                       "properties": {"type": {"const": "json_schema"}, "schema": {"type": "object"}}}]}
TOOLS_NEEDED = {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {
    "type": ["string", "object"], "not": {"enum": ["none", "auto"]}}}},
    "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}}
MAX_STORED = 1024  # responses kept for previous_response_id (least recently used dropped first)


class ResponseNotFoundError(InvalidRequestError):
    """``previous_response_id`` names no stored response (HTTP 400, as OpenAI answers)."""


# what OpenAI's ``include`` may name (anything else is a 400 there too)
IncludeValue = Literal["code_interpreter_call.outputs", "computer_call_output.output.image_url",
                       "file_search_call.results", "message.input_image.image_url", "message.output_text.logprobs",
                       "reasoning.encrypted_content", "web_search_call.action.sources", "web_search_call.results"]


class ResponsesRequest(PolyKVFields):
    """OpenAI's ``POST /v1/responses`` body (unknown fields are ignored)."""

    model: str | None = None
    model_config = ConfigDict(json_schema_extra={"allOf": [SHARED_PREFIX_NEEDS_POOL, TOOLS_NEEDED]})
    input: Union[str, list[Any]] = Field(..., description="text, or a list of input items (message, function_call, "
                                                          "function_call_output; reasoning items are skipped)",
                                         json_schema_extra=INPUT_SCHEMA)
    instructions: str | None = None
    tools: list[Any] | None = Field(None, description="function tools", json_schema_extra={"items": TOOL_SCHEMA})
    tool_choice: Union[str, dict[str, Any], None] = Field(None, json_schema_extra=TOOL_CHOICE_SCHEMA)
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1, description="tokens to generate at most (default: the "
                                                                  "server's); with the input, within the model's "
                                                                  "context (400 context_length_exceeded)")
    temperature: float | None = Field(None, json_schema_extra=field_range(0, 100))
    top_p: float | None = Field(None, json_schema_extra={"exclusiveMinimum": 0, "maximum": 1})
    text: dict[str, Any] | None = Field(None, description="{\"format\": {\"type\": \"text\" | \"json_object\" | "
                                                          "\"json_schema\", ...}}",
                                         json_schema_extra={"properties": {"format": _FORMATS}})
    stream: bool = False
    previous_response_id: str | None = Field(None, description="a stored response of this server (400 when it is "
                                                                "unknown, not stored or dropped)")
    store: bool = True
    metadata: dict[str, Any] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    include: list[IncludeValue] | None = Field(None, description="extra output OpenAI can add (accepted; nothing "
                                                                 "is added)")
    timings_per_token: bool = Field(False, description="llama.cpp: timings on every streamed delta")
    return_progress: bool = Field(False, description="llama.cpp: prompt progress events while streaming")


class ResponseStore:
    """Finished responses by id (their conversation, for ``previous_response_id``), bounded."""

    def __init__(self, limit: int = MAX_STORED):
        self.limit = limit
        self._items: OrderedDict[str, dict] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, rid: str, messages: list[dict], response: dict) -> None:
        with self._lock:
            self._items[rid] = {"messages": messages, "response": response}
            while len(self._items) > self.limit:
                self._items.popitem(last=False)

    def get(self, rid: str) -> dict:
        with self._lock:
            item = self._items.get(rid)
            if item is None:
                raise ResponseNotFoundError(f"Previous response with id {rid!r} not found (unknown, not stored, "
                                            "or dropped)")
            self._items.move_to_end(rid)
            return item


def store_of(ctx) -> ResponseStore:
    """The context's response store (one per engine view: a tenant sees only its own responses)."""
    store = getattr(ctx, "response_store", None)
    if store is None:
        store = ctx.response_store = ResponseStore()
    return store


def _part_text(part: Any, where: str) -> str:
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        raise InvalidRequestError(f"{where} must be a content part object")
    kind = part.get("type")
    if kind in ("input_image", "input_file", "input_audio"):
        raise InvalidRequestError(f"{where}: {kind.removeprefix('input_')} input is not supported: the model reads "
                                  "text only")
    if kind not in ("input_text", "output_text", "text", "refusal"):
        raise InvalidRequestError(f"{where}.type must be input_text or output_text, got {kind!r}")
    text = part.get("text", part.get("refusal"))
    if not isinstance(text, str):
        raise InvalidRequestError(f"{where}.text must be a string")
    return text


def input_messages(items: Union[str, list]) -> list[dict]:
    """Responses input -> chat messages (function calls join the assistant message before them)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequestError(f"{where}.role must be user, assistant, system or developer, got {role!r}")
            content = item.get("content", "")
            if isinstance(content, list):
                content = "".join(_part_text(p, f"{where}.content[{j}]") for j, p in enumerate(content))
            elif not isinstance(content, str):
                raise InvalidRequestError(f"{where}.content must be a string or a list of content parts")
            out.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            name, args = item.get("name"), item.get("arguments", "{}")
            if not isinstance(name, str) or not name or not isinstance(args, str):
                raise InvalidRequestError(f"{where}: a function_call needs a name and arguments (a JSON string)")
            call = {"id": str(item.get("call_id") or item.get("id") or "call_" + uuid.uuid4().hex[:24]),
                    "type": "function", "function": {"name": name, "arguments": args}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output", "")
            if not isinstance(call_id, str) or not call_id:
                raise InvalidRequestError(f"{where}.call_id must be a non-empty string")
            if isinstance(output, list):
                output = "".join(_part_text(p, f"{where}.output[{j}]") for j, p in enumerate(output))
            elif not isinstance(output, str):
                raise InvalidRequestError(f"{where}.output must be a string")
            out.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            continue
        else:
            raise InvalidRequestError(f"{where}.type {kind!r} is not supported (message, function_call, "
                                      "function_call_output)")
    return out


def _tools(tools: list | None) -> list[dict] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise InvalidRequestError(f"tools[{i}]: only function tools are supported, got {kind!r}")
        fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        if "parameters" in fn:
            if not isinstance(fn["parameters"], dict):
                raise InvalidRequestError(f"tools[{i}].parameters must be a JSON schema object")
            check_schema_depth(fn["parameters"], f"tools[{i}].parameters")
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise InvalidRequestError("tool_choice must be auto, none, required or {\"type\": \"function\", "
                                      "\"name\": ...}")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise InvalidRequestError("text.format.schema must be a JSON Schema object")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    raise InvalidRequestError(f"text.format.type must be text, json_object or json_schema, got {fmt.get('type')!r}")


def chat_request(body: ResponsesRequest, history: list[dict], pool_header: int | None = None
                 ) -> tuple[ChatCompletionRequest, list[dict]]:
    """(the chat completion a Responses request stands for, its conversation without instructions)."""
    conversation = [*history, *input_messages(body.input)]
    if not conversation:
        raise InvalidRequestError("input: at least one input item is required")
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
    fields: dict[str, Any] = {k: getattr(body, k) for k in _POLYKV}
    if fields.get("pool_id") is None and pool_header is not None:
        fields["pool_id"] = pool_header
    fields.update(model=body.model, messages=messages, tools=_tools(body.tools), tool_choice=_tool_choice(
        body.tool_choice), parallel_tool_calls=body.parallel_tool_calls, max_tokens=body.max_output_tokens,
        temperature=body.temperature, top_p=body.top_p, response_format=_response_format(body.text),
        stream=body.stream)
    return ChatCompletionRequest.model_construct(**fields), conversation


def output_items(mid: str, content: str, calls: list[ToolCall]) -> list[dict]:
    items: list[dict] = []
    if content or not calls:
        items.append(message_item(mid, content))
    items.extend(call_item(c) for c in calls)
    return items


def message_item(mid: str, content: str, status: str = "completed") -> dict:
    return {"type": "message", "id": mid, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": content, "annotations": [], "logprobs": []}]}


def call_item(call: ToolCall, status: str = "completed") -> dict:
    return {"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"), "call_id": call.id,
            "name": call.name, "arguments": call.arguments, "status": status}


def response_usage(info: RequestInfo, output_tokens: int) -> dict:
    return {"input_tokens": info.prompt_tokens, "input_tokens_details": {"cached_tokens": info.cached_prefix_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": info.prompt_tokens + output_tokens}


def response_object(rid: str, model: str, body: ResponsesRequest, created: int, *, status: str = "completed",
                    output: list[dict] | None = None, usage: dict | None = None,
                    incomplete: str | None = None) -> dict:
    fmt = (body.text or {}).get("format") or {"type": "text"}
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
            "output": output or [], "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "temperature": body.temperature,
            "top_p": body.top_p, "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
            "text": {"format": fmt}, "store": body.store, "metadata": body.metadata or {}, "reasoning": None,
            "truncation": "disabled", "user": body.user, "usage": usage}


def finished(result: GenerationResult) -> tuple[str, str | None]:
    """(status, incomplete reason) of a finished turn."""
    if result.stop_reason == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None


def assistant_message(content: str, calls: list[ToolCall]) -> dict:
    """The turn as a chat message (stored for the next turn's ``previous_response_id``)."""
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [c.as_openai() for c in calls]
    return msg


def new_ids() -> tuple[str, str, int]:
    """(response id, message item id, created_at)."""
    return "resp_" + uuid.uuid4().hex, "msg_" + uuid.uuid4().hex[:24], int(time.time())
