"""Chat rendering: OpenAI-style messages (+ tools) -> prompt text, one chain for every caller.

``render_chat`` is the only way a conversation becomes a prompt (``Engine.apply_chat_template``,
``Engine.generate(messages=...)``, pools made from messages, the HTTP routes and the in-process
client all go through it), so the same messages + tools always give the same tokens:

1. ``normalize_messages`` / ``normalize_tools``: validate request shapes once and put them in the
   form chat templates expect (content a string, tool-call arguments a dict). Every problem is an
   InvalidRequestError naming the offending message index and field.
2. ``inject_tools``: for templates that do not render ``tools`` / assistant ``tool_calls`` themselves
   (found once per template by ``template_caps``; e.g. SmolLM2's), the tool definitions go into the
   system message in the Hermes/Qwen form, tool calls become ``<tool_call>{json}</tool_call>`` text
   and tool results ``<tool_response>`` blocks. Never depends on ``tool_choice``, so a pool made from
   the same messages + tools is a token-exact prefix of every request that uses them.
3. ``apply_template``: the model's Jinja template (transformers renders HF tokenizers' templates;
   a sandbox configured like transformers' renders the built-in byte-level one).

``prepare_chat`` adds what a chat *request* needs on top: ``tool_choice`` and its prefill.
Tool-call parsing of the output is in :mod:`opencoti.engine.chat.tool_calls`.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable

from ..checks import check_schema_depth
from ..errors import InvalidRequestError
from .tool_calls import ToolChoice, format_tool_call_text, parse_tool_choice, tool_choice_prefill, tool_names, \
    tools_system_text

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool")
_PROBE_NAME = "opencoti_probe_fn_7f3a"


# ============================================================================ the chain
def render_chat(tokenizer: "Tokenizer", messages: Any, tools: Any = None, add_generation_prompt: bool = True) -> str:
    """Messages (+ tools) -> prompt text: normalize, inject tools the template ignores, apply the template.

    ``messages`` are OpenAI chat messages: ``{"role", "content"}`` with role one of
    system/user/assistant/tool; content a string or a list of ``{"type": "text", "text": ...}``
    parts; assistant messages may carry ``tool_calls`` (and then ``content`` may be None); tool
    messages may carry ``tool_call_id``. ``tools`` are OpenAI function tools. Raises
    InvalidRequestError on malformed input, a model without a template, or a template that
    rejects the conversation.
    """
    _require_template(tokenizer)
    msgs, template_tools = inject_tools(normalize_messages(messages), normalize_tools(tools), template_caps(tokenizer))
    return apply_template(tokenizer, msgs, template_tools, add_generation_prompt)


@dataclass(frozen=True)
class ChatPrompt:
    """A chat request's prompt: ``text`` (the rendered conversation), ``prefill`` (appended after it to
    force a tool call), the parsed ``choice`` and the known function ``names``."""

    text: str
    prefill: str
    choice: ToolChoice
    names: frozenset[str]

    @property
    def full_text(self) -> str:
        return self.text + self.prefill


def prepare_chat(tokenizer: "Tokenizer", messages: Any, tools: Any = None, tool_choice: Any = None) -> ChatPrompt:
    """The prompt of a chat request: ``render_chat`` plus ``tool_choice`` (validated against ``tools``)."""
    tool_list = normalize_tools(tools)
    choice = parse_tool_choice(tool_choice, tool_list)
    text = render_chat(tokenizer, messages, tool_list, add_generation_prompt=True)
    return ChatPrompt(text, tool_choice_prefill(choice), choice, frozenset(tool_names(tool_list)))


# ============================================================================ tool injection
@dataclass(frozen=True)
class TemplateCaps:
    """What a chat template renders natively."""

    supports_tools: bool = False  # the `tools` argument shows up in the prompt
    supports_tool_calls: bool = False  # assistant `tool_calls` show up in the prompt


def probe_template_caps(render: Callable[..., str]) -> TemplateCaps:
    """Render probes through ``render(messages, tools, add_generation_prompt)`` (normalized input)."""
    tool = {"type": "function", "function": {"name": _PROBE_NAME, "description": "probe",
                                             "parameters": {"type": "object", "properties": {}}}}
    base = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    try:
        tools_ok = _PROBE_NAME in render(base, [tool], True)
    except Exception:  # noqa: BLE001 - a template that rejects tools does not support them
        tools_ok = False
    calls = base + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_probe", "type": "function", "function": {"name": _PROBE_NAME, "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "call_probe", "content": "r"}]
    try:
        calls_ok = _PROBE_NAME in render(calls, [tool] if tools_ok else None, True)
    except Exception:  # noqa: BLE001
        calls_ok = False
    return TemplateCaps(supports_tools=tools_ok, supports_tool_calls=calls_ok)


_CAPS: "weakref.WeakKeyDictionary[Any, tuple[str, TemplateCaps]]" = weakref.WeakKeyDictionary()


def template_caps(tokenizer: "Tokenizer") -> TemplateCaps:
    """The tokenizer's template capabilities (probed once per template)."""
    template = tokenizer.chat_template
    if not template:
        return TemplateCaps()
    cached = _CAPS.get(tokenizer)
    if cached is None or cached[0] != template:
        caps = probe_template_caps(lambda m, t, g: apply_template(tokenizer, m, t, g))
        _CAPS[tokenizer] = cached = (template, caps)
    return cached[1]


def inject_tools(messages: list[dict], tools: list[dict] | None,
                 caps: TemplateCaps) -> tuple[list[dict], list[dict] | None]:
    """Rewrite normalized messages for a template: returns (messages, tools to hand the template)."""
    msgs = list(messages)
    if tools and not caps.supports_tools:
        block = tools_system_text(tools)
        if msgs[0]["role"] == "system":
            msgs[0] = {**msgs[0], "content": (msgs[0]["content"] + "\n\n" if msgs[0]["content"] else "") + block}
        else:
            msgs.insert(0, {"role": "system", "content": block})
    if not caps.supports_tool_calls:
        msgs = [_tool_turn_as_text(m) for m in msgs]
    return msgs, (tools if caps.supports_tools else None)


def _tool_turn_as_text(m: dict) -> dict:
    if m["role"] == "assistant" and m.get("tool_calls"):
        parts = [m["content"]] if m["content"] else []
        parts += [format_tool_call_text(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
        return {**{k: v for k, v in m.items() if k != "tool_calls"}, "content": "\n".join(parts)}
    if m["role"] == "tool":
        return {**{k: v for k, v in m.items() if k != "tool_call_id"},
                "content": "<tool_response>\n" + m["content"] + "\n</tool_response>"}
    return m


# ============================================================================ the template
def apply_template(tokenizer: "Tokenizer", messages: list[dict], tools: list[dict] | None,
                   add_generation_prompt: bool) -> str:
    """Render already-normalized messages with the tokenizer's template (no validation, no injection)."""
    template = _require_template(tokenizer)
    import jinja2  # a transformers dependency; imported late to keep imports cheap

    try:
        if tokenizer.hf_tokenizer is not None:
            return tokenizer.hf_tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=bool(add_generation_prompt),
                chat_template=template)
        return _jinja_template(template).render(
            messages=messages, tools=tools, add_generation_prompt=bool(add_generation_prompt),
            **tokenizer.template_vars)
    except (jinja2.TemplateError, TypeError, ValueError) as exc:
        raise InvalidRequestError(f"the chat template rejected the messages: {exc}") from exc


def _require_template(tokenizer: "Tokenizer") -> str:
    if not tokenizer.chat_template:
        raise InvalidRequestError("this model has no chat template; use the completion endpoint with raw text")
    return tokenizer.chat_template


_TEMPLATE_CACHE: dict[str, Any] = {}


def _jinja_template(source: str):
    """Compile a chat template in a sandbox configured like transformers' own."""
    template = _TEMPLATE_CACHE.get(source)
    if template is None:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise InvalidRequestError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        template = _TEMPLATE_CACHE[source] = env.from_string(source)
    return template


# ============================================================================ normalization
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
        if fn.get("parameters") is not None:
            if not isinstance(fn["parameters"], dict):
                raise InvalidRequestError(f"{where}.function.parameters must be a JSON schema object")
            check_schema_depth(fn["parameters"], f"{where}.function.parameters")  # whatever tool_choice is
        out.append({**tool, "type": "function"})
    return out or None


_NAME = {"type": "string", "minLength": 1}
# an assistant's tool call as _normalize_tool_call accepts it (arguments: a JSON string or an object)
_TOOL_CALL = {"type": "object", "required": ["function"],
              "properties": {"type": {"const": "function"},
                             "function": {"type": "object", "required": ["name"],
                                          "properties": {"name": _NAME, "arguments": {"type": ["string", "object"]}}}}}
# a tool as normalize_tools accepts it (the OpenAPI schema of every ``tools`` item of the chat routes)
TOOL_SCHEMA = {"type": "object", "required": ["function"],
               "properties": {"type": {"const": "function"},
                              "function": {"type": "object", "required": ["name"],
                                           "properties": {"name": _NAME, "description": {"type": ["string", "null"]},
                                                          "parameters": {"type": ["object", "null"]}}}}}
# tool_choice as parse_tool_choice accepts it ("required" needs tools: see TOOLS_NEEDED; a function
# named must be one of the tools: a rule across two fields' values that JSON Schema cannot state)
TOOL_CHOICE_SCHEMA = {"anyOf": [
    {"enum": ["none", "auto", "required"]},
    {"type": "object", "required": ["function"],
     "properties": {"type": {"const": "function"},
                    "function": {"type": "object", "required": ["name"], "properties": {"name": _NAME}}}},
    {"type": "null"}]}
# a forced call needs tools: tool_choice "required" or a function object -> a non-empty tools list
TOOLS_NEEDED = {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {"type": ["string", "object"],
                                                                                    "not": {"enum": ["none", "auto"]}}}},
                "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}}
_TEXT_PARTS = {"type": "array", "items": {"type": "object", "required": ["type", "text"],
                                          "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}
# A message as _normalize_message accepts it (the OpenAPI schema of every ``messages`` item):
# system / user / tool messages need content; an assistant's may be null (tool calls only).
MESSAGE_SCHEMA = {"anyOf": [
    {"type": "object", "required": ["role", "content"],
     "properties": {"role": {"enum": ["system", "user"]}, "content": {"anyOf": [{"type": "string"}, _TEXT_PARTS]},
                    "name": {"type": ["string", "null"]}, "tool_calls": {"type": "null"},
                    "tool_call_id": {"type": "null"}}},
    {"type": "object", "required": ["role", "content"],
     "properties": {"role": {"const": "tool"}, "content": {"anyOf": [{"type": "string"}, _TEXT_PARTS]},
                    "name": {"type": ["string", "null"]}, "tool_calls": {"type": "null"},
                    "tool_call_id": {"type": ["string", "null"]}}},
    {"type": "object", "required": ["role"],
     "properties": {"role": {"const": "assistant"}, "content": {"anyOf": [{"type": "string"}, _TEXT_PARTS,
                                                                         {"type": "null"}]},
                    "name": {"type": ["string", "null"]}, "tool_call_id": {"type": "null"},
                    "tool_calls": {"type": ["array", "null"], "items": _TOOL_CALL},
                    "reasoning_content": {"type": ["string", "null"]}}},
]}


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
