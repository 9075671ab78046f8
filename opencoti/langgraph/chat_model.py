"""``OpencotiChatModel``: a LangChain chat model over an in-process Engine or a remote ``opencoti serve``.

    from opencoti.langgraph import OpencotiChatModel
    model = OpencotiChatModel(engine=engine)                          # in-process
    model = OpencotiChatModel(base_url="http://127.0.0.1:8080")       # over HTTP
    msg = model.invoke("Hello", pool_id=3, session_id="agent-1")

Streaming is the primitive: ``_stream``/``_astream`` turn the client's chat events into
``AIMessageChunk``s (content deltas, complete tool calls as ``tool_call_chunks``, and a last chunk
with ``usage_metadata`` and ``response_metadata``); ``_generate``/``_agenerate`` aggregate them.
The message converters are pure module-level functions (unit-tested directly).
"""

from __future__ import annotations

import json
from operator import itemgetter
from typing import Any, AsyncIterator, Callable, Iterator, Literal, Sequence

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LanguageModelInput
from langchain_core.language_models.chat_models import (BaseChatModel, LangSmithParams, agenerate_from_stream,
                                                        generate_from_stream)
from langchain_core.messages import (AIMessage, AIMessageChunk, BaseMessage, ChatMessage, HumanMessage,
                                     SystemMessage, ToolMessage)
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.exceptions import OutputParserException
from langchain_core.output_parsers import JsonOutputKeyToolsParser, PydanticToolsParser
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableLambda, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils import from_env, secret_from_env
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, model_validator

from ..client import AsyncPolyKVClient, ChatChunk, GenerationInfo, PolyKVClient, SessionStatus

DEFAULT_BASE_URL = "http://127.0.0.1:8080"

# Per-call keyword arguments that go into the chat request (everything else is ignored).
_REQUEST_KEYS = ("tools", "tool_choice", "parallel_tool_calls", "pool_id", "session_id", "overcommit",
                 "shared_prefix_n_tokens", "temperature", "max_tokens", "top_p", "top_k", "min_p", "seed", "stop",
                 "ignore_eos")


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
    return md


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
            return schema.model_validate(value) if schema is not None else value
    raise OutputParserException(f"no JSON object in the answer: {text[:200]!r}", llm_output=text)


# ============================================================================ the model
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
    """Model id for traces and ``response_metadata`` (default: what the server reports). One engine
    serves one model, so this does not select a model."""
    temperature: float | None = None
    """Sampling temperature; 0 is greedy (server default 0.8)."""
    max_tokens: int | None = None
    """Tokens to generate at most (None: until end of turn or the context is full)."""
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
    """URL of a running ``opencoti serve`` (env ``OPENCOTI_BASE_URL``; default http://127.0.0.1:8080)."""
    api_key: SecretStr | None = Field(default_factory=secret_from_env("OPENCOTI_API_KEY", default=None))
    """The server's API key (env ``OPENCOTI_API_KEY``)."""
    timeout: float | None = 120.0
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

    @model_validator(mode="after")
    def _check_transport(self) -> "OpencotiChatModel":
        if self.engine is not None and self.base_url is not None:
            raise ValueError("give engine= (in-process) or base_url= (HTTP), not both")
        if self.max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        return self

    # ---------------------------------------------------------------- clients
    def _client_kwargs(self) -> dict:
        if self.engine is not None:
            return {"engine": self.engine, "max_retries": self.max_retries}
        return {"base_url": self.base_url or DEFAULT_BASE_URL, "timeout": self.timeout, "max_retries": self.max_retries,
                "api_key": self.api_key.get_secret_value() if self.api_key else None}

    @property
    def polykv_client(self) -> PolyKVClient:
        """The sync PolyKV client this model talks through (also usable for pool control)."""
        if self.client is not None:
            return self.client
        if self._sync is None:
            kw = self._client_kwargs()
            if self.http_client is not None and self.engine is None:
                kw["http_client"] = self.http_client
            self._sync = PolyKVClient(**kw)
        return self._sync

    @property
    def async_polykv_client(self) -> AsyncPolyKVClient:
        """The async PolyKV client."""
        if self.async_client is not None:
            return self.async_client
        if self._async is None:
            kw = self._client_kwargs()
            if self.http_async_client is not None and self.engine is None:
                kw["http_client"] = self.http_async_client
            self._async = AsyncPolyKVClient(**kw)
        return self._async

    # ---------------------------------------------------------------- LangChain plumbing
    @property
    def _llm_type(self) -> str:
        return "opencoti"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "base_url": None if self.engine is not None else self.base_url,
                "in_process": self.engine is not None, "temperature": self.temperature,
                "max_tokens": self.max_tokens, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                "seed": self.seed, "stop": self.stop, "pool_id": self.pool_id}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(ls_provider="opencoti", ls_model_type="chat",
                                 ls_model_name=kwargs.get("model") if isinstance(kwargs.get("model"), str)
                                 else (self.model_name or "opencoti"))
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

    def _request(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict) -> dict:
        req: dict[str, Any] = {"temperature": self.temperature, "max_tokens": self.max_tokens, "top_p": self.top_p,
                               "top_k": self.top_k, "min_p": self.min_p, "seed": self.seed, "stop": self.stop,
                               "pool_id": self.pool_id, "session_id": self.session_id,
                               "overcommit": self.overcommit}
        req.update({k: v for k, v in kwargs.items() if k in _REQUEST_KEYS})
        if stop is not None:
            req["stop"] = stop
        if "tool_choice" in req:
            req["tool_choice"] = format_tool_choice(req["tool_choice"])
        req = {k: v for k, v in req.items() if v is not None}
        req["messages"] = convert_messages(messages)
        return req

    def _should_release(self, req: dict) -> bool:
        return self.release_anonymous_sessions and not req.get("session_id")

    def _final(self, end: ChatChunk, info: GenerationInfo | None, status: SessionStatus | None,
               model_override: Any) -> ChatGenerationChunk:
        name = model_override if isinstance(model_override, str) else self.model_name
        md = response_metadata(end, info, status, name)
        msg = AIMessageChunk(content="", usage_metadata=usage_metadata(end), response_metadata=md,
                             chunk_position="last")
        return ChatGenerationChunk(message=msg, generation_info={"finish_reason": md["finish_reason"],
                                                                 "model_name": md["model_name"]})

    # ---------------------------------------------------------------- streaming (the primitive)
    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        req = self._request(messages, stop, kwargs)
        client = self.polykv_client
        msgs = req.pop("messages")
        info: GenerationInfo | None = None
        events = client.chat_stream(msgs, **req)
        try:
            for ev in events:
                info = info or ev.info
                if ev.finish_reason is not None:
                    status = None
                    if self.include_session_status and info is not None and info.session_id:
                        status = client.session_status(info.session_id)
                    yield self._final(ev, info, status, kwargs.get("model"))
                    continue
                msg = chunk_from_event(ev)
                if msg is not None:
                    chunk = ChatGenerationChunk(message=msg)
                    if run_manager and msg.content:
                        run_manager.on_llm_new_token(msg.content, chunk=chunk)
                    yield chunk
        finally:
            events.close()
            if info is not None and self._should_release(req):
                _quietly(client.release_session, info.session_id)

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        req = self._request(messages, stop, kwargs)
        client = self.async_polykv_client
        msgs = req.pop("messages")
        info: GenerationInfo | None = None
        events = client.chat_stream(msgs, **req)
        try:
            async for ev in events:
                info = info or ev.info
                if ev.finish_reason is not None:
                    status = None
                    if self.include_session_status and info is not None and info.session_id:
                        status = await client.session_status(info.session_id)
                    yield self._final(ev, info, status, kwargs.get("model"))
                    continue
                msg = chunk_from_event(ev)
                if msg is not None:
                    chunk = ChatGenerationChunk(message=msg)
                    if run_manager and msg.content:
                        await run_manager.on_llm_new_token(msg.content, chunk=chunk)
                    yield chunk
        finally:
            await events.aclose()
            if info is not None and self._should_release(req):
                await _aquietly(client.release_session, info.session_id)

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
                               method: Literal["function_calling", "json_schema", "json_mode"] = "function_calling",
                               include_raw: bool = False, strict: bool | None = None,
                               **kwargs: Any) -> Runnable[LanguageModelInput, dict | BaseModel]:
        """Structured output. ``function_calling`` and ``json_schema`` force a call of a tool made
        from ``schema`` (there is no constrained decoding, so both use the forced tool call);
        ``json_mode`` parses a JSON object from the text answer (ask for JSON in the prompt)."""
        if kwargs:
            raise ValueError(f"unexpected arguments {sorted(kwargs)}")
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        if method in ("function_calling", "json_schema"):
            tool = convert_to_openai_tool(schema, strict=strict)
            name = tool["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, strict=strict,
                                  ls_structured_output_format={"kwargs": {"method": method, "strict": strict},
                                                               "schema": tool})
            parser: Runnable = (PydanticToolsParser(tools=[schema], first_tool_only=True) if is_pydantic
                                else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True))
        elif method == "json_mode":
            llm = self.bind(ls_structured_output_format={"kwargs": {"method": method}, "schema": schema})
            parser = RunnableLambda(lambda msg: parse_json_answer(msg, schema if is_pydantic else None))
        else:
            raise ValueError(f"method must be function_calling | json_schema | json_mode, got {method!r}")
        if not include_raw:
            return llm | parser
        parser_assign = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        parser_none = RunnablePassthrough.assign(parsed=lambda _: None)
        with_fallback = parser_assign.with_fallbacks([parser_none], exception_key="parsing_error")
        return RunnableMap(raw=llm) | with_fallback


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


# ============================================================================ from the environment
_ENGINES: dict[str, Any] = {}


def model_from_env(**fields: Any) -> OpencotiChatModel:
    """An ``OpencotiChatModel`` chosen by the environment, for graphs served by ``langgraph dev``:
    ``OPENCOTI_BASE_URL`` set -> over HTTP (with ``OPENCOTI_API_KEY``); otherwise an in-process
    engine on ``OPENCOTI_MODEL`` (default: the bundled model; ``tiny:llama`` for tests), made once
    per process and shared by every graph."""
    import os
    if os.environ.get("OPENCOTI_BASE_URL"):
        return OpencotiChatModel(**fields)
    name = os.environ.get("OPENCOTI_MODEL") or "default"
    eng = _ENGINES.get(name)
    if eng is None or eng.is_closed:
        from ..engine import Engine, EngineConfig
        kv = os.environ.get("OPENCOTI_KV_BUDGET_TOKENS")
        eng = _ENGINES[name] = Engine(EngineConfig(model=None if name == "default" else name,
                                                   kv_budget_tokens=int(kv) if kv else None))
    return OpencotiChatModel(engine=eng, **fields)
