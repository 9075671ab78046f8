"""``PolyKVView``: the read-only surface of the engine's pool and session state.

What the parts beside the core read of it, declared once: ``Metrics`` (tps, context headroom,
counters, Prometheus), the admission controller and its capacity report, the persister (which
also writes, see ``persist.engine_view.PersistCore``), the simulator's ``SimCore`` and the tests'
``FakeCore``. ``EngineCore`` implements it; so do ``sim.engine.SimCore`` and
``tests/offline/fake_core.FakeCore``, checked by mypy (``tests/offline/test_view.py``), so a change
of the surface breaks the type check instead of one of the stand-ins guessing it wrong.

Every member is read-only here, and so is what it hands out: the tree is a ``TreeView`` (its pools,
no ``add`` or link), pools are ``PoolView``, sessions ``SessionView`` and their sequences
``SeqView``, Protocols of properties and reads only. The objects behind them are ``PolyKV``'s own
(no copy is made), so a reader sees the state as it is; a write through one is a type error, and
``tests/offline/test_owner.py`` finds any write outside the owner in the source. Everything is read
on the engine's step thread.

Its own module (not ``core/core.py``) so that readers depend on this small module only: it imports
the state's data types (``requests.py``, with ``SeqView``; ``kv/pool.py``), never the core, the model or torch.
"""

from __future__ import annotations

from typing import AbstractSet, Callable, Iterable, Mapping, Protocol, Sequence as Seq

from ..requests import Job, SeqView, SessionState, Work
from ..kv.pool import Residency

Listener = Callable[[str, dict], None]  # (event, data) on the step thread: submit, token, finish, materialized, step


class PoolView(Protocol):
    """A pool of the tree, read only (``kv.pool.Pool``, whose fields ``PolyKV`` alone sets)."""

    @property
    def pool_id(self) -> int: ...

    @property
    def parent(self) -> PoolView | None: ...

    @property
    def branch_pos(self) -> int: ...

    @property
    def seq(self) -> SeqView: ...

    @property
    def pinned(self) -> bool: ...

    @property
    def residency(self) -> Residency: ...

    @property
    def children(self) -> Seq[PoolView]: ...

    @property
    def sessions(self) -> AbstractSet[str]: ...

    @property
    def last_access_wall(self) -> float: ...  # time.time() (the other times: time.monotonic())

    @property
    def grace_until(self) -> float: ...

    @property
    def release_at(self) -> float | None: ...

    @property
    def rematerializations(self) -> int: ...

    @property
    def cache_hits(self) -> int: ...

    @property
    def label(self) -> str: ...

    @property
    def tenant(self) -> str | None: ...

    @property
    def prefix_len(self) -> int: ...

    @property
    def own_len(self) -> int: ...

    @property
    def tokens(self) -> Seq[int]: ...

    @property
    def live_children(self) -> Seq[PoolView]: ...

    def hash_at(self, n: int) -> bytes | None: ...

    def is_auto_pinned(self, now: float, sessions_in_use: bool) -> bool: ...

    def depth(self) -> int: ...


class SessionView(Protocol):
    """A session, read only (``requests.Session``, whose fields ``PolyKV`` alone sets)."""

    @property
    def session_id(self) -> str: ...

    @property
    def anonymous(self) -> bool: ...

    @property
    def pool_id(self) -> int | None: ...

    @property
    def tenant(self) -> str | None: ...

    @property
    def seq(self) -> SeqView: ...

    @property
    def job(self) -> Job | None: ...

    @property
    def last_access(self) -> float: ...  # time.monotonic()

    @property
    def created(self) -> float: ...

    @property
    def spilled_keys(self) -> Seq[bytes]: ...

    @property
    def state(self) -> SessionState: ...

    @property
    def is_idle(self) -> bool: ...


class TreeView(Protocol):
    """The pool tree, read only (``polykv.state.PoolTree``, whose mutators only ``PolyKV`` calls)."""

    @property
    def pools(self) -> Mapping[int, PoolView]:
        """Live pools (not released), by id."""

    @property
    def released(self) -> Mapping[int, PoolView]:
        """Released pools whose KV sessions still read, by id."""

    @property
    def max_pools(self) -> int: ...

    @property
    def num_used(self) -> int: ...

    @property
    def next_id(self) -> int: ...

    def get(self, pool_id: int) -> PoolView:
        """The live pool ``pool_id`` (``PoolNotFoundError`` when there is none)."""

    def depth(self) -> int: ...


class PageCounts(Protocol):
    """The KV page store as readers see it: sizes and how many pages are free."""

    @property
    def num_pages(self) -> int: ...

    @property
    def num_free(self) -> int: ...

    @property
    def page_bytes(self) -> int: ...


class CacheCounts(Protocol):
    """The KV tables as readers see it: pages only the prefix cache holds (reclaimed first)."""

    def num_cache_only(self) -> int: ...

    def kv_location(self, seq: SeqView, spilled_keys: Seq[bytes] = ()) -> dict:
        """Where a session's KV lives: RAM, the disk tier or nowhere (``KVTables.kv_location``)."""


class JobQueues(Protocol):
    """The scheduler's requests and materializations in flight."""

    @property
    def running(self) -> Iterable[Work]: ...

    @property
    def waiting(self) -> Iterable[Work]: ...


class PolyKVView(Protocol):
    """The pool tree, sessions, jobs in flight, KV page counts and counters of one engine."""

    @property
    def listeners(self) -> list[Listener]:
        """Observers of the core's events (readers append theirs once, at construction)."""

    @property
    def sessions(self) -> Mapping[str, SessionView]: ...

    @property
    def tree(self) -> TreeView: ...

    @property
    def scheduler(self) -> JobQueues: ...

    @property
    def kv(self) -> PageCounts: ...

    @property
    def tables(self) -> CacheCounts: ...

    @property
    def page_size(self) -> int: ...

    @property
    def max_context(self) -> int: ...

    @property
    def counters(self) -> Mapping[str, int]: ...

    def auto_pinned(self, pool: PoolView, now: float) -> bool:
        """Whether ``pool`` is kept resident at ``now`` (``EngineCore.auto_pinned``)."""
