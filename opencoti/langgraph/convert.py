"""Pure converters between LangChain messages and the PolyKV client's chat events (unit-tested
directly): messages -> OpenAI chat messages, ``tool_choice``, chat events -> ``AIMessageChunk``,
usage and response metadata, and the JSON answer parser of ``json_mode``."""

from __future__ import annotations

import json
from typing import Any, Sequence

from langchain_core.messages import (AIMessage, AIMessageChunk, BaseMessage, ChatMessage, HumanMessage,
                                     SystemMessage, ToolMessage)
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from langchain_core.exceptions import OutputParserException
from langchain_core.messages.tool import tool_call_chunk

from ..client import ChatChunk, GenerationInfo, SessionStatus

# ============================================================================ converters (pure)
def _text_of(content: Any, where: str) -> str:
    """Message content (a string or a list of text blocks) as one string."""
    if isinstance(content, str):
        return content
    parts = []
    for block in content or ():
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(str(block.get("text", "")))
        elif isinstance(block, dict) and block.get("type") in ("tool_use", "tool_call", "reasoning", "thinking"):
            continue  # represented elsewhere (tool_calls) or not sent back to the model
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ValueError(f"{where}: opencoti models take text only; got a {kind!r} content block")
    return "".join(parts)


def convert_message_to_dict(message: BaseMessage) -> dict:
    """A LangChain message -> an OpenAI chat message (what the server and the engine render)."""
    if isinstance(message, SystemMessage):
        return {"role": "system", "content": _text_of(message.content, "system message")}
    if isinstance(message, HumanMessage):
        return {"role": "user", "content": _text_of(message.content, "human message")}
    if isinstance(message, AIMessage):
        out: dict[str, Any] = {"role": "assistant", "content": _text_of(message.content, "ai message")}
        calls = [{"id": tc.get("id") or f"call_{i}", "type": "function",
                  "function": {"name": tc["name"], "arguments": json.dumps(tc.get("args") or {}, ensure_ascii=False)}}
                 for i, tc in enumerate(message.tool_calls)]
        calls += [{"id": tc.get("id") or f"call_invalid_{i}", "type": "function",
                   "function": {"name": tc.get("name") or "", "arguments": tc.get("args") or ""}}
                  for i, tc in enumerate(message.invalid_tool_calls) if tc.get("name")]
        if calls:
            out["tool_calls"] = calls
        return out
    if isinstance(message, ToolMessage):
        content = message.content
        text = content if isinstance(content, str) else (
            _text_of(content, "tool message") if isinstance(content, list) else json.dumps(content))
        return {"role": "tool", "content": text, "tool_call_id": message.tool_call_id}
    if isinstance(message, ChatMessage):
        role = {"human": "user", "ai": "assistant"}.get(message.role, message.role)
        return {"role": role, "content": _text_of(message.content, f"{role} message")}
    raise ValueError(f"unsupported message type {type(message).__name__}")


def convert_messages(messages: Sequence[BaseMessage]) -> list[dict]:
    """LangChain messages -> OpenAI chat messages."""
    return [convert_message_to_dict(m) for m in messages]


def format_tool_choice(tool_choice: Any) -> Any:
    """LangChain's ``tool_choice`` -> OpenAI's: a tool name -> that function, ``"any"``/True ->
    ``"required"``; ``"auto"``/``"none"``/``"required"`` and dicts pass through."""
    if tool_choice is None or tool_choice is False:
        return None
    if tool_choice is True or tool_choice == "any":
        return "required"
    if isinstance(tool_choice, str):
        if tool_choice in ("auto", "none", "required"):
            return tool_choice
        return {"type": "function", "function": {"name": tool_choice}}
    if isinstance(tool_choice, dict):
        return tool_choice
    raise ValueError(f"unsupported tool_choice {tool_choice!r}: a tool name, 'auto', 'none', 'any', 'required', "
                     "True, or an OpenAI tool_choice dict")


def chunk_from_event(event: ChatChunk) -> AIMessageChunk | None:
    """A client chat event -> an AIMessageChunk (None for the start event, which carries nothing
    to add to the message; the end is built by ``final_chunk``)."""
    if event.tool_calls:
        return AIMessageChunk(content=event.content, tool_call_chunks=[
            tool_call_chunk(name=c.name, args=c.arguments, id=c.id, index=c.index) for c in event.tool_calls])
    if event.content:
        return AIMessageChunk(content=event.content)
    return None


def usage_metadata(event: ChatChunk) -> UsageMetadata | None:
    """Token counts, with the prompt tokens read from the KV cache as ``input_token_details.cache_read``."""
    u = event.usage
    if u is None:
        return None
    return UsageMetadata(input_tokens=u.prompt_tokens, output_tokens=u.completion_tokens,
                         total_tokens=u.total_tokens, input_token_details=InputTokenDetails(cache_read=u.cached_tokens))


def response_metadata(end: ChatChunk, info: GenerationInfo | None, status: SessionStatus | None,
                      model_name: str | None) -> dict:
    """The ``response_metadata`` of a finished answer: PolyKV placement, live session health, timings."""
    info = end.info or info
    timings = end.timings or {}
    md: dict[str, Any] = {
        "model_name": model_name or end.model or "opencoti",
        "model_provider": "opencoti",
        "finish_reason": end.finish_reason or "stop",
        "pool_id": info.pool_id if info else None,
        "session_id": info.session_id if info else None,
        "cached_prefix_tokens": info.cached_prefix_tokens if info else timings.get("cache_n"),
        "session_tps": status.tps_ewma if status and status.tps_ewma else timings.get("predicted_per_second"),
        "ctx_headroom_tokens": status.ctx_headroom_tokens if status else None,
        "compaction_pressure": status.compaction_pressure if status else None,
        "timings": timings,
    }
    if info is not None and info.sessions_remaining is not None:
        md["sessions_remaining"] = info.sessions_remaining
    if info is not None and info.admission_warning:
        md["admission_warning"] = info.admission_warning
    bp = backpressure(info)
    if bp is not None:
        md["backpressure"] = bp
    return md


def backpressure(info: GenerationInfo | None) -> dict | None:
    """``response_metadata["backpressure"]``: what an enforced pool's admission gate said when it
    admitted this request as a session new to the pool (None otherwise: no gate applied; the same
    cases as the ``X-Sessions-Remaining`` header). ``sessions_remaining``: new sessions the pool
    could take at that moment, this one included (0: none fit, this one came in by the guarantee,
    ``warn`` or ``overcommit``; ``"unknown"``: a floor and nothing measured to project from);
    ``warning``: only when admitted past a full pool; ``retry_after_s``: only when no other new
    session fits after this one, the whole seconds until one is likely to."""
    if info is None or info.sessions_remaining is None:
        return None
    bp: dict[str, Any] = {"sessions_remaining": info.sessions_remaining}
    if info.admission_warning:
        bp["warning"] = info.admission_warning
    if info.admission_retry_after_s is not None:
        bp["retry_after_s"] = info.admission_retry_after_s
    return bp


def parse_json_answer(message: BaseMessage, schema: type | None = None) -> Any:
    """The first JSON object in an answer's text (small models often write a sentence around it),
    validated into ``schema`` when it is a pydantic class."""
    text = message.text if isinstance(message, BaseMessage) else str(message)
    decoder = json.JSONDecoder()
    for i, ch in enumerate(text):
        if ch != "{":
            continue
        try:
            value, _ = decoder.raw_decode(text[i:])
        except ValueError:
            continue
        if isinstance(value, dict):
            if schema is None:
                return value
            # pydantic 2 models, or pydantic.v1 ones (parse_obj)
            return schema.model_validate(value) if hasattr(schema, "model_validate") else schema.parse_obj(value)
    raise OutputParserException(f"no JSON object in the answer: {text[:200]!r}", llm_output=text)
