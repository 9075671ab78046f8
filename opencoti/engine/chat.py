"""Chat: OpenAI-style messages and tools -> prompt text, with the model's own template.

Responsibilities:

* ``normalize_messages`` / ``normalize_tools``: validate request shapes and put
  them in the form chat templates expect (content always a string, tool-call
  arguments as a dict). Every problem is an InvalidRequestError with a message
  that names the offending message index and field.
* ``render_chat``: validate, then render with the tokenizer's chat template.
* Tool-call parsing of model output (``<tool_call>{...}</tool_call>`` and the
  other formats our model families emit) belongs in this module too, next to
  the rendering it mirrors; it is not written yet.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from .errors import InvalidRequestError

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool")


def render_chat(
    tokenizer: "Tokenizer",
    messages: list[dict],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """Render a chat request to prompt text with the model's chat template.

    ``messages`` are OpenAI chat messages: ``{"role", "content"}`` with role one
    of system/user/assistant/tool; content a string or a list of
    ``{"type": "text", "text": ...}`` parts; assistant messages may carry
    ``tool_calls`` (and then ``content`` may be None); tool messages may carry
    ``tool_call_id``. ``tools`` are OpenAI function tools. Raises
    InvalidRequestError on any malformed input or a model without a template.
    """
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt)


def normalize_messages(messages: Any) -> list[dict]:
    """Validate OpenAI-style chat messages and return template-ready copies.

    Content parts are joined into one string, a missing/None assistant content
    becomes "", tool-call arguments given as a JSON-object string are parsed to
    a dict (chat templates ``tojson`` them), and unknown keys are dropped.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError("'messages' must be a non-empty list of message objects")
    return [_normalize_message(i, m) for i, m in enumerate(messages)]


def normalize_tools(tools: Any) -> list[dict] | None:
    """Validate OpenAI function tools; an empty list or None means no tools."""
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)):
        raise InvalidRequestError("'tools' must be a list of tool objects")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidRequestError(f"{where} must be an object")
        if tool.get("type", "function") != "function":
            raise InvalidRequestError(f"{where}.type must be 'function', got {tool.get('type')!r}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise InvalidRequestError(f"{where}.function must be an object")
        _require_str(fn.get("name"), f"{where}.function.name", non_empty=True)
        if fn.get("description") is not None:
            _require_str(fn["description"], f"{where}.function.description")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise InvalidRequestError(f"{where}.function.parameters must be a JSON schema object")
        out.append({**tool, "type": "function"})
    return out or None


def _normalize_message(index: int, message: Any) -> dict:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise InvalidRequestError(f"{where} must be an object with 'role' and 'content'")
    role = message.get("role")
    if role not in ROLES:
        raise InvalidRequestError(f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}")
    out: dict[str, Any] = {"role": role}

    content = message.get("content")
    if content is None:
        if role != "assistant":
            raise InvalidRequestError(f"{where}.content is required for role '{role}'")
        out["content"] = ""
    else:
        out["content"] = _content_text(content, f"{where}.content")

    if message.get("name") is not None:
        out["name"] = _require_str(message["name"], f"{where}.name")
    if message.get("tool_calls") is not None:
        if role != "assistant":
            raise InvalidRequestError(f"{where}.tool_calls is only allowed on assistant messages")
        calls = message["tool_calls"]
        if not isinstance(calls, (list, tuple)):
            raise InvalidRequestError(f"{where}.tool_calls must be a list")
        if calls:
            out["tool_calls"] = [_normalize_tool_call(f"{where}.tool_calls[{j}]", c) for j, c in enumerate(calls)]
    if message.get("tool_call_id") is not None:
        if role != "tool":
            raise InvalidRequestError(f"{where}.tool_call_id is only allowed on tool messages")
        out["tool_call_id"] = _require_str(message["tool_call_id"], f"{where}.tool_call_id")
    if role == "assistant" and message.get("reasoning_content") is not None:
        out["reasoning_content"] = _require_str(message["reasoning_content"], f"{where}.reasoning_content")
    return out


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        raise InvalidRequestError(f"{where} must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequestError(f"{where}[{j}] must be a {{'type': 'text', 'text': ...}} part (got {kind!r})")
        texts.append(_require_str(part.get("text"), f"{where}[{j}].text"))
    return "".join(texts)


def _normalize_tool_call(where: str, call: Any) -> dict:
    if not isinstance(call, dict):
        raise InvalidRequestError(f"{where} must be an object")
    if call.get("type", "function") != "function":
        raise InvalidRequestError(f"{where}.type must be 'function', got {call.get('type')!r}")
    fn = call.get("function")
    if not isinstance(fn, dict):
        raise InvalidRequestError(f"{where}.function must be an object with 'name' and 'arguments'")
    name = _require_str(fn.get("name"), f"{where}.function.name", non_empty=True)
    arguments = fn.get("arguments", {})
    if isinstance(arguments, str):
        # OpenAI sends a JSON string; templates expect a mapping. Text that is not a
        # JSON object (a model's malformed call, echoed back) is kept verbatim.
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            arguments = parsed
    elif not isinstance(arguments, dict):
        raise InvalidRequestError(f"{where}.function.arguments must be a JSON string or an object")
    out: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call.get("id") is not None:
        out["id"] = _require_str(call["id"], f"{where}.id")
    return out


def _require_str(value: Any, where: str, non_empty: bool = False) -> str:
    if not isinstance(value, str) or (non_empty and not value):
        raise InvalidRequestError(f"{where} must be a {'non-empty ' if non_empty else ''}string")
    return value
