"""Pool-control tools for agents: ``create_pool``, ``fork_pool``, ``pool_status``, ``session_tps``,
``capacity``, ``release_pool`` as LangChain tools with pydantic argument schemas.

    tools = polykv_tools(client)                  # a PolyKVClient / AsyncPolyKVClient / Engine / OpencotiChatModel
    model.bind_tools(tools); ToolNode(tools)      # or create_agent(model, tools=[*my_tools, *tools])

Each tool returns a JSON-able dict, sync or async. Errors of the control plane (unknown pool,
prefix contract violated, a pool with children, ...) come back to the model as the tool's error
text instead of failing the graph. Run by a ``ToolNode`` (or ``create_agent``), the tools also
keep ``state["pools"]`` (``opencoti.langgraph.pools``): the pools they create are recorded, the
ones they release forgotten, and a pool id the model gives that is gone (an engine or server
restart) is re-created from the record and used instead — the answer says so
(``"recreated": [...]``).
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any, Generator, Optional

from langchain_core.messages import ToolMessage
from langchain_core.tools import BaseTool, StructuredTool, ToolException
from langgraph.prebuilt import ToolRuntime
from langgraph.types import Command
from pydantic import BaseModel, ConfigDict, Field

from ..client import OpencotiError
from ._clients import client_pair
from .pools import POOLS_KEY, aensure_pool, ensure_pool, merge_pools, pool_spec
from .steps import adrive, call, drive


class _Args(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)

    runtime: ToolRuntime = Field(None)
    """Injected by ToolNode / create_agent (the graph state, the tool call id); not shown to the model."""


class ChatMessageArg(BaseModel):
    """One chat message of a pool prefix."""

    role: str = Field(description="system | user | assistant | tool")
    content: str = Field(description="the message text")


class CreatePoolArgs(_Args):
    """Create a root pool: a shared, immutable prefix other agents can attach to."""

    messages: Optional[list[ChatMessageArg]] = Field(
        None, description="the prefix as chat messages (e.g. the system prompt), rendered like a chat request")
    text: Optional[str] = Field(None, description="the prefix as raw text (instead of messages)")
    from_session: Optional[str] = Field(None, description="snapshot this idle session's context as the prefix")
    as_root: bool = Field(False, description="with from_session of a session attached to a pool: make an "
                                             "independent root (the shared part is computed again) instead of a "
                                             "zero-copy child of that pool")
    pinned: bool = Field(False, description="never evict this pool")
    label: str = Field("", description="a free-form label")


class ForkPoolArgs(_Args):
    """Fork a pool: extend it (a sub-task context for sub-agents) or branch it (a different toolset)."""

    parent_pool_id: int = Field(description="the pool to fork")
    messages: Optional[list[ChatMessageArg]] = Field(
        None, description="the child's FULL prefix as chat messages: the parent's messages followed by the new ones")
    text: Optional[str] = Field(None, description="the child's FULL prefix as raw text (instead of messages)")
    from_session: Optional[str] = Field(None, description="snapshot this idle session's context instead")
    branch_pos: Optional[int] = Field(
        None, description="token position D to branch at (default: the parent's length, i.e. extend)")
    label: str = Field("", description="a free-form label")


class PoolIdArgs(_Args):
    """A pool."""

    pool_id: int = Field(description="the pool id")


class ReleasePoolArgs(PoolIdArgs):
    """A pool to release."""

    immediate: bool = Field(False, description="release now instead of after the pool's grace period")


class PoolStatusArgs(_Args):
    """Status of one pool (with its subtree), or of the whole pool tree."""

    pool_id: Optional[int] = Field(None, description="the pool id; omit for the whole tree")


class SessionTpsArgs(_Args):
    """Live decode speed: one session's, or the engine-wide summary."""

    session_id: Optional[str] = Field(None, description="the session id; omit for the engine-wide summary")


class CapacityArgs(_Args):
    """Whether one more sub-agent (a new session) fits a pool now, and why."""

    pool_id: int = Field(description="the pool the new sub-agent would attach to")
    expected_tokens: Optional[int] = Field(None, description="tokens the new sub-agent is expected to use")


def _messages(msgs: Optional[list[ChatMessageArg]]) -> Optional[list[dict]]:
    return None if msgs is None else [{"role": m.role, "content": m.content} for m in msgs]


def _pool_summary(p) -> dict:
    d = p.model_dump(exclude={"subtree"})
    d["sessions"] = [{k: s.get(k) for k in ("session_id", "suffix_n_tokens", "tps_ewma", "ttft_ms", "state")} for s in p.sessions]
    if p.subtree:
        d["subtree"] = [x.pool_id for x in p.subtree]
    return d


def _tps_summary(snap, session_id: Optional[str]) -> dict:
    if session_id is not None:
        row = snap.session(session_id)
        if row is None:
            raise ToolException(f"session {session_id!r} not found")
        return row.model_dump()
    return {"aggregate_tps": snap.aggregate_tps, "mean_active_tps": snap.mean_active_tps,
            "n_warming": snap.n_warming, "n_sessions": len(snap.sessions),
            "compaction_pressure": snap.compaction_pressure}


def _capacity_summary(cap) -> dict:
    keys = ("pool_id", "can_admit", "reason", "sessions_remaining", "headroom_sessions", "tps_headroom_sessions",
            "mean_active_tps", "projected_mean_tps_if_admitted",
            "target_tps_per_session", "kv_headroom_pct", "settling", "settle_remaining_ms", "n_warming",
            "n_pool_sessions", "guaranteed", "compaction_pressure")
    d = cap.model_dump()
    return {k: d.get(k) for k in keys}


# ============================================================================ the tools, as steps
# Each tool is a generator of steps -- ("call", method, args, kwargs) -> the client's answer,
# ("ensure", pool_id) -> the live id -- returning (answer, pools update); the sync and the async
# driver run the same steps.
Steps = Generator[tuple, Any, tuple[dict, dict]]


def _source(messages, text, from_session) -> dict:
    return {k: v for k, v in (("messages", _messages(messages)), ("text", text), ("from_session", from_session))
            if v is not None}


def _create_pool(messages=None, text=None, from_session=None, as_root=False, pinned=False, label="") -> Steps:
    src = _source(messages, text, from_session)
    pool = yield ("call", "create_pool", (), {**src, "pinned": pinned, "label": label, "as_root": as_root})
    return _pool_summary(pool), _record(pool, src)


def _fork_pool(parent_pool_id, messages=None, text=None, from_session=None, branch_pos=None, label="") -> Steps:
    parent = yield ("ensure", parent_pool_id)
    src = _source(messages, text, from_session)
    pool = yield ("call", "fork_pool", (parent,), {**src, "branch_pos": branch_pos, "label": label})
    return _pool_summary(pool), _record(pool, src)


def _pool_status(pool_id=None) -> Steps:
    if pool_id is None:
        tree = yield ("call", "pools", (), {})
        return {"pools": [_pool_summary(p) for p in tree.pools], "tree_depth": tree.tree_depth,
                "kv_pages_used": tree.kv_pages_used, "kv_pages_total": tree.kv_pages_total}, {}
    live = yield ("ensure", pool_id)
    return _pool_summary((yield ("call", "pool", (live,), {}))), {}


def _session_tps(session_id=None) -> Steps:
    return _tps_summary((yield ("call", "tps", (), {})), session_id), {}


def _capacity(pool_id, expected_tokens=None) -> Steps:
    live = yield ("ensure", pool_id)
    return _capacity_summary((yield ("call", "capacity", (live,), {"expected_tokens": expected_tokens}))), {}


def _release_pool(pool_id, immediate=False) -> Steps:
    yield ("call", "release_pool", (pool_id,), {"immediate": immediate})
    return {"pool_id": pool_id, "released": True}, {str(pool_id): None}


def _record(pool, src: dict) -> dict:
    if "from_session" in src:
        return {str(pool.pool_id): pool_spec(pool, from_session=src["from_session"])}
    return {str(pool.pool_id): pool_spec(pool, **src)} if src else {}


# ============================================================================ drivers
class _Known:
    """The pools one tool call knows: the graph state's, plus those it recorded or re-created so far."""

    def __init__(self, runtime: Any):
        st = getattr(runtime, "state", None) if runtime is not None else None
        self.runtime, self.state = runtime, st if isinstance(st, dict) else {}
        self.pools: dict = {}
        self.moved: list[dict] = []

    def view(self) -> dict:
        """The state an ``ensure`` step sees."""
        return {**self.state, POOLS_KEY: merge_pools(self.state.get(POOLS_KEY), self.pools)}

    def ensured(self, live_and_update: tuple[int, dict]) -> int:
        live, upd = live_and_update
        self.pools.update(upd.get(POOLS_KEY) or {})
        self.moved += upd.get("pools_recreated") or []
        return live

    def finish(self, name: str, answer: dict, recorded: dict) -> Any:
        """The tool's answer, or a ``Command`` with it and the pools update when the tool runs in a graph."""
        pools, moved, runtime = {**self.pools, **recorded}, self.moved, self.runtime
        if moved:
            answer = {**answer, "recreated": moved}
        if runtime is None or getattr(runtime, "tool_call_id", None) is None or not (pools or moved):
            return answer
        update: dict[str, Any] = {POOLS_KEY: pools} if pools else {}
        if moved:
            update["pools_recreated"] = moved
        update["messages"] = [ToolMessage(json.dumps(answer, default=str), tool_call_id=runtime.tool_call_id,
                                          name=name)]
        return Command(update=update)


def _errors_as_tool_errors(steps: Steps) -> Steps:
    try:
        return (yield from steps)
    except OpencotiError as e:
        raise ToolException(f"{type(e).__name__}: {e}") from e


def _sync_tool(name: str, steps, clients) -> Any:
    def run(runtime: Any = None, **kw):
        known = _Known(runtime)
        answer, recorded = drive(_errors_as_tool_errors(steps(**kw)), {
            "ensure": lambda pool_id: known.ensured(ensure_pool(clients.sync, known.view(), pool_id)),
            "call": partial(call, clients.sync)})
        return known.finish(name, answer, recorded)
    return run


def _async_tool(name: str, steps, clients) -> Any:
    async def run(runtime: Any = None, **kw):
        known = _Known(runtime)

        async def ensure(pool_id: int) -> int:
            return known.ensured(await aensure_pool(clients.aio, known.view(), pool_id))
        answer, recorded = await adrive(_errors_as_tool_errors(steps(**kw)), {
            "ensure": ensure, "call": partial(call, clients.aio)})
        return known.finish(name, answer, recorded)
    return run


_SPECS = [
    ("create_pool", _create_pool, CreatePoolArgs,
     "Create a shared prefix pool (system prompt, tools, a task brief) that sub-agents attach to; "
     "they then pay only for their own suffix. Returns the pool (pool_id, prefix_len, ...)."),
    ("fork_pool", _fork_pool, ForkPoolArgs,
     "Fork a pool: extend it with a sub-task context (give the FULL prefix: the parent's messages plus the "
     "new ones), or branch at an earlier position for a different toolset. Returns the child pool."),
    ("pool_status", _pool_status, PoolStatusArgs,
     "Status of a pool (prefix length, KV bytes, attached sessions, children) or of the whole pool tree."),
    ("session_tps", _session_tps, SessionTpsArgs,
     "Live decode speed (tokens/s) and context headroom of a session, or the engine-wide summary."),
    ("capacity", _capacity, CapacityArgs,
     "Whether one more sub-agent fits a pool under its tps floor and KV/context headroom, and why. "
     "Check it before spawning; when 'settling' is true, wait instead of spawning."),
    ("release_pool", _release_pool, ReleasePoolArgs,
     "Release a pool you no longer need (release child pools first). It stays usable for a short grace "
     "period unless immediate is true."),
]


def polykv_tools(client: Any, *, include: Optional[list[str]] = None) -> list[BaseTool]:
    """The pool-control tools over ``client`` (a PolyKVClient, AsyncPolyKVClient, Engine or
    OpencotiChatModel), usable with ``invoke`` and ``ainvoke``. ``include``: only these tool names."""
    clients = client_pair(client)
    names = [n for n, *_ in _SPECS]
    if include is not None and (bad := sorted(set(include) - set(names))):
        raise ValueError(f"unknown tool names {bad}; the tools are {names}")
    return [StructuredTool.from_function(func=_sync_tool(name, steps, clients),
                                         coroutine=_async_tool(name, steps, clients), name=name,
                                         description=description, args_schema=schema, handle_tool_error=True)
            for name, steps, schema, description in _SPECS if include is None or name in include]
