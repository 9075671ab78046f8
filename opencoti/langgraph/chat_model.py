"""``OpencotiChatModel``: a LangChain chat model over an in-process Engine or a remote ``opencoti serve``.

    from opencoti.langgraph import OpencotiChatModel
    model = OpencotiChatModel(engine=engine)                          # in-process
    model = OpencotiChatModel(base_url="http://127.0.0.1:8080")       # over HTTP
    msg = model.invoke("Hello", pool_id=3, session_id="agent-1")

Streaming is the primitive: ``_stream``/``_astream`` turn the client's chat events into
``AIMessageChunk``s (content deltas, complete tool calls as ``tool_call_chunks``, and a last chunk
with ``usage_metadata`` and ``response_metadata``); ``_generate``/``_agenerate`` aggregate them.
The message converters live in ``convert`` and the parameter rules in ``params``.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable, Iterator, Literal, Sequence

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LanguageModelInput
from langchain_core.language_models.chat_models import (BaseChatModel, LangSmithParams, agenerate_from_stream,
                                                        generate_from_stream)
from langchain_core.language_models.model_profile import ModelProfile
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool
from langchain_core.utils import from_env, secret_from_env
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, model_validator

from ..client import AsyncPolyKVClient, ChatChunk, GenerationInfo, OpencotiError, PolyKVClient, SessionStatus
from .convert import (chunk_from_event, convert_message_to_dict, convert_messages, format_tool_choice,  # noqa: F401
                      parse_json_answer, response_metadata, usage_metadata)
from .structured import structured_output
from .params import build_extra, client_params, model_profile, served_model_facts, split_call_kwargs

DEFAULT_BASE_URL = "http://127.0.0.1:8080"
DEFAULT_MAX_TOKENS = 1024
"""Tokens an answer may have at most unless ``max_tokens`` says otherwise (``None``: no limit)."""
PROFILE_TIMEOUT_S = 2.0
"""The longest wait for the server's model facts (for the profile) while a model over HTTP is made."""


class OpencotiChatModel(BaseChatModel):
    """Chat model served by opencoti: in-process (``engine=``) or over HTTP (``base_url=``).

    Setup:
        ``pip install opencoti-langgraph``; either build an ``opencoti.engine.Engine`` or run
        ``opencoti serve`` and give its URL (``OPENCOTI_BASE_URL``, ``OPENCOTI_API_KEY``).

    Key init args — generation:
        temperature, max_tokens, top_p, top_k, min_p, seed, stop.

    Key init args — PolyKV:
        pool_id (attach every request to this pool), session_id (reuse this session's KV across
        turns), overcommit (bypass an enforced admission floor).

    Key init args — client:
        engine, base_url, api_key, timeout, max_retries.

    Instantiate:
        .. code-block:: python

            from opencoti.langgraph import OpencotiChatModel
            model = OpencotiChatModel(base_url="http://127.0.0.1:8080", temperature=0, max_tokens=256)

    Invoke:
        .. code-block:: python

            msg = model.invoke([("system", "Be brief."), ("human", "Hi!")], pool_id=2)
            msg.response_metadata["cached_prefix_tokens"], msg.usage_metadata["input_token_details"]

    Tool calling:
        .. code-block:: python

            model.bind_tools([my_tool], tool_choice="my_tool").invoke("...").tool_calls

    Per-call keyword arguments (``invoke(..., pool_id=..., session_id=...)`` or ``bind``) override
    the fields of the same name. 429s from an enforced pool raise ``PoolSaturatedError`` once
    ``max_retries`` retries (honouring ``Retry-After``) are used up.
    """

    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True, protected_namespaces=())

    model_name: str | None = Field(default=None, alias="model")
    """Model id for traces and ``response_metadata`` (default: the served model's). One engine
    serves one model, so this does not select a model."""
    temperature: float | None = None
    """Sampling temperature; 0 is greedy (server default 0.8)."""
    max_tokens: int | None = Field(default=DEFAULT_MAX_TOKENS,
                                   validation_alias=AliasChoices("max_tokens", "max_completion_tokens", "num_predict"))
    """Tokens to generate at most (default 1024; None: until end of turn or the context is full).
    Also accepted as ``max_completion_tokens`` (ChatOpenAI) and ``num_predict`` (ChatOllama)."""
    top_p: float | None = None
    """Nucleus sampling (server default 0.95)."""
    top_k: int | None = None
    """Top-k sampling, 0 = off (server default 40)."""
    min_p: float | None = None
    """Min-p sampling (server default 0.05)."""
    seed: int | None = None
    """Sampling seed: the same seed, prompt and parameters give the same answer."""
    stop: list[str] | None = Field(default=None, alias="stop_sequences")
    """Strings that end generation (not included in the output)."""
    frequency_penalty: float | None = None
    """Penalize tokens by how often they already appear (OpenAI semantics; the engine validates it)."""
    presence_penalty: float | None = None
    """Penalize tokens that already appear (OpenAI semantics; the engine validates it)."""
    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Further chat request fields sent as they are (e.g. ``repeat_penalty``, ``logit_bias``,
    ``response_format``); names the server does not know are refused."""
    extra_body: dict[str, Any] | None = None
    """Like ``model_kwargs`` (ChatOpenAI's name for fields added to the request body)."""
    stream_usage: bool = True
    """Report token usage (``usage_metadata``) on answers, streamed or not."""
    default_headers: dict[str, str] | None = None
    """HTTP headers sent with every request (over HTTP)."""
    pool_id: int | None = None
    """Attach every request to this PolyKV pool (the shared prefix is found automatically)."""
    session_id: str | None = None
    """Run every request in this session, so each turn reuses the previous turns' KV cache."""
    overcommit: bool = False
    """Bypass an enforced admission floor (the context arm still applies)."""
    release_anonymous_sessions: bool = True
    """Release the session the server made for a request that named none (its cache could never
    be reused); set False to keep it (its id is in ``response_metadata["session_id"]``)."""
    include_session_status: bool = True
    """Read the session's live tps, context headroom and compaction pressure after each answer
    (one extra control-plane call) for ``response_metadata``."""
    engine: Any = Field(default=None, exclude=True)
    """An in-process ``opencoti.engine.Engine`` (instead of ``base_url``)."""
    base_url: str | None = Field(default_factory=from_env("OPENCOTI_BASE_URL", default=None))
    """URL of a running ``opencoti serve`` (env ``OPENCOTI_BASE_URL``, not read when ``engine`` is
    given; default http://127.0.0.1:8080)."""
    api_key: SecretStr | None = Field(default_factory=secret_from_env("OPENCOTI_API_KEY", default=None))
    """The server's API key (env ``OPENCOTI_API_KEY``)."""
    timeout: float | None = Field(default=120.0, alias="request_timeout")
    """Seconds per HTTP request (None: no timeout)."""
    max_retries: int = 2
    """Retries of requests refused with 429 / 503 + Retry-After, or that could not be sent."""
    streaming: bool = False
    """Stream by default in ``invoke`` (answers are always produced by streaming internally)."""
    client: Any = Field(default=None, exclude=True)
    """A ready ``PolyKVClient`` to use for sync calls (advanced; built from the fields otherwise)."""
    async_client: Any = Field(default=None, exclude=True)
    """A ready ``AsyncPolyKVClient`` for async calls (advanced)."""
    http_client: Any = Field(default=None, exclude=True)
    """An ``httpx.Client`` for HTTP requests (e.g. with custom transport or TLS settings)."""
    http_async_client: Any = Field(default=None, exclude=True)
    """An ``httpx.AsyncClient`` for async HTTP requests."""

    _sync: PolyKVClient | None = PrivateAttr(default=None)
    _async: AsyncPolyKVClient | None = PrivateAttr(default=None)
    _served_name: str | None = PrivateAttr(default=None)
    _profile_complete: bool = PrivateAttr(default=False)

    @model_validator(mode="before")
    @classmethod
    def _build_extra(cls, values: Any) -> Any:
        """ChatOpenAI/ChatOllama names; unknown arguments -> ``model_kwargs`` (with a warning) or refused."""
        return build_extra(cls, values)

    @model_validator(mode="after")
    def _check_transport(self) -> "OpencotiChatModel":
        if self.engine is not None and self.base_url is not None:
            raise ValueError("give engine= (in-process) or base_url= (HTTP), not both")
        if self.max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1 (None: no limit)")
        return self

    # ---------------------------------------------------------------- clients
    def _client_kwargs(self) -> dict:
        if self.engine is not None:
            return {"engine": self.engine, "max_retries": self.max_retries}
        return {"base_url": self.base_url or DEFAULT_BASE_URL, "timeout": self.timeout, "max_retries": self.max_retries,
                "api_key": self.api_key.get_secret_value() if self.api_key else None}

    def _with_headers(self, client: Any) -> Any:
        headers = getattr(client, "headers", None)  # the dict the HTTP transport sends (in place)
        if self.default_headers and self.engine is None and isinstance(headers, dict):
            for k, v in self.default_headers.items():
                headers.setdefault(k, v)
        return client

    def _shell(self, given: Any, cached: str, cls: type, http_client: Any) -> Any:
        """The client given by the caller, else the one made once from this model's settings (kept in ``cached``)."""
        if given is not None:
            return given
        if getattr(self, cached) is None:
            kw = self._client_kwargs()
            if http_client is not None and self.engine is None:
                kw["http_client"] = http_client
            setattr(self, cached, self._with_headers(cls(**kw)))
        return getattr(self, cached)

    @property
    def polykv_client(self) -> PolyKVClient:
        """The sync PolyKV client this model talks through (also usable for pool control)."""
        return self._shell(self.client, "_sync", PolyKVClient, self.http_client)

    @property
    def async_polykv_client(self) -> AsyncPolyKVClient:
        """The async PolyKV client."""
        return self._shell(self.async_client, "_async", AsyncPolyKVClient, self.http_async_client)

    # ---------------------------------------------------------------- LangChain plumbing
    @property
    def _llm_type(self) -> str:
        return "opencoti"

    @classmethod
    def is_lc_serializable(cls) -> bool:
        return True

    @classmethod
    def get_lc_namespace(cls) -> list[str]:
        return ["opencoti", "langgraph", "chat_model"]

    @property
    def lc_secrets(self) -> dict[str, str]:
        return {"api_key": "OPENCOTI_API_KEY"}

    def _resolve_model_profile(self) -> ModelProfile | None:
        """The profile, with the served model's name and context: from an in-process engine that is
        loaded, else asked of the server once (``GET /v1/models``, a short timeout, no retries); what
        is not known yet (a server not up, an engine still loading) is filled in before the first call."""
        if self.engine is not None:
            return model_profile(self.engine)
        return model_profile(served=self._served_info(quick=True))

    def _served_info(self, quick: bool = False) -> dict | None:
        """The server's ``GET /v1/models`` entry of the served model (None when it cannot be read;
        ``quick``: one try of at most ``PROFILE_TIMEOUT_S``)."""
        try:
            timeout = min(self.timeout or PROFILE_TIMEOUT_S, PROFILE_TIMEOUT_S) if quick else None
            return self.polykv_client.model_info(timeout=timeout)
        except Exception:  # noqa: BLE001 - a profile is optional: what is missing is asked again later
            return None

    def _complete_profile(self, served: dict | None) -> None:
        """Fill in the served model's name and context where the profile lacks them: from the engine
        once it has loaded, or from ``served`` (the server's ``GET /v1/models`` entry; None: not read)."""
        profile = self.profile
        if profile is None or "max_input_tokens" in profile:
            self._profile_complete = True
            return
        if self.engine is None and served is None:
            return  # the server did not answer: asked again before the next call
        facts = served_model_facts(self.engine, served)
        if facts:
            self.profile = {**facts, **profile}  # type: ignore[assignment]
        # a server that does not say its context is not asked again; an engine still loading is
        self._profile_complete = self.engine is None or "max_input_tokens" in facts

    def _ensure_profile(self) -> None:
        if not self._profile_complete:
            self._complete_profile(None if self.engine is not None else self._served_info(quick=True))

    async def _aensure_profile(self) -> None:
        if not self._profile_complete:
            served = None if self.engine is not None else await asyncio.to_thread(self._served_info, True)
            self._complete_profile(served)

    def served_model_name(self) -> str | None:
        """The served model's id (asked once; None when the server cannot be reached)."""
        if self._served_name is None:
            try:
                self._served_name = self.polykv_client.model_name()
            except Exception:  # noqa: BLE001 - a trace label must never fail the call
                return None
        return self._served_name

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "base_url": None if self.engine is not None else self.base_url,
                "in_process": self.engine is not None, "temperature": self.temperature,
                "max_tokens": self.max_tokens, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                "seed": self.seed, "stop": self.stop, "pool_id": self.pool_id}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        name = kwargs.get("model") if isinstance(kwargs.get("model"), str) else self.model_name
        params = LangSmithParams(ls_provider="opencoti", ls_model_type="chat",
                                 ls_model_name=name or self.served_model_name() or "opencoti")
        temperature = kwargs.get("temperature", self.temperature)
        if temperature is not None:
            params["ls_temperature"] = temperature
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if max_tokens is not None:
            params["ls_max_tokens"] = max_tokens
        stop = stop or kwargs.get("stop") or self.stop
        if stop:
            params["ls_stop"] = list(stop)
        return params

    # ---------------------------------------------------------------- token counting (the served tokenizer)
    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` by the served model's tokenizer (``/tokenize`` over HTTP)."""
        return self.polykv_client.tokenize(text)

    def get_num_tokens(self, text: str) -> int:
        return len(self.get_token_ids(text))

    def get_num_tokens_from_messages(self, messages: list[BaseMessage],
                                     tools: Sequence[dict[str, Any] | type | Callable | BaseTool] | None = None) -> int:
        """Tokens of ``messages`` (+ ``tools``) as the served model's chat template renders them
        (``/apply-template`` + ``/tokenize`` over HTTP), without the generation prompt."""
        client = self.polykv_client
        msgs = convert_messages(messages)
        formatted = [convert_to_openai_tool(t) for t in tools] if tools else None
        try:
            text = client.apply_template(msgs, formatted, add_generation_prompt=False)
        except OpencotiError:
            # a template that refuses this message sequence on its own (e.g. roles must alternate):
            # count each message rendered alone
            return sum(len(client.tokenize(client.apply_template([m], None, add_generation_prompt=False)))
                       for m in msgs)
        return len(client.tokenize(text))

    # ---------------------------------------------------------------- requests
    def _request(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict) -> tuple[dict, dict]:
        """(client kwargs incl. ``messages`` and ``extra_body``, the model's own per-call options)."""
        req: dict[str, Any] = {"temperature": self.temperature, "max_tokens": self.max_tokens, "top_p": self.top_p,
                               "top_k": self.top_k, "min_p": self.min_p, "seed": self.seed, "stop": self.stop,
                               "frequency_penalty": self.frequency_penalty,
                               "presence_penalty": self.presence_penalty, "pool_id": self.pool_id,
                               "session_id": self.session_id, "overcommit": self.overcommit}
        extra = {**self.model_kwargs, **(self.extra_body or {})}
        call, call_extra, own = split_call_kwargs(kwargs, set(type(self).model_fields))
        req.update(call)
        extra.update(call_extra)
        if stop is not None:
            req["stop"] = stop
        if "tool_choice" in req:
            req["tool_choice"] = format_tool_choice(req["tool_choice"])
        if "max_tokens" in extra:
            req["max_tokens"] = extra.pop("max_tokens")
        req = {k: v for k, v in req.items() if v is not None or k == "max_tokens"}
        if req.get("max_tokens") is None:
            req.pop("max_tokens", None)
        # what the client takes by name goes by name; the rest of the request travels in the body
        takes = client_params()
        for k in [k for k in req if k not in takes]:
            extra[k] = req.pop(k)
        if extra:
            req["extra_body"] = extra
        req["messages"] = convert_messages(messages)
        return req, own

    # ---------------------------------------------------------------- streaming (the primitive)
    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        run = _Run(self, *self._request(messages, stop, kwargs))
        self._ensure_profile()
        client = self.polykv_client
        events = client.chat_stream(run.req.pop("messages"), **run.req)
        try:
            for ev in events:
                chunk = run.chunk(ev)
                if ev.finish_reason is not None:
                    sid = run.status_of()
                    yield run.final(ev, client.session_status(sid) if sid else None)
                elif chunk is not None:
                    if run_manager and chunk.message.content:
                        run_manager.on_llm_new_token(chunk.message.content, chunk=chunk)
                    yield chunk
        finally:
            events.close()
            if (sid := run.to_release()) is not None:
                _quietly(client.release_session, sid)

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        run = _Run(self, *self._request(messages, stop, kwargs))
        await self._aensure_profile()
        client = self.async_polykv_client
        events = client.chat_stream(run.req.pop("messages"), **run.req)
        try:
            async for ev in events:
                chunk = run.chunk(ev)
                if ev.finish_reason is not None:
                    sid = run.status_of()
                    yield run.final(ev, await client.session_status(sid) if sid else None)
                elif chunk is not None:
                    if run_manager and chunk.message.content:
                        await run_manager.on_llm_new_token(chunk.message.content, chunk=chunk)
                    yield chunk
        finally:
            await events.aclose()
            if (sid := run.to_release()) is not None:
                await _aquietly(client.release_session, sid)

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        return generate_from_stream(self._stream(messages, stop=stop, run_manager=run_manager, **kwargs))

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        return await agenerate_from_stream(self._astream(messages, stop=stop, run_manager=run_manager, **kwargs))

    # ---------------------------------------------------------------- tools & structured output
    def bind_tools(self, tools: Sequence[dict[str, Any] | type | Callable | BaseTool], *,
                   tool_choice: dict | str | bool | None = None, parallel_tool_calls: bool | None = None,
                   strict: bool | None = None, **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (anything ``convert_to_openai_tool`` takes). ``tool_choice``: a tool name (that
        tool must be called), ``"any"``/``"required"``/True (some tool must be called), ``"auto"``,
        ``"none"``. Extra kwargs (e.g. ``pool_id``, ``session_id``) are bound too."""
        formatted = [convert_to_openai_tool(t, strict=strict) for t in tools]
        if tool_choice is not None and tool_choice is not False:
            choice = format_tool_choice(tool_choice)
            if isinstance(choice, dict):
                names = {t["function"]["name"] for t in formatted}
                name = choice.get("function", {}).get("name")
                if name not in names:
                    raise ValueError(f"tool_choice names {name!r}, which is not among the bound tools {sorted(names)}")
            kwargs["tool_choice"] = choice
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return super().bind(tools=formatted, **kwargs)

    def with_structured_output(self, schema: dict | type, *,
                               method: Literal["function_calling", "json_schema", "json_mode"] = "json_schema",
                               include_raw: bool = False, strict: bool | None = None,
                               **kwargs: Any) -> Runnable[LanguageModelInput, dict | BaseModel]:
        """Structured output. ``json_schema`` (the default, as ChatOpenAI's) constrains the answer to
        the schema (``response_format``) where the server decodes under constraints
        (``params.STRUCTURED_OUTPUT``), else it forces the tool call; a document that ``max_tokens``
        would cut is closed within the budget, so the answer parses; ``function_calling`` forces a
        call of a tool made from ``schema``; ``json_mode`` parses a JSON object from the answer
        (constrained to JSON where supported)."""
        if kwargs:
            raise ValueError(f"unexpected arguments {sorted(kwargs)}")
        return structured_output(self, schema, method, include_raw, strict)

class _Run:
    """One streamed request: what its events become, which ``_stream`` and ``_astream`` share (they
    differ only in their I/O: the client, the callbacks, the session's status and its release)."""

    def __init__(self, model: OpencotiChatModel, req: dict, own: dict):
        self.model, self.req, self.own = model, req, own
        self.info: GenerationInfo | None = None  # the request's (from its first event)

    def chunk(self, ev: ChatChunk) -> ChatGenerationChunk | None:
        """A token event's chunk (None: it makes none; and for the final event, :meth:`final`'s)."""
        self.info = self.info or ev.info
        msg = chunk_from_event(ev) if ev.finish_reason is None else None
        return ChatGenerationChunk(message=msg) if msg is not None else None

    def status_of(self) -> str | None:
        """The session whose status the final chunk reports (None: none)."""
        info = self.info
        return info.session_id if self.model.include_session_status and info is not None and info.session_id else None

    def final(self, end: ChatChunk, status: SessionStatus | None) -> ChatGenerationChunk:
        """The final event's chunk: the answer's metadata (finish reason, usage, the session's ``status``)."""
        model, override = self.model, self.own.get("model")
        name = override if isinstance(override, str) else model.model_name
        if end.model and model._served_name is None:
            model._served_name = end.model
        md = response_metadata(end, self.info, status, name)
        usage = usage_metadata(end) if self.own.get("stream_usage", model.stream_usage) else None
        msg = AIMessageChunk(content="", usage_metadata=usage, response_metadata=md, chunk_position="last")
        return ChatGenerationChunk(message=msg, generation_info={"finish_reason": md["finish_reason"],
                                                                 "model_name": md["model_name"]})

    def to_release(self) -> str | None:
        """The session to release once the stream ends (an anonymous one, where the model says so)."""
        release = self.model.release_anonymous_sessions and not self.req.get("session_id")
        return self.info.session_id if self.info is not None and release else None


def _quietly(fn: Callable, *args) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - best-effort cleanup (the session may be gone already)
        pass


async def _aquietly(fn: Callable, *args) -> None:
    try:
        await fn(*args)
    except Exception:  # noqa: BLE001
        pass
