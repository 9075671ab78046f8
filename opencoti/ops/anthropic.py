"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``), translated
onto the chat operation: a Messages request becomes a ``ChatCompletionRequest`` (so it is rendered,
constrained, admitted, cached and measured exactly as a chat completion), and a chat turn's result
becomes a Message.

What is translated: ``system`` (a string or text blocks) -> a system message; ``text`` blocks ->
text; ``tool_use`` blocks (assistant) -> tool calls; ``tool_result`` blocks (user) -> tool messages
(``is_error`` prefixes the content with "Error: "); ``thinking`` blocks -> ``<think>`` text before
the assistant's answer (``thinking_text``: rendered and counted, as a reasoning template does);
``tools`` (``input_schema``) -> function tools; ``tool_choice`` (auto / any / tool / none,
``disable_parallel_tool_use``); ``stop_sequences``; ``temperature``,
``top_p``, ``top_k``; ``output_config.format`` (json_schema: the constraint engine). ``metadata``
and ``thinking`` are accepted (the model has no thinking mode), the values Anthropic refuses are
refused here too (a missing ``max_tokens`` or one under 1, a tool without ``input_schema``,
``budget_tokens`` under 1024 or not below ``max_tokens``).
Image and document blocks are refused (400): the model reads text only. The PolyKV fields
(``pool_id``, ``session_id``, ``cache_salt``, ...) may be sent as extra fields.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Union

from pydantic import ConfigDict, Field

from ..engine.checks import check_schema_depth, is_int
from ..engine.errors import InvalidRequestError
from ..engine.results import GenerationResult, RequestInfo
from ..engine.chat.tool_calls import ToolCall
from .schemas import SHARED_PREFIX_NEEDS_POOL, ChatCompletionRequest, PolyKVFields, field_range

STOP_REASON = {"eos": "end_turn", "stop": "stop_sequence", "length": "max_tokens", "cancelled": "end_turn"}
_POLYKV = tuple(PolyKVFields.model_fields)

# The request as _message / _tools / _tool_choice / check_thinking accept it (the OpenAPI schemas)
_NAME = {"type": "string", "minLength": 1}
_TEXT_BLOCK = {"type": "object", "required": ["type", "text"],
               "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_TEXTS = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_BLOCK}]}
_TOOL_RESULT = {"type": "object", "required": ["type", "tool_use_id"],
                "properties": {"type": {"const": "tool_result"}, "tool_use_id": _NAME, "content": _TEXTS}}
_TOOL_USE = {"type": "object", "required": ["type", "name"],
             "properties": {"type": {"const": "tool_use"}, "name": _NAME, "input": {"type": "object"}}}
_THINKING = {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["thinking", "redacted_thinking"]}}}
MESSAGE_SCHEMA = {"anyOf": [
    {"type": "object", "required": ["role", "content"],
     "properties": {"role": {"const": "user"}, "content": {"anyOf": [
         {"type": "string"}, {"type": "array", "items": {"anyOf": [_TEXT_BLOCK, _TOOL_RESULT]}}]}}},
    {"type": "object", "required": ["role", "content"],
     "properties": {"role": {"const": "assistant"}, "content": {"anyOf": [
         {"type": "string"}, {"type": "array", "items": {"anyOf": [_TEXT_BLOCK, _TOOL_USE, _THINKING]}}]}}}]}
TOOL_SCHEMA = {"type": "object", "required": ["name", "input_schema"],
               "properties": {"type": {"enum": ["custom", None]}, "name": _NAME, "input_schema": {"type": "object"}}}
TOOL_CHOICE_SCHEMA = {"anyOf": [
    {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["auto", "any", "none"]}}},
    {"type": "object", "required": ["type", "name"], "properties": {"type": {"const": "tool"}, "name": _NAME}}]}
THINKING_SCHEMA = {"anyOf": [
    {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["disabled", "adaptive", "between_tools"]}}},
    {"type": "object", "required": ["type", "budget_tokens"],
     "properties": {"type": {"const": "enabled"}, "budget_tokens": {"type": "integer", "minimum": 1024}}}]}


def _OR_NULL(schema: dict) -> dict:  # noqa: N802 - a schema constant's nullable form
    return {"anyOf": [*schema["anyOf"], {"type": "null"}]}


# a forced call (tool_choice any / tool) needs tools
TOOLS_NEEDED = {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {
    "type": "object", "required": ["type"], "properties": {"type": {"enum": ["any", "tool"]}}}}},
    "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}}
_FORMAT = {"type": "object", "required": ["type", "schema"],
           "properties": {"type": {"const": "json_schema"}, "schema": {"type": "object"}}}


class MessagesRequest(PolyKVFields):
    """Anthropic's ``POST /v1/messages`` body (unknown fields are ignored)."""

    model_config = ConfigDict(json_schema_extra={"allOf": [SHARED_PREFIX_NEEDS_POOL, TOOLS_NEEDED]})

    model: str | None = None
    messages: list[Any] = Field(..., description="user / assistant turns: a string or content blocks each",
                                json_schema_extra={"minItems": 1, "items": MESSAGE_SCHEMA})  # (an empty list is a 400)
    max_tokens: int = Field(..., ge=1, description="tokens to generate at most (required, as Anthropic requires it)")
    system: Union[str, list[Any], None] = Field(None, description="a string or text blocks",
                                                json_schema_extra={"anyOf": [*_TEXTS["anyOf"], {"type": "null"}]})
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, json_schema_extra=field_range(0, 100))
    top_p: float | None = Field(None, json_schema_extra={"exclusiveMinimum": 0, "maximum": 1})
    top_k: int | None = Field(None, json_schema_extra=field_range(-1))
    tools: list[Any] | None = Field(None, json_schema_extra={"items": TOOL_SCHEMA})
    tool_choice: dict[str, Any] | None = Field(None, description="auto | any | none | {\"type\": \"tool\", \"name\": "
                                                                 "...} (any and tool need tools; the name must be one "
                                                                 "of theirs)", json_schema_extra=_OR_NULL(TOOL_CHOICE_SCHEMA))
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = Field(None, description="{\"type\": \"enabled\", \"budget_tokens\": >= 1024} "
                                                           "or {\"type\": \"disabled\"}: accepted (the model has no "
                                                           "thinking mode); max_tokens must be above "
                                                           "budget_tokens", json_schema_extra=_OR_NULL(THINKING_SCHEMA))
    output_config: dict[str, Any] | None = Field(None, description="{\"format\": {\"type\": \"json_schema\", "
                                                                   "\"schema\": {...}}}: structured output",
                                                   json_schema_extra={"properties": {"format": {
                                                       "anyOf": [_FORMAT, {"type": "null"}]}}})
    output_format: dict[str, Any] | None = Field(None, description="the earlier name of output_config.format",
                                                 json_schema_extra=_OR_NULL({"anyOf": [_FORMAT]}))


class CountTokensRequest(MessagesRequest):
    """``POST /v1/messages/count_tokens``: a Messages body without ``max_tokens``."""

    max_tokens: int | None = Field(None, ge=1, description="not needed to count (checked when given)")


def _refuse_media(kind: str, where: str) -> None:
    raise InvalidRequestError(f"{where}: {kind} input is not supported: the model reads text only "
                              "(send the content as text blocks)")


def _block_text(block: Any, where: str) -> str:
    """The text of a text block (image / document blocks are refused)."""
    if not isinstance(block, dict):
        raise InvalidRequestError(f"{where} must be a content block object")
    kind = block.get("type")
    if kind in ("image", "document"):
        _refuse_media("image" if kind == "image" else "document", where)
    if kind != "text":
        raise InvalidRequestError(f"{where}.type must be 'text' here, got {kind!r}")
    text = block.get("text")
    if not isinstance(text, str):
        raise InvalidRequestError(f"{where}.text must be a string")
    return text


def _texts(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where} must be a string or a list of content blocks")
    return "".join(_block_text(b, f"{where}[{i}]") for i, b in enumerate(content))


def _tool_result(block: dict, where: str) -> dict:
    tool_use_id = block.get("tool_use_id")
    if not isinstance(tool_use_id, str) or not tool_use_id:
        raise InvalidRequestError(f"{where}.tool_use_id must be a non-empty string")
    text = _texts(block.get("content", ""), f"{where}.content")
    if block.get("is_error"):
        text = "Error: " + text
    return {"role": "tool", "tool_call_id": tool_use_id, "content": text}


THINK_OPEN, THINK_CLOSE = "<think>\n", "\n</think>\n\n"


def thinking_text(thinking: str) -> str:
    """An assistant turn's ``thinking`` as the text before its answer, in the form reasoning models write
    and their chat templates read back (``<think>\n...\n</think>\n\n``; a template that renders
    reasoning splits it off the content itself, one that does not renders it as the model's own text):
    it is part of the prompt, so ``count_tokens`` counts it. Empty thinking adds nothing."""
    return THINK_OPEN + thinking + THINK_CLOSE if thinking else ""


def _message(i: int, m: Any) -> list[dict]:
    """One Anthropic message -> the OpenAI messages it stands for (tool results become tool messages,
    before the user's own text)."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise InvalidRequestError(f"{where} must be an object with 'role' and 'content'")
    role = m.get("role")
    if role not in ("user", "assistant"):
        raise InvalidRequestError(f"{where}.role must be 'user' or 'assistant', got {role!r}")
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where}.content must be a string or a list of content blocks")
    texts: list[str] = []
    calls: list[dict] = []
    results: list[dict] = []
    reasoning: list[str] = []
    for j, block in enumerate(content):
        bw = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_use" and role == "assistant":
            name, args = block.get("name"), block.get("input", {})
            if not isinstance(name, str) or not name or not isinstance(args, dict):
                raise InvalidRequestError(f"{bw}: a tool_use block needs a name and an input object")
            calls.append({"id": str(block.get("id") or "toolu_" + uuid.uuid4().hex[:24]), "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, bw))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            if isinstance(block.get("thinking"), str):  # a redacted block's text is encrypted: nothing to render
                reasoning.append(block["thinking"])
        else:
            texts.append(_block_text(block, bw))
    out: list[dict] = list(results)
    if role == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": thinking_text("".join(reasoning)) + "".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    elif texts or not results:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _tools(tools: list | None) -> list[dict] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise InvalidRequestError(f"{where} must be an object")
        if t.get("type") not in (None, "custom"):
            raise InvalidRequestError(f"{where}: server tool {t.get('type')!r} is not supported; give client tools "
                                      "(name, description, input_schema)")
        name, schema = t.get("name"), t.get("input_schema")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"{where}.name: a tool needs a name (a non-empty string)")
        if schema is None:
            raise InvalidRequestError(f"{where}.input_schema: Field required (a tool's input is described by a JSON "
                                      "schema, e.g. {\"type\": \"object\", \"properties\": {...}})")
        if not isinstance(schema, dict):
            raise InvalidRequestError(f"{where}.input_schema must be a JSON schema object, got {type(schema).__name__}")
        check_schema_depth(schema, f"{where}.input_schema")
        fn: dict[str, Any] = {"name": name, "parameters": schema}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: dict | None) -> tuple[Any, bool | None]:
    """(OpenAI tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError("tool_choice of type 'tool' needs a name")
        return {"type": "function", "function": {"name": name}}, parallel
    raise InvalidRequestError(f"tool_choice.type must be auto, any, tool or none, got {kind!r}")


MIN_THINKING_BUDGET = 1024  # Anthropic's least budget_tokens
THINKING_TYPES = ("enabled", "disabled", "adaptive", "between_tools")  # Anthropic's thinking configurations


def check_thinking(thinking: dict | None, max_tokens: int | None) -> None:
    """Refuse a ``thinking`` setting Anthropic refuses (the model has no thinking mode: a valid one is
    accepted and changes nothing)."""
    if thinking is None:
        return
    kind = thinking.get("type")
    if kind in THINKING_TYPES and kind != "enabled":
        return
    if kind != "enabled":
        raise InvalidRequestError(f"thinking.type must be one of {', '.join(THINKING_TYPES)}, got {kind!r}")
    budget = thinking.get("budget_tokens")
    if not is_int(budget):
        raise InvalidRequestError("thinking.budget_tokens: an integer is required when thinking is enabled, got "
                                  f"{budget!r}")
    if budget < MIN_THINKING_BUDGET:
        raise InvalidRequestError(f"thinking.budget_tokens: Input should be greater than or equal to "
                                  f"{MIN_THINKING_BUDGET} (got {budget})")
    if max_tokens is not None and max_tokens <= budget:
        raise InvalidRequestError(f"max_tokens must be greater than thinking.budget_tokens (got max_tokens {max_tokens}, "
                                  f"budget_tokens {budget})")


def _response_format(body: MessagesRequest) -> dict | None:
    """Anthropic's structured output (``output_config.format``) as the chat's json_schema response_format."""
    fmt = (body.output_config or {}).get("format") or body.output_format
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise InvalidRequestError("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}


def chat_request(body: MessagesRequest, pool_header: int | None = None) -> ChatCompletionRequest:
    """The chat completion a Messages request stands for (``pool_header``: the x-pool-id header)."""
    if not body.messages:
        raise InvalidRequestError("messages: at least one message is required")
    check_thinking(body.thinking, body.max_tokens)
    messages: list[dict] = []
    if body.system:
        messages.append({"role": "system", "content": _texts(body.system, "system")})
    for i, m in enumerate(body.messages):
        messages.extend(_message(i, m))
    tool_choice, parallel = _tool_choice(body.tool_choice)
    fields: dict[str, Any] = {k: getattr(body, k) for k in _POLYKV}
    if fields.get("pool_id") is None and pool_header is not None:
        fields["pool_id"] = pool_header
    fields.update(model=body.model, messages=messages, tools=_tools(body.tools), tool_choice=tool_choice,
                  parallel_tool_calls=parallel, max_tokens=body.max_tokens, stop=body.stop_sequences,
                  temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                  response_format=_response_format(body), stream=bool(getattr(body, "stream", False)))
    return ChatCompletionRequest.model_construct(**fields)


def message_usage(info: RequestInfo, output_tokens: int) -> dict:
    """Anthropic's usage: input_tokens excludes the tokens read from the cache."""
    return {"input_tokens": info.prompt_tokens - info.cached_prefix_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": info.cached_prefix_tokens,
            "output_tokens": output_tokens}


def tool_use_block(call: ToolCall) -> dict:
    try:
        args = json.loads(call.arguments) if call.arguments else {}
    except ValueError:
        args = {"_raw": call.arguments}
    if not isinstance(args, dict):
        args = {"_value": args}
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name, "input": args}


def stop_reason(result: GenerationResult, calls: list[ToolCall], stops: list[str] | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished turn."""
    if calls and result.stop_reason != "length":
        return "tool_use", None
    if result.stop_reason == "stop" and stops and result.stopping_word in stops:
        return "stop_sequence", result.stopping_word
    return STOP_REASON.get(result.stop_reason, "end_turn") if result.stop_reason != "stop" else "end_turn", None


def message(mid: str, model: str, info: RequestInfo, result: GenerationResult, content: str,
            calls: list[ToolCall], stops: list[str] | None) -> dict:
    """The whole Message of a non-streamed answer."""
    blocks: list[dict] = []
    if content or not calls:
        blocks.append({"type": "text", "text": content})
    blocks.extend(tool_use_block(c) for c in calls)
    reason, seq = stop_reason(result, calls, stops)
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": reason, "stop_sequence": seq, "usage": message_usage(info, len(result.token_ids))}
