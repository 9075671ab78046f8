"""Operation inputs (pydantic, strict: a wrong JSON type is a 400, never coerced): request bodies
and query parameters, validated the same way whether they come over HTTP or in-process.

Unknown fields are ignored (OpenAI and llama.cpp clients send fields we don't use), except in
the control-plane bodies, where a misspelt field would silently change nothing and is rejected.
Every generation body accepts the PolyKV fields ``pool_id``, ``session_id``,
``shared_prefix_n_tokens`` and ``overcommit``.
"""

from __future__ import annotations

import contextvars
import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from ..engine.admission.policy import RANGES as ADMISSION_RANGES
from ..engine.chat import MESSAGE_SCHEMA, TOOL_CHOICE_SCHEMA, TOOL_SCHEMA, TOOLS_NEEDED
from ..engine.config import MAX_STOP_STRINGS as ENGINE_MAX_STOP_STRINGS

# Size limits of the strings the server keeps or echoes (ids, labels, stop strings)
MAX_ID_CHARS = 128
MAX_LABEL_CHARS = 256
MAX_STOP_STRINGS = ENGINE_MAX_STOP_STRINGS
MAX_STOP_CHARS = 1024

Stop = Annotated[str, Field(max_length=MAX_STOP_CHARS, json_schema_extra={"minLength": 1})]  # "" is refused
StopField = Union[Stop, Annotated[list[Stop], Field(max_length=MAX_STOP_STRINGS)], None]
# long lists fail fast: validation stops at a list's first bad element (pydantic would otherwise
# report every element that does not fit each branch of a union: millions of errors for one body)
_FAIL_FAST = Field(fail_fast=True)
# a token id: the OpenAPI document bounds it by the served model's vocabulary (server/openapi.py
# fills "maximum" where "x-token-id" is); an id outside it is a 400
TOKEN_ID_SCHEMA = {"minimum": 0, "x-token-id": True}
TokenIds = Annotated[list[Annotated[int, Field(json_schema_extra=TOKEN_ID_SCHEMA)]], _FAIL_FAST]
Strings = Annotated[list[str], _FAIL_FAST]
PromptField = Union[str, TokenIds, Strings, Annotated[list[TokenIds], _FAIL_FAST]]
# llama.cpp: token ids and texts in one sequence, one prompt (the texts tokenized where they stand)
# (strict: true or 1.5 beside a text is no token id)
MixedPrompt = Annotated[list[Union[Annotated[int, Field(strict=True, json_schema_extra=TOKEN_ID_SCHEMA)],
                                   Annotated[str, Field(strict=True, min_length=1)]]], _FAIL_FAST]
LlamaPrompts = Annotated[list[Union[str, TokenIds, dict[str, Any], MixedPrompt]], _FAIL_FAST]
MAX_PROMPTS = 64  # prompts in one completion request (a list: one result per prompt)
MAX_CHOICES = 16  # OpenAI n: choices of one prompt (server/choices.py)
# what the generation routes accept (pydantic's own schema would allow "" and []): an empty
# prompt, alone or in a list, is a 400
_TEXT = {"type": "string", "minLength": 1}
_IDS = {"type": "array", "items": {"type": "integer", **TOKEN_ID_SCHEMA}, "minItems": 1}
PROMPT_SCHEMA = {"anyOf": [
    _TEXT, _IDS,
    {"type": "array", "items": _TEXT, "minItems": 1, "maxItems": MAX_PROMPTS},
    {"type": "array", "items": _IDS, "minItems": 1, "maxItems": MAX_PROMPTS}]}
_PROMPT_OBJECT = {"type": "object", "properties": {"prompt_string": _TEXT}, "required": ["prompt_string"]}
# ids and texts mixed (llama.cpp's [12, "text", 34]): a list holding a number is one prompt
_MIXED = {"type": "array", "items": {"anyOf": [{"type": "integer", **TOKEN_ID_SCHEMA}, _TEXT]},
          "contains": {"type": "integer"}, "minItems": 1}
LLAMA_PROMPT_SCHEMA = {"anyOf": [
    _TEXT, _IDS, _PROMPT_OBJECT, _MIXED,
    {"type": "array", "items": {"anyOf": [_TEXT, _IDS, _PROMPT_OBJECT, _MIXED]}, "minItems": 1,
     "maxItems": MAX_PROMPTS}]}
NON_EMPTY = {"minItems": 1}
MESSAGES = {"minItems": 1, "items": MESSAGE_SCHEMA}  # what the chat template renderer accepts
TOOLS = {"items": TOOL_SCHEMA}
# tokens to generate: at least 1, or -1 (until EOS / the context: llama.cpp's convention); null = the default
MAX_TOKENS_SCHEMA = {"anyOf": [{"type": "integer", "minimum": 1}, {"const": -1}, {"type": "null"}]}
# a session id is echoed in the x-session-id header: printable ASCII
SESSION_ID_SCHEMA = {"pattern": "^[ -~]+$"}


def _given(name: str, schema: dict | None = None) -> dict:
    """``name`` present and not null (and, with ``schema``, matching it)."""
    return {"required": [name], "properties": {name: {"not": {"type": "null"}, **(schema or {})}}}


def _absent(*names: str) -> dict:
    return {"properties": {n: {"type": "null"} for n in names}}


# explicit P is checked against the pool: it needs one (pool_id, or its legacy name shared_pool_slot)
SHARED_PREFIX_NEEDS_POOL = {"if": _given("shared_prefix_n_tokens"),
                            "then": {"anyOf": [_given("pool_id"), _given("shared_pool_slot")]}}
# several choices run as sessions of their own: no session (session_id / id_slot) and no explicit P
CHOICES_ALONE = {"if": _given("n", {"minimum": 2}),
                 "then": {"allOf": [_absent("session_id", "shared_prefix_n_tokens"),
                                    {"properties": {"id_slot": {"anyOf": [{"type": "null"}, {"const": -1}]}}}]}}
TOP_LOGPROBS_NEED_LOGPROBS = {"if": _given("top_logprobs"), "then": {"required": ["logprobs"],
                                                                      "properties": {"logprobs": {"const": True}}}}
MAX_TOP_LOGPROBS = 20  # SamplingParams' limit


def field_range(minimum: float, maximum: float | None = None) -> dict:
    """The documented range of a number the engine checks (SamplingParams keeps the runtime check)."""
    return {"minimum": minimum} if maximum is None else {"minimum": minimum, "maximum": maximum}
# one output constraint at most: response_format, json_schema or grammar
ONE_CONSTRAINT = {"not": {"anyOf": [{"allOf": [_given(a), _given(b)]} for a, b in (
    ("response_format", "json_schema"), ("response_format", "grammar"), ("json_schema", "grammar"))]}}
# OpenAI's logit_bias: token ids (as keys) to biases in [-100, 100]
OPENAI_LOGIT_BIAS = {"type": ["object", "null"], "propertyNames": {"pattern": "^[0-9]+$"},
                     "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}
OPENAI_PENALTY = field_range(-2, 2)  # OpenAI's range of presence / frequency penalties (llama.cpp's: +-100)
SessionId = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]
Label = Annotated[str, Field(max_length=MAX_LABEL_CHARS)]


def lone_surrogate_path(value: Any, where: str = "") -> str | None:
    """Where ``value`` holds a string with a lone UTF-16 surrogate (``"\\ud800"`` in JSON: not Unicode
    text, cannot be encoded), or None."""
    try:  # the fast path: one C-level pass
        json.dumps(value, ensure_ascii=False).encode("utf-8")
        return None
    except UnicodeEncodeError:
        pass
    except (TypeError, ValueError, RecursionError):
        return None  # not JSON data (or nested too deeply): the validators report it
    if isinstance(value, str):
        return where or "a string"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        if isinstance(k, str) and lone_surrogate_path(k) is not None:
            return f"{where}.{k!r}" if where else repr(k)
        found = lone_surrogate_path(v, f"{where}.{k}" if isinstance(k, str) else f"{where}[{k}]")
        if found is not None:
            return found.lstrip(".")
    return where or "a string"


SURROGATE_MESSAGE = "{where} holds a lone UTF-16 surrogate: strings must be valid Unicode text"
# set while validating a body whose strings were already checked (the server parses bodies in a thread)
surrogates_checked: contextvars.ContextVar[bool] = contextvars.ContextVar("surrogates_checked", default=False)


def _int_kinds(t: Any) -> set:
    """What an annotation holds, flattened: ``int``, ``float``, ``("list", int)``, ... (Annotated,
    Optional and unions opened)."""
    import types
    import typing

    origin = typing.get_origin(t)
    if origin is Annotated:
        return _int_kinds(typing.get_args(t)[0])
    if origin in (Union, types.UnionType):
        return set().union(*(_int_kinds(a) for a in typing.get_args(t)))
    if origin is list:
        args = typing.get_args(t)
        return {("list", k) for k in _int_kinds(args[0])} if args else {list}
    return {t}


_INTEGRAL: dict[type, dict[str, str]] = {}


def _integral_fields(cls: type[BaseModel]) -> dict[str, str]:
    """Keys (names and aliases) of the fields that hold integers and no float: "int" or "list"."""
    out = _INTEGRAL.get(cls)
    if out is None:
        out = {}
        for name, f in cls.model_fields.items():
            kinds = _int_kinds(f.annotation)
            kind = ("int" if int in kinds and float not in kinds else
                    "list" if ("list", int) in kinds and ("list", float) not in kinds else None)
            if kind is not None:
                out[name] = kind
                if f.alias:
                    out[f.alias] = kind
        _INTEGRAL[cls] = out
    return out


def _integral(v: Any) -> Any:
    return int(v) if type(v) is float and v.is_integer() and abs(v) < 2**63 else v


class _Input(BaseModel):
    @model_validator(mode="before")
    @classmethod
    def _integral_numbers(cls, data: Any) -> Any:
        """JSON Schema's ``integer`` holds 19.0 (a number without a fraction; the OpenAPI document
        says ``integer``): an integer field takes it as 19, as JSON parsers that read every number
        as a float send it. 19.5 stays a 400."""
        if not isinstance(data, dict):
            return data
        fields = _integral_fields(cls)
        changed = None
        for k in fields.keys() & data.keys():
            v = data[k]
            new = (_integral(v) if fields[k] == "int" else
                   [_integral(x) for x in v] if isinstance(v, list) and any(type(x) is float for x in v) else v)
            if new is not v:
                changed = dict(data) if changed is None else changed
                changed[k] = new
        return data if changed is None else changed

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        if surrogates_checked.get():
            return data
        where = lone_surrogate_path(data)
        if where is not None:
            raise PydanticCustomError("invalid_unicode", SURROGATE_MESSAGE, {"where": where})
        return data


class _Lenient(_Input):
    model_config = ConfigDict(strict=True, extra="ignore")


class _Strict(_Input):
    model_config = ConfigDict(strict=True, extra="forbid")


class PolyKVFields(_Lenient):
    model_config = ConfigDict(json_schema_extra={"allOf": [SHARED_PREFIX_NEEDS_POOL]})
    pool_id: int | None = Field(None, description="attach to this pool (the shared prefix P is found automatically)")
    shared_pool_slot: int | None = Field(None, description="the PolyKV design's legacy name of pool_id (an alias: "
                                                           "it must equal pool_id when both are given)")
    session_id: SessionId | None = Field(None, description="the session whose KV cache outlives the request "
                                                           "(a new one is made when absent; returned in x-session-id: "
                                                           "printable ASCII)", json_schema_extra=SESSION_ID_SCHEMA)
    shared_prefix_n_tokens: int | None = Field(None, description="explicit P (needs pool_id; checked against the "
                                                                 "pool's tokens and the prompt: a mismatch is a 400)")
    overcommit: bool = Field(False, description="bypass an enforced admission floor for this request")
    cache_salt: str | None = Field(None, description="prefix-cache namespace: requests share cached KV only with "
                                                     "requests of the same salt (vLLM's cache_salt)")
    id_slot: int | None = Field(None, description="llama.cpp's slot: slot N is the session named \"N\" (the same "
                                                  "as session_id \"N\": with both, they name one session); -1 or null "
                                                  "= none",
                                json_schema_extra={"minimum": -1})


class SamplingFields(_Lenient):
    temperature: float | None = Field(None, description="0 = greedy (default 0.8)", json_schema_extra=field_range(0, 100))
    top_k: int | None = Field(None, description="0 or -1 = off (default 40)", json_schema_extra=field_range(-1, 1_000_000))
    top_p: float | None = Field(None, description="nucleus sampling (default 0.95)",
                                json_schema_extra={"exclusiveMinimum": 0, "maximum": 1})
    min_p: float | None = Field(None, description="min-p sampling (default 0.05)", json_schema_extra=field_range(0, 1))
    seed: int | None = Field(None, description="per-request seed (-1 or null = random)",
                             json_schema_extra={"minimum": -(2**63 - 1), "maximum": 2**63 - 1})
    stop: StopField = Field(None, description="strings that end generation")
    ignore_eos: bool = Field(False, description="keep generating past end-of-sequence")
    presence_penalty: float | None = Field(None, description="subtracted from the logit of every token already in "
                                                             "the penalty window (0 = off)",
                                           json_schema_extra=field_range(-100, 100))
    frequency_penalty: float | None = Field(None, description="subtracted per occurrence of a token in the penalty "
                                                              "window (0 = off)", json_schema_extra=field_range(-100, 100))
    repeat_penalty: float | None = Field(None, description="llama.cpp repetition penalty (1 = off)",
                                         json_schema_extra={"exclusiveMinimum": 0, "maximum": 100})
    repeat_last_n: int | None = Field(None, description="penalty window in tokens (-1 = whole context, 0 = off; "
                                                        "/completion: last 64 of prompt + output; OpenAI routes: "
                                                        "all generated tokens)", json_schema_extra=field_range(-1))
    logit_bias: Any = Field(None, description="{\"token id\": bias} (OpenAI) or [[token id or text, bias or false]] "
                                              "(llama.cpp); false bans the token",
                            json_schema_extra={"type": ["object", "array", "null"]})
    post_sampling_probs: bool = Field(False, description="report probabilities after the sampling filters")
    json_schema: Any = Field(None, description="constrain the output to this JSON Schema (llama.cpp; also taken as "
                                               "its JSON text)", json_schema_extra={"type": ["object", "null"]})
    grammar: str | None = Field(None, description="constrain the output to this GBNF (llama.cpp) or Lark grammar "
                                                  "(its syntax is checked: 400 'invalid grammar: ...')",
                                json_schema_extra={"minLength": 1})
    speculative_n_max: int | None = Field(None, alias="speculative.n_max",
                                          description="prompt-lookup draft tokens verified per step at most "
                                                      "(llama.cpp's speculative.n_max; 0 = no speculative decoding; "
                                                      "default: the server's --speculative / --draft-max)",
                                          json_schema_extra=field_range(0, 64))


class CompletionRequest(SamplingFields, PolyKVFields):
    """llama.cpp's ``POST /completion``."""

    model_config = ConfigDict(json_schema_extra={"allOf": [SHARED_PREFIX_NEEDS_POOL, ONE_CONSTRAINT]})

    prompt: Union[PromptField, dict[str, Any], LlamaPrompts, MixedPrompt] = Field(
        ..., description="text, token ids, token ids and texts mixed in one list ([12, \"text\", 34]: one prompt), "
                         "{\"prompt_string\": text}, or a list of them (one result per prompt, each with its index; "
                         "streamed with stream); none may be empty",
        json_schema_extra=LLAMA_PROMPT_SCHEMA)
    n_predict: int | None = Field(None, description="tokens to generate at most (-1 = until EOS / context)",
                                  json_schema_extra=MAX_TOKENS_SCHEMA)
    max_tokens: int | None = Field(None, description="alias of n_predict", json_schema_extra=MAX_TOKENS_SCHEMA)
    stream: bool = False
    n_probs: int = Field(0, description="top alternatives to report per token (completion_probabilities)",
                         json_schema_extra=field_range(0, MAX_TOP_LOGPROBS))
    cache_prompt: bool = Field(True, description="accepted for compatibility; sessions always cache")
    return_tokens: bool = Field(False, description="include the generated token ids")
    response_fields: Strings | None = Field(None, description="only these fields of the answer ('a/b' takes b "
                                                            "from object a, keyed 'a/b')")
    return_progress: bool = Field(False, description="stream: report prompt processing progress (prompt_progress)")
    response_format: dict[str, Any] | None = Field(None, description="{\"type\": \"json_object\", \"schema\": {...}} "
                                                                     "or OpenAI's json_schema form")


class StreamOptions(_Lenient):
    include_usage: bool = False


class OpenAICompletionRequest(SamplingFields, PolyKVFields):
    """OpenAI's legacy ``POST /v1/completions``."""

    model: str | None = None
    prompt: PromptField = Field(..., description="text, token ids, or a list of either (choice p * n + j is "
                                                 "choice j of prompt p); none may be empty",
                                json_schema_extra=PROMPT_SCHEMA)
    model_config = ConfigDict(json_schema_extra={"allOf": [SHARED_PREFIX_NEEDS_POOL, CHOICES_ALONE, ONE_CONSTRAINT]})
    max_tokens: int | None = Field(None, description="tokens to generate at most (null: the server's default; -1: "
                                                     "until EOS / context)", json_schema_extra=MAX_TOKENS_SCHEMA)
    n: int = Field(1, json_schema_extra=field_range(1, MAX_CHOICES))
    best_of: int | None = Field(None, description="1 (one candidate per choice) or null",
                                json_schema_extra={"anyOf": [{"const": 1}, {"type": "null"}]})
    presence_penalty: float | None = Field(None, description="OpenAI's presence penalty", json_schema_extra=OPENAI_PENALTY)
    logit_bias: Any = Field(None, description="{\"token id\": bias in [-100, 100]}", json_schema_extra=OPENAI_LOGIT_BIAS)
    frequency_penalty: float | None = Field(None, description="OpenAI's frequency penalty",
                                            json_schema_extra=OPENAI_PENALTY)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, description="top alternatives per token (0..20)",
                                 json_schema_extra=field_range(0, MAX_TOP_LOGPROBS))
    echo: bool = False
    suffix: str | None = Field(None, description="insertion after the completion is not supported: \"\" or null",
                               json_schema_extra={"maxLength": 0})
    response_format: dict[str, Any] | None = None
    user: str | None = None


class ChatCompletionRequest(SamplingFields, PolyKVFields):
    """OpenAI's ``POST /v1/chat/completions``."""

    model: str | None = None
    model_config = ConfigDict(json_schema_extra={"allOf": [SHARED_PREFIX_NEEDS_POOL, CHOICES_ALONE, TOOLS_NEEDED,
                                                           TOP_LOGPROBS_NEED_LOGPROBS, ONE_CONSTRAINT]})
    messages: list[Any] = Field(..., description="OpenAI chat messages. A trailing assistant message is continued "
                                                 "(one at most; continue_final_message needs one; not with tool_calls "
                                                 "or a forced tool call); the served model's chat template may refuse "
                                                 "a conversation by rules of its own (400 'the chat template rejected "
                                                 "the messages: ...')", json_schema_extra=MESSAGES)
    tools: list[Any] | None = Field(None, json_schema_extra=TOOLS)
    tool_choice: Union[str, dict[str, Any], None] = Field(
        None, description="none | auto | required | {\"type\": \"function\", \"function\": {\"name\": ...}} "
                          "(required and a named function need tools; the name must be one of theirs)",
        json_schema_extra=TOOL_CHOICE_SCHEMA)
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = Field(None, json_schema_extra=MAX_TOKENS_SCHEMA)
    max_completion_tokens: int | None = Field(None, description="tokens to generate at most (wins over max_tokens)",
                                              json_schema_extra=MAX_TOKENS_SCHEMA)
    n: int = Field(1, json_schema_extra=field_range(1, MAX_CHOICES))
    presence_penalty: float | None = Field(None, description="OpenAI's presence penalty", json_schema_extra=OPENAI_PENALTY)
    logit_bias: Any = Field(None, description="{\"token id\": bias in [-100, 100]}", json_schema_extra=OPENAI_LOGIT_BIAS)
    frequency_penalty: float | None = Field(None, description="OpenAI's frequency penalty",
                                            json_schema_extra=OPENAI_PENALTY)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, description="needs logprobs: true",
                                     json_schema_extra=field_range(0, MAX_TOP_LOGPROBS))
    response_format: dict[str, Any] | None = None
    user: str | None = None
    add_generation_prompt: bool | None = Field(None, description="open the assistant turn (default true; false "
                                                                 "when continuing the final assistant message)")
    continue_final_message: bool | None = Field(None, description="continue the final assistant message instead "
                                                                  "of starting a new one (default: when it is last)")
    verbose: bool = Field(False, description="llama.cpp: add __verbose (the rendered prompt, the generation "
                                             "settings) to a whole answer")
    return_progress: bool = Field(False, description="llama.cpp: stream prompt processing progress "
                                                     "(chunks with prompt_progress and no choices)")


class TokenizeRequest(_Lenient):
    content: str
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(_Lenient):
    tokens: TokenIds


class ApplyTemplateRequest(_Lenient):
    messages: list[Any] = Field(..., json_schema_extra=MESSAGES)
    tools: list[Any] | None = Field(None, json_schema_extra=TOOLS)
    add_generation_prompt: bool = True


def _exactly_one(*names: str) -> dict:
    """Exactly one of ``names`` given (null counts as not given, as in validation)."""
    return {"oneOf": [{"required": [n], "properties": {n: {"not": {"type": "null"}}}} for n in names]}


_TOOLS_NEED_MESSAGES = {"if": _given("tools"), "then": _given("messages")}


class _PrefixSource(_Strict):
    """Exactly one of ``tokens`` / ``text`` / ``messages`` (+ ``tools``) / ``from_session``."""

    # tools go with messages (they are rendered with them): a body with tools and no messages is a 400
    model_config = ConfigDict(json_schema_extra={**_exactly_one("tokens", "text", "messages", "from_session"),
                                                 **_TOOLS_NEED_MESSAGES})
    tokens: TokenIds | None = Field(None, description="the full prefix [0, L) as token ids",
                                    json_schema_extra=NON_EMPTY)
    text: str | None = Field(None, description="the full prefix as raw text (tokenized without specials)",
                             json_schema_extra={"minLength": 1})
    messages: list[Any] | None = Field(None, description="chat messages rendered with the chat template",
                                       json_schema_extra=MESSAGES)
    tools: list[Any] | None = Field(None, description="tools rendered with the messages (as a chat request would)",
                                    json_schema_extra=TOOLS)
    add_generation_prompt: bool = Field(False, description="end the rendered messages with the assistant header")
    from_session: SessionId | None = Field(None, description="snapshot this idle session's cached context")


class CreatePoolRequest(_PrefixSource):
    pinned: bool = False
    label: Label = ""
    as_root: bool = Field(False, description="from_session of a session attached to a pool: make a root (its "
                                             "borrowed prefix is computed again) instead of a zero-copy child of "
                                             "that pool (the default); other prefixes always make a root")


class ForkPoolRequest(_PrefixSource):
    branch_pos: int | None = Field(None, description="D: == parent prefix_len extends, < branches (default: extend)")
    pinned: bool = False
    label: Label = ""


def _admission_range(name: str, integer: bool = False) -> dict:
    """The policy's own range: integers in [low, high], numbers in (low, high]."""
    lo, hi = ADMISSION_RANGES[name]
    return {"minimum": lo, "maximum": hi} if integer else {"exclusiveMinimum": lo, "maximum": hi}


class AdmissionRequest(_Strict):
    target_tps_per_session: float | None = Field(None, json_schema_extra=_admission_range("target_tps_per_session"))
    mode: Literal["advisory", "enforced"] | None = None
    on_saturation: Literal["reject", "warn", "queue"] | None = None
    guarantee_min_sessions: int | None = Field(None, json_schema_extra=_admission_range("guarantee_min_sessions", True))
    settle_tokens: int | None = Field(None, json_schema_extra=_admission_range("settle_tokens", True))
    settle_max_ms: float | None = Field(None, json_schema_extra=_admission_range("settle_max_ms"))
    queue_timeout_ms: float | None = Field(None, json_schema_extra=_admission_range("queue_timeout_ms"))
    forecast: Literal["adaptive", "conservative"] | None = None


class CompactRequest(_Strict):
    """The compacted prefix as exactly one of ``tokens`` / ``text`` / ``messages`` (+ ``tools``)."""

    model_config = ConfigDict(json_schema_extra={**_exactly_one("tokens", "text", "messages"), **_TOOLS_NEED_MESSAGES})
    ancestor_pool_id: int
    tokens: TokenIds | None = Field(None, json_schema_extra=NON_EMPTY)
    text: str | None = Field(None, json_schema_extra={"minLength": 1})
    messages: list[Any] | None = Field(None, json_schema_extra=MESSAGES)
    tools: list[Any] | None = Field(None, description="tools rendered with the messages", json_schema_extra=TOOLS)
    branch_pos: int | None = None
    release_old: bool = True


# a query parameter is absent or a value: "null" is not one (the schema leaves None out)
NoNull = SkipJsonSchema[None]


class _Query(BaseModel):
    # query strings are text: numbers are parsed (lax); an unknown parameter is a 400 (the document
    # lists every parameter a route takes: one it does not know would be ignored silently)
    model_config = ConfigDict(extra="forbid")


class ReleasePoolQuery(_Query):
    immediate: bool = Field(False, description="release now instead of after the pool's grace TTL (pending "
                                               "releases of its children go first)")
    cascade: Literal["sessions"] | NoNull = Field(None, description="'sessions': first end the sessions that keep "
                                                  "the pool's KV (its own and its descendants', released ones "
                                                  "included: held_by / released_pools in the listing)")


class CapacityQuery(_Query):
    expected_tokens: Annotated[int, Field(ge=0)] | NoNull = Field(None, description="tokens the new session expects to use")
    session_id: str | NoNull = Field(None, description="ask for this (existing) session")


class EventsQuery(_Query):
    pool_id: int | NoNull = Field(None, description="only this pool's events")
    since: float | NoNull = Field(None, description="only events after this wall-clock time")


class TpsHistoryQuery(_Query):
    session_id: str | NoNull = Field(None, description="only this session's series")
    since: float | NoNull = Field(None, description="only samples after this wall-clock time")
