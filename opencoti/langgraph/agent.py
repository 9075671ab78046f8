"""``PolyKVMiddleware``: PolyKV for ``langchain.agents.create_agent``.

    agent = create_agent(model, tools=[*my_tools, *polykv_tools(model)], system_prompt=SYSTEM,
                         middleware=[PolyKVMiddleware()], checkpointer=InMemorySaver())

Before each model call it

* puts the system prompt + tools in a **pool** (made once, recorded in ``state["pools"]`` and
  re-created from that record if the engine or server restarted — ``ensure_pool``), so every
  thread and every agent with the same prompt and tools shares that KV;
* runs the call in the thread's **session** (``session="thread"``: ``<prefix><thread_id>``), so a
  later turn of the thread reuses the KV of the earlier ones — ``usage_metadata`` shows it as
  ``input_token_details.cache_read``. With ``session=None`` no session is named: the reuse then
  comes from the pool, and from the engine's automatic prefix reuse where it has one;

and after it copies the answer's pool, session, tps and compaction pressure into the state
(``polykv_update``). It needs the agent's model to be an ``OpencotiChatModel`` (or a ``client=``).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Awaitable, Callable, Literal, Optional

from langchain.agents.middleware import AgentMiddleware, AgentState, ModelRequest, ModelResponse
from langchain.agents.middleware.types import ExtendedModelResponse
from langchain_core.messages import AIMessage
from langchain_core.utils.function_calling import convert_to_openai_tool
from langgraph.config import get_config
from langgraph.types import Command
from typing_extensions import Annotated, NotRequired

from ._clients import ClientPair, client_pair
from ..client import PoolNotFoundError
from .pools import POOLS_KEY, PoolSpec, _transport, aensure_pool, ensure_pool, merge_pools, pool_spec
from .state import append_list, keep_latest, polykv_update
from .steps import Steps, adrive, call, drive


# Prompt pools made by this process, by (transport, prompt key): threads with the same system
# prompt and tools share one.
_PROMPT_POOLS: dict[tuple, PoolSpec] = {}


class PolyKVAgentState(AgentState):
    """``create_agent``'s state plus the PolyKV keys the middleware keeps."""

    pool_id: NotRequired[Annotated[Optional[int], keep_latest]]
    root_pool_id: NotRequired[Annotated[Optional[int], keep_latest]]
    session_id: NotRequired[Annotated[Optional[str], keep_latest]]
    session_tps: NotRequired[Annotated[Optional[float], keep_latest]]
    compaction_pressure: NotRequired[Annotated[Optional[float], keep_latest]]
    ctx_headroom_tokens: NotRequired[Annotated[Optional[int], keep_latest]]
    pools: NotRequired[Annotated[dict[str, PoolSpec], merge_pools]]
    pools_recreated: NotRequired[Annotated[list[dict], append_list]]
    prompt_pool_key: NotRequired[Annotated[Optional[str], keep_latest]]


class PolyKVMiddleware(AgentMiddleware):
    """Pool + session per thread for ``create_agent`` (see the module docstring).

    session: ``"thread"`` (one session per thread id; no thread id: none), ``None`` (no session),
        or a function ``(state, config) -> session id | None``.
    session_prefix: the prefix of per-thread session ids.
    prompt_pool: put the system prompt + tools in a shared pool (pinned when ``pinned``).
    client: a PolyKVClient / AsyncPolyKVClient / Engine when the model is not an OpencotiChatModel.
    """

    state_schema = PolyKVAgentState

    def __init__(self, *, session: Literal["thread"] | None | Callable[[dict, dict], Optional[str]] = "thread",
                 session_prefix: str = "thread-", prompt_pool: bool = True, pinned: bool = False,
                 client: Any = None):
        super().__init__()
        if not (session in ("thread", None) or callable(session)):
            raise ValueError(f"session must be 'thread', None or a function, got {session!r}")
        self.session, self.session_prefix = session, session_prefix
        self.prompt_pool, self.pinned = prompt_pool, pinned
        self._clients: ClientPair | None = client_pair(client) if client is not None else None

    # ---------------------------------------------------------------- pieces
    def _pair(self, request: ModelRequest) -> ClientPair:
        if self._clients is not None:
            return self._clients
        from .chat_model import OpencotiChatModel
        if isinstance(request.model, OpencotiChatModel):
            return client_pair(request.model)
        raise TypeError("PolyKVMiddleware needs an OpencotiChatModel as the agent's model, or client=")

    def _session_id(self, state: dict) -> Optional[str]:
        if self.session is None:
            return None
        try:
            config = get_config()
        except RuntimeError:
            config = {}
        if callable(self.session):
            return self.session(state, config)
        thread = (config.get("configurable") or {}).get("thread_id")
        return f"{self.session_prefix}{thread}" if thread is not None else None

    @staticmethod
    def _prefix(request: ModelRequest) -> tuple[list[dict], list[dict] | None, str] | None:
        """(messages, tools, key) of the prompt pool: the system message + the tools, as rendered."""
        system = request.system_message
        if system is None and not request.tools:
            return None
        messages = [{"role": "system", "content": system.text}] if system is not None else []
        tools = [t if isinstance(t, dict) and "function" in t else convert_to_openai_tool(t)
                 for t in request.tools] or None
        if not messages:
            return None  # a pool of tools alone would not be a prefix of the chat requests
        key = hashlib.sha1(json.dumps([messages, tools], sort_keys=True, default=str).encode()).hexdigest()[:16]
        return messages, tools, key

    def _plan(self, request: ModelRequest) -> tuple[dict, Optional[tuple]]:
        state = request.state if isinstance(request.state, dict) else {}
        settings: dict[str, Any] = {}
        sid = self._session_id(state)
        if sid is not None:
            settings["session_id"] = sid
        prefix = self._prefix(request) if self.prompt_pool else None
        return settings, prefix

    def _after(self, response: Any, update: dict) -> Any:
        result = response.result if isinstance(response, ModelResponse) else [response]
        last = next((m for m in reversed(result) if isinstance(m, AIMessage)), None)
        update = {**update, **polykv_update(last)}
        if not update:
            return response
        if isinstance(response, AIMessage):
            response = ModelResponse(result=[response])
        return ExtendedModelResponse(model_response=response, command=Command(update=update))

    def _known(self, client: Any, state: dict, key: str) -> Optional[tuple[str, dict]]:
        """The prompt pool this thread (its state) or this process already has for ``key``."""
        if state.get("prompt_pool_key") == key and state.get("root_pool_id") is not None:
            return "state", state
        spec = _PROMPT_POOLS.get((_transport(client), key))
        if spec is not None:
            return "process", {POOLS_KEY: {str(spec["pool_id"]): spec}, "root_pool_id": spec["pool_id"]}
        return None

    @staticmethod
    def _made(client: Any, pool: Any, messages: list, tools: Any, key: str) -> dict:
        spec = pool_spec(pool, messages=messages, tools=tools)
        _PROMPT_POOLS[(_transport(client), key)] = spec
        return {"root_pool_id": pool.pool_id, "prompt_pool_key": key, POOLS_KEY: {str(pool.pool_id): spec}}

    @staticmethod
    def _found(where: str, known: dict, live: int, moved: dict, key: str) -> dict:
        if where == "state":
            return moved
        spec = {**known[POOLS_KEY][str(known["root_pool_id"])]}
        moved_specs = moved.get(POOLS_KEY) or {}
        spec = moved_specs.get(str(live), spec)
        return {**{k: v for k, v in moved.items() if k != POOLS_KEY}, "root_pool_id": live, "prompt_pool_key": key,
                POOLS_KEY: {str(live): spec}}

    def _prompt_pool(self, client: Any, state: dict, prefix: tuple) -> Steps:
        """(pool id, state update) of the prompt pool: the one this thread or this process already has
        (re-created if it is gone), else a new one."""
        messages, tools, key = prefix
        known = self._known(client, state, key)
        if known is not None:
            try:
                pid, moved = yield ("ensure", client, known[1], known[1]["root_pool_id"])
            except PoolNotFoundError:
                pass
            else:
                update = self._found(known[0], known[1], pid, moved, key)
                if known[0] == "process" or moved:
                    _PROMPT_POOLS[(_transport(client), key)] = update.get(POOLS_KEY, {}).get(str(pid)) or \
                        _PROMPT_POOLS.get((_transport(client), key))
                return pid, update
        pool = yield ("call", client, "create_pool", (), {"messages": messages, "tools": tools, "pinned": self.pinned,
                                                           "label": "agent prompt"})
        return pool.pool_id, self._made(client, pool, messages, tools, key)

    def _prepared(self, request: ModelRequest, side: str) -> Steps:
        """(the request with this middleware's model settings, the state update for the answer);
        ``side``: the client of the pair that runs the steps (``"sync"`` or ``"aio"``)."""
        settings, prefix = self._plan(request)
        update: dict = {}
        if prefix is not None:
            state = request.state if isinstance(request.state, dict) else {}
            client = getattr(self._pair(request), side)
            settings["pool_id"], update = yield from self._prompt_pool(client, state, prefix)
        return request.override(model_settings={**request.model_settings, **settings}), update

    # ---------------------------------------------------------------- hooks
    def wrap_model_call(self, request: ModelRequest, handler: Callable[[ModelRequest], ModelResponse]) -> Any:
        request, update = drive(self._prepared(request, "sync"), {"ensure": ensure_pool, "call": call})
        return self._after(handler(request), update)

    async def awrap_model_call(self, request: ModelRequest,
                               handler: Callable[[ModelRequest], Awaitable[ModelResponse]]) -> Any:
        request, update = await adrive(self._prepared(request, "aio"), {"ensure": aensure_pool, "call": call})
        return self._after(await handler(request), update)
