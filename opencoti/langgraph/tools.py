"""Pool-control tools for agents: ``create_pool``, ``fork_pool``, ``pool_status``, ``session_tps``,
``capacity``, ``release_pool`` as LangChain tools with pydantic argument schemas.

    tools = polykv_tools(client)                  # a PolyKVClient / AsyncPolyKVClient / Engine / OpencotiChatModel
    model.bind_tools(tools); ToolNode(tools)

Each tool returns a JSON-able dict. Errors of the control plane (unknown pool, prefix contract
violated, a pool with children, ...) come back to the model as the tool's error text instead of
failing the graph.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Optional

from langchain_core.tools import BaseTool, StructuredTool, ToolException
from pydantic import BaseModel, Field

from ..client import AsyncPolyKVClient, OpencotiError, PolyKVClient


class ChatMessageArg(BaseModel):
    """One chat message of a pool prefix."""

    role: str = Field(description="system | user | assistant | tool")
    content: str = Field(description="the message text")


class CreatePoolArgs(BaseModel):
    """Create a root pool: a shared, immutable prefix other agents can attach to."""

    messages: Optional[list[ChatMessageArg]] = Field(
        None, description="the prefix as chat messages (e.g. the system prompt), rendered like a chat request")
    text: Optional[str] = Field(None, description="the prefix as raw text (instead of messages)")
    from_session: Optional[str] = Field(None, description="snapshot this idle session's context as the prefix")
    pinned: bool = Field(False, description="never evict this pool")
    label: str = Field("", description="a free-form label")


class ForkPoolArgs(BaseModel):
    """Fork a pool: extend it (a sub-task context for sub-agents) or branch it (a different toolset)."""

    parent_pool_id: int = Field(description="the pool to fork")
    messages: Optional[list[ChatMessageArg]] = Field(
        None, description="the child's FULL prefix as chat messages: the parent's messages followed by the new ones")
    text: Optional[str] = Field(None, description="the child's FULL prefix as raw text (instead of messages)")
    from_session: Optional[str] = Field(None, description="snapshot this idle session's context instead")
    branch_pos: Optional[int] = Field(
        None, description="token position D to branch at (default: the parent's length, i.e. extend)")
    label: str = Field("", description="a free-form label")


class PoolIdArgs(BaseModel):
    """A pool."""

    pool_id: int = Field(description="the pool id")


class PoolStatusArgs(BaseModel):
    """Status of one pool (with its subtree), or of the whole pool tree."""

    pool_id: Optional[int] = Field(None, description="the pool id; omit for the whole tree")


class SessionTpsArgs(BaseModel):
    """Live decode speed: one session's, or the engine-wide summary."""

    session_id: Optional[str] = Field(None, description="the session id; omit for the engine-wide summary")


class CapacityArgs(BaseModel):
    """Whether one more sub-agent (a new session) fits a pool now, and why."""

    pool_id: int = Field(description="the pool the new sub-agent would attach to")
    expected_tokens: Optional[int] = Field(None, description="tokens the new sub-agent is expected to use")


def _resolve(client: Any) -> tuple[PolyKVClient | None, AsyncPolyKVClient | None]:
    from .chat_model import OpencotiChatModel
    if isinstance(client, OpencotiChatModel):
        return client.polykv_client, client.async_polykv_client
    if isinstance(client, PolyKVClient):
        return client, None
    if isinstance(client, AsyncPolyKVClient):
        return None, client
    if hasattr(client, "create_pool") and hasattr(client, "capacity") and hasattr(client, "tps_snapshot"):
        return PolyKVClient(engine=client), AsyncPolyKVClient(engine=client)
    raise TypeError(f"polykv_tools needs a PolyKVClient, AsyncPolyKVClient, Engine or OpencotiChatModel, "
                    f"got {type(client).__name__}")


def _messages(msgs: Optional[list[ChatMessageArg]]) -> Optional[list[dict]]:
    return None if msgs is None else [{"role": m.role, "content": m.content} for m in msgs]


def _pool_summary(p) -> dict:
    d = p.model_dump(exclude={"subtree"})
    d["sessions"] = [{k: s.get(k) for k in ("session_id", "suffix_n_tokens", "tps_ewma", "state")} for s in p.sessions]
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
    keys = ("pool_id", "can_admit", "reason", "headroom_sessions", "mean_active_tps", "projected_mean_tps_if_admitted",
            "target_tps_per_session", "kv_headroom_pct", "settling", "settle_remaining_ms", "n_warming",
            "n_pool_sessions", "guaranteed", "compaction_pressure")
    d = cap.model_dump()
    return {k: d.get(k) for k in keys}


def _wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(**kw):
        try:
            return fn(**kw)
        except OpencotiError as e:
            raise ToolException(f"{type(e).__name__}: {e}") from e
    return run


def _awrap(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def run(**kw):
        try:
            return await fn(**kw)
        except OpencotiError as e:
            raise ToolException(f"{type(e).__name__}: {e}") from e
    return run


def polykv_tools(client: Any, *, include: Optional[list[str]] = None) -> list[BaseTool]:
    """The pool-control tools over ``client`` (a PolyKVClient, AsyncPolyKVClient, Engine or
    OpencotiChatModel). ``include``: only these tool names."""
    sync, aio = _resolve(client)

    # ------------------------------------------------------------ sync implementations
    def create_pool(messages=None, text=None, from_session=None, pinned=False, label=""):
        return _pool_summary(sync.create_pool(messages=_messages(messages), text=text, from_session=from_session,
                                              pinned=pinned, label=label))

    def fork_pool(parent_pool_id, messages=None, text=None, from_session=None, branch_pos=None, label=""):
        return _pool_summary(sync.fork_pool(parent_pool_id, messages=_messages(messages), text=text,
                                            from_session=from_session, branch_pos=branch_pos, label=label))

    def pool_status(pool_id=None):
        if pool_id is None:
            tree = sync.pools()
            return {"pools": [_pool_summary(p) for p in tree.pools], "tree_depth": tree.tree_depth,
                    "kv_pages_used": tree.kv_pages_used, "kv_pages_total": tree.kv_pages_total}
        return _pool_summary(sync.pool(pool_id))

    def session_tps(session_id=None):
        return _tps_summary(sync.tps(), session_id)

    def capacity(pool_id, expected_tokens=None):
        return _capacity_summary(sync.capacity(pool_id, expected_tokens=expected_tokens))

    def release_pool(pool_id):
        sync.release_pool(pool_id)
        return {"pool_id": pool_id, "released": True}

    # ------------------------------------------------------------ async implementations
    async def acreate_pool(messages=None, text=None, from_session=None, pinned=False, label=""):
        return _pool_summary(await aio.create_pool(messages=_messages(messages), text=text,
                                                   from_session=from_session, pinned=pinned, label=label))

    async def afork_pool(parent_pool_id, messages=None, text=None, from_session=None, branch_pos=None, label=""):
        return _pool_summary(await aio.fork_pool(parent_pool_id, messages=_messages(messages), text=text,
                                                 from_session=from_session, branch_pos=branch_pos, label=label))

    async def apool_status(pool_id=None):
        if pool_id is None:
            tree = await aio.pools()
            return {"pools": [_pool_summary(p) for p in tree.pools], "tree_depth": tree.tree_depth,
                    "kv_pages_used": tree.kv_pages_used, "kv_pages_total": tree.kv_pages_total}
        return _pool_summary(await aio.pool(pool_id))

    async def asession_tps(session_id=None):
        return _tps_summary(await aio.tps(), session_id)

    async def acapacity(pool_id, expected_tokens=None):
        return _capacity_summary(await aio.capacity(pool_id, expected_tokens=expected_tokens))

    async def arelease_pool(pool_id):
        await aio.release_pool(pool_id)
        return {"pool_id": pool_id, "released": True}

    specs = [
        ("create_pool", create_pool, acreate_pool, CreatePoolArgs,
         "Create a shared prefix pool (system prompt, tools, a task brief) that sub-agents attach to; "
         "they then pay only for their own suffix. Returns the pool (pool_id, prefix_len, ...)."),
        ("fork_pool", fork_pool, afork_pool, ForkPoolArgs,
         "Fork a pool: extend it with a sub-task context (give the FULL prefix: the parent's messages plus the "
         "new ones), or branch at an earlier position for a different toolset. Returns the child pool."),
        ("pool_status", pool_status, apool_status, PoolStatusArgs,
         "Status of a pool (prefix length, KV bytes, attached sessions, children) or of the whole pool tree."),
        ("session_tps", session_tps, asession_tps, SessionTpsArgs,
         "Live decode speed (tokens/s) and context headroom of a session, or the engine-wide summary."),
        ("capacity", capacity, acapacity, CapacityArgs,
         "Whether one more sub-agent fits a pool under its tps floor and KV/context headroom, and why. "
         "Check it before spawning; when 'settling' is true, wait instead of spawning."),
        ("release_pool", release_pool, arelease_pool, PoolIdArgs,
         "Release a pool you no longer need (release child pools first)."),
    ]
    tools: list[BaseTool] = []
    for name, fn, afn, schema, description in specs:
        if include is not None and name not in include:
            continue
        tools.append(StructuredTool.from_function(
            func=_wrap(fn) if sync is not None else None, coroutine=_awrap(afn) if aio is not None else None,
            name=name, description=description, args_schema=schema, handle_tool_error=True))
    return tools
