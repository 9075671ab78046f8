"""Reports on the pool and session state (read only): one session's and one pool's row, the tree,
KV bytes by ownership, the prefix cache's counters, the engine-wide ``stats()``, and the integrity
check (refcounts match the page tables, every used page has one owner)."""

from __future__ import annotations

import time

from ..kv.pool import Pool, Residency
from ..results import PoolInfo
from ..requests import Session
from .state import PolyKV


def session_info(polykv: PolyKV, s: Session, max_context: int) -> dict:
    return {
        "session_id": s.session_id,
        "pool_id": s.pool_id,
        "suffix_n_tokens": len(s.seq.tokens) - s.seq.num_shared_tokens,
        "marginal_kv_bytes": len(s.seq.owned_pages) * polykv.kv.page_bytes,
        "ctx_used": len(s.seq.tokens),
        "ctx_total": max_context,
        "state": s.state.value,
        **polykv.tables.kv_location(s.seq, s.spilled_keys),  # RAM, disk (the KV tier) or nowhere
    }


def holder_info(polykv: PolyKV, s: Session, now: float) -> dict:
    """A session that keeps a pool's KV: where it is attached and until when (``expires_in_s``: an
    idle anonymous session's TTL; None: busy, or named, kept until released)."""
    return {"session_id": s.session_id, "pool_id": s.pool_id, "state": s.state.value,
            "expires_in_s": polykv.session_expires_in(s, now)}


def held_by(polykv: PolyKV, pool: Pool, now: float, released_only: bool) -> list[dict]:
    """The sessions keeping ``pool``'s KV: of released descendants only (``released_only``: the
    others are listed with their own pools), or all of its subtree's."""
    out = []
    for s in polykv.holding_sessions(pool):
        at = polykv.session_pool(s)
        if not released_only or (at is not None and at.residency == Residency.RELEASED):
            out.append(holder_info(polykv, s, now))
    return out


def released_pools(polykv: PolyKV, now: float) -> list[dict]:
    """Released pools whose KV sessions still read (of theirs or of released descendants): not in
    the pool budget, their pages counted in ``kv_pages_used`` until those sessions end."""
    pb = polykv.kv.page_bytes
    return [{"pool_id": p.pool_id, "parent": p.parent.pool_id if p.parent else None, "prefix_len": p.prefix_len,
             "own_kv_bytes": len(p.seq.owned_pages) * pb, "held_by": held_by(polykv, p, now, False)}
            for p in sorted(polykv.tree.released.values(), key=lambda p: p.pool_id)]


def pool_info(polykv: PolyKV, pool: Pool, max_context: int) -> PoolInfo:
    now = time.monotonic()
    own = len(pool.seq.owned_pages) * polykv.kv.page_bytes
    sessions = [session_info(polykv, polykv.sessions[sid], max_context) for sid in sorted(pool.sessions)
                if sid in polykv.sessions]
    subtree = own + sum(x["marginal_kv_bytes"] for x in sessions)
    kids = [c for c in pool.children if c.residency != Residency.RELEASED]
    for c in pool.children:
        subtree += pool_info(polykv, c, max_context).subtree_kv_bytes
    return PoolInfo(
        pool_id=pool.pool_id, parent=pool.parent.pool_id if pool.parent else None, branch_pos=pool.branch_pos,
        prefix_len=pool.prefix_len, own_len=pool.own_len, own_kv_bytes=own, subtree_kv_bytes=subtree,
        residency=pool.residency.value, pinned=pool.pinned, auto_pinned=polykv.auto_pinned(pool, now),
        orphaned_pin=pool.pinned and not pool.sessions and not kids,
        last_access_ts=pool.last_access_wall, children=[c.pool_id for c in kids], sessions=sessions,
        rematerialized=pool.rematerializations > 0, cache_hits=pool.cache_hits, label=pool.label,
        release_in_s=None if pool.release_at is None else max(0.0, max(pool.release_at, pool.grace_until) - now),
        held_by=held_by(polykv, pool, now, True) if pool.children else [])


def kv_accounting(polykv: PolyKV) -> tuple[int, int, int]:
    """(pages held by pools and sessions, pages held only by the prefix cache (evicted on demand,
    so reported apart like free pages), pages no pool or session owns: the cache owner's)."""
    cache_only = polykv.tables.num_cache_only()
    owned = sum(len(s.owned_pages) for s in polykv.holders())
    return polykv.kv.num_used - cache_only, cache_only, polykv.kv.num_used - owned


def cache_status(polykv: PolyKV, counters: dict, cache_only: int, cache_owned: int) -> dict:
    """The prefix cache: pages only it holds (evictable), pages it owns (those plus pages sessions
    still read after their owner ended), hits."""
    c, pb, index = counters, polykv.kv.page_bytes, polykv.tables.index
    return {
        "enabled": index is not None,
        "cache_pages": cache_only,
        "cache_kv_bytes": cache_only * pb,
        "owned_pages": cache_owned,
        "indexed_pages": len(index) if index is not None else 0,
        "evicted_pages": polykv.tables.evicted_pages,
        "prompt_tokens": c["prompt_tokens"],
        "cached_prompt_tokens": c["cached_prompt_tokens"],
        "auto_prefix_tokens": c["auto_prefix_tokens"],
        # prompt tokens reused (pools, sessions and the automatic index) / prompt tokens
        "hit_rate": c["cached_prompt_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0,
    }


def tier_status(polykv: PolyKV) -> dict:
    """The bytes of each KV tier: RAM (pages in use, the prefix cache's included) and the disk tier."""
    tier = polykv.tables.tier
    disk = tier.status() if tier is not None else {"enabled": False, "used_bytes": 0, "pages": 0}
    return {"ram": {"used_bytes": polykv.kv.num_used * polykv.kv.page_bytes, "pages": polykv.kv.num_used,
                    "budget_bytes": polykv.kv.num_pages * polykv.kv.page_bytes},
            "disk": {**disk, "promoted_pages": polykv.tables.promoted_pages}}


def stats(polykv: PolyKV, counters: dict, running: int, waiting: int) -> dict:
    used, cache_only, cache_owned = kv_accounting(polykv)
    return {**counters, "kv_pages_used": used, "kv_pages_cache": cache_only,
            "kv_pages_total": polykv.kv.num_pages, "sessions": len(polykv.sessions),
            "running": running, "waiting": waiting,
            "prefix_cache": cache_status(polykv, counters, cache_only, cache_owned),
            "kv_memory": polykv.kv.memory(), "kv_tiers": tier_status(polykv)}


def pools_status(polykv: PolyKV, counters: dict, max_context: int) -> dict:
    used, cache_only, cache_owned = kv_accounting(polykv)
    cache = cache_status(polykv, counters, cache_only, cache_owned)
    tree, pages = polykv.tree, polykv.kv
    return {
        "pools": [pool_info(polykv, p, max_context).as_dict() for p in sorted(tree.pools.values(), key=lambda p: p.pool_id)],
        "tree_depth": tree.depth(),
        "pools_used": tree.num_used,
        "pools_max": tree.max_pools,
        "released_pools": released_pools(polykv, time.monotonic()),
        # the design's names: a session here is a page table, not a sequence slot, so only pools use ids
        "seq_ids_used": tree.num_used,
        "seq_ids_max": tree.max_pools,
        "kv_pages_total": pages.num_pages,
        "kv_pages_used": used,  # held by pools and sessions (cache-only pages are reported apart)
        "kv_bytes_used": used * pages.page_bytes,
        "kv_pages_cache": cache_only,  # held only by the prefix cache: evicted first, on demand
        "cache_kv_bytes": cache_only * pages.page_bytes,
        "cache_hit_rate": cache["hit_rate"],
        "page_size": polykv.page_size,
        "prefix_cache": cache,
        "kv_memory": pages.memory(),  # reserved (the cap) / resident / used bytes
        "kv_tiers": tier_status(polykv),  # bytes in RAM and in the disk tier
    }


def check_integrity(polykv: PolyKV) -> None:
    """Refcounts match the page tables (and the prefix index), and every used page has exactly
    one owner: a pool, a session, or else the cache."""
    polykv.tables.check_integrity(polykv.holders())
    for s in polykv.sessions.values():
        pool = polykv.session_pool(s)
        if s.seq.num_borrowed_pages and pool is not None:  # without a pool it borrows from the cache
            n = s.seq.num_borrowed_pages
            assert s.seq.page_table[:n] == pool.seq.page_table[:n], f"session {s.session_id} borrow mismatch"
    for p in polykv.tree.pools.values():
        if p.residency == Residency.RESIDENT and p.parent is not None:
            n = p.seq.num_borrowed_pages
            assert p.seq.page_table[:n] == p.parent.seq.page_table[:n], f"pool {p.pool_id} borrow mismatch"
