"""Tool calls in model output, and ``tool_choice``: the engine-side half of tool calling.

The rendering half (tool definitions injected into the prompt for templates that ignore them)
is in :mod:`opencoti.engine.chat`; both use the Hermes/Qwen form defined here, so a call the
model writes looks like the calls the prompt shows it.

* ``parse_tool_choice`` / ``tool_choice_prefill``: the parsed ``tool_choice`` and the start of the
  assistant turn that makes the model call a tool (``required``) or one named function (there is
  no constrained decoding here, so this is the one lever).
* ``parse_tool_calls``: model output -> (content, calls). Recognised: ``<tool_call>{json}</tool_call>``
  (one or more; a JSON list inside the tags; an unterminated last tag) and a bare JSON object (or a
  list of them, optionally in a ```json fence) with ``name`` and ``arguments``/``parameters``.
* ``ToolStreamFilter``: the same for a token stream: content is passed through as it comes, the
  text of a tool call is held back and turned into calls at the end.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidRequestError

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

TOOLS_SYSTEM_HEADER = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_SYSTEM_FOOTER = (
    "\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
    "</tool_call>"
)


def tools_system_text(tools: list[dict]) -> str:
    """The Hermes/Qwen tool block for templates without tool support (deterministic JSON)."""
    lines = [json.dumps(t, ensure_ascii=False, sort_keys=False) for t in tools]
    return TOOLS_SYSTEM_HEADER + "".join("\n" + s for s in lines) + TOOLS_SYSTEM_FOOTER


def format_tool_call_text(name: str, arguments: Any) -> str:
    """An assistant tool call as text, for templates that do not render ``tool_calls``."""
    return TOOL_CALL_OPEN + "\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n" \
        + TOOL_CALL_CLOSE


# ============================================================================ tool_choice
@dataclass(frozen=True)
class ToolChoice:
    """The parsed ``tool_choice``: mode none|auto|required, and the forced function name (or None)."""

    mode: str = "auto"
    name: str | None = None


def parse_tool_choice(tool_choice: Any, tools: list[dict] | None) -> ToolChoice:
    names = tool_names(tools)
    if tool_choice is None:
        return ToolChoice("auto" if names else "none")
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise InvalidRequestError(f"tool_choice must be none|auto|required or a function object, got {tool_choice!r}")
        if tool_choice == "required" and not names:
            raise InvalidRequestError("tool_choice 'required' needs a non-empty 'tools' list")
        if tool_choice == "required" and len(names) == 1:
            return ToolChoice("required", next(iter(names)))  # one tool: a call means calling it
        return ToolChoice(tool_choice if names else "none")
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type", "function") != "function" or not isinstance(name, str) or not name:
            raise InvalidRequestError("tool_choice object must be {\"type\": \"function\", \"function\": {\"name\": ...}}")
        if name not in names:
            raise InvalidRequestError(f"tool_choice names function {name!r}, which is not in 'tools' {sorted(names)}")
        return ToolChoice("required", name)
    raise InvalidRequestError("tool_choice must be a string or an object")


def tool_names(tools: list[dict] | None) -> set[str]:
    return {t["function"]["name"] for t in tools or () if isinstance(t, dict) and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str)}


def tool_choice_prefill(choice: ToolChoice) -> str:
    """Text appended after the generation prompt to force a call (empty for none/auto)."""
    if choice.mode != "required":
        return ""
    if choice.name is not None:
        return TOOL_CALL_OPEN + "\n" + '{"name": ' + json.dumps(choice.name, ensure_ascii=False) + ', "arguments": '
    return TOOL_CALL_OPEN + '\n{"name": "'


# ============================================================================ parsing
@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON text (as OpenAI sends it), or the model's raw text when it wrote no JSON
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def as_openai(self, index: int | None = None) -> dict:
        d: dict[str, Any] = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d = {"index": index, **d}
        return d


_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)


def _json_prefix(text: str) -> tuple[Any, str] | None:
    """Decode one JSON value at the start of ``text``; returns (value, rest) or None."""
    text = text.lstrip()
    if not text or text[0] not in "{[":
        return None
    try:
        value, end = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return None
    return value, text[end:]


def _args_text(args: Any) -> str:
    if isinstance(args, str):
        return args
    return json.dumps(args, ensure_ascii=False)


def _calls_from_value(value: Any, names: set[str] | None) -> list[ToolCall] | None:
    """A dict or list of dicts with name + arguments/parameters -> calls; None when it isn't one."""
    items = value if isinstance(value, list) else [value]
    if not items:
        return None
    calls = []
    for it in items:
        if not isinstance(it, dict):
            return None
        if isinstance(it.get("function"), dict) and "name" not in it:  # {"type": "function", "function": {...}}
            it = it["function"]
        name = it.get("name")
        args = it.get("arguments", it.get("parameters", None))
        if not isinstance(name, str) or not name or (names is not None and name not in names):
            return None
        if args is None:
            args = {}
        if not isinstance(args, (dict, str)):
            return None
        calls.append(ToolCall(name, _args_text(args)))
    return calls


def _call_json_then_close(text: str, start: int, names: set[str] | None) -> tuple[list[ToolCall] | None, int]:
    """The call whose JSON starts at ``text[start:]`` (after ``<tool_call>``), read as JSON first, so a
    ``</tool_call>`` inside one of its strings (a name the model invented) does not cut it; the JSON
    must be followed by the closing tag or by the end of the text. Returns (calls, end) or (None, start)."""
    got = _json_prefix(text[start:])
    if got is None:
        return None, start
    after = got[1].lstrip()
    if after and not after.startswith(TOOL_CALL_CLOSE):
        return None, start
    found = _calls_from_value(got[0], names)
    if not found:
        return None, start
    return found, len(text) - len(after) + (len(TOOL_CALL_CLOSE) if after else 0)


def parse_tool_calls(text: str, names: set[str] | None = None) -> tuple[str, list[ToolCall]]:
    """Split model output into (content, tool calls). ``names``: the known function names (calls to
    other names are left as content). Text that is not a recognisable call stays content."""
    if TOOL_CALL_OPEN in text:
        content_parts: list[str] = []
        unparsed: list[int] = []  # indices of the parts that are tool-call blocks with no call in them
        calls: list[ToolCall] = []
        pos = 0
        while True:
            i = text.find(TOOL_CALL_OPEN, pos)
            if i < 0:
                content_parts.append(text[pos:])
                break
            content_parts.append(text[pos:i])
            found, end = _call_json_then_close(text, i + len(TOOL_CALL_OPEN), names)
            if found is None:
                j = text.find(TOOL_CALL_CLOSE, i)
                body = text[i + len(TOOL_CALL_OPEN): j if j >= 0 else len(text)]
                end = j + len(TOOL_CALL_CLOSE) if j >= 0 else len(text)
                got = _json_prefix(body)
                found = _calls_from_value(got[0], names) if got is not None else None  # junk after the JSON too
            if found:
                calls.extend(found)
            else:
                unparsed.append(len(content_parts))
                content_parts.append(text[i:end])
            pos = end
        if not calls:
            return "".join(content_parts), calls
        # beside real calls, a block that is no call (one cut short by max_tokens) and the start of
        # a tag the output ended in are markup, not content
        content = "".join(p for k, p in enumerate(content_parts) if k not in unparsed).strip()
        return content[:len(content) - _partial_suffix(content, TOOL_CALL_OPEN)].rstrip(), calls
    stripped = text.strip()
    m = _FENCE.match(stripped)
    candidate = m.group(1) if m else stripped
    got = _json_prefix(candidate)
    if got is not None and not got[1].strip():
        found = _calls_from_value(got[0], names)
        if found:
            return "", found
    return text, []


def json_key(text: str) -> str:
    """``text`` as a comparable key: a JSON text in one canonical form (keys sorted, no layout), any
    other text as it is."""
    try:
        return json.dumps(json.loads(text), sort_keys=True)
    except ValueError:
        return text


def distinct_calls(calls: list[ToolCall]) -> list[ToolCall]:
    """``calls`` without repeats: a call with the same name and the same arguments (as JSON values)
    as an earlier one is dropped (a model forced to call often writes its call twice)."""
    seen: set[tuple[str, str]] = set()
    out = []
    for c in calls:
        key = (c.name, json_key(c.arguments))
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def forced_call_fallback(name: str, generated: str) -> ToolCall:
    """tool_choice named a function but the output is not a parsable call: the arguments are the
    JSON object the model started with, else its raw text (OpenAI's own caveat: arguments may be
    invalid JSON)."""
    raw = generated.split(TOOL_CALL_CLOSE, 1)[0].strip()
    got = _json_prefix(raw)
    if got is not None and isinstance(got[0], dict):
        return ToolCall(name, json.dumps(got[0], ensure_ascii=False))
    if raw.endswith("}"):
        raw = raw[:-1].rstrip()
    return ToolCall(name, raw)


def resolve_tool_output(text: str, prefill: str, choice: ToolChoice, names: set[str]) -> tuple[str, list[ToolCall]]:
    """Content and calls of a finished chat completion (``text`` is what the model generated after
    ``prefill``)."""
    if choice.mode == "none":
        return text, []
    content, calls = parse_tool_calls(prefill + text, names)
    if calls:
        return content, calls
    if choice.name is not None:
        return "", [forced_call_fallback(choice.name, text)]
    return text, []


# ============================================================================ streaming
class ToolStreamFilter:
    """Content deltas pass through; tool-call text is held back and parsed at the end.

    ``feed(text)`` returns the content to send now; ``finish()`` returns (content still to send,
    calls). Output that starts with ``{``, ``[`` or a code fence is held until the end (it may be a
    bare JSON call); ``<tool_call>`` anywhere starts holding; a partial ``<tool_call>`` at the end
    of a delta is held until the next one decides.
    """

    def __init__(self, choice: ToolChoice, names: set[str], prefill: str = ""):
        self.choice, self.names, self.prefill = choice, names, prefill
        self.generated = ""
        self.sent = 0  # chars of `generated` already sent as content
        self.mode = "hold" if prefill else ("pass" if choice.mode == "none" else "start")

    def feed(self, text: str) -> str:
        self.generated += text
        if self.mode == "pass":
            return self._send(len(self.generated))
        if self.mode == "hold":
            return ""
        if self.mode == "start":
            s = self.generated.lstrip()
            if not s:
                return ""
            if s[0] in "{[`":
                self.mode = "hold"
                return ""
            self.mode = "content"
        i = self.generated.find(TOOL_CALL_OPEN, self.sent)
        if i >= 0:
            self.mode = "hold"
            return self._send(i)
        keep = _partial_suffix(self.generated, TOOL_CALL_OPEN)
        return self._send(len(self.generated) - keep)

    def _send(self, upto: int) -> str:
        out = self.generated[self.sent:upto]
        self.sent = max(self.sent, upto)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        if self.mode in ("pass", "content", "start"):
            return self._send(len(self.generated)), []
        rest = self.generated[self.sent:]
        if self.prefill:
            content, calls = resolve_tool_output(rest, self.prefill, self.choice, self.names)
        else:
            content, calls = parse_tool_calls(rest, self.names)
        self.sent = len(self.generated)
        return content, calls


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
