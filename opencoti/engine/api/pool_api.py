"""``PoolAPI``: what the Engine's pool and session calls do, composed into the Engine (``Engine.pool_api``).

The Engine's public methods (``create_pool``, ``fork_pool``, ``pool``, ``pools``, ``pin_pool``,
``evict_pool``, ``flush_pool``, ``release_pool``, ``compact_session``, ``release_session``) hold the
signatures and documentation; each hands its arguments to one method here. Every change runs on the
step thread (``run``) as one call of the owner of the pool and session state, ``PolyKV``; answers are
read by ``polykv/status.py`` and carry each session's live tps (``metrics``).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable

from ..errors import InvalidRequestError, PoolBusyError, SessionBusyError
from ..kv.pool import Residency
from ..polykv import status
from ..results import PoolInfo


class PoolAPI:
    def __init__(self, core, *, run: Callable[..., Any], tokenize: Callable[[str], list[int]],
                 apply_chat_template: Callable[..., str], metrics, page_bytes: int):
        """``core``: the EngineCore (its ``polykv``, ``release_session`` and read-only view);
        ``run``: runs a function on the step thread and returns its result."""
        self.core = core
        self.run = run
        self.tokenize = tokenize
        self.apply_chat_template = apply_chat_template
        self.metrics = metrics
        self.page_bytes = page_bytes

    def release_session(self, session_id: str) -> None:
        self.run(self.core.release_session, session_id)

    def tokens_of(self, tokens, text, messages, tools, add_generation_prompt: bool) -> list[int] | None:
        """A pool's tokens from exactly one of ``tokens`` / ``text`` / ``messages`` (None: none given)."""
        given = sum(x is not None for x in (tokens, text, messages))
        if given > 1:
            raise InvalidRequestError("give exactly one of tokens / text / messages / from_session")
        if text is not None:
            if not isinstance(text, str) or not text:
                raise InvalidRequestError("text must be a non-empty string")
            return self.tokenize(text)
        if messages is not None:
            return self.tokenize(self.apply_chat_template(messages, tools=tools,
                                                          add_generation_prompt=add_generation_prompt))
        return None if tokens is None else list(tokens) if isinstance(tokens, (list, tuple)) else tokens

    def _pool_call(self, op: Callable, *args, tenant: str | None = None, **kwargs) -> PoolInfo:
        done: Future = Future()

        def on_done(result):
            if isinstance(result, BaseException):
                done.set_exception(result)
            else:
                done.set_result(result)

        def run():
            pool = op(on_done, *args, **kwargs)
            self.core.polykv.set_tenant(pool, tenant)  # the owning tenant (tenancy.py): given, else the parent's
            return pool

        self.run(run)
        pool = done.result()
        return self.run(self.info_of, pool)

    def live(self, sessions: list[dict]) -> list[dict]:
        """Session rows with their live ``tps_ewma`` and ``ttft_ms`` (step thread): one shape in every
        answer that lists sessions (the tree, one pool, pin / evict / create / fork)."""
        m = self.metrics
        for sess in sessions:
            s = self.core.sessions.get(sess["session_id"])
            sess["tps_ewma"] = m.session_tps(sess["session_id"], s.job if s is not None else None)
            sess["ttft_ms"] = m.ttft_ms.get(sess["session_id"])
        return sessions

    def info_of(self, pool) -> PoolInfo:
        """(step thread) One pool's row, its sessions live."""
        info = status.pool_info(self.core.polykv, pool, self.core.max_context)
        self.live(info.sessions)
        return info

    def create(self, toks: list[int] | None, *, from_session: str | None, pinned: bool, label: str, as_root: bool,
               tenant: str | None) -> PoolInfo:
        if toks is not None and from_session is not None:
            raise InvalidRequestError("give exactly one of tokens / text / messages / from_session")
        return self._pool_call(self.core.polykv.create_pool, tokens=toks, from_session=from_session, pinned=pinned,
                               label=label, as_root=as_root, tenant=tenant)

    def fork(self, parent_id: int, branch_pos: int | None, toks: list[int] | None, *, from_session: str | None,
             pinned: bool, label: str, tenant: str | None) -> PoolInfo:
        if toks is not None and from_session is not None:
            raise InvalidRequestError("give exactly one of tokens / text / messages / from_session")
        if branch_pos is None:
            branch_pos = self.info(parent_id).prefix_len
        return self._pool_call(self.core.polykv.fork_pool, parent_id, branch_pos, tokens=toks, from_session=from_session,
                               pinned=pinned, label=label, tenant=tenant)

    def info(self, pool_id: int) -> PoolInfo:
        return self.run(lambda: self.info_of(self.core.tree.get(pool_id)))

    def tokens(self, pool_id: int) -> list[int]:
        return self.run(lambda: list(self.core.tree.get(pool_id).tokens))

    def tree(self) -> dict:
        def run():
            st = status.pools_status(self.core.polykv, self.core.counters, self.core.max_context)
            for p in st["pools"]:
                self.live(p["sessions"])
            return st
        return self.run(run)

    def pin(self, pool_id: int, pinned: bool) -> PoolInfo:
        return self.run(lambda: self.info_of(self.core.polykv.pin_pool(pool_id, pinned)))

    def evict(self, pool_id: int) -> PoolInfo:
        return self.run(lambda: self.info_of(self.core.polykv.evict_pool(pool_id)))

    def flush(self, pool_id: int) -> int:
        return self.run(self.core.polykv.flush_pool, pool_id)

    def release(self, pool_id: int, immediate: bool, cascade_sessions: bool = False) -> list[str]:
        """Release the pool; ``cascade_sessions``: first end the sessions that keep its KV (those of
        its subtree, released descendants included; a request in flight is cancelled). Returns
        the ended session ids."""
        def go() -> list[str]:
            kv = self.core.polykv
            pool = kv.tree.get(pool_id)
            if not cascade_sessions:
                kv.release_pool(pool_id, immediate)
                return []
            live = [c.pool_id for c in pool.children if c.residency != Residency.RELEASED and c.release_at is None]
            if live:  # nothing ended before the release is known to go through
                raise PoolBusyError(f"pool {pool_id} has child pools {live}; release them first (leaves first)")
            ended = [s.session_id for s in kv.holding_sessions(pool)]
            for sid in ended:
                self.core.release_session(sid)
            kv.release_pool(pool_id, immediate)
            return ended
        return self.run(go)

    def compact(self, session_id: str, ancestor_pool_id: int, toks: list[int] | None, branch_pos: int | None,
                release_old: bool) -> dict:
        if toks is None:
            raise InvalidRequestError("compaction needs the compacted prefix (tokens, text or messages)")

        def check():
            s = self.core.polykv.get_session(session_id)
            if s.job is not None:
                raise SessionBusyError(f"session {session_id!r} is serving a request; compact it when idle")
            return status.kv_accounting(self.core.polykv), s.pool_id

        before, old_pool_id = self.run(check)
        if branch_pos is None:
            branch_pos = self.info(ancestor_pool_id).prefix_len
        info = self.fork(ancestor_pool_id, branch_pos, toks, from_session=None, pinned=False, label="compacted",
                         tenant=None)
        try:
            released = self.run(self.core.polykv.move_session, session_id, info.pool_id,
                                old_pool_id if release_old else None, ancestor_pool_id)
        except Exception:
            self.run(self.core.polykv.release_pool, info.pool_id, True)  # nothing half-done
            raise
        after = self.run(status.kv_accounting, self.core.polykv)
        return {"pool": self.info(info.pool_id), "released_pools": released, "kv_pages_before": before[0],
                "kv_pages_after": after[0], "kv_pages_cache_before": before[1], "kv_pages_cache_after": after[1],
                "page_bytes": self.page_bytes}
