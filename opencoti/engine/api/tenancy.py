"""Tenants: one engine shared by several clients that cannot see or touch each other's state.

``TenantEngine(engine, "alice")`` is alice's view of a shared :class:`Engine`, with the methods
the API layer uses. Pools belong to the tenant that created them (a fork belongs to its parent's
tenant): any other tenant gets 404 for them, exactly as for an id that does not exist, and
listings (pools, sessions, tps, events) show only the tenant's own. Session ids are per tenant:
alice's ``agent-1`` and bob's ``agent-1`` are two sessions (inside the engine they are
``alice:agent-1`` and ``bob:agent-1``; the view never shows the prefix). Automatic prefix reuse is
salted with the tenant, so one tenant's cached prompt never speeds up (or reveals itself to)
another's. Server-wide numbers (KV pages in use, the pool budget, aggregate tps) stay global.

Anything the view does not know is refused (``AttributeError``): new engine methods are not
reachable by tenants until they are scoped here.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import uuid
from concurrent.futures import Future
from typing import Any, Callable, Protocol, TypeVar

from ..errors import InvalidRequestError, OpencotiError, PoolNotFoundError
from ..polykv.view import TreeView

T = TypeVar("T")

SEP = ":"
TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,32}")
MAX_SESSION_ID = 128  # the engine's limit for the whole (prefixed) id

_PASSTHROUGH = frozenset({
    "model_name", "max_context", "tokenizer", "kv", "device", "dtype", "config", "backend", "is_closed",
    "load_seconds", "tokenize", "detokenize", "apply_chat_template", "check_integrity", "stats",
    "loaded", "weights_info", "attention_check",
})


class AnonymousSessions(Protocol):
    """The owner of the session state as a view uses it (``PolyKV.mark_anonymous``)."""

    def mark_anonymous(self, session_id: str) -> None: ...


class TenantCore(Protocol):
    """What a tenant's view reads of the shared engine's core, on its step thread: the pool tree, read
    only (whose pools are whose), and the owner of the sessions (a session the view named for its
    client is marked anonymous there)."""

    @property
    def tree(self) -> TreeView: ...

    @property
    def polykv(self) -> AnonymousSessions: ...


class StepThread(Protocol):
    """What the view runs on the shared ``Engine``'s step thread, and the core it reads there. Checked
    against ``Engine`` by mypy (``tests/offline/test_view.py``)."""

    @property
    def core(self) -> TenantCore: ...

    def run_on_step_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T: ...

    def post_to_step_thread(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future: ...


def check_tenant_name(name) -> str:
    if not isinstance(name, str) or not TENANT_NAME.fullmatch(name):
        raise InvalidRequestError(f"a tenant name is 1-32 characters of A-Z a-z 0-9 _ . -, got {name!r}")
    return name


def _pool_op(name: str) -> Callable[..., Any]:
    """A ``TenantEngine`` method that checks the pool is the tenant's, then calls the engine's ``name``."""
    def op(self, pool_id: int, *args, **kwargs):
        self._check_pool(pool_id)
        r = self._call(getattr(self._eng, name), pool_id, *args, **kwargs)
        return self._info(r) if dataclasses.is_dataclass(r) else self._out(r)
    op.__name__ = name
    return op


class TenantEngine:
    """One tenant's view of a shared engine (thread-safe like the engine itself)."""

    def __init__(self, engine, tenant: str):
        self._eng = engine
        self._step: StepThread = engine  # the same engine, as the view reads its core
        self.tenant = check_tenant_name(tenant)
        self._prefix = tenant + SEP
        try:
            self._salted = "cache_salt" in inspect.signature(engine.stream).parameters
        except (TypeError, ValueError):
            self._salted = False

    def engine_and_session_id(self, session_id) -> tuple[Any, str]:
        """(the shared engine, its id for this tenant's ``session_id``): for code that works on the
        engine's sessions on a tenant's behalf (llama.cpp slot files)."""
        return self._eng, self._sid(session_id)

    def __getattr__(self, name: str) -> Any:
        if name in _PASSTHROUGH:
            return getattr(self._eng, name)
        raise AttributeError(f"{name!r} is not available through a tenant's view of the engine")

    def __repr__(self) -> str:
        return f"TenantEngine({self.tenant!r})"

    # ================================================================== ids in and out
    def _sid(self, session_id) -> str:
        if not isinstance(session_id, str) or not session_id:
            raise InvalidRequestError("session_id must be a non-empty string")
        limit = MAX_SESSION_ID - len(self._prefix)
        if len(session_id) > limit:
            raise InvalidRequestError(f"session_id must be at most {limit} characters")
        return self._prefix + session_id

    def _own_sid(self, internal: str) -> bool:
        return isinstance(internal, str) and internal.startswith(self._prefix)

    def _out(self, obj):
        """Strip this tenant's prefix from session ids; drop other tenants' sessions."""
        if isinstance(obj, str):
            return obj[len(self._prefix):] if obj.startswith(self._prefix) else obj
        if isinstance(obj, dict):
            out = {}
            for k, v in obj.items():
                if k == "sessions" and isinstance(v, dict):  # {session_id: ...}
                    out[k] = {self._out(sid): self._out(x) for sid, x in v.items() if self._own_sid(sid)}
                else:
                    out[k] = self._out(v)
            return out
        if isinstance(obj, list):
            return [self._out(x) for x in obj
                    if not (isinstance(x, dict) and "session_id" in x and x["session_id"] is not None
                            and not self._own_sid(x["session_id"]))]
        return obj

    def _info(self, info):
        """A PoolInfo / RequestInfo with this tenant's ids."""
        if info is None:
            return None
        changes = {}
        if hasattr(info, "sessions"):
            changes["sessions"] = self._out(info.sessions)
        if hasattr(info, "held_by"):
            changes["held_by"] = self._out(info.held_by)
        if hasattr(info, "children"):
            owned = self._owned()
            changes["children"] = [c for c in info.children if c in owned]
        if isinstance(getattr(info, "session_id", None), str):
            changes["session_id"] = self._out(info.session_id)
        return dataclasses.replace(info, **changes)

    def rewrite_error(self, e: OpencotiError) -> OpencotiError:
        """``e`` with this tenant's session-id prefix taken out of its message (the client's ids)."""
        if e.args and isinstance(e.args[0], str) and self._prefix in e.args[0]:
            e.args = (e.args[0].replace(self._prefix, ""), *e.args[1:])
        return e

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except OpencotiError as e:
            raise self.rewrite_error(e) from None

    # ================================================================== ownership (step thread reads)
    def _owned(self) -> set[int]:
        t, step = self.tenant, self._step
        return step.run_on_step_thread(lambda: {pid for pid, p in step.core.tree.pools.items() if p.tenant == t})

    def _check_pool(self, pool_id: int) -> None:
        t, step = self.tenant, self._step

        def check() -> None:
            pool = step.core.tree.get(pool_id)  # PoolNotFoundError for unknown ids
            if pool.tenant != t:
                raise PoolNotFoundError(f"pool {pool_id!r} not found")

        step.run_on_step_thread(check)

    # ================================================================== pools
    def create_pool(self, *, from_session: str | None = None, **kw):
        fs = self._sid(from_session) if from_session is not None else None
        return self._info(self._call(self._eng.create_pool, from_session=fs, tenant=self.tenant, **kw))

    def fork_pool(self, parent_id: int, *, from_session: str | None = None, **kw):
        self._check_pool(parent_id)
        fs = self._sid(from_session) if from_session is not None else None
        return self._info(self._call(self._eng.fork_pool, parent_id, from_session=fs, tenant=self.tenant, **kw))

    def pool(self, pool_id: int):
        self._check_pool(pool_id)
        return self._info(self._call(self._eng.pool, pool_id))

    def pools(self) -> dict:
        st = self._eng.pools()
        owned = self._owned()
        st = dict(st)
        mine = [p for p in st["pools"] if p["pool_id"] in owned]
        for p in mine:
            p["children"] = [c for c in p["children"] if c in owned]
        st["pools"] = self._out(mine)
        # released pools kept by this tenant's sessions only (others' sessions are dropped by _out)
        st["released_pools"] = [r for r in self._out(st.get("released_pools", [])) if r["held_by"]]
        by_id = {p["pool_id"]: p for p in mine}

        def depth(p) -> int:
            d = 1
            while p["parent"] in by_id:
                d, p = d + 1, by_id[p["parent"]]
            return d
        st["tree_depth"] = max((depth(p) for p in mine), default=0)
        return st

    pin_pool = _pool_op("pin_pool")
    unpin_pool = _pool_op("unpin_pool")
    evict_pool = _pool_op("evict_pool")
    flush_pool = _pool_op("flush_pool")
    release_pool = _pool_op("release_pool")
    set_admission = _pool_op("set_admission")
    admission = _pool_op("admission")

    def capacity(self, pool_id: int, expected_tokens: int | None = None, session_id: str | None = None) -> dict:
        self._check_pool(pool_id)
        sid = self._sid(session_id) if session_id is not None else None
        return self._out(self._call(self._eng.capacity, pool_id, expected_tokens=expected_tokens, session_id=sid))

    def admission_events(self, pool_id: int | None = None, since: float | None = None) -> list[dict]:
        if pool_id is not None:
            self._check_pool(pool_id)
        owned = self._owned()
        return self._out([e for e in self._eng.admission_events(pool_id, since) if e.get("pool_id") in owned])

    def check_kv_files(self) -> dict:
        return self._eng.check_kv_files(self._owned())

    # ================================================================== sessions
    def release_session(self, session_id: str) -> None:
        self._call(self._eng.release_session, self._sid(session_id))

    def compact_session(self, session_id: str, ancestor_pool_id: int, **kw) -> dict:
        self._check_pool(ancestor_pool_id)
        out = self._call(self._eng.compact_session, self._sid(session_id), ancestor_pool_id, **kw)
        return {**out, "pool": self._info(out["pool"])}

    def tps_snapshot(self) -> dict:
        return self._out(self._eng.tps_snapshot())

    def tps_history(self, session_id: str | None = None, since: float | None = None) -> dict:
        sid = self._sid(session_id) if session_id is not None else None
        return self._out(self._call(self._eng.tps_history, sid, since))

    def configure_tps(self, **settings) -> dict:
        if settings:
            raise InvalidRequestError("the tps settings are server-wide; a tenant can only read them")
        return self._eng.configure_tps()

    # ================================================================== generation
    def _gen_kwargs(self, kw: dict) -> dict:
        kw = dict(kw)
        sid = kw.pop("session_id", None)
        kw["session_id"] = self._sid(sid) if sid is not None else f"{self._prefix}s-{uuid.uuid4().hex[:12]}"
        if kw.get("pool_id") is not None:
            self._check_pool(kw["pool_id"])
        if self._salted:
            salt = kw.get("cache_salt")
            kw["cache_salt"] = self.tenant + SEP + (salt or "")
        elif kw.get("cache_salt") is not None:
            raise InvalidRequestError("cache_salt is not supported by this engine")
        return kw

    def _anonymous(self, kw: dict, gen: dict) -> None:
        """A session the view named for the client is still nobody's choice: it expires like the
        engine's own anonymous sessions (marked on the step thread, after the request was queued)."""
        if kw.get("session_id") is None:
            sid = gen["session_id"]
            step = self._step
            step.post_to_step_thread(step.core.polykv.mark_anonymous, sid)

    def stream(self, prompt=None, **kw) -> "TenantStream":
        gen = self._gen_kwargs(kw)
        inner = self._call(self._eng.stream, prompt, **gen)
        self._anonymous(kw, gen)
        return TenantStream(inner, self)

    async def astream(self, prompt=None, **kw) -> "TenantStream":
        gen = self._gen_kwargs(kw)
        try:
            inner = await self._eng.astream(prompt, **gen)
        except OpencotiError as e:
            raise self.rewrite_error(e) from None
        self._anonymous(kw, gen)
        return TenantStream(inner, self)

    def generate(self, prompt=None, **kw):
        s = self.stream(prompt, **kw)
        for _ in s:
            pass
        return s.result

    async def agenerate(self, prompt=None, **kw):
        s = await self.astream(prompt, **kw)
        async for _ in s:
            pass
        return s.result


class TenantStream:
    """A token stream whose ``info`` / ``result`` carry the tenant's own session id."""

    def __init__(self, inner, view: TenantEngine):
        self._inner = inner
        self._view = view
        self.info = view._info(inner.info)

    @property
    def result(self):
        r = self._inner.result
        return None if r is None else dataclasses.replace(r, info=self._view._info(r.info))

    def _wrap_error(self, e: OpencotiError) -> OpencotiError:
        return self._view.rewrite_error(e)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._inner)
        except OpencotiError as e:
            raise self._wrap_error(e) from None

    def close(self) -> None:
        self._inner.close()

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            return await self._inner.__anext__()
        except OpencotiError as e:
            raise self._wrap_error(e) from None

    async def aclose(self) -> None:
        await self._inner.aclose()

    def started(self):
        """The inner stream's ``started`` (a coroutine for an async stream)."""
        return self._inner.started()

    def report_progress(self) -> None:
        self._inner.report_progress()
