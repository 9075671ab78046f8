"""Persister: keeps a StateStore in step with the engine's pool tree and named sessions.

Runs on the engine's step thread only. ``restore()`` (at engine start) brings the stored tree
back as EVICTED pools (tokens kept, no KV: they re-materialize on first use, or load their KV
file, see ``kvfile``) and the stored sessions as idle sessions without KV; pool ids continue
above the stored high-water mark. ``sync()`` (after every engine command, and on the events that
change the tree between commands) writes what changed in ONE transaction: pools that became
resident for the first time (a pool is stored once its creation is acknowledged; one that is
still computing is not, but its id is already spent), pins, labels, admission policies, released
pools, sessions' tokens and pool after each request. Writes happen before the command's caller
is answered, so whatever a client was told survives a crash.
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import Literal, TypeVar, Union

from ..kv.pool import Pool, Residency
from ..requests import Session
from . import kvfile
from .engine_view import PersistCore, PersistEngine, PoolPolicies, RunOnStep, identity_of, kv_identity_of
from .files import KV_DIR, SESSION_KV_DIR, kv_file_pool_id
from .session_kv import DEFAULT_BUDGET_MIB, SessionKv
from .store import PoolRecord, SessionRecord, StateStore

log = logging.getLogger("opencoti.engine.persist")

AUTO_SESSION_ID = re.compile(r"(?:.*:)?s-[0-9a-f]{12}")  # ids the engine made up (optionally tenant-prefixed)

PoolKey = tuple[bool, str, Union[dict, None]]  # what is stored of a pool that can change: (pinned, label, policy)
SessionKey = tuple[Union[int, None], int, int]  # a session's (pool_id, len(tokens), id(seq)): changed when stored
# One change of a sync, in the order applied: the id high-water mark, a pool stored (parents first),
# a pool's key changed, a pool deleted (leaves first), a session deleted, a session stored.
Op = Union[tuple[Literal["reserve"], int], tuple[Literal["put"], Pool], tuple[Literal["update"], Pool, PoolKey],
           tuple[Literal["delete"], int], tuple[Literal["sdel"], str], tuple[Literal["sput"], Session, SessionKey]]
T = TypeVar("T")


class Persister:
    enabled = True

    def __init__(self, store: StateStore, core: PersistCore, *, admission: PoolPolicies | None = None,
                 kv_files: bool = True, kv_identity: dict | None = None,
                 session_kv_budget_mib: float = DEFAULT_BUDGET_MIB):
        self.store = store
        self.core = core
        self.kv_identity = kv_identity  # written into every KV file; a file of another identity is not loaded
        self.admission = admission  # the engine's admission controller (policy dicts), optional
        self.kv_dir = store.dir / KV_DIR
        self.kv_files = kv_files
        if kv_files:
            self.kv_dir.mkdir(exist_ok=True)
        self._pools: dict[int, PoolKey] = {}  # stored pool id -> (pinned, label, admission)
        self._sessions: dict[str, SessionKey] = {}  # stored session id -> (pool_id, len(tokens), id(seq))
        self._kv_saved: set[int] = set()  # pool ids whose KV file is written (or queued)
        self.kv_rejected: list[int] = []  # pools whose KV file was not used at start (checksum, swapped, other engine)
        self.kv_writer = kvfile.KvWriter()
        # named sessions' KV files (session_kv.py), within their disk budget
        self.session_kv = SessionKv(store.dir / SESSION_KV_DIR, core, self.kv_writer, kv_identity,
                                    int(session_kv_budget_mib * 2**20) if kv_files else 0)
        self._reserved = 0
        self._dirty_sessions: set[str] = set()
        self.stats: dict = {}
        core.listeners.append(self.on_event)

    # ================================================================== restore
    def restore(self) -> dict:
        t0 = time.perf_counter()
        core, polykv = self.core, self.core.polykv
        snap = self.store.load()
        restored: dict[int, Pool] = {}
        skipped: list[int] = []
        for rec in snap.pools:
            parent = restored.get(rec.parent) if rec.parent is not None else None
            why = self._invalid(rec, parent)
            if why:
                skipped.append(rec.pool_id)
                log.warning("state: pool %d not restored: %s", rec.pool_id, why)
                continue
            pool = polykv.restore_pool(rec.pool_id, parent, rec.branch_pos, rec.tokens, pinned=rec.pinned,
                                       label=rec.label, tenant=rec.tenant)
            restored[pool.pool_id] = pool
            self._pools[pool.pool_id] = self._pool_key(pool)
            if rec.admission and self.admission is not None:
                try:
                    self.admission.set_policy(pool.pool_id, **rec.admission)
                except Exception as e:  # noqa: BLE001 - a policy this version rejects: defaults
                    log.warning("state: admission policy of pool %d not restored: %s", pool.pool_id, e)
                self._pools[pool.pool_id] = self._pool_key(pool)
        polykv.skip_pool_ids(max(snap.next_pool_id, max(restored, default=0) + 1))
        self._reserved = snap.next_pool_id
        n_sessions = 0
        back: list[Session] = []
        for srec in snap.sessions:
            if srec.session_id in core.sessions:
                continue
            home = restored.get(srec.pool_id) if srec.pool_id is not None else None
            # no KV: the next request recomputes what it needs
            s = polykv.restore_session(srec.session_id, list(srec.tokens), home, srec.tenant)
            self._sessions[s.session_id] = self._session_key(s)
            back.append(s)
            n_sessions += 1
        loaded = self._load_pinned_kv() if self.kv_files else 0
        sessions_loaded = self.session_kv.restore(back)
        for s in back:  # a session given its KV back keeps the key it is stored under
            self._sessions[s.session_id] = self._session_key(s)
        self.sync()
        self.stats = {"pools": len(restored), "sessions": n_sessions, "skipped_pools": skipped,
                      "next_pool_id": polykv.tree.next_id, "kv_loaded_pools": loaded,
                      "kv_loaded_sessions": sessions_loaded,
                      "seconds": time.perf_counter() - t0}
        return self.stats

    def _invalid(self, rec: PoolRecord, parent: Pool | None) -> str | None:
        core = self.core
        tree = core.polykv.tree
        if rec.pool_id in tree.pools or rec.pool_id in tree.released:
            return f"pool id {rec.pool_id} is taken already"
        if rec.parent is not None and parent is None:
            return f"its parent {rec.parent} was not restored"
        if not rec.tokens:
            return "no tokens"
        if max(rec.tokens) >= core.vocab_size:
            return "a token id is outside this model's vocabulary"
        if len(rec.tokens) > core.max_context:
            return f"{len(rec.tokens)} tokens exceed the context length {core.max_context}"
        if parent is not None:
            d = rec.branch_pos
            if not 0 <= d <= parent.prefix_len or rec.tokens[:d] != parent.tokens[:d]:
                return f"its tokens do not extend pool {parent.pool_id} at branch_pos {d}"
        elif rec.branch_pos != 0:
            return "a root pool with branch_pos != 0"
        return None

    # ================================================================== sync
    def on_event(self, event: str, data: dict) -> None:
        if event == "materialized":
            self.sync()
            if self.kv_files and data["pool"].pool_id not in self._kv_saved:
                self._save_pinned_kv()  # e.g. pinned while evicted: its KV exists only now
        elif event == "finish":  # written once per step (one transaction for every session that finished)
            s = getattr(data.get("job"), "session", None)
            if s is not None:
                self._dirty_sessions.add(s.session_id)
        elif event == "step" and self._dirty_sessions:
            self.sync()

    def _pool_key(self, pool: Pool) -> PoolKey:
        return (pool.pinned, pool.label, self._policy(pool.pool_id))

    def _policy(self, pool_id: int) -> dict | None:
        adm = self.admission
        st = adm.states.get(pool_id) if adm is not None else None
        if st is None:
            return None
        d = st.policy.as_dict()
        default = type(st.policy)().as_dict()
        changed = {k: v for k, v in d.items() if default.get(k) != v}
        return changed or None

    @staticmethod
    def _session_key(s: Session) -> SessionKey:
        return (s.pool_id, len(s.seq.tokens), id(s.seq))

    @staticmethod
    def persistable_session(s: Session) -> bool:
        return (s.job is None and not s.anonymous
                and not AUTO_SESSION_ID.fullmatch(s.session_id))

    def sync(self) -> None:
        """Write every change since the last sync in one transaction (no-op when nothing changed)."""
        if self.store.closed:
            return
        core, tree = self.core, self.core.polykv.tree  # the pools themselves (stored as they are)
        ops: list[Op] = []
        if tree.next_id > self._reserved:
            ops.append(("reserve", tree.next_id))
        live = tree.pools
        for pid in sorted(live):
            pool = live[pid]
            if pid not in self._pools:
                if pool.residency == Residency.MATERIALIZING and not pool.rematerializations:
                    continue  # not acknowledged yet
                if pool.parent is not None and pool.parent.pool_id not in self._pools:
                    continue  # (cannot happen: a parent is resident first) keep the tree closed
                ops.append(("put", pool))
            else:
                key = self._pool_key(pool)
                if key != self._pools[pid]:
                    ops.append(("update", pool, key))
        for pid in sorted(set(self._pools) - set(live), reverse=True):  # leaves first
            ops.append(("delete", pid))
        sessions = core.polykv.sessions
        for sid in set(self._sessions) - set(sessions):
            ops.append(("sdel", sid))
        for sid, s in sessions.items():
            if not self.persistable_session(s):
                continue
            skey = self._session_key(s)
            if self._sessions.get(sid) != skey or sid in self._dirty_sessions:
                ops.append(("sput", s, skey))
        self._dirty_sessions.clear()
        if not ops:
            return
        stored = (set(self._pools) | {op[1].pool_id for op in ops if op[0] == "put"}) - \
            {op[1] for op in ops if op[0] == "delete"}
        # Pool changes and id reservations are fsync'ed before anyone is told (FULL); a transaction
        # of session tokens only is durable against a crash of the process, not a power loss (NORMAL).
        durable = any(op[0] not in ("sput", "sdel") for op in ops)
        self.store.set_durable(durable)
        with self.store.transaction():
            for op in ops:
                self._apply(op, stored)
        for op in ops:  # the cache follows only after the commit
            if op[0] == "reserve":
                self._reserved = op[1]
            elif op[0] == "put":
                self._pools[op[1].pool_id] = self._pool_key(op[1])
            elif op[0] == "update":
                self._pools[op[1].pool_id] = op[2]
            elif op[0] == "delete":
                self._pools.pop(op[1], None)
                self._drop_kv_file(op[1], "the pool was released")
            elif op[0] == "sdel":
                self._sessions.pop(op[1], None)
                self.session_kv.drop(op[1])
            elif op[0] == "sput":
                self._sessions[op[1].session_id] = op[2]
                self.session_kv.save(op[1])
        if self.kv_files:
            self._save_pinned_kv()

    def _apply(self, op: Op, stored: set[int]) -> None:
        st = self.store
        if op[0] == "reserve":
            st.reserve_pool_ids(op[1])
        elif op[0] == "put":
            p = op[1]
            st.put_pool(PoolRecord(pool_id=p.pool_id, parent=p.parent.pool_id if p.parent else None,
                                   branch_pos=p.branch_pos, tokens=list(p.tokens), label=p.label, pinned=p.pinned,
                                   tenant=p.tenant, admission=self._policy(p.pool_id)))
        elif op[0] == "update":
            p, key = op[1], op[2]
            st.update_pool(p.pool_id, pinned=key[0], label=key[1], admission=key[2])
        elif op[0] == "delete":
            st.delete_pool(op[1])
        elif op[0] == "sdel":
            st.delete_session(op[1])
        elif op[0] == "sput":
            s = op[1]
            pool_id = s.pool_id if s.pool_id in stored else None  # a released pool is not stored
            st.put_session(SessionRecord(session_id=s.session_id, tokens=list(s.seq.tokens), pool_id=pool_id,
                                         tenant=s.tenant))

    # ================================================================== KV files of pinned pools
    def _kv_path(self, pool_id: int) -> Path:
        return self.kv_dir / f"{pool_id}.kv"

    def _pinned_closure(self) -> set[int]:
        """Pinned pools and their ancestors (a pinned pool keeps its ancestors resident)."""
        out: set[int] = set()
        for p in self.core.polykv.tree.pools.values():
            if p.pinned:
                q: Pool | None = p
                while q is not None and q.pool_id not in out:
                    out.add(q.pool_id)
                    q = q.parent
        return out

    def _save_pinned_kv(self) -> None:
        want = self._pinned_closure()
        for pid in list(self._kv_saved - want):
            self._drop_kv_file(pid, "the pool is no longer pinned (nor an ancestor of a pinned pool)")
        for pid in sorted(want - self._kv_saved):
            pool = self.core.tree.pools.get(pid)
            if pool is None or pool.residency != Residency.RESIDENT or pid not in self._pools:
                continue
            k, v = kvfile.snapshot_kv(self.core.kv, pool.seq.page_table, pool.branch_pos, pool.prefix_len)
            self.kv_writer.save(self._kv_path(pid), k, v, pool.branch_pos, pool.tokens, self.kv_identity,
                                extra={"pool_id": pid})
            self._kv_saved.add(pid)

    def _drop_kv_file(self, pool_id: int, why: str) -> None:
        self._kv_saved.discard(pool_id)
        if self.kv_files:
            log.debug("state: removing %s/%d.kv: %s", KV_DIR, pool_id, why)
            self.kv_writer.drop(self._kv_path(pool_id))

    def _load_pinned_kv(self) -> int:
        """At restart: load the KV files of pinned pools (and their ancestors), parents first, as far
        as free pages allow; the rest stays evicted (recomputed on first use)."""
        n = 0
        closure = self._pinned_closure()
        # half-written files, files of pools gone or no longer pinned: removed, each with its reason
        # (their ids are in the high-water mark already: StateStore counted every file name)
        for f in self.kv_dir.glob("*.kv*"):
            why = self._stray_kv_file(f.name, closure)
            if why is not None:
                log.warning("state: removing %s/%s: %s", KV_DIR, f.name, why)
                f.unlink(missing_ok=True)
        for pid in sorted(closure):
            pool = self.core.polykv.tree.pools[pid]
            path = self._kv_path(pid)
            if path.exists():
                why = kvfile.mismatch(kvfile.read_header(path), pool.branch_pos, pool.tokens, self.kv_identity)
                if why is None:
                    self._kv_saved.add(pid)
                else:  # written for other tokens (a swapped file), another model, weight format or KV dtype
                    log.warning("state: %s/%s is not used: %s; the KV of pool %d is recomputed and the file "
                                "written again", KV_DIR, path.name, why, pid)
                    self.kv_rejected.append(pid)
                    path.unlink(missing_ok=True)  # (and written again once the pool is resident)
            if pool.parent is not None and pool.parent.residency != Residency.RESIDENT:
                continue
            if self.load_pool_kv(pool):
                n += 1
        return n

    def _stray_kv_file(self, name: str, closure: set[int]) -> str | None:
        """Why the file ``kv/<name>`` is not kept at a restart (None: it is the KV of a pinned pool or
        of an ancestor of one)."""
        pid = kv_file_pool_id(name)
        if pid is None:
            return "not a KV file of a pool (its name is not <pool id>.kv)"
        if name.endswith(".tmp"):
            return f"a half-written KV file of pool {pid} (the process stopped while writing it)"
        if pid in closure:
            return None
        if pid not in self.core.tree.pools:
            return (f"pool {pid} is not in the state database (it was released, or the database was lost): "
                    "its KV cannot be used without its tokens")
        return f"pool {pid} is not pinned (only pinned pools and their ancestors keep KV files)"

    def load_pool_kv(self, pool: Pool) -> bool:
        """Make an evicted pool (whose parent is resident) resident from its KV file. False when
        there is no matching file or no free pages (nothing changed then)."""
        path = self._kv_path(pool.pool_id)
        if pool.residency != Residency.EVICTED or not path.exists():
            return False
        return self._load_into(pool, path)

    def _load_into(self, pool: Pool, path: Path) -> bool:
        tables, kv = self.core.tables, self.core.kv
        parent, d, n = pool.parent, pool.branch_pos, pool.prefix_len
        if parent is not None and parent.residency != Residency.RESIDENT:
            return False
        full = d // kv.page_size
        if not kv.can_allocate(kv.pages_for(n) - full):  # the borrowed pages are the parent's
            return False
        if d and parent is not None and not tables.share_into(pool.seq, parent.seq.page_table, d, full):
            return False
        if not tables.extend_reclaiming(pool.seq, n) or not kvfile.load_kv(path, kv, pool.seq.page_table, d, n,
                                                                            pool.tokens, identity=self.kv_identity):
            tables.drop(pool.seq)
            problem = kvfile.verify(path)
            if problem is not None:  # never loaded: the pool stays evicted, recomputed on first use
                log.warning("state: the KV file of pool %d is not used (%s); its KV is recomputed and the "
                            "file written again", pool.pool_id, problem)
                self.kv_rejected.append(pool.pool_id)
                self._drop_kv_file(pool.pool_id, problem)
            return False
        tables.advance(pool.seq, n - d)
        self.core.polykv.pool_loaded(pool)
        self._kv_saved.add(pool.pool_id)
        return True

    def check_kv_files(self, on_step: RunOnStep, pool_ids: set[int] | None = None) -> dict:
        """Verify the checksums of the KV files (of ``pool_ids``, default all), reading them off the
        step thread (``on_step(fn)`` runs ``fn`` there). A corrupt file is dropped and, for a resident
        pool, written again from its pages. Returns {"checked", "corrupt", "rejected_at_load"}."""
        mine = (lambda pid: True) if pool_ids is None else pool_ids.__contains__
        files = [pid for pid in on_step(lambda: sorted(self._kv_saved)) if mine(pid)]
        self.kv_writer.flush()
        corrupt: list[int] = []
        for pid in files:
            problem = kvfile.verify(self._kv_path(pid))
            if problem is not None:
                log.warning("state: the KV file of pool %d: %s; it is written again", pid, problem)
                corrupt.append(pid)

        def rewrite() -> None:
            for pid in corrupt:
                self._drop_kv_file(pid, "its content does not match its checksum")
            self._save_pinned_kv()
        if corrupt:
            on_step(rewrite)
        return {"checked": len(files), "corrupt": corrupt,
                "rejected_at_load": [pid for pid in self.kv_rejected if mine(pid)]}

    def after(self, result: T) -> T:
        """Called by the step loop after each command, before its caller gets ``result``."""
        try:
            self.sync()
        except Exception:  # noqa: BLE001 - retried after the next command (sync writes the difference)
            log.exception("state: writing the state directory failed")
        return result

    def close(self) -> None:
        try:
            self.sync()
        finally:
            self.kv_writer.close()
            self.store.close()


def attach(engine: PersistEngine, state_dir: str | Path, *, admission: PoolPolicies | None = None,
           kv_files: bool = True) -> Persister:
    """Open ``state_dir`` for ``engine`` (on its step thread), restore what it holds, keep it in sync.
    ``admission``: the engine's AdmissionController (its pool policies are kept too)."""
    store = StateStore(state_dir, identity=identity_of(engine))
    try:
        p = Persister(store, engine.core, admission=admission, kv_files=kv_files,
                      kv_identity=kv_identity_of(engine),
                      session_kv_budget_mib=engine.config.session_kv_budget_mib)
        p.restore()
    except BaseException:
        store.close()
        raise
    log.info("state: %s restored: %d pools (%d with KV loaded), %d sessions in %.3f s; next pool id %d",
             store.dir, p.stats["pools"], p.stats["kv_loaded_pools"], p.stats["sessions"], p.stats["seconds"],
             p.stats["next_pool_id"])
    return p


class Ephemeral:
    """No state directory: nothing persists."""

    enabled = False
    stats: dict = {}

    @staticmethod
    def check_kv_files(on_step: RunOnStep, pool_ids: set[int] | None = None) -> dict:
        return {"checked": 0, "corrupt": [], "rejected_at_load": []}

    @staticmethod
    def after(result: T) -> T:
        return result

    def sync(self) -> None:
        pass

    def close(self) -> None:
        pass


def open_state(engine: PersistEngine, *, admission: PoolPolicies | None = None) -> Persister | Ephemeral:
    """The engine's persistence: its ``config.state_dir`` restored and kept in sync, or nothing.
    ``admission``: the engine's AdmissionController (its pool policies are kept too)."""
    state_dir = engine.config.state_dir
    return attach(engine, state_dir, admission=admission) if state_dir is not None else Ephemeral()
