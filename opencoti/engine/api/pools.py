"""The Engine's session and pool API (a mixin of Engine): each call runs on the step thread."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Callable, Sequence as Seq

from ..errors import InvalidRequestError, SessionBusyError
from ..polykv import status
from ..results import PoolInfo


class PoolAPIMixin:
    """Needs from Engine: core, kv, metrics, run_on_step_thread, tokenize, apply_chat_template, pool."""

    def release_session(self, session_id: str) -> None:
        self.run_on_step_thread(self.core.release_session, session_id)

    def _pool_tokens(self, tokens, text, messages, tools, add_generation_prompt) -> list[int] | None:
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

        self.run_on_step_thread(run)
        pool = done.result()
        return self.run_on_step_thread(self._pool_info, pool)

    def _live(self, sessions: list[dict]) -> list[dict]:
        """Session rows with their live ``tps_ewma`` and ``ttft_ms`` (step thread): one shape in every
        answer that lists sessions (the tree, one pool, pin / evict / create / fork)."""
        m = self.metrics
        for sess in sessions:
            s = self.core.sessions.get(sess["session_id"])
            sess["tps_ewma"] = m.session_tps(sess["session_id"], s.job if s is not None else None)
            sess["ttft_ms"] = m.ttft_ms.get(sess["session_id"])
        return sessions

    def _pool_info(self, pool) -> PoolInfo:
        info = status.pool_info(self.core.polykv, pool, self.core.max_context)
        self._live(info.sessions)
        return info

    def create_pool(self, *, tokens: Seq[int] | None = None, text: str | None = None,
                    messages: list[dict] | None = None, tools: list[dict] | None = None,
                    from_session: str | None = None, pinned: bool = False, label: str = "",
                    add_generation_prompt: bool = False, as_root: bool = False,
                    tenant: str | None = None) -> PoolInfo:
        """Create a root pool and materialize it (prefill only). Returns when it is resident.

        ``messages`` are rendered with the chat template (``add_generation_prompt`` False by
        default, so a later chat request that continues the conversation attaches to it).
        ``from_session`` of a session attached to a resident pool makes a child of that pool
        (zero-copy, branched at a page boundary) unless ``as_root`` (docs/polykv.md).
        """
        toks = self._pool_tokens(tokens, text, messages, tools, add_generation_prompt)
        if toks is not None and from_session is not None:
            raise InvalidRequestError("give exactly one of tokens / text / messages / from_session")
        return self._pool_call(self.core.polykv.create_pool, tokens=toks, from_session=from_session, pinned=pinned,
                               label=label, as_root=as_root, tenant=tenant)

    def fork_pool(self, parent_id: int, *, branch_pos: int | None = None, tokens: Seq[int] | None = None,
                  text: str | None = None, messages: list[dict] | None = None, tools: list[dict] | None = None,
                  from_session: str | None = None, pinned: bool = False, label: str = "",
                  add_generation_prompt: bool = False, tenant: str | None = None) -> PoolInfo:
        """Fork ``parent_id`` at ``branch_pos`` D (default: the parent's L, i.e. extend).

        ``tokens`` (or text/messages) is the child's FULL prefix [0, L); ``tokens[0:D]`` must equal
        the parent's (else PoolContractError, nothing changes). The child computes only [D, L).
        """
        toks = self._pool_tokens(tokens, text, messages, tools, add_generation_prompt)
        if toks is not None and from_session is not None:
            raise InvalidRequestError("give exactly one of tokens / text / messages / from_session")
        if branch_pos is None:
            branch_pos = self.pool(parent_id).prefix_len
        return self._pool_call(self.core.polykv.fork_pool, parent_id, branch_pos, tokens=toks, from_session=from_session,
                               pinned=pinned, label=label, tenant=tenant)

    def pool(self, pool_id: int) -> PoolInfo:
        return self.run_on_step_thread(lambda: self._pool_info(self.core.tree.get(pool_id)))

    def pool_tokens(self, pool_id: int) -> list[int]:
        """A pool's whole token prefix ``[0, L)`` (PoolNotFoundError for an unknown id)."""
        return self.run_on_step_thread(lambda: list(self.core.tree.get(pool_id).tokens))

    def pools(self) -> dict:
        """The pool tree (fields in docs/polykv.md), each session with its live ``tps_ewma``."""
        def run():
            st = status.pools_status(self.core.polykv, self.core.counters, self.core.max_context)
            for p in st["pools"]:
                self._live(p["sessions"])
            return st
        return self.run_on_step_thread(run)

    def pin_pool(self, pool_id: int) -> PoolInfo:
        return self.run_on_step_thread(lambda: self._pool_info(self.core.polykv.pin_pool(pool_id, True)))

    def unpin_pool(self, pool_id: int) -> PoolInfo:
        return self.run_on_step_thread(lambda: self._pool_info(self.core.polykv.pin_pool(pool_id, False)))

    def evict_pool(self, pool_id: int) -> PoolInfo:
        return self.run_on_step_thread(lambda: self._pool_info(self.core.polykv.evict_pool(pool_id)))

    def flush_pool(self, pool_id: int) -> int:
        """End the idle sessions attached to the pool; returns how many."""
        return self.run_on_step_thread(self.core.polykv.flush_pool, pool_id)

    def release_pool(self, pool_id: int, *, immediate: bool = False) -> None:
        """Release a pool (leaves first). Within its grace TTL the release is deferred until the
        grace ends (the pool stays attachable meanwhile); ``immediate`` releases it now."""
        self.run_on_step_thread(self.core.polykv.release_pool, pool_id, immediate)

    def compact_session(self, session_id: str, ancestor_pool_id: int, *, tokens: Seq[int] | None = None,
                        text: str | None = None, messages: list[dict] | None = None,
                        branch_pos: int | None = None, release_old: bool = True) -> dict:
        """Compaction by re-fork: fork the stable ancestor with the compacted prefix
        (e.g. system + summary + recent tail), move the session onto it, release the pools it leaves
        behind that nothing else uses (at once). Returns the new pool, the released pool ids and the
        KV pages owned by pools and sessions before / after (pages only the prefix cache holds,
        reusable and evicted first, apart: ``kv_pages_cache_before`` / ``_after``)."""
        toks = self._pool_tokens(tokens, text, messages, None, False)
        if toks is None:
            raise InvalidRequestError("compaction needs the compacted prefix (tokens, text or messages)")
        def check():
            s = self.core.polykv.get_session(session_id)
            if s.job is not None:
                raise SessionBusyError(f"session {session_id!r} is serving a request; compact it when idle")
            return status.kv_accounting(self.core.polykv), s.pool_id

        before, old_pool_id = self.run_on_step_thread(check)
        if branch_pos is None:
            branch_pos = self.pool(ancestor_pool_id).prefix_len
        info = self.fork_pool(ancestor_pool_id, branch_pos=branch_pos, tokens=toks, label="compacted")
        try:
            released = self.run_on_step_thread(self.core.polykv.move_session, session_id, info.pool_id,
                                  old_pool_id if release_old else None, ancestor_pool_id)
        except Exception:
            self.run_on_step_thread(self.core.polykv.release_pool, info.pool_id, True)  # nothing half-done
            raise
        after = self.run_on_step_thread(status.kv_accounting, self.core.polykv)
        return {"pool": self.pool(info.pool_id), "released_pools": released, "kv_pages_before": before[0],
                "kv_pages_after": after[0], "kv_pages_cache_before": before[1], "kv_pages_cache_after": after[1],
                "page_bytes": self.kv.page_bytes}
