"""Request parameters of ``OpencotiChatModel``: the names it accepts (its own, ChatOpenAI's and
ChatOllama's where they map to something real), what goes to the server as is, and what is refused.

* Mapped: ``num_predict`` (ChatOllama; -1 / -2 = no limit) and ``max_completion_tokens``
  (ChatOpenAI) -> ``max_tokens``; ``stop_sequences`` -> ``stop``; ``request_timeout`` ->
  ``timeout``.
* Passed through to the chat request (``model_kwargs``, ``extra_body``, or by name): the request
  fields the server knows (``frequency_penalty``, ``presence_penalty``, ``repeat_penalty``,
  ``logit_bias``, ``response_format``, ``logprobs``, ``top_logprobs``, ``n``, ``user``, ...). The
  server validates their values (e.g. a value it cannot honour is a clear 400).
* Anything else is refused with a ``ValueError`` naming it — in the constructor and per call —
  instead of vanishing. As with ChatOpenAI, a constructor argument that is a request field but not
  a model field is moved into ``model_kwargs`` with a warning.
"""

from __future__ import annotations

from typing import Any

from langchain_core.language_models.model_profile import ModelProfile
from langchain_core.utils.utils import _build_model_kwargs
from pydantic import AliasChoices

STRUCTURED_OUTPUT = True
"""Chat requests take ``response_format={"type": "json_schema", ...}`` and decode under the schema
(also combined with tools in ``auto`` mode: a tool call or the JSON answer), so
``create_agent(response_format=...)`` uses the provider strategy and ``with_structured_output``'s
``json_schema`` / ``json_mode`` methods constrain the answer instead of forcing a tool call."""

# The chat request fields of `opencoti serve` (and of the in-process operations), besides the
# messages themselves; used when the server's schema module cannot be imported.
_FALLBACK_FIELDS = ("model", "tools", "tool_choice", "parallel_tool_calls", "max_tokens", "max_completion_tokens",
                    "n", "logprobs", "top_logprobs", "response_format", "user", "temperature", "top_k", "top_p",
                    "min_p", "seed", "stop", "ignore_eos", "presence_penalty", "frequency_penalty", "repeat_penalty",
                    "logit_bias", "pool_id", "session_id", "shared_prefix_n_tokens", "overcommit")
_NOT_PASSED = {"messages", "stream", "stream_options", "model"}

# Per-call names the model handles itself (besides its request fields).
_OWN_CALL_KEYS = {"model", "stream_usage", "model_kwargs", "extra_body", "num_predict", "max_completion_tokens",
                  "stop_sequences"}

ALIASES = {"num_predict": "max_tokens", "max_completion_tokens": "max_tokens", "stop_sequences": "stop",
           "request_timeout": "timeout"}


def request_fields() -> frozenset[str]:
    """The chat request fields the server accepts (its schema), less messages / stream / model."""
    try:
        from ..ops.schemas import ChatCompletionRequest
        names = set(ChatCompletionRequest.model_fields)
    except ImportError:  # pragma: no cover - the schema moved: the list above is the contract
        names = set(_FALLBACK_FIELDS)
    return frozenset(names - _NOT_PASSED)


def max_tokens_value(name: str, value: Any) -> Any:
    """``num_predict``'s "no limit" values (-1, -2) are ``max_tokens=None``."""
    if name == "num_predict" and isinstance(value, int) and value < 0:
        return None
    return value


def refuse_unknown(names: set[str], where: str) -> None:
    unknown = sorted(names - request_fields())
    if unknown:
        known = ", ".join(sorted(request_fields()))
        raise ValueError(f"{where}: {', '.join(map(repr, unknown))} "
                         f"{'is not a parameter' if len(unknown) == 1 else 'are not parameters'} of an opencoti "
                         f"chat request (it would be ignored). Request fields: {known}")


def split_call_kwargs(kwargs: dict, model_fields: set[str]) -> tuple[dict, dict, dict]:
    """Per-call kwargs -> (request fields, extra body fields, the model's own options)."""
    fields = request_fields()
    req: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    own: dict[str, Any] = {}
    for k, v in kwargs.items():
        if k in ("model_kwargs", "extra_body"):
            if v:
                if not isinstance(v, dict):
                    raise ValueError(f"{k} must be a dict, got {type(v).__name__}")
                refuse_unknown(set(v), f"{k} of this call")
                extra.update(v)
        elif k in ALIASES and ALIASES[k] in ("max_tokens", "stop"):
            req[ALIASES[k]] = max_tokens_value(k, v)
        elif k in _OWN_CALL_KEYS:
            own[k] = v
        elif k in fields:
            req[k] = v
        elif k in model_fields:
            raise ValueError(f"{k!r} is set on the model, not per call (model.model_copy(update={{{k!r}: ...}}))")
        else:
            refuse_unknown({k}, "this call")
    return req, extra, own


def build_extra(cls: type, values: Any) -> Any:
    """The model's before-validator: maps ChatOpenAI/ChatOllama names, moves request fields given
    as constructor arguments into ``model_kwargs`` (warning, as ChatOpenAI does), refuses the rest."""
    if not isinstance(values, dict):
        return values
    values = dict(values)
    if values.get("engine") is not None and "base_url" not in values:
        values["base_url"] = None  # an in-process engine: OPENCOTI_BASE_URL is for HTTP models
    if "num_predict" in values:
        values["num_predict"] = max_tokens_value("num_predict", values["num_predict"])
    names: set[str] = set()
    for name, f in cls.model_fields.items():
        names.add(name)
        if f.alias:
            names.add(f.alias)
        if isinstance(f.validation_alias, AliasChoices):
            names.update(c for c in f.validation_alias.choices if isinstance(c, str))
    refuse_unknown({k for k in values if k not in names}, f"{cls.__name__}()")
    values = _build_model_kwargs(values, names)
    for key in ("model_kwargs", "extra_body"):
        given = values.get(key) or {}
        if not isinstance(given, dict):
            raise ValueError(f"{key} must be a dict, got {type(given).__name__}")
        fields = sorted(k for k in given if k in names or k in ALIASES)
        if key == "extra_body" and fields:
            raise ValueError(f"extra_body: {fields} are arguments of the model itself: give them directly")
        refuse_unknown(set(given) - set(fields), f"{cls.__name__}({key}=...)")
    return values


def model_profile(engine: Any = None, served: dict | None = None) -> ModelProfile:
    """What the model can do (LangChain's model profile): text in and out, tool calling with
    ``tool_choice`` and streamed tool calls, structured output; and what the engine says of the
    served model (``served_model_facts``): its name and context (``max_input_tokens``, which
    ``SummarizationMiddleware`` sizes its retry and its ``("fraction", f)`` limits by), from an
    in-process ``engine`` once it is loaded, or from ``served``, the server's ``GET /v1/models`` entry."""
    profile = ModelProfile(text_inputs=True, image_inputs=False, audio_inputs=False, video_inputs=False,
                           pdf_inputs=False, text_outputs=True, image_outputs=False, audio_outputs=False,
                           video_outputs=False, tool_calling=True, tool_choice=True, tool_call_streaming=True,
                           structured_output=STRUCTURED_OUTPUT, temperature=True, open_weights=True,
                           reasoning_output=False)
    profile.update(served_model_facts(engine, served))  # type: ignore[typeddict-item]
    return profile


def served_model_facts(engine: Any = None, served: dict | None = None) -> dict:
    """``name``, ``max_input_tokens`` and ``max_output_tokens`` of the served model: from an
    in-process ``engine`` that is loaded (a ``LazyEngine`` still loading gives nothing yet) or from
    ``served`` (a ``GET /v1/models`` entry: ``id``, ``meta.n_ctx``); {} when neither tells."""
    if engine is not None:
        if not getattr(engine, "ready", True) or engine.is_closed:
            return {}
        name, n_ctx = engine.model_name, min(engine.max_context, engine.kv.num_pages * engine.kv.page_size)
    elif isinstance(served, dict):
        meta = served.get("meta") if isinstance(served.get("meta"), dict) else {}
        name, n_ctx = served.get("id"), meta.get("n_ctx", meta.get("n_ctx_train"))
    else:
        return {}
    facts: dict[str, Any] = {}
    if isinstance(name, str) and name:
        facts["name"] = name
    if isinstance(n_ctx, int) and not isinstance(n_ctx, bool) and n_ctx > 0:
        # a prompt may fill the context; an answer what the prompt leaves of it
        facts["max_input_tokens"] = facts["max_output_tokens"] = n_ctx
    return facts


_CLIENT_PARAMS: frozenset[str] | None = None


def client_params() -> frozenset[str]:
    """The request fields ``PolyKVClient.chat_stream`` takes by name (``calls.ChatArgs``; the rest go
    in ``extra_body``)."""
    global _CLIENT_PARAMS
    if _CLIENT_PARAMS is None:
        from ..client.calls import ChatArgs
        _CLIENT_PARAMS = frozenset(ChatArgs.__annotations__) - {"extra_body"}
    return _CLIENT_PARAMS
