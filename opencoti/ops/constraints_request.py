"""Request vocabulary -> sampler settings: the OpenAI and llama.cpp fields that constrain or bias
sampling, turned into ``ConstraintSpec`` / ``logit_bias`` / penalty keyword arguments.

Used by the generation operations (HTTP routes and the in-process client alike):

* ``constraint_from_request``: OpenAI ``response_format`` (``json_object``, ``json_schema``; with
  ``strict: true`` the schema must follow OpenAI's strict mode, ``engine.constraints.strict``, as
  must the parameters of a tool function with ``strict: true``),
  llama.cpp ``json_schema`` / ``grammar`` / ``response_format`` (``{"type": "json_object",
  "schema": ...}``), and the tool-call constraint of ``tool_choice``. At most one output
  constraint per request; tools in ``auto`` mode combine with a JSON response format (the answer
  is either a tool call or the JSON document).
* ``logit_bias_from_request``: OpenAI ``{"<token id>": bias}`` and llama.cpp ``[[id, bias]]`` /
  ``[["text", bias]]`` / ``{"text": bias}`` forms; ``false`` bans a token; a string applies to
  every token of its tokenization (llama.cpp).
* ``penalty_kwargs``: repeat / presence / frequency penalties with the route's semantics.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable, Sequence

from ..engine.constraints import (ConstraintSpec, load_llguidance, schema_dict, tool_calls_lark, validate_grammar,
                                 with_json_options)
from ..engine.constraints.sat import check_satisfiable
from ..engine.constraints.strict import check_strict_schema
from ..engine.errors import InvalidRequestError

__all__ = ["check_strict_tools", "constraint_from_request", "logit_bias_from_request", "penalty_kwargs",
           "tool_constraint"]

_OPENAI_BIAS_RANGE = 100.0


def _response_format_schema(rf: Any) -> tuple[str, Any]:
    """('text' | 'json_object' | 'json_schema', schema or None) of a response_format object."""
    if not isinstance(rf, dict):
        raise InvalidRequestError("response_format must be an object like {\"type\": \"json_object\"}")
    kind = rf.get("type", "text")
    if kind == "text":
        return "text", None
    if kind == "json_object":
        # llama.cpp accepts {"type": "json_object", "schema": {...}}
        schema = rf.get("schema")
        return ("json_schema", schema) if schema is not None else ("json_object", None)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if isinstance(js, dict) and js.get("strict") is not None:
            if not isinstance(js["strict"], bool):
                raise InvalidRequestError(f"response_format.json_schema.strict must be a boolean, got {js['strict']!r}")
            if js["strict"]:  # OpenAI's structured outputs: the schema must follow strict mode's rules
                if "schema" not in js:
                    raise InvalidRequestError("response_format.json_schema.strict needs a schema")
                name = js.get("name") if isinstance(js.get("name"), str) else "json_schema"
                check_strict_schema(schema_dict(js["schema"], "JSON schema"), f"response_format {name!r}")
        if isinstance(js, dict) and "schema" in js:
            return "json_schema", js["schema"]
        if isinstance(rf.get("schema"), (dict, bool)):  # llama.cpp's flat form
            return "json_schema", rf["schema"]
        if isinstance(js, dict) and js.get("name") and "schema" not in js:
            return "json_object", None  # OpenAI: a named format without a schema is any JSON object
        raise InvalidRequestError("response_format json_schema needs {\"json_schema\": {\"name\": ..., "
                                  "\"schema\": {...}}}")
    raise InvalidRequestError(f"response_format type must be text|json_object|json_schema, got {kind!r}")


def tool_constraint(choice_mode: str, tool_name: str | None, tools: Sequence[dict] | None, prefill: str = "",
                    parallel: bool = True) -> ConstraintSpec | None:
    """The tool-call constraint of a parsed tool_choice: required / named -> the whole output is
    calls (after ``prefill``, the forced start); auto -> lazy (free text until ``<tool_call>``)."""
    if not tools or choice_mode == "none":
        return None
    if choice_mode == "required":
        return ConstraintSpec.tool_calls(tools, name=tool_name, parallel=parallel, prefix=prefill)
    return ConstraintSpec.tool_calls(tools, parallel=parallel, lazy=True)


def constraint_from_request(*, response_format: Any = None, json_schema: Any = None, grammar: Any = None,
                            tool_mode: str = "none", tool_name: str | None = None, tools: Sequence[dict] | None = None,
                            prefill: str = "", parallel_tool_calls: bool = True) -> ConstraintSpec | None:
    """The one output constraint of a request (None: unconstrained). Raises InvalidRequestError
    for contradictions and for an invalid schema / grammar (the message names the problem)."""
    check_strict_tools(tools)
    given = [name for name, v in (("response_format", response_format), ("json_schema", json_schema),
                                  ("grammar", grammar)) if v is not None]
    kind, source = "text", None
    if response_format is not None:
        kind, source = _response_format_schema(response_format)
        if kind == "text":
            given.remove("response_format")
    if len(given) > 1:
        raise InvalidRequestError(f"give at most one of response_format, json_schema and grammar (got {', '.join(given)})")
    if json_schema is not None:
        kind, source = "json_schema", json_schema
    if grammar is not None:
        if not isinstance(grammar, str):
            raise InvalidRequestError("grammar must be a string (llama.cpp GBNF or Lark)")
        kind, source = "grammar", grammar
    tools_on = bool(tools) and tool_mode in ("auto", "required")
    if tools_on and tool_mode == "required":
        return tool_constraint(tool_mode, tool_name, tools, prefill, parallel_tool_calls)
    if kind == "text":
        return tool_constraint(tool_mode, tool_name, tools, prefill, parallel_tool_calls) if tools_on else None
    if tools_on:
        if kind == "grammar":
            raise InvalidRequestError("a grammar cannot be combined with tools; use tool_choice \"none\" or drop the grammar")
        return _calls_or_json(tools, parallel_tool_calls, source if kind == "json_schema" else {"type": "object"})
    if kind == "json_schema":
        return ConstraintSpec.json_schema(source)
    if kind == "json_object":
        return ConstraintSpec.json_object()
    return ConstraintSpec.gbnf(source)


def check_strict_tools(tools: Sequence[dict] | None) -> None:
    """Tools whose function sets ``"strict": true``: their parameters must follow OpenAI's strict
    mode (whatever tool_choice is: OpenAI checks the schema with the request)."""
    for t in tools or ():
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or fn.get("strict") is None:
            continue
        if not isinstance(fn["strict"], bool):
            raise InvalidRequestError(f"function {fn.get('name')!r}: strict must be a boolean, got {fn['strict']!r}")
        if fn["strict"]:
            params = fn.get("parameters")
            params = {"type": "object", "properties": {}, "required": [], "additionalProperties": False} \
                if params is None else schema_dict(params, f"tool {fn.get('name')!r} parameters")
            check_strict_schema(params, f"function {fn.get('name')!r}")


def _calls_or_json(tools: Sequence[dict], parallel: bool, schema: Any) -> ConstraintSpec:
    """tool_choice=auto with a JSON response format: one or more tool calls, or the JSON answer."""
    schema = schema_dict(schema, "JSON schema")
    check_satisfiable(schema, "JSON schema")
    validate_grammar(load_llguidance().LLMatcher.grammar_from_json_schema(with_json_options(schema)), "JSON schema")
    calls = tool_calls_lark(tools, None, parallel).replace("start:", "calls:", 1)
    lark = "start: calls | answer\n" + calls + "\nanswer: %json " + json.dumps(with_json_options(schema))
    return ConstraintSpec.gbnf(lark)


def logit_bias_from_request(value: Any, tokenize: Callable[[str], list[int]], openai: bool = False) -> dict[int, float]:
    """Normalize a request's logit_bias to {token id: bias} (-inf = banned).

    openai: OpenAI's form: an object keyed by token ids (text keys and the list form are
        llama.cpp's), biases in [-100, 100]; llama.cpp accepts any number.
    Biases given twice for a token add up (as the logits would).
    """
    if value is None:
        return {}
    if openai and not isinstance(value, dict):
        raise InvalidRequestError("logit_bias must be an object mapping token ids to biases, like {\"50256\": -100}")
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list):
        items = []
        for el in value:
            if not isinstance(el, (list, tuple)) or len(el) != 2:
                raise InvalidRequestError("logit_bias as a list must hold [token, bias] pairs")
            items.append((el[0], el[1]))
    else:
        raise InvalidRequestError("logit_bias must be an object {token: bias} or a list of [token, bias] pairs")
    out: dict[int, float] = {}
    for key, bias in items:
        if bias is False:
            b = -math.inf
        elif isinstance(bias, (int, float)) and not isinstance(bias, bool) and math.isfinite(bias):
            b = float(bias)
            if openai and abs(b) > _OPENAI_BIAS_RANGE:
                raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {bias!r} for {key!r}")
        else:
            raise InvalidRequestError(f"logit_bias for {key!r} must be a number or false (ban), got {bias!r}")
        if isinstance(key, int) and not isinstance(key, bool):
            ids = [key]
        elif isinstance(key, str) and key.strip().lstrip("-").isdigit():
            ids = [int(key)]
        elif openai:  # OpenAI's form: token ids only (a text key is llama.cpp's, on /completion)
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r} (text keys are accepted "
                                      "by /completion)")
        elif isinstance(key, str) and key:
            ids = tokenize(key)  # llama.cpp: a string biases every token of its tokenization
        else:
            raise InvalidRequestError(f"logit_bias keys must be token ids or non-empty strings, got {key!r}")
        for t in ids:
            if t < 0:
                raise InvalidRequestError(f"logit_bias token id {t} is negative")
            prev = out.get(t, 0.0)
            out[t] = -math.inf if -math.inf in (b, prev) else prev + b
    return out


def penalty_kwargs(*, repeat_penalty=None, repeat_last_n=None, presence_penalty=None, frequency_penalty=None,
                   openai: bool = False) -> dict:
    """SamplingParams keyword arguments for the penalties a request sets.

    llama.cpp (``/completion``): the last ``repeat_last_n`` (default 64) tokens of prompt + output.
    OpenAI routes: presence / frequency count the generated tokens only, all of them (OpenAI's
    definition), unless ``repeat_last_n`` bounds the window; presence / frequency in [-2, 2].
    """
    kw: dict[str, Any] = {}
    for name, v in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if v is None:
            continue
        if openai and isinstance(v, (int, float)) and not -2 <= v <= 2:
            raise InvalidRequestError(f"{name} must be in [-2, 2], got {v!r}")
        kw[name] = v
    if repeat_penalty is not None:
        kw["repeat_penalty"] = repeat_penalty
    if repeat_last_n is not None:
        kw["repeat_last_n"] = repeat_last_n
    if openai:
        kw["penalty_scope"] = "output"
        kw.setdefault("repeat_last_n", -1)
    return kw
