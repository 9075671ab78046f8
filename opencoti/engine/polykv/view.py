"""``PolyKVView``: the read-only surface of the engine's pool and session state.

What the parts beside the core read of it, declared once: ``Metrics`` (tps, context headroom,
counters, Prometheus), the admission controller and its capacity report, the persister (which
also writes, see ``persist.engine_view.PersistCore``), the simulator's ``SimCore`` and the tests'
``FakeCore``. ``EngineCore`` implements it; so do ``sim.engine.SimCore`` and
``tests/offline/fake_core.FakeCore``, checked by mypy (``tests/offline/test_view.py``), so a change
of the surface breaks the type check instead of one of the stand-ins guessing it wrong.

Every member is read-only here (properties): a reader may look at sessions, pools and jobs, not
replace them. Everything is read on the engine's step thread.

Its own module (not ``core/core.py``) so that readers depend on this small module only: it imports
the state's data types (``core/requests.py``, ``kv/pools.py``), never the core, the model or torch.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Protocol, Sequence as Seq

from ..kv.pools import Pool, PoolTree
from ..core.requests import Sequence, Session, Work

Listener = Callable[[str, dict], None]  # (event, data) on the step thread: submit, token, finish, materialized, step


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

    def kv_location(self, seq: Sequence, spilled_keys: Seq[bytes] = ()) -> dict:
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
    def sessions(self) -> Mapping[str, Session]: ...

    @property
    def tree(self) -> PoolTree: ...

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

    def auto_pinned(self, pool: Pool, now: float) -> bool:
        """Whether ``pool`` is kept resident at ``now`` (``EngineCore.auto_pinned``)."""
