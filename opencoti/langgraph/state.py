"""Graph state for PolyKV-aware graphs: a TypedDict mixin and its reducers.

    class State(PolyKVMessagesState):
        task: str

The keys surface live PolyKV capacity into the graph so conditional edges can branch on it:
``pool_id`` (the pool the graph's model calls attach to), ``session_id``, ``sessions_remaining``
(new sessions that fit the pool now: KV and tps floor together), ``kv_headroom_sessions`` (the KV
arm alone), ``mean_active_tps``, ``compaction_pressure``, ``ctx_headroom_tokens`` (written by
``CapacityGateNode`` and by ``polykv_update(message)`` after a model call), plus the gate's
``capacity_ok`` / ``reason`` / ``settling``, and ``pools``: what each pool is, so that a missing
pool can be re-created (see ``opencoti.langgraph.pools``). Every key has a reducer, so parallel branches
(``Send`` fan-out) may write them in the same step without a conflict.
"""

from __future__ import annotations

from typing import Annotated, Any, Callable, Literal, Optional, TypedDict, Union

from langchain_core.messages import AIMessage, AnyMessage, BaseMessage
from langgraph.graph.message import add_messages

from .pools import PoolSpec, merge_pools


def keep_latest(current: Any, update: Any) -> Any:
    """The newest non-None value (None never erases a known value, so parallel branches that do
    not know a key do not clear it). To reset a key to None, bypass the reducer:
    ``{"pool_id": Overwrite(None)}`` (``langgraph.types.Overwrite``; ``{"__overwrite__": null}``
    over the LangGraph REST API)."""
    return current if update is None else update


def keep_min(current: Optional[float], update: Optional[float]) -> Optional[float]:
    """The smaller of two values (None = unknown): e.g. the tightest headroom seen by parallel branches."""
    return _known_pick(min, current, update)


def keep_max(current: Optional[float], update: Optional[float]) -> Optional[float]:
    """The larger of two values (None = unknown): e.g. the worst compaction pressure."""
    return _known_pick(max, current, update)


def _known_pick(pick: Callable[[float, float], float], current: Optional[float],
                update: Optional[float]) -> Optional[float]:
    """``pick`` of the two where both are known, else the known one (None when neither is)."""
    if current is None:
        return update
    if update is None:
        return current
    return pick(current, update)


def append_list(current: Optional[list], update: Any) -> list:
    """Concatenate (a single item is appended); for results gathered from a fan-out."""
    current = list(current or [])
    if update is None:
        return current
    if isinstance(update, list):
        return current + update
    return current + [update]


class PolyKVState(TypedDict, total=False):
    """PolyKV keys to mix into a graph's state (all optional)."""

    pool_id: Annotated[Optional[int], keep_latest]
    """The pool the graph's model calls attach to (moved by ``CompactionNode``)."""
    root_pool_id: Annotated[Optional[int], keep_latest]
    """The stable ancestor (system + tools) that compaction re-forks."""
    session_id: Annotated[Optional[str], keep_latest]
    """The session the graph's model calls run in."""
    capacity_ok: Annotated[Optional[bool], keep_latest]
    """The last capacity gate's decision."""
    reason: Annotated[Optional[str], keep_latest]
    """Why (the capacity report's reason)."""
    settling: Annotated[Optional[bool], keep_latest]
    """The pool is absorbing its last admit."""
    sessions_remaining: Annotated[Optional[Union[int, Literal["unknown"]]], keep_latest]
    """New sessions that fit the pool now, by its KV and its tps floor together (the capacity
    report's ``sessions_remaining``; ``"unknown"``: a floor and nothing measured yet). Branch on this."""
    kv_headroom_sessions: Annotated[Optional[int], keep_latest]
    """New sessions the pool's free KV alone has room for (the report's ``headroom_sessions``): an
    upper bound that ignores the tps floor."""
    mean_active_tps: Annotated[Optional[float], keep_latest]
    """Mean experienced decode tps of the active sessions."""
    session_tps: Annotated[Optional[float], keep_latest]
    """The last model call's session tps."""
    compaction_pressure: Annotated[Optional[float], keep_latest]
    """0..1: how close the session / KV is to the wall (compact before 1)."""
    ctx_headroom_tokens: Annotated[Optional[int], keep_latest]
    """Tokens the session can still grow by."""
    pools: Annotated[dict[str, PoolSpec], merge_pools]
    """What each pool the graph uses is (prefix, parent, branch position), by pool id, so that
    ``ensure_pool`` can re-create it after a restart (``track_pool`` records one)."""
    pools_recreated: Annotated[list[dict], append_list]
    """Pools re-created by ``ensure_pool``: ``{old_pool_id, pool_id, label, prefix_len}``."""


class PolyKVMessagesState(PolyKVState, total=False):
    """``PolyKVState`` plus LangGraph's ``messages`` channel."""

    messages: Annotated[list[AnyMessage], add_messages]
    """The conversation."""


_METADATA_KEYS = ("pool_id", "session_id", "session_tps", "compaction_pressure", "ctx_headroom_tokens")


def polykv_update(message: BaseMessage | None) -> dict:
    """State update from a model answer's ``response_metadata`` (pool, session, tps, pressure)."""
    if not isinstance(message, AIMessage):
        return {}
    md = message.response_metadata or {}
    return {k: md[k] for k in _METADATA_KEYS if md.get(k) is not None}


def capacity_update(cap: Any) -> dict:
    """State update from a capacity report (``opencoti.client.Capacity`` or its dict)."""
    d = cap.model_dump() if hasattr(cap, "model_dump") else dict(cap)
    return {"capacity_ok": bool(d.get("can_admit")), "reason": d.get("reason"), "settling": bool(d.get("settling")),
            "sessions_remaining": d.get("sessions_remaining"), "kv_headroom_sessions": d.get("headroom_sessions"),
            "mean_active_tps": d.get("mean_active_tps"),
            "compaction_pressure": d.get("compaction_pressure")}
