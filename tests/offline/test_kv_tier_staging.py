"""The staging buffers of reclaimed pages (``persist/staging.py``): a buffer the writer is done with is used
again for the next snapshot - but never while a view of it, handed to a request reading pending pages back,
is alive (that would overwrite KV a request is copying: wrong answers) - and at most ``keep_bytes`` of free
buffers are kept."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from opencoti.engine.persist.staging import Staging
from opencoti.engine.persist.tier import DiskTier

SHAPE = (2, 4, 16, 1, 8)  # [L, pages, page size, H, D]


def test_a_buffer_given_back_is_used_again_and_a_live_view_keeps_it_out():
    st = Staging(keep_bytes=1 << 20)
    t, buf = st.take(SHAPE, torch.float16)
    assert t.shape == SHAPE and t.is_contiguous() and t.dtype == torch.float16
    ptr = t.data_ptr()
    view = t[:, 1:3]  # (a reader's part of the snapshot)
    del t
    st.give(buf)
    t2, buf2 = st.take(SHAPE, torch.float16)  # the view is alive: a fresh buffer
    assert t2.data_ptr() != ptr and st.stats == {"staging_reused": 0, "staging_fresh": 2}
    del view
    t3, _ = st.take(SHAPE, torch.float16)  # now it is free: used again
    assert t3.data_ptr() == ptr and st.stats["staging_reused"] == 1
    small, _ = st.take((2, 1, 16, 1, 8), torch.float32)  # a smaller snapshot fits a bigger free buffer
    del small
    assert st.stats["staging_fresh"] == 3  # (none was free)


def test_free_buffers_beyond_keep_bytes_go_back_to_the_kernel():
    nbytes = torch.Size(SHAPE).numel() * 2
    st = Staging(keep_bytes=nbytes)
    taken = [st.take(SHAPE, torch.float16) for _ in range(3)]
    bufs = [b for _, b in taken]
    del taken
    for b in bufs:
        st.give(b)
    st.take((1,), torch.uint8)  # (collects what was given back)
    assert st.kept_bytes == 0  # the one that fit the cap was taken for this snapshot; the others dropped
    st2 = Staging(keep_bytes=0)
    _, b = st2.take(SHAPE, torch.float16)
    st2.give(b)
    st2.take((1,), torch.uint8)
    assert st2.kept_bytes == 0 and st2.stats["staging_reused"] == 0


def test_buffers_waiting_for_readers_are_bounded_and_free_ones_are_let_go_when_given_back():
    nbytes = torch.Size(SHAPE).numel() * 2
    st = Staging(keep_bytes=2 * nbytes)
    views = []
    for _ in range(5):  # readers hold a view of every snapshot: none can be used again
        t, b = st.take(SHAPE, torch.float16)
        views.append(t[:, :1])
        del t
        st.give(b)
    assert st.kept_bytes <= 2 * nbytes  # the oldest were forgotten (freed when their readers let go)
    assert torch.all(views[0] == views[0])  # (a forgotten buffer's memory is still the reader's)
    views.clear()
    st.give(st.take(SHAPE, torch.float16)[1])  # given back with no reader: kept for the next snapshot
    assert 0 < st.kept_bytes <= 2 * nbytes


class _Entry:
    def __init__(self, key: bytes, page: int, tokens: tuple, parent, depth: int):
        self.key, self.page, self.tokens, self.parent, self.depth = key, page, tokens, parent, depth


def _kv(pages: int = 16):
    L, ps, H, D = 2, 16, 1, 8
    k = torch.zeros(L, pages, ps, H, D, dtype=torch.float16)
    return SimpleNamespace(k_cache=k, v_cache=k.clone(), page_size=ps, page_bytes=2 * L * ps * H * D * 2,
                           num_layers=L, num_kv_heads=H, dtype=torch.float16)


def _chain(tag: str, pages: list[int], ps: int = 16) -> list[_Entry]:
    root = _Entry(f"root-{tag}".encode().ljust(16, b"\0"), -1, (), None, 0)
    out, parent = [], root
    for i, page in enumerate(pages):
        e = _Entry(f"{tag}-{i}".encode().ljust(16, b"\0"), page, tuple(range(i * ps, (i + 1) * ps)), parent, i + 1)
        out.append(e)
        parent = e
    return out


def test_a_pending_snapshot_read_back_is_not_overwritten_by_later_reclaims(tmp_path):
    kv = _kv()
    tier = DiskTier(tmp_path / "tier", 1 << 30, None)
    try:
        kv.k_cache[:, 0:4] = 1.0
        kv.v_cache[:, 0:4] = 2.0
        a = _chain("a", [0, 1, 2, 3])
        tier.pacer.step_begin()  # the engine computes and lends the writer nothing: the snapshot stays pending
        tier.pacer.step_end(0.0)
        tier.spill(kv, [a])
        parts = tier.fetch([e.key for e in a], [e.tokens for e in a], a[0].parent.key, kv)
        assert tier.stats["read_from_memory"] == 1 and len(parts) == 1
        k_part, v_part = parts[0]
        tier.pacer.idle()  # nothing computes: the writer writes it and gives its buffers back
        tier.flush()
        kv.k_cache[:, 4:8] = 7.0
        kv.v_cache[:, 4:8] = 7.0
        tier.spill(kv, [_chain("b", [4, 5, 6, 7])])  # same size: it would take the buffers the read still views
        tier.flush()
        assert torch.all(k_part == 1.0) and torch.all(v_part == 2.0)  # what the request copies is still A's KV
        assert tier.staging.stats["staging_reused"] == 0
        del parts, k_part, v_part
        tier.spill(kv, [_chain("c", [8, 9, 10, 11])])  # no view left: used again
        tier.flush()
        assert tier.staging.stats["staging_reused"] == 2  # (K's and V's)
        got = tier.fetch([e.key for e in _chain("c", [8, 9, 10, 11])], [e.tokens for e in _chain("c", [8, 9, 10, 11])],
                         _chain("c", [8])[0].parent.key, kv)
        assert got and torch.all(got[0][0] == 0.0)  # c's pages (zeros), read back from its file, checked
        assert tier.status()["staging_reused"] == 2
    finally:
        tier.close()
