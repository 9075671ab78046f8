"""Typed results of the operations (pydantic): what the client returns, and the response schemas
the HTTP API documents. Unknown fields are kept: a server may report more than a client knows."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    # Unknown fields are kept: the server may report more than this client knows about.
    model_config = ConfigDict(extra="allow", use_attribute_docstrings=True, populate_by_name=True)


class Pool(_Model):
    """A pool (docs/polykv.md): an immutable prefix ``[0, prefix_len)``, a node of the pool tree."""

    pool_id: int
    """The pool's id."""
    parent: int | None = None
    """The parent pool (None for a root)."""
    branch_pos: int = 0
    """D: where this pool branches off its parent (== parent.prefix_len for an extension)."""
    prefix_len: int = 0
    """L: the number of prefix tokens."""
    own_len: int = 0
    """Tokens this pool owns, ``[D, L)``."""
    own_kv_bytes: int = 0
    """KV bytes owned by this pool (its ``[D, L)`` range only)."""
    subtree_kv_bytes: int = 0
    """KV bytes of this pool, its descendants and their sessions' suffixes."""
    residency: str = "resident"
    """``resident`` | ``evicted`` | ``materializing``."""
    pinned: bool = False
    """Pinned pools are never evicted."""
    auto_pinned: bool = False
    """Interior pools are pinned while descendants are attached."""
    orphaned_pin: bool = False
    """Pinned with no sessions and no children: a leak hazard to sweep."""
    last_access_ts: float = 0.0
    """Wall-clock time of the last attach."""
    children: list[int] = Field(default_factory=list)
    """Child pool ids."""
    sessions: list[dict[str, Any]] = Field(default_factory=list)
    """Attached sessions: ``{session_id, suffix_n_tokens, marginal_kv_bytes, tps_ewma, state, ...}``."""
    label: str = ""
    """A free-form label given at creation."""
    release_in_s: float | None = None
    """A release deferred by the grace TTL: seconds until it takes effect (None: none asked)."""
    held_by: list[dict[str, Any]] = Field(default_factory=list)
    """Sessions of released descendant pools that keep this pool's KV (it stays auto-pinned while
    they do): ``{session_id, pool_id, state, expires_in_s}`` (``expires_in_s``: an idle anonymous
    session's remaining TTL; None: busy, or named, kept until released). ``DELETE
    /polykv/pools/{id}?cascade=sessions`` ends them."""
    subtree: list["Pool"] = Field(default_factory=list)
    """Descendant pools (filled by ``pool(id)`` only)."""


class PoolTree(_Model):
    """The whole pool tree (``GET /polykv/pools``)."""

    pools: list[Pool] = Field(default_factory=list)
    """Every pool, by id."""
    tree_depth: int = 0
    """Depth of the deepest pool."""
    kv_pages_used: int = 0
    """KV pages held by pools and sessions (pages only the prefix cache holds: ``kv_pages_cache``)."""
    kv_pages_total: int = 0
    """KV pages in the cache."""
    kv_memory: dict[str, Any] = Field(default_factory=dict)
    """The KV store's memory: ``reserved_bytes`` (the cap), ``resident_bytes`` (CPU: pages written at
    least once; they stay resident when freed), ``used_bytes``, ``touched_pages``, ``allocation``."""
    released_pools: list[dict[str, Any]] = Field(default_factory=list)
    """Released pools whose KV sessions still read (not in the pool budget; their pages count in
    ``kv_pages_used`` until those sessions end): ``{pool_id, parent, prefix_len, own_kv_bytes, held_by}``."""
    kv_pages_cache: int = 0
    """Pages only the prefix cache holds: reusable, evicted first (LRU, leaves first) when memory is needed."""
    cache_kv_bytes: int = 0
    """Bytes of those pages."""
    cache_hit_rate: float = 0.0
    """Prompt tokens reused from cached KV (pools, sessions, automatic prefix cache) / prompt tokens."""

    def get(self, pool_id: int) -> Pool | None:
        """The pool with this id, or None."""
        return next((p for p in self.pools if p.pool_id == pool_id), None)


class Capacity(_Model):
    """Whether one more (new) session fits a pool now, and why."""

    pool_id: int | None = None
    """The pool asked about."""
    can_admit: bool
    """True when a new session fits (tps floor, KV headroom and context arms)."""
    reason: str = ""
    """Why (e.g. ``ok``, ``measurement settling``, ``projected mean tps below floor``)."""
    sessions_remaining: int | Literal["unknown"] | None = None
    """New sessions that fit now, by the KV and the tps floor together (``"unknown"``: a floor and
    nothing measured yet)."""
    headroom_sessions: int | None = None
    """New sessions the free KV alone has room for (ignores the tps floor)."""
    tps_headroom_sessions: int | None = None
    """New sessions the tps floor alone allows (None: no floor, or nothing measured)."""
    mean_active_tps: float | None = None
    """Mean experienced decode tps of the active (non-warming) sessions."""
    projected_mean_tps_if_admitted: float | None = None
    """The projected mean tps with one more session."""
    target_tps_per_session: float | None = None
    """The pool's tps floor (None: no floor)."""
    kv_headroom_pct: float | None = None
    """Free KV as a percentage."""
    settling: bool = False
    """The pool is still absorbing its last admit: wait, don't shrink."""
    settle_remaining_ms: float = 0.0
    """Milliseconds until the settle window ends at the latest."""
    n_warming: int = 0
    """Sessions whose tps EWMA is still cold."""
    n_pool_sessions: int = 0
    """Sessions attached to the pool."""
    guaranteed: bool = False
    """Admitted by ``guarantee_min_sessions``."""
    compaction_pressure: float = 0.0
    """0..1: how close the pool's sessions are to the context / KV wall (compact before 1)."""
    context_ok: bool = True
    """The context arm: ``expected_tokens`` fit the context and the free KV."""


class AdmissionPolicy(_Model):
    """A pool's admission policy."""

    target_tps_per_session: float | None = None
    """The floor on experienced decode tps (None: no floor)."""
    mode: str = "advisory"
    """``advisory`` (report only) or ``enforced`` (gate new sessions)."""
    on_saturation: str = "reject"
    """Enforced: ``reject`` (429), ``warn`` (admit with a warning) or ``queue`` (hold FIFO)."""
    guarantee_min_sessions: int = 1
    """Below this many sessions a new one is always admitted."""
    settle_tokens: int = 48
    """Tokens an admitted session decodes before the pool is settled."""
    settle_max_ms: float = 5000.0
    """The settle window's upper bound."""
    queue_timeout_ms: float = 30000.0
    """How long ``queue`` holds a request."""


class SessionStatus(_Model):
    """One session in the tps snapshot."""

    session_id: str
    """The session's id."""
    pool_id: int | None = None
    """The pool it is attached to."""
    tps_ewma: float = 0.0
    """Experienced decode tokens/s (EWMA)."""
    ctx_used: int = 0
    """Tokens in its context."""
    ctx_total: int = 0
    """The context length."""
    ctx_headroom_tokens: int = 0
    """Tokens it can still grow by (context and free KV)."""
    compaction_pressure: float = 0.0
    """0..1: how close it is to the context / KV wall."""
    state: str = ""
    """``idle`` | ``prefill`` | ``decode`` | ..."""


class TpsSnapshot(_Model):
    """Live tps (``GET /polykv/tps?once=1``)."""

    ts: float = 0.0
    """Wall-clock time of the snapshot."""
    aggregate_tps: float = 0.0
    """System decode throughput."""
    mean_active_tps: float | None = None
    """Mean experienced tps of the active, non-warming sessions (None when no session is active)."""
    n_warming: int = 0
    """Sessions whose tps EWMA is still cold."""
    compaction_pressure: float = 0.0
    """Engine-wide compaction pressure (KV occupancy, largest session share)."""
    sessions: list[SessionStatus] = Field(default_factory=list)
    """Every session."""

    def session(self, session_id: str) -> SessionStatus | None:
        """The row of one session, or None."""
        return next((s for s in self.sessions if s.session_id == session_id), None)


class CompactionResult(_Model):
    """The result of compaction by re-fork."""

    pool: Pool
    """The new pool the session moved to."""
    released_pools: list[int] = Field(default_factory=list)
    """Pools released because nothing else used them."""
    kv_pages_before: int = 0
    """KV pages owned by pools and sessions before (pages only the prefix cache holds are apart)."""
    kv_pages_after: int = 0
    """KV pages owned by pools and sessions after."""
    kv_pages_cache_before: int = 0
    """Pages only the prefix cache held before: reusable, evicted first when memory is needed."""
    kv_pages_cache_after: int = 0
    """Pages only the prefix cache holds after (the freed pages a later prompt may still reuse)."""


class GenerationInfo(_Model):
    """What the server knows when it accepts a request (the ``x-*`` headers)."""

    session_id: str
    """The session the request ran in (made by the server when none was given)."""
    pool_id: int | None = None
    """The pool it attached to."""
    cached_prefix_tokens: int = 0
    """Prompt tokens reused from the pool / session cache (``cache_n``)."""
    sessions_remaining: int | Literal["unknown"] | None = None
    """Enforced pools: new sessions that fit when the gate admitted this one, this one included
    (``X-Sessions-Remaining``); ``"unknown"`` with a floor and nothing measured; None: no gate."""
    admission_warning: str | None = None
    """Admitted under ``on_saturation: warn`` (or by ``overcommit`` past a full pool): the warning."""
    admission_retry_after_s: float | None = None
    """Enforced pools, when no other new session fits after this one: seconds until one is likely
    to fit (``x-admission-retry-after``)."""


class Usage(_Model):
    """Token counts of one request."""

    prompt_tokens: int = 0
    """Prompt tokens."""
    completion_tokens: int = 0
    """Generated tokens."""
    total_tokens: int = 0
    """prompt + completion."""
    cached_tokens: int = 0
    """Prompt tokens read from the KV cache."""


class ToolCall(_Model):
    """A complete tool call parsed from the model's output."""

    id: str
    """The call id."""
    name: str
    """The function name."""
    arguments: str
    """The arguments as JSON text (or the model's raw text when it wrote no JSON)."""
    index: int = 0
    """Position among the calls of the message."""

    def parsed_arguments(self) -> dict[str, Any] | None:
        """The arguments as a dict, or None when they are not a JSON object."""
        try:
            v = json.loads(self.arguments) if self.arguments.strip() else {}
        except ValueError:
            return None
        return v if isinstance(v, dict) else None


class ChatChunk(_Model):
    """One event of a chat stream: the first carries ``info``; content deltas; complete
    ``tool_calls`` (held back by the server until parsed); the last carries ``finish_reason``,
    ``usage`` and ``timings``."""

    content: str = ""
    """Text to append."""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    """Complete tool calls."""
    info: GenerationInfo | None = None
    """Set on the first event (and repeated on the last)."""
    finish_reason: str | None = None
    """``stop`` | ``length`` | ``tool_calls`` on the last event."""
    usage: Usage | None = None
    """On the last event."""
    timings: dict[str, Any] | None = None
    """llama.cpp-style timings (``predicted_per_second``, ``cache_n``, ...) on the last event."""
    model: str | None = None
    """The model that answered (on the last event)."""


class ChatCompletion(_Model):
    """A finished chat request."""

    content: str = ""
    """The assistant's text (without tool-call text)."""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    """Parsed tool calls."""
    finish_reason: str = "stop"
    """``stop`` | ``length`` | ``tool_calls``."""
    usage: Usage = Field(default_factory=Usage)
    """Token counts."""
    timings: dict[str, Any] = Field(default_factory=dict)
    """llama.cpp-style timings."""
    info: GenerationInfo
    """Session, pool, cached prefix tokens."""
    model: str | None = None
    """The model that answered."""


class Completion(_Model):
    """A finished raw-text completion."""

    text: str = ""
    """The generated text."""
    finish_reason: str = "stop"
    """``stop`` | ``length``."""
    usage: Usage = Field(default_factory=Usage)
    """Token counts."""
    timings: dict[str, Any] = Field(default_factory=dict)
    """llama.cpp-style timings."""
    info: GenerationInfo
    """Session, pool, cached prefix tokens."""
