"""Shared-prefix (cascade) attention equals the plain paged backend, on random pool trees."""

from __future__ import annotations

import random

import pytest
import torch

from opencoti.engine import SamplingParams
from opencoti.engine.attention.base import SeqBatchEntry, build_metadata
from opencoti.engine.attention.cascade import build_cascade_plan
from opencoti.engine.attention.torch_backend import TorchAttentionBackend
from opencoti.engine.kv.pages import PagePool

H, HKV, D = 6, 2, 16


def _random_tree_batch(rng: random.Random, kv: PagePool, levels: int, num_seqs: int, with_prefill: bool):
    """Page tables for sequences under a random pool tree of ``levels`` shared levels (plus some
    sequences in no pool), each with an uneven private suffix. Returns batch entries."""
    ps = kv.page_size

    def fresh(n_pages):
        return kv.allocate(n_pages)

    # a random tree: each node = list of shared pages, children nodes
    def make_node(depth):
        node = {"pages": fresh(rng.randint(1, 4 if ps > 1 else 24)), "kids": []}
        if depth + 1 < levels:
            node["kids"] = [make_node(depth + 1) for _ in range(rng.randint(1, 2))]
        return node

    roots = [make_node(0) for _ in range(rng.randint(1, 2))]
    paths = []

    def walk(node, prefix):
        prefix = prefix + node["pages"]
        paths.append(prefix)
        for k in node["kids"]:
            walk(k, prefix)

    for r in roots:
        walk(r, [])
    entries = []
    for i in range(num_seqs):
        shared = rng.choice(paths) if i % 5 != 4 else []  # every 5th sequence is in no pool
        shared_tokens = len(shared) * ps
        private_tokens = rng.randint(1, 3 * ps + 5)
        q_len = rng.randint(2, private_tokens) if (with_prefill and i % 3 == 0 and private_tokens > 1) else 1
        kv_len = shared_tokens + private_tokens
        table = list(shared) + fresh(kv.pages_for(kv_len) - len(shared))
        entries.append(SeqBatchEntry(table, kv_len - q_len, q_len))
    return entries


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("levels", [1, 2, 3])
@pytest.mark.parametrize("with_prefill", [False, True], ids=["decode", "mixed"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cascade_equals_plain(page_size, levels, with_prefill, seed):
    rng = random.Random(seed * 100 + levels * 10 + page_size)
    torch.manual_seed(seed)
    kv = PagePool(num_layers=1, num_pages=4096, page_size=page_size, num_kv_heads=HKV, head_dim=D,
                  dtype=torch.float32)
    kv.k_cache.normal_()
    kv.v_cache.normal_()
    entries = _random_tree_batch(rng, kv, levels, num_seqs=rng.randint(4, 12), with_prefill=with_prefill)
    T = sum(e.num_new for e in entries)
    q = torch.randn(T, H, D)
    k = torch.randn(T, HKV, D)
    v = torch.randn(T, HKV, D)
    outs = {}
    for mode in ("off", "on"):
        be = TorchAttentionBackend(cascade=mode)
        meta = build_metadata(entries, page_size)
        be.plan(meta, num_heads=H, num_kv_heads=HKV, head_dim=D)
        assert be.last_used_cascade == (mode == "on")
        outs[mode] = be.forward(0, q, k, v, kv.k_cache[0], kv.v_cache[0], meta, 0.25)
        if mode == "on":
            plan = meta.cascade
            assert plan.groups and max(g.level for g in plan.groups) + 1 <= levels
    assert (outs["on"] - outs["off"]).abs().max().item() <= 1e-5


def test_plan_levels_in_flashinfer_format():
    # two pools: sequences 0,1,2 share pages [10, 11]; 0,1 further share [12]; 3 is alone
    tables = [[10, 11, 12, 20], [10, 11, 12, 21, 22], [10, 11, 30], [40, 41]]
    kv_lens = [4 * 4 - 1, 5 * 4 - 2, 3 * 4, 2 * 4 - 3]
    plan = build_cascade_plan(tables, kv_lens, [1, 1, 3, 1], page_size=4)
    assert [(g.seqs, g.pages, g.level) for g in plan.groups] == [([0, 1, 2], [10, 11], 0), ([0, 1], [12], 1)]
    assert plan.private_start == [3, 3, 2, 0]
    assert plan.num_levels == 3 and sorted(plan.order) == [0, 1, 2, 3]
    assert plan.saved_tokens == (2 * 2 + 1 * 1) * 4
    order = plan.order
    assert order[:3] in ([0, 1, 2], [1, 0, 2])  # DFS: the nested group is contiguous
    lv0, lv1, lv2 = plan.levels
    # level 0: group {0,1,2} (5 query tokens) then the lone sequence 3 with no shared pages
    assert lv0["qo_indptr"].tolist() == [0, 5, 6]
    assert lv0["kv_indptr"].tolist() == [0, 2, 2] and lv0["kv_indices"].tolist() == [10, 11]
    assert lv0["kv_last_page_len"].tolist() == [4, 0]
    assert lv1["qo_indptr"].tolist() == [0, 2, 5, 6] and lv1["kv_indices"].tolist() == [12]
    # last level: private pages of each sequence, FlashInfer's 1 <= last_page_len <= page_size
    assert lv2["qo_indptr"].tolist() == [0, 1, 2, 5, 6]
    assert all(1 <= x <= 4 for x in lv2["kv_last_page_len"].tolist())
    priv = {s: tables[s][plan.private_start[s]:] for s in range(4)}
    assert lv2["kv_indices"].tolist() == sum((priv[s] for s in order), [])


def test_auto_default_uses_cascade_from_6144_spared_reads():
    """The default threshold (bench_cascade: the plain kernel is as fast up to ~3,600 spared reads):
    1,024 shared tokens x 6 sessions (5,120 reads spared) stays plain; x 7 (6,144) uses cascade, as
    do 6,144 shared tokens x 2 sessions, and not one page fewer."""
    be = TorchAttentionBackend()
    assert be.min_saved_tokens == 6144
    for shared_pages, n, used in ((256, 6, False), (256, 7, True), (1536, 2, True), (1535, 2, False)):  # page size 4
        seqs = [SeqBatchEntry(list(range(shared_pages)) + [10000 + i], shared_pages * 4 + 1, 1) for i in range(n)]
        be.plan(build_metadata(seqs, 4), num_heads=H, num_kv_heads=HKV, head_dim=D)
        assert be.last_used_cascade == used, (shared_pages, n)


def test_auto_mode_only_when_enough_is_shared():
    be = TorchAttentionBackend(cascade="auto", min_saved_tokens=64)
    kv = PagePool(num_layers=1, num_pages=64, page_size=4, num_kv_heads=HKV, head_dim=D, dtype=torch.float32)
    small = [SeqBatchEntry([1, 2, 5], 10, 1), SeqBatchEntry([1, 2, 6], 10, 1)]  # 8 shared tokens, 1 saved read
    meta = build_metadata(small, 4)
    be.plan(meta, num_heads=H, num_kv_heads=HKV, head_dim=D)
    assert not be.last_used_cascade
    big = [SeqBatchEntry(list(range(20)) + [40 + i], 81, 1) for i in range(4)]  # 80 shared tokens x 3 saved
    meta = build_metadata(big, 4)
    be.plan(meta, num_heads=H, num_kv_heads=HKV, head_dim=D)
    assert be.last_used_cascade
    del kv


def test_engine_greedy_on_equals_off(make_engine):
    prefix = [(7 * j) % 250 + 1 for j in range(90)]
    outs = {}
    for mode in ("on", "off"):
        eng = make_engine(cascade=mode)
        root = eng.create_pool(tokens=prefix[:50])
        inner = eng.fork_pool(root.pool_id, tokens=prefix)
        streams = [eng.stream(prefix + [i + 1] * (i + 1), pool_id=inner.pool_id if i % 3 else root.pool_id,
                              params=SamplingParams.greedy(12, ignore_eos=True)) for i in range(6)]
        streams.append(eng.stream([3, 4, 5], params=SamplingParams.greedy(12, ignore_eos=True)))
        res = []
        for s in streams:
            list(s)
            res.append(s.result.token_ids)
        outs[mode] = res
        assert (eng.backend.num_cascade_steps > 0) == (mode == "on")
    assert outs["on"] == outs["off"]


def test_cascade_groups_requests_sharing_through_the_prefix_cache(make_engine):
    """No pool: plain requests that share a prefix through the automatic index share page ids,
    so cascade attention groups them like pooled sessions; greedy output equals cascade off."""
    prefix = [(11 * j) % 250 + 1 for j in range(80)]
    outs = {}
    for mode in ("on", "off"):
        eng = make_engine(cascade=mode)
        eng.generate(prefix, params=SamplingParams.greedy(1))  # the prefix is now cached
        streams = [eng.stream(prefix + [i + 1] * (i + 2), params=SamplingParams.greedy(10, ignore_eos=True))
                   for i in range(5)]
        res = []
        for s in streams:
            assert s.info.cached_prefix_tokens >= 80 // 4 * 4 and s.info.pool_id is None
            list(s)
            res.append(s.result.token_ids)
        outs[mode] = res
        assert (eng.backend.num_cascade_steps > 0) == (mode == "on")
    assert outs["on"] == outs["off"]


def test_plan_treats_a_drafts_rows_as_their_sequence():
    """Rows marked same_seq (a speculative draft's rows) are planned as their sequence: alone they
    share nothing; with another sequence every row of both attends to the shared run, and the spared
    reads count sequences, not rows."""
    shared = list(range(8))
    alone = [SeqBatchEntry(shared + [20], 32 + i, 1, same_seq=i > 0) for i in range(4)]  # page size 4
    meta = build_metadata(alone, 4)
    assert meta.seq_of == [0, 0, 0, 0]
    plan = build_cascade_plan(meta.page_tables, meta.kv_lens, meta.qo_lens, 4, seq_of=meta.seq_of)
    assert plan.groups == [] and plan.saved_tokens == 0
    assert build_cascade_plan(meta.page_tables, meta.kv_lens, meta.qo_lens, 4).groups  # rows as sequences: shared
    two = alone + [SeqBatchEntry(shared + [30], 32, 1)]
    meta = build_metadata(two, 4)
    assert meta.seq_of == [0, 0, 0, 0, 1]
    plan = build_cascade_plan(meta.page_tables, meta.kv_lens, meta.qo_lens, 4, seq_of=meta.seq_of)
    assert [sorted(g.seqs) for g in plan.groups] == [[0, 1, 2, 3, 4]] and plan.groups[0].pages == shared
    assert plan.saved_tokens == 1 * len(shared) * 4
    assert sorted(plan.order) == [0, 1, 2, 3, 4] and plan.private_start == [8] * 5
    be = TorchAttentionBackend(cascade="on")
    be.plan(meta, num_heads=H, num_kv_heads=HKV, head_dim=D)
    assert be.last_used_cascade
    with pytest.raises(ValueError, match="same_seq"):
        build_metadata([SeqBatchEntry(shared, 3, 1, same_seq=True)], 4)
    with pytest.raises(ValueError, match="seq_of"):
        build_cascade_plan(meta.page_tables, meta.kv_lens, meta.qo_lens, 4, seq_of=[0])


def test_a_same_seq_entry_must_be_the_next_row_of_the_previous_one():
    table = list(range(9))
    build_metadata([SeqBatchEntry(table, 32, 1), SeqBatchEntry(table, 33, 1, same_seq=True)], 4)  # fine
    for bad in (SeqBatchEntry(table, 34, 1, same_seq=True),  # a gap
                SeqBatchEntry(table, 33, 2, same_seq=True),  # more than one token
                SeqBatchEntry([50] + table[1:], 33, 1, same_seq=True)):  # another table
        with pytest.raises(ValueError, match="same_seq"):
            build_metadata([SeqBatchEntry(table, 32, 1), bad], 4)
