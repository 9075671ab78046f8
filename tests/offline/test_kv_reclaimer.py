"""The KV tables' one dependency upward is the ``Reclaimer`` they are given at construction: asked
for the shortfall (and the session whose pages must survive) when too few pages are free."""

from __future__ import annotations

import torch

from opencoti.engine.kv.pages import PagePool
from opencoti.engine.kv.tables import KVTables
from opencoti.engine.requests import SeqState, Session


def _kv(num_pages: int = 4) -> PagePool:
    return PagePool(num_layers=1, num_pages=num_pages, page_size=4, num_kv_heads=1, head_dim=2, dtype=torch.float32)


def test_without_a_reclaimer_only_free_pages_are_used():
    kv = _kv()
    tables = KVTables(kv)
    a = SeqState(list(range(16)))
    assert tables.extend_reclaiming(a, 16) and kv.num_free == 0
    b = SeqState(list(range(4)))
    assert not tables.extend_reclaiming(b, 4) and b.page_table == []


def test_the_reclaimer_is_asked_for_the_shortfall_and_what_it_frees_is_used():
    kv = _kv()
    held = SeqState(list(range(16)))
    asked: list[tuple[int, object]] = []

    def reclaim(num_pages: int, keep: Session | None = None) -> int:
        asked.append((num_pages, keep))
        tables.drop(held)  # the memory policy chose to evict this one
        return 4

    tables = KVTables(kv, reclaim=reclaim)
    assert tables.extend_reclaiming(held, 16) and asked == []  # pages were free: not asked
    b = SeqState(list(range(8)))
    assert tables.extend_reclaiming(b, 8) and asked == [(2, None)] and len(b.page_table) == 2
    tables.check_integrity([b])


def test_a_reclaimer_that_frees_too_little_leaves_the_table_unchanged():
    kv = _kv()
    keep = Session("s")
    asked: list[tuple[int, object]] = []
    tables = KVTables(kv, reclaim=lambda n, keep=None: asked.append((n, keep)) or 0)
    a = SeqState(list(range(14)))
    assert tables.extend_reclaiming(a, 14) and kv.num_free == 0
    tables.advance(a, 14)
    c = SeqState(list(range(14)))
    assert not tables.share_into(c, a.page_table, 14, borrowed=3, keep=keep)  # its partial page needs a copy
    assert asked == [(1, keep)] and c.page_table == [] and kv.num_free == 0
    tables.check_integrity([a])
