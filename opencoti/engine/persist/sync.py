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

import hashlib
import logging
import re
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ..kv.pools import Pool, Residency
from ..core.requests import Session
from ..polykv.view import PolyKVView
from . import kvfile
from .files import KV_DIR, SESSION_KV_DIR, kv_file_pool_id
from .session_kv import DEFAULT_BUDGET_MIB, SessionKv
from .store import PoolRecord, SessionRecord, StateStore

if TYPE_CHECKING:
    from ..kv.pages import PagePool
    from ..kv.tables import KVTables
    from ..polykv.state import PolyKV

log = logging.getLogger("opencoti.engine.persist")

AUTO_SESSION_ID = re.compile(r"(?:.*:)?s-[0-9a-f]{12}")  # ids the engine made up (optionally tenant-prefixed)


class PersistCore(PolyKVView, Protocol):
    """What the persister needs of the core: the read-only view (what it writes to the store),
    plus what restoring and loading KV files take: the vocabulary size, the KV pages themselves
    (``kvfile`` copies their rows), the KV tables, and the owner of the pool and session state
    (``PolyKV``), whose ``restore_pool`` / ``restore_session`` / ``pool_loaded`` bring the stored
    tree back: the persister writes no pool or session field itself."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def polykv(self) -> PolyKV: ...

    @property
    def kv(self) -> PagePool: ...

    @property
    def tables(self) -> KVTables: ...


class Persister:
    enabled = True

    def __init__(self, store: StateStore, core: PersistCore, *, admission=None, kv_files: bool = True,
                 kv_identity: dict | None = None, session_kv_budget_mib: float = DEFAULT_BUDGET_MIB):
        self.store = store
        self.core = core
        self.kv_identity = kv_identity  # written into every KV file; a file of another identity is not loaded
        self.admission = admission  # the engine's admission controller (policy dicts), optional
        self.kv_dir = store.dir / KV_DIR
        self.kv_files = kv_files
        if kv_files:
            self.kv_dir.mkdir(exist_ok=True)
        self._pools: dict[int, tuple] = {}  # stored pool id -> (pinned, label, admission)
        self._sessions: dict[str, tuple] = {}  # stored session id -> (pool_id, len(tokens), id(seq))
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
        skipped = []
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
        for rec in snap.sessions:
            if rec.session_id in core.sessions:
                continue
            pool = restored.get(rec.pool_id) if rec.pool_id is not None else None
            # no KV: the next request recomputes what it needs
            s = polykv.restore_session(rec.session_id, list(rec.tokens), pool, rec.tenant)
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

    def _pool_key(self, pool: Pool) -> tuple:
        return (pool.pinned, pool.label, self._policy(pool.pool_id))

    def _policy(self, pool_id: int) -> dict | None:
        adm = self.admission
        st = getattr(adm, "states", {}).get(pool_id) if adm is not None else None
        if st is None:
            return None
        d = st.policy.as_dict()
        default = type(st.policy)().as_dict()
        changed = {k: v for k, v in d.items() if default.get(k) != v}
        return changed or None

    @staticmethod
    def _session_key(s: Session) -> tuple:
        return (s.pool_id, len(s.seq.tokens), id(s.seq))

    @staticmethod
    def persistable_session(s: Session) -> bool:
        return (s.job is None and not getattr(s, "anonymous", False)
                and not AUTO_SESSION_ID.fullmatch(s.session_id))

    def sync(self) -> None:
        """Write every change since the last sync in one transaction (no-op when nothing changed)."""
        if self.store.closed:
            return
        core, tree = self.core, self.core.tree
        ops = []
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
        sessions = core.sessions
        for sid in set(self._sessions) - set(sessions):
            ops.append(("sdel", sid))
        for sid, s in sessions.items():
            if not self.persistable_session(s):
                continue
            key = self._session_key(s)
            if self._sessions.get(sid) != key or sid in self._dirty_sessions:
                ops.append(("sput", s, key))
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
            kind = op[0]
            if kind == "reserve":
                self._reserved = op[1]
            elif kind == "put":
                self._pools[op[1].pool_id] = self._pool_key(op[1])
            elif kind == "update":
                self._pools[op[1].pool_id] = op[2]
            elif kind == "delete":
                self._pools.pop(op[1], None)
                self._drop_kv_file(op[1], "the pool was released")
            elif kind == "sdel":
                self._sessions.pop(op[1], None)
                self.session_kv.drop(op[1])
            elif kind == "sput":
                self._sessions[op[1].session_id] = op[2]
                self.session_kv.save(op[1])
        if self.kv_files:
            self._save_pinned_kv()

    def _apply(self, op: tuple, stored: set[int]) -> None:
        st = self.store
        kind = op[0]
        if kind == "reserve":
            st.reserve_pool_ids(op[1])
        elif kind == "put":
            p = op[1]
            st.put_pool(PoolRecord(pool_id=p.pool_id, parent=p.parent.pool_id if p.parent else None,
                                   branch_pos=p.branch_pos, tokens=list(p.tokens), label=p.label, pinned=p.pinned,
                                   tenant=p.tenant, admission=self._policy(p.pool_id)))
        elif kind == "update":
            p, key = op[1], op[2]
            st.update_pool(p.pool_id, pinned=key[0], label=key[1], admission=key[2])
        elif kind == "delete":
            st.delete_pool(op[1])
        elif kind == "sdel":
            st.delete_session(op[1])
        elif kind == "sput":
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
        for p in self.core.tree.pools.values():
            if p.pinned:
                q = p
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
            pool = self.core.tree.pools[pid]
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
        if d and not tables.share_into(pool.seq, parent.seq.page_table, d, full):
            return False
        if not tables.extend(pool.seq, n) or not kvfile.load_kv(path, kv, pool.seq.page_table, d, n, pool.tokens,
                                                                  identity=self.kv_identity):
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

    def check_kv_files(self, on_step, pool_ids: set[int] | None = None) -> dict:
        """Verify the checksums of the KV files (of ``pool_ids``, default all), reading them off the
        step thread (``on_step(fn)`` runs ``fn`` there). A corrupt file is dropped and, for a resident
        pool, written again from its pages. Returns {"checked", "corrupt", "rejected_at_load"}."""
        mine = (lambda pid: True) if pool_ids is None else pool_ids.__contains__
        files = [pid for pid in on_step(lambda: sorted(self._kv_saved)) if mine(pid)]
        self.kv_writer.flush()
        corrupt = []
        for pid in files:
            problem = kvfile.verify(self._kv_path(pid))
            if problem is not None:
                log.warning("state: the KV file of pool %d: %s; it is written again", pid, problem)
                corrupt.append(pid)

        def rewrite():
            for pid in corrupt:
                self._drop_kv_file(pid, "its content does not match its checksum")
            self._save_pinned_kv()
        if corrupt:
            on_step(rewrite)
        return {"checked": len(files), "corrupt": corrupt,
                "rejected_at_load": [pid for pid in self.kv_rejected if mine(pid)]}

    def after(self, result):
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


def identity_of(engine) -> dict:
    """What a state directory must match: token ids only mean something to the same tokenizer."""
    tok = engine.tokenizer
    return {"model": engine.loaded.name, "vocab_size": int(engine.core.vocab_size),
            "eos": sorted(int(t) for t in tok.eos_token_ids)}


_KV_IDENTITIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> its KV identity


def kv_identity_of(engine) -> dict:
    """What a KV file must match besides its tokens and shape: the same tokens give other KV under
    another model, another weight format (int4 projections compute other keys and values than fp32)
    or another KV dtype. The page size is not part of it: a file holds token rows, loaded into any
    page layout. Computed once per engine (on its step thread)."""
    cached = _KV_IDENTITIES.get(engine)
    if cached is not None:
        return cached
    model = engine.model
    h = hashlib.sha256(engine.loaded.hf_config.to_json_string(use_diff=False).encode())
    rows = -(-4096 // model.embed.shape[1])  # the table's first 4096 values (a sample of this model's weights)
    emb = model.embed[:rows].reshape(-1)[:4096].float().contiguous().cpu()
    h.update(emb.numpy().tobytes())
    ident = {**identity_of(engine), "fingerprint": h.hexdigest()[:16], "weights": str(model.weights),
             "source": "gguf" if getattr(engine.loaded, "source_gguf", None) else "hf",
             "kv_dtype": engine.kv.dtype_name}
    _KV_IDENTITIES[engine] = ident
    return ident


def attach(engine, state_dir, *, admission=None, kv_files: bool = True) -> Persister:
    """Open ``state_dir`` for ``engine`` (on its step thread), restore what it holds, keep it in sync.
    ``admission``: the engine's AdmissionController (its pool policies are kept too)."""
    store = StateStore(state_dir, identity=identity_of(engine))
    try:
        p = Persister(store, engine.core, admission=admission, kv_files=kv_files,
                      kv_identity=kv_identity_of(engine),
                      session_kv_budget_mib=getattr(engine.config, "session_kv_budget_mib", DEFAULT_BUDGET_MIB))
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
    def check_kv_files(on_step, pool_ids=None) -> dict:
        return {"checked": 0, "corrupt": [], "rejected_at_load": []}

    @staticmethod
    def after(result):
        return result

    def sync(self) -> None:
        pass

    def close(self) -> None:
        pass


def open_state(engine, *, admission=None) -> Persister | Ephemeral:
    """The engine's persistence: its ``config.state_dir`` restored and kept in sync, or nothing.
    ``admission``: the engine's AdmissionController (its pool policies are kept too)."""
    state_dir = engine.config.state_dir
    return attach(engine, state_dir, admission=admission) if state_dir is not None else Ephemeral()
