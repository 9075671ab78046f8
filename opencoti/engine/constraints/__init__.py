"""Grammar-constrained decoding: JSON Schema, GBNF / Lark grammars, regexes and tool calls.

Built on llguidance (a Rust library with Python bindings and no Python dependencies): a grammar
compiles lazily in about a millisecond and the token mask of one step costs tens of
microseconds on a 49k vocabulary, so masks are computed per step, only for constrained rows.

* ``ConstraintSpec``: what a request is constrained to. Validated on construction (the grammar is
  compiled without a tokenizer), so a bad schema / grammar / regex is an ``InvalidRequestError``
  that names the problem, raised before the engine accepts the request.
* ``Constraint``: the per-request runtime state (an llguidance matcher over the model's
  tokenizer). ``prefix`` is text already forced into the output (e.g. a tool-call prefill), fed
  to the matcher first; ``trigger`` makes the constraint lazy: the output is free until the
  trigger text appears, and from the trigger on it must match the grammar (tool_choice=auto).
* ``compute_masks`` / ``apply_masks`` (``llg.py``, with loading llguidance and the tokenizer
  bridge ``llg_tokenizer``): one batched mask computation per step (llguidance's executor, which
  releases the GIL) and the in-place masking of the logit rows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Sequence

from .close import CLOSE_HORIZON, CloseWatch
from .llg import apply_masks, compute_masks, llg_tokenizer, load_llguidance
from .sat import check_satisfiable
from ..checks import check_schema_depth, schema_too_deep
from ..config import OutputConstraint
from ..errors import InvalidRequestError
from ..chat.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, json_key  # noqa: F401 - re-exported

__all__ = ["ConstraintSpec", "Constraint", "compute_masks", "apply_masks", "JSON_OPTIONS", "llg_tokenizer"]

# JSON layout the constraint allows: the separators models write by habit (json.dumps style) and
# no free whitespace, so a small model cannot wander off into endless newlines.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_KINDS = ("json_schema", "json_object", "grammar", "regex", "tool_calls")
_MAX_SOURCE_CHARS = 1 << 20


def validate_grammar(grammar: str, what: str) -> None:
    llg = load_llguidance()
    try:
        msg = llg.LLMatcher.validate_grammar(grammar)
    except (ValueError, TypeError, RuntimeError) as exc:  # API-level rejection of the input
        raise InvalidRequestError(f"invalid {what}: {exc}") from None
    if msg:
        raise InvalidRequestError(f"invalid {what}: {msg.strip()}")


def schema_dict(schema: Any, what: str) -> dict | bool:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise InvalidRequestError(f"{what} is not valid JSON: {exc}") from None
        except RecursionError:  # (nested far deeper than the limit)
            raise schema_too_deep(what) from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError(f"{what} must be a JSON object, got {type(schema).__name__}")
    check_schema_depth(schema, what)  # before anything walks it (every walk recurses once per level)
    try:
        text = json.dumps(schema)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"{what} is not JSON-serializable: {exc}") from None
    if len(text) > _MAX_SOURCE_CHARS:
        raise InvalidRequestError(f"{what} is too large ({len(text)} characters, at most {_MAX_SOURCE_CHARS})")
    return schema


def with_json_options(schema: dict | bool) -> dict:
    """The schema with our JSON layout options (the schema's own x-guidance options win)."""
    if schema is True:
        schema = {}
    if schema is False:
        schema = {"not": {}}
    given = schema.get("x-guidance")
    own = given if isinstance(given, dict) else {}
    return {**schema, "x-guidance": {**JSON_OPTIONS, **own}}


_LITERAL_KEYS = ("const", "enum", "default", "examples")
_NAMED_KEYS = ("properties", "$defs", "definitions", "patternProperties")  # maps of names to schemas


def _reroot(schema: Any, base: str) -> Any:
    """``schema`` with its local ``$ref``s (``#/...``) rewritten for its new place ``base`` inside
    a larger schema (a tool's ``$defs`` stay where they are, under the tool's arguments)."""
    if isinstance(schema, dict):
        return {k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
                    else v if k in _LITERAL_KEYS else _reroot(v, base)) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_reroot(v, base) for v in schema]
    return schema


def _tool_call_schema(tools: Sequence[dict], name: str | None) -> dict:
    """anyOf over the allowed tools: {"name": <const>, "arguments": <the tool's parameters>}."""
    chosen = []
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequestError("each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}")
        if name is not None and fn["name"] != name:
            continue
        params = fn.get("parameters")
        params = {"type": "object"} if params is None else schema_dict(params, f"tool {fn['name']!r} parameters")
        # arguments follow the schema: an object that lists its properties and says nothing about
        # others gets no invented keys (an explicit additionalProperties is kept)
        params = _closed_objects(params, explicit=False)
        what = f"JSON schema for the parameters of tool {fn['name']!r}"
        check_satisfiable(params, what)
        validate_grammar(load_llguidance().LLMatcher.grammar_from_json_schema(with_json_options(params)), what)
        chosen.append((fn["name"], params))
    if not chosen:
        raise InvalidRequestError(f"tool_choice names {name!r}, which is not one of the tools")
    options = []
    for k, (fname, params) in enumerate(chosen):
        base = f"#/anyOf/{k}/properties/arguments" if len(chosen) > 1 else "#/properties/arguments"
        options.append({"type": "object", "properties": {"name": {"const": fname}, "arguments": _reroot(params, base)},
                        "required": ["name", "arguments"], "additionalProperties": False})
    return {"anyOf": options} if len(options) > 1 else options[0]


def tool_calls_lark(tools: Sequence[dict], name: str | None = None, parallel: bool = True) -> str:
    """Lark grammar of one (or, with ``parallel``, several) Hermes-style tool calls:
    ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""
    schema = with_json_options(_tool_call_schema(tools, name))
    block = "block: " + json.dumps(TOOL_CALL_OPEN + "\n") + " call " + json.dumps("\n" + TOOL_CALL_CLOSE)
    start = 'start: block ("\\n" block)*' if parallel else "start: block"
    return "\n".join([start, block, "call: %json " + json.dumps(schema)])


@dataclass(frozen=True)
class ConstraintSpec(OutputConstraint):
    """What a request's output must match (see the module docstring).

    kind: json_schema | json_object | grammar (llama.cpp GBNF or llguidance Lark) | regex | tool_calls
    source: the schema (dict or JSON text), the grammar / regex text, or for tool_calls a dict
        {"tools": [...], "name": str | None, "parallel": bool}.
    prefix: output text already forced (e.g. a tool-call prefill): fed to the grammar first.
    trigger: lazy constraint: free text until ``trigger`` appears in the output; the grammar
        applies from the trigger's first character on.
    """

    kind: str
    source: Any = None
    prefix: str = ""
    trigger: str | None = None
    grammar: str = field(default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise InvalidRequestError(f"constraint kind must be one of {'|'.join(_KINDS)}, got {self.kind!r}")
        if not isinstance(self.prefix, str) or (self.trigger is not None and (not isinstance(self.trigger, str)
                                                                               or not self.trigger)):
            raise InvalidRequestError("constraint prefix must be a string and trigger a non-empty string")
        if self.grammar:
            return  # copied from a validated spec
        llg = load_llguidance()
        if self.kind == "json_schema":
            schema = schema_dict(self.source, "JSON schema")
            check_satisfiable(schema, "JSON schema")
            grammar = llg.LLMatcher.grammar_from_json_schema(with_json_options(schema))
            what = "JSON schema"
        elif self.kind == "json_object":
            grammar = llg.LLMatcher.grammar_from_json_schema(with_json_options({"type": "object"}))
            what = "JSON object constraint"
        elif self.kind == "regex":
            if not isinstance(self.source, str) or not self.source:
                raise InvalidRequestError("regex must be a non-empty string")
            grammar, what = llg.LLMatcher.grammar_from_regex(self.source), "regex"
        elif self.kind == "grammar":
            grammar, what = _grammar_text(self.source), "grammar"
        else:
            src = self.source if isinstance(self.source, dict) else {}
            tools = src.get("tools")
            if not isinstance(tools, (list, tuple)) or not tools:
                raise InvalidRequestError("a tool-call constraint needs a non-empty list of tools")
            lark = tool_calls_lark(tools, src.get("name"), bool(src.get("parallel", True)))
            grammar, what = llg.LLMatcher.grammar_from_lark(lark), "tool-call grammar"
        validate_grammar(grammar, what)
        object.__setattr__(self, "grammar", grammar)

    # ---- constructors
    @classmethod
    def json_schema(cls, schema: Any, **kw) -> "ConstraintSpec":
        return cls("json_schema", schema, **kw)

    @classmethod
    def json_object(cls, **kw) -> "ConstraintSpec":
        return cls("json_object", None, **kw)

    @classmethod
    def gbnf(cls, text: str, **kw) -> "ConstraintSpec":
        return cls("grammar", text, **kw)

    @classmethod
    def regex(cls, pattern: str, **kw) -> "ConstraintSpec":
        return cls("regex", pattern, **kw)

    @classmethod
    def tool_calls(cls, tools: Sequence[dict], name: str | None = None, parallel: bool = True,
                   lazy: bool = False, prefix: str = "") -> "ConstraintSpec":
        """Tool calls in the Hermes form; ``lazy``: the model may answer in text, and once it opens
        a ``<tool_call>`` the call is constrained (tool_choice=auto)."""
        return cls("tool_calls", {"tools": list(tools), "name": name, "parallel": parallel}, prefix=prefix,
                   trigger=TOOL_CALL_OPEN if lazy else None)


def _closed_objects(schema: Any, explicit: bool = True) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that allows any key
    (``explicit`` False: only on objects that list ``properties`` and do not set it)."""
    if isinstance(schema, list):
        return [_closed_objects(v, explicit) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in _LITERAL_KEYS else
               {n: _closed_objects(sub, explicit) for n, sub in v.items()} if k in _NAMED_KEYS and isinstance(v, dict)
               else _closed_objects(v, explicit)) for k, v in schema.items()}
    given = out.get("type")
    types = given if isinstance(given, list) else [given]
    if explicit:
        close = ("object" in types or "properties" in out) and out.get("additionalProperties", True) is True
    else:
        close = "properties" in out and "additionalProperties" not in out and "patternProperties" not in out
    if close:
        out["additionalProperties"] = False
    return out


def closing_grammar(spec: ConstraintSpec) -> str | None:
    """The grammar of ``spec`` with every object closed (a subset of its language: what the
    closing search of constraints/close.py follows), or None when there is none (grammars,
    regexes, any JSON object). Cached on the spec."""
    cached = spec.__dict__.get("_closing", ())
    if cached != ():
        return cached
    grammar = None
    try:
        if spec.kind == "json_schema":
            schema = _closed_objects(schema_dict(spec.source, "JSON schema"))
            grammar = load_llguidance().LLMatcher.grammar_from_json_schema(with_json_options(schema))
        elif spec.kind == "tool_calls":
            src = spec.source
            tools = [{**t, "function": {**t["function"], "parameters": _closed_objects(
                t["function"].get("parameters") or {"type": "object"})}} for t in src["tools"]]
            grammar = load_llguidance().LLMatcher.grammar_from_lark(
                tool_calls_lark(tools, src.get("name"), bool(src.get("parallel", True))))
        if grammar is not None and load_llguidance().LLMatcher.validate_grammar(grammar):
            grammar = None  # the closed variant does not compile: search with the request's own grammar
    except (InvalidRequestError, ValueError, TypeError, KeyError, RuntimeError):
        grammar = None
    object.__setattr__(spec, "_closing", grammar)
    return grammar


def _grammar_text(source: Any) -> str:
    if not isinstance(source, str) or not source.strip():
        raise InvalidRequestError("grammar must be a non-empty string")
    if len(source) > _MAX_SOURCE_CHARS:
        raise InvalidRequestError(f"grammar is too large ({len(source)} characters, at most {_MAX_SOURCE_CHARS})")
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        lark = any_to_lark(source)  # GBNF (llama.cpp) is converted; Lark passes through
    except Exception as exc:  # noqa: BLE001 - the converter raises plain Exception on bad GBNF
        raise InvalidRequestError(f"invalid grammar: {exc}") from None
    return load_llguidance().LLMatcher.grammar_from_lark(lark)


# ============================================================================ runtime
class Constraint:
    """One request's matcher. ``mask`` holds the next-token bitmask once computed (``mask_ready``)."""

    __slots__ = ("spec", "lt", "matcher", "dead", "_tail", "mask", "mask_ready", "close", "_out", "_shadow",
                 "_calls_seen")

    def __init__(self, spec: ConstraintSpec, lt: Any):
        import torch  # imported on use: the request side (ConstraintSpec) is imported by clients
        self.spec = spec
        self.lt = lt
        self.matcher: Any = None  # llguidance's LLMatcher once started (llguidance is loaded on first use)
        self.dead = False  # gave up (a lazy trigger followed by text the grammar rejects)
        self._tail = bytearray()
        self.mask = torch.empty((lt.vocab_size + 31) // 32, dtype=torch.int32)
        self.mask_ready = False
        self.close = CloseWatch()  # the closing way within the token budget (constraints/close.py)
        self._out = bytearray()  # what the matcher has consumed (replayed by the closing search)
        self._shadow: Any = None  # the closed-objects matcher of the closing search (None: not built)
        self._calls_seen = 0  # tool-call blocks of the output already compared with the earlier ones
        if spec.trigger is None:
            if not self._start(spec.prefix.encode()):
                raise InvalidRequestError(f"the forced output prefix {spec.prefix!r} does not match the constraint")

    def _start(self, text: bytes) -> bool:
        m = load_llguidance().LLMatcher(self.lt, self.spec.grammar, log_level=0)
        if m.is_error():
            raise InvalidRequestError(f"invalid constraint: {m.get_error()}")
        if text and not m.consume_tokens(self.lt.tokenize_bytes(text)):
            return False
        self.matcher = m
        self._out = bytearray(text)
        return True

    @property
    def active(self) -> bool:
        """Whether the next token is constrained."""
        return self.matcher is not None and not self.dead

    def budget(self, remaining: int | None) -> None:
        """Before a step, with ``remaining`` tokens left (None: no budget). Tool calls: a complete
        output ends when its last call repeats an earlier one, or when fewer tokens are left than
        its last call took (another call would be cut and finished by the closing way with
        invented values); either ends it as the model would, its calls whole. Any constraint:
        force the next token of the closing way when it is time to finish the document (see
        constraints/close.py)."""
        if not self.active:
            return
        if self.spec.kind == "tool_calls" and self.matcher.is_accepting():
            blocks = self._call_blocks()
            if blocks and (self._repeated_call(blocks) or (remaining is not None and self._no_room(blocks, remaining))):
                self._force(self.lt.eos_token)
                return
        if remaining is None:
            return
        token = self.close.check(self._closing_matcher, self.lt, remaining)
        if token is not None:
            self._force(token)

    def _force(self, token: int) -> None:
        self.mask.zero_()
        bit = 1 << (token & 31)
        self.mask[token >> 5] = bit - (1 << 32) if bit >= 1 << 31 else bit
        self.mask_ready = True

    def _call_blocks(self) -> list[str]:
        """The bodies of the output's tool calls (the output stands after a complete call)."""
        text = bytes(self._out).decode("utf-8", "replace")
        return [b.rsplit(TOOL_CALL_CLOSE, 1)[0] for b in text.split(TOOL_CALL_OPEN)[1:]]

    def _repeated_call(self, blocks: list[str]) -> bool:
        """Whether the last call has the name and the arguments of an earlier one: a model forced
        to call tends to write its call again and again, each copy dropped by the parser (checked
        once per call)."""
        if len(blocks) <= self._calls_seen:
            return False
        self._calls_seen = len(blocks)
        *earlier, last = [json_key(b.strip()) for b in blocks]
        return last in earlier

    def _no_room(self, blocks: list[str], remaining: int) -> bool:
        """Fewer tokens left than a call like the last one takes (checked in the last
        CLOSE_HORIZON tokens only)."""
        if remaining > CLOSE_HORIZON:
            return False
        need = len(self.lt.tokenize_bytes(f"\n{TOOL_CALL_OPEN}{blocks[-1]}{TOOL_CALL_CLOSE}".encode()))
        return remaining < need

    def _closing_matcher(self) -> Any:
        """The matcher the closing search starts from: for a JSON schema (or tool calls) the same
        output under the schema with every object closed (``additionalProperties: false``), so
        the search writes the missing required keys instead of inventing new ones; the request's
        own matcher when there is no such variant or the output already uses an extra key."""
        if self._shadow is None:
            self._shadow = False
            grammar = closing_grammar(self.spec)
            if grammar is not None:
                m = load_llguidance().LLMatcher(self.lt, grammar, log_level=0)
                if not m.is_error() and m.consume_tokens(self.lt.tokenize_bytes(bytes(self._out))):
                    self._shadow = m
        return self._shadow or self.matcher

    @property
    def closed_by_budget(self) -> bool:
        return self.close.engaged

    def advance(self, token: int) -> None:
        """The sampled token (after the mask was applied, or a free one before a lazy trigger)."""
        self.mask_ready = False
        if self.dead:
            return
        self.close.advance(token)
        if self.matcher is not None:
            if not self.matcher.consume_token(token):
                self.dead = True  # only reachable if the token bypassed the mask (e.g. forced)
            self._out += self.lt.decode_bytes([token])
            if self._shadow and not self._shadow.consume_token(token):
                self._shadow = False  # the output left the closed-objects variant (an extra key)
            return
        self._tail += self.lt.decode_bytes([token])
        trigger = self.spec.trigger
        assert trigger is not None  # only a lazy constraint waits for its trigger
        trig = trigger.encode()
        i = self._tail.find(trig)
        if i < 0:
            del self._tail[:max(0, len(self._tail) - len(trig) + 1)]
            return
        if not self._start(bytes(self._tail[i:])):
            self.dead = True
        self._tail = bytearray()

    @property
    def finished(self) -> bool:
        return self.matcher is not None and self.matcher.is_stopped()
