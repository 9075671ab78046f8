"""The native shared-prefix (cascade) kernel (``oc_cascade_groups``): each group's pages read once for all its
query rows, merged with each row's own partial through the log-sum-exp. Checked against the torch cascade
path and plain attention on random pool trees, every KV dtype, GQA and plain multi-head, the scalar build, and
greedy decoding of an engine with cascade on and off."""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from opencoti.engine import SamplingParams, native
from opencoti.engine.attention.base import SeqBatchEntry, build_metadata
from opencoti.engine.attention.torch_backend import TorchAttentionBackend
from opencoti.engine.attention import q8
from opencoti.engine.kv.pages import PagePool

LIB = native.lib()
KV_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "q8": q8.DTYPE}


def _fill(kv: PagePool, head_dim: int) -> None:
    for cache in (kv.k_cache, kv.v_cache):
        x = torch.randn(*cache.shape[:-1], head_dim)
        cache.copy_(q8.quantize(x) if cache.dtype == q8.DTYPE else x.to(cache.dtype))


def _tree_batch(rng: random.Random, kv: PagePool, levels: int, num_seqs: int, with_prefill: bool):
    """Sequences under a random pool tree of ``levels`` shared levels (every 4th in no pool), each with an
    uneven private suffix; some rows prefill several tokens."""
    ps = kv.page_size

    def node(depth):
        n = {"pages": kv.allocate(rng.randint(1, 5 if ps > 1 else 40)), "kids": []}
        if depth + 1 < levels:
            n["kids"] = [node(depth + 1) for _ in range(rng.randint(1, 2))]
        return n

    paths = []

    def walk(n, prefix):
        paths.append(prefix + n["pages"])
        for k in n["kids"]:
            walk(k, prefix + n["pages"])

    for root in [node(0) for _ in range(rng.randint(1, 2))]:
        walk(root, [])
    entries = []
    for i in range(num_seqs):
        shared = rng.choice(paths) if i % 4 != 3 else []
        private = rng.randint(1, 3 * ps + 5)
        q_len = rng.randint(2, private) if (with_prefill and i % 3 == 0 and private > 1) else 1
        kv_len = len(shared) * ps + private
        entries.append(SeqBatchEntry(list(shared) + kv.allocate(kv.pages_for(kv_len) - len(shared)), kv_len - q_len,
                                     q_len))
    return entries


def _run(entries, q, k, v, kv, mode, use_native, calls=None):
    be = TorchAttentionBackend(cascade=mode, min_saved_tokens=1, native=use_native)
    if calls is not None:
        orig = be._native_groups

        def counted(*a):
            used = orig(*a)
            calls.append(used)
            return used

        be._native_groups = counted
    meta = build_metadata(entries, kv.page_size)
    be.plan(meta, num_heads=q.shape[1], num_kv_heads=k.shape[1], head_dim=q.shape[2])
    assert be.last_used_cascade == (mode == "on")
    return be.forward(0, q, k, v, kv.k_cache[0], kv.v_cache[0], meta, q.shape[2] ** -0.5)


@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES))
@pytest.mark.parametrize("heads", [(6, 2, 16), (4, 4, 8), (8, 2, 64), (6, 3, 12)], ids=lambda h: "x".join(map(str, h)))
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("levels", [1, 3])
@pytest.mark.parametrize("with_prefill", [False, True], ids=["decode", "mixed"])
def test_native_cascade_equals_torch_cascade_and_plain(kv_dtype, heads, page_size, levels, with_prefill):
    """(6, 3, 12): a head size that is no multiple of 8 takes the kernel's portable loops."""
    H, HKV, D = heads
    seed = zlib.crc32(repr((kv_dtype, heads, page_size, levels, with_prefill)).encode()) % 10_000
    rng = random.Random(seed)
    torch.manual_seed(seed)
    kv = PagePool(num_layers=1, num_pages=2048, page_size=page_size, num_kv_heads=HKV, head_dim=D,
                  dtype=KV_DTYPES[kv_dtype])
    _fill(kv, D)
    entries = _tree_batch(rng, kv, levels, num_seqs=rng.randint(5, 12), with_prefill=with_prefill)
    T = sum(e.num_new for e in entries)
    q, k, v = torch.randn(T, H, D), torch.randn(T, HKV, D), torch.randn(T, HKV, D)
    calls: list[bool] = []
    native_on = _run(entries, q, k, v, kv, "on", True, calls)
    assert calls == [True]  # the groups went through the native kernel
    torch_on = _run(entries, q, k, v, kv, "on", False)
    plain = _run(entries, q, k, v, kv, "off", False)
    assert native_on.dtype == torch.float32 and native_on.shape == q.shape
    assert (native_on - torch_on).abs().max().item() <= 2e-5
    assert (native_on - plain).abs().max().item() <= 2e-5


def _reference(q, rows_keys, k_cache, v_cache, page_size, scale):
    """Per query row: attention over its listed (page, slot) keys in float64; out [T, H, D], lse [T, H]."""
    T, H, D = q.shape
    hkv = k_cache.shape[2]
    out, lse = torch.zeros(T, H, D, dtype=torch.float64), torch.full((T, H), float("-inf"), dtype=torch.float64)
    for r, pages in rows_keys.items():
        keys = k_cache[pages].reshape(-1, hkv, D).double().repeat_interleave(H // hkv, 1)  # [n, H, D]
        vals = v_cache[pages].reshape(-1, hkv, D).double().repeat_interleave(H // hkv, 1)
        s = torch.einsum("hd,nhd->hn", q[r].double(), keys) * scale
        out[r] = torch.einsum("hn,nhd->hd", s.softmax(-1), vals)
        lse[r] = s.logsumexp(-1)
    return out, lse


def _flat_groups(groups) -> list[torch.Tensor]:
    """(page_ptr, pages, row_ptr, rows) int64 tensors of ``groups`` [(page ids, query rows)], as the kernels take them."""
    page_ptr, pages, row_ptr, rows = [0], [], [0], []
    for g_pages, g_rows in groups:
        pages += g_pages
        rows += g_rows
        page_ptr.append(len(pages))
        row_ptr.append(len(rows))
    return [torch.tensor(x, dtype=torch.int64) for x in (page_ptr, pages, row_ptr, rows)]


def _call_groups(lib, q, k_cache, v_cache, groups, scale, out, lse, nt=2):
    """The operator runs with torch's thread count at the call: ``nt`` for this call."""
    before = torch.get_num_threads()
    torch.set_num_threads(nt)
    try:
        lib.cascade_groups(q, k_cache, v_cache, *_flat_groups(groups), scale, out, lse)
    finally:
        torch.set_num_threads(before)


@pytest.fixture(params=["native", "scalar"])
def any_lib(request, scalar_lib):
    return LIB if request.param == "native" else scalar_lib


@pytest.mark.parametrize("nt", [1, 2, 3])
def test_groups_merge_into_partials_exactly(any_lib, nt):
    """Nested groups over rows that already hold a partial (their private pages), and a row with none yet
    (lse -inf): the result is attention over the union of the keys."""
    torch.manual_seed(nt)
    H, HKV, D, ps = 6, 2, 32, 4
    k_cache, v_cache = torch.randn(40, ps, HKV, D), torch.randn(40, ps, HKV, D)
    q = torch.randn(5, H, D)
    outer, inner = [3, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [20, 21]  # enough pages to split into runs
    private = {0: [30], 1: [31, 32], 2: [33], 3: [34], 4: []}
    groups = [(outer, [0, 1, 2, 4]), (inner, [0, 1])]
    out = torch.zeros(5, H, D)
    lse = torch.full((5, H), float("-inf"))
    have = {r: p for r, p in private.items() if p}
    o0, l0 = _reference(q, have, k_cache, v_cache, ps, 0.3)
    out[list(have)] = o0[list(have)].float()
    lse[list(have)] = l0[list(have)].float()
    _call_groups(any_lib, q, k_cache, v_cache, groups, 0.3, out, lse, nt)
    union = {r: private[r] + (outer if r in (0, 1, 2, 4) else []) + (inner if r in (0, 1) else []) for r in range(5)}
    ref_o, ref_l = _reference(q, union, k_cache, v_cache, ps, 0.3)
    assert (out.double() - ref_o).abs().max().item() < 1e-5
    assert (lse.double() - ref_l).abs().max().item() < 1e-5


@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES))
def test_scalar_build_computes_cascade_groups_on_each_kv_dtype(scalar_lib, kv_dtype):
    torch.manual_seed(1)
    H, HKV, D, ps = 8, 2, 16, 16
    kv = PagePool(num_layers=1, num_pages=24, page_size=ps, num_kv_heads=HKV, head_dim=D, dtype=KV_DTYPES[kv_dtype])
    _fill(kv, D)
    kc, vc = kv.k_cache[0], kv.v_cache[0]
    q = torch.randn(4, H, D)
    groups = [(list(range(2, 12)), [0, 1, 3])]
    outs = {}
    for name, lib in (("native", LIB), ("scalar", scalar_lib)):
        out, lse = torch.zeros(4, H, D), torch.full((4, H), float("-inf"))
        _call_groups(lib, q, kc, vc, groups, 0.25, out, lse)
        outs[name] = (out, lse)
    deq = (lambda c: q8.dequantize(c, torch.float32)) if kv_dtype == "q8" else (lambda c: c.float())
    ref_o, ref_l = _reference(q, {r: groups[0][0] for r in groups[0][1]}, deq(kc), deq(vc), ps, 0.25)
    for out, lse in outs.values():
        assert (out.double() - ref_o).abs().max().item() < 1e-5
        assert (lse.double() - ref_l)[groups[0][1]].abs().max().item() < 1e-5
        assert bool((out[2] == 0).all()) and bool(torch.isinf(lse[2]).all())  # a row in no group: untouched


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp16", "q8"])
def test_engine_greedy_cascade_on_equals_off_with_the_native_kernel(make_engine, monkeypatch, kv_dtype):
    """Sessions under nested pools decode the same tokens with cascade on (native group kernel) and off."""
    calls: list[bool] = []
    orig = TorchAttentionBackend._native_groups

    def counted(self, *a):
        used = orig(self, *a)
        calls.append(used)
        return used

    monkeypatch.setattr(TorchAttentionBackend, "_native_groups", counted)
    prefix = [(5 * j) % 240 + 2 for j in range(70)]
    outs = {}
    for mode in ("on", "off"):
        eng = make_engine(cascade=mode, kv_dtype=kv_dtype)
        root = eng.create_pool(tokens=prefix[:40])
        inner = eng.fork_pool(root.pool_id, tokens=prefix)
        streams = [eng.stream(prefix + [i + 3] * (i + 1), pool_id=inner.pool_id if i % 2 else root.pool_id,
                              params=SamplingParams.greedy(10, ignore_eos=True)) for i in range(5)]
        streams.append(eng.stream([9, 8, 7], params=SamplingParams.greedy(10, ignore_eos=True)))
        for s in streams:
            list(s)
        outs[mode] = [s.result.token_ids for s in streams]
        assert (eng.backend.num_cascade_steps > 0) == (mode == "on")
    assert calls and all(calls)  # every cascade step ran the native group kernel
    assert outs["on"] == outs["off"]


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp16", "q8"])
def test_fused_decode_layer_with_cascade_groups_equals_plain(make_engine, monkeypatch, tmp_path, kv_dtype):
    """``decode_layer_cascade`` (each row's private pages plus nested shared groups) computes the layer
    ``decode_layer`` computes over the whole page tables: same residual stream, same K/V written."""
    monkeypatch.setenv("OPENCOTI_AUTOTUNE", "0")  # the native int8 kernels: the fused layer applies
    monkeypatch.setenv("OPENCOTI_CACHE", str(tmp_path))
    eng = make_engine(weights="int8")
    model, d = eng.model, eng.model.dims
    assert model.fused_layers is not None
    torch.manual_seed(7)
    ps, T = 4, 5
    shared, inner = list(range(0, 6)), list(range(6, 9))  # rows 0-3 share 6 pages, rows 0-1 three more
    kv = PagePool(num_layers=1, num_pages=64, page_size=ps, num_kv_heads=d.num_kv_heads, head_dim=d.head_dim,
                  dtype=KV_DTYPES[kv_dtype])
    _fill(kv, d.head_dim)
    tables, lens, private = [], [], []
    for t in range(T):
        base = shared + inner if t < 2 else shared if t < 4 else []
        own = [20 + 3 * t, 21 + 3 * t, 22 + 3 * t]
        tables.append(base + own)
        lens.append(len(base) * ps + 2 * ps + 1 + t % 3)
        private.append(own)
    slots = torch.tensor([tables[t][(lens[t] - 1) // ps] * ps + (lens[t] - 1) % ps for t in range(T)])
    angles = torch.rand(T, d.head_dim // 2) * 6
    cos = torch.cat([angles.cos(), angles.cos()], -1).contiguous()
    sin = torch.cat([-angles.sin(), angles.sin()], -1).contiguous()
    rows = torch.arange(T, dtype=torch.int64)
    x0 = torch.randn(T, d.hidden_size)
    L = model.layers[0]

    def run(page_tables, kv_lens, groups):
        width = max(len(p) for p in page_tables)
        idx = torch.tensor([p + [0] * (width - len(p)) for p in page_tables], dtype=torch.int64)
        kl = torch.tensor(kv_lens, dtype=torch.int64)
        kc, vc = kv.k_cache[0].clone(), kv.v_cache[0].clone()
        x = x0.clone()
        args = [x, L.in_norm, L.post_norm, d.rms_norm_eps, *model.fused_layers.per_layer[0], cos, sin, slots, kc, vc, rows, idx,
                kl, d.num_heads, model.scale]
        if groups is None:
            LIB.decode_layer(*args)
        else:
            LIB.decode_layer_cascade(*args, *_flat_groups(groups))
        return x, kc, vc

    plain = run(tables, lens, None)
    priv_lens = [lens[t] - (len(tables[t]) - 3) * ps for t in range(T)]
    cascade = run(private, priv_lens, [(shared, [0, 1, 2, 3]), (inner, [0, 1])])
    assert (cascade[0] - plain[0]).abs().max().item() < 1e-4 * plain[0].abs().max().item()
    assert torch.equal(cascade[1], plain[1]) and torch.equal(cascade[2], plain[2])
    no_groups = run(tables, lens, [])  # n_groups 0: the plain layer, bit for bit
    assert torch.equal(no_groups[0], plain[0])


@pytest.mark.parametrize("kv_dtype", ["fp32", "q8"])
def test_cascade_steps_take_the_one_call_fused_decode(make_engine, monkeypatch, tmp_path, kv_dtype):
    """With native int8 projections, a decode step under a cascade plan runs every layer in one call
    (``decode_layers_cascade``) and gives the tokens and logprobs of cascade off and of the
    layer-by-layer path."""
    from opencoti.engine.model import fused as fused_mod

    monkeypatch.setenv("OPENCOTI_AUTOTUNE", "0")  # the native int8 kernels: the fused decode applies
    monkeypatch.setenv("OPENCOTI_CACHE", str(tmp_path))
    taken: list[tuple[bool, bool]] = []  # per decode-only forward: (fused path taken, cascade plan)
    orig = fused_mod.decode_step

    def counted(model, layers, x, meta, *a):
        used = orig(model, layers, x, meta, *a)
        if all(q == 1 for q in meta.qo_lens):
            taken.append((used, meta.cascade is not None))
        return used

    monkeypatch.setattr(fused_mod, "decode_step", counted)
    prefix = [(7 * j) % 200 + 3 for j in range(70)]
    params = SamplingParams.greedy(8, ignore_eos=True)
    params.logprobs = 2
    runs = {}
    for name, cascade, fused in (("on", "on", True), ("off", "off", True), ("layers", "on", False)):
        taken.clear()
        eng = make_engine(model="tiny:llama", weights="int8", cascade=cascade, kv_dtype=kv_dtype)
        if not fused:
            eng.model.fused_layers = None
        else:
            assert eng.model.fused_layers is not None
        root = eng.create_pool(tokens=prefix[:40])
        inner = eng.fork_pool(root.pool_id, tokens=prefix)
        streams = [eng.stream(prefix + [i + 3] * (i + 1), pool_id=inner.pool_id if i % 2 else root.pool_id,
                              params=params) for i in range(4)]
        streams.append(eng.stream([9, 8, 7], params=params))  # in no pool: its own pages only
        for s in streams:
            list(s)
        runs[name] = [s.result for s in streams]
        if name == "on":
            assert any(used and casc for used, casc in taken)  # cascade decode steps went through the one call
            assert all(used for used, _ in taken)  # every decode-only step did, cascade or not
    for other in ("off", "layers"):
        for a, b in zip(runs["on"], runs[other]):
            assert a.token_ids == b.token_ids
            for da, db in zip(a.logprobs, b.logprobs):
                assert abs(da.logprob - db.logprob) < 1e-3


def _decode_reference(q, kc, vc, page_idx, lens, scale, deq):
    """Per row: softmax attention in float64 over its first lens[b] keys (output, lse)."""
    H, hkv = q.shape[1], kc.shape[2]
    kf, vf = deq(kc).double(), deq(vc).double()
    outs = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        if n == 0:
            outs.append((torch.zeros(H, kf.shape[-1], dtype=torch.float64), torch.full((H,), float("-inf"),
                                                                                       dtype=torch.float64)))
            continue
        keys = torch.cat([kf[p] for p in page_idx[b]])[:n].repeat_interleave(H // hkv, 1)
        vals = torch.cat([vf[p] for p in page_idx[b]])[:n].repeat_interleave(H // hkv, 1)
        s = torch.einsum("hd,nhd->hn", q[b].double(), keys) * scale
        outs.append((torch.einsum("hn,nhd->hd", s.softmax(-1), vals), s.logsumexp(-1)))
    return outs


def _decode(q, rows, kc, vc, page_idx, lens, scale, nt):
    before = torch.get_num_threads()
    torch.set_num_threads(nt)
    try:
        out = torch.full(q.shape, float("nan"))
        lse = torch.full(q.shape[:2], float("nan"))
        LIB.paged_decode(q, rows, kc, vc, page_idx, lens, scale, out, lse)
    finally:
        torch.set_num_threads(before)
    return out, lse


@pytest.mark.parametrize("ps,D,heads,kv_dtype", [(16, 64, (9, 3), "fp16"), (5, 64, (14, 2), "q8"), (3, 20, (12, 1), "fp32"),
                                                 (100, 64, (8, 8), "fp32"), (7, 48, (16, 2), "q8"),
                                                 (16, 40, (10, 2), "bf16")])
def test_decode_kernel_chunks_page_sizes_and_batch_independence(ps, D, heads, kv_dtype):
    """The decode kernel (blocks of pages, 512-key chunks merged at the end) against float64 softmax
    attention: lengths of 0 to three chunks, page sizes that do not divide its 64-key blocks, 1 to 12
    query heads per KV head; a row's result is bit for bit the same alone as in the batch and with 1, 2
    or 3 threads."""
    torch.manual_seed(ps + D)
    H, hkv = heads
    lens_l = [0, 1, 511, 512, 513, 1537, 7]
    maxp = max(-(-n // ps) for n in lens_l) + 1
    P = maxp * len(lens_l) + 3
    k, v = torch.randn(P, ps, hkv, D) * 2, torch.randn(P, ps, hkv, D)
    if kv_dtype == "q8":
        kc, vc, deq = q8.quantize(k), q8.quantize(v), (lambda t: q8.dequantize(t, torch.float32))
    else:
        kc, vc = k.to(KV_DTYPES[kv_dtype]), v.to(KV_DTYPES[kv_dtype])
        deq = lambda t: t.float()  # noqa: E731
    perm = torch.randperm(P)
    page_idx = torch.stack([perm[b * maxp:(b + 1) * maxp] for b in range(len(lens_l))]).to(torch.int64)
    lens = torch.tensor(lens_l, dtype=torch.int64)
    q = torch.randn(len(lens_l), H, D)
    rows = torch.arange(len(lens_l), dtype=torch.int64)
    out, lse = _decode(q, rows, kc, vc, page_idx, lens, 0.2, 1)
    for b, (ro, rl) in enumerate(_decode_reference(q, kc, vc, page_idx, lens, 0.2, deq)):
        assert (out[b].double() - ro).abs().max().item() < 1e-4, b
        if lens_l[b] == 0:
            assert bool(torch.isinf(lse[b]).all()) and bool((out[b] == 0).all())
        else:
            assert (lse[b].double() - rl).abs().max().item() < 1e-4, b
    for nt in (2, 3):
        o2, l2 = _decode(q, rows, kc, vc, page_idx, lens, 0.2, nt)
        assert torch.equal(out, o2) and torch.equal(lse, l2), nt
    for b in range(len(lens_l)):
        ob, lb = _decode(q[b:b + 1], rows[:1], kc, vc, page_idx[b:b + 1], lens[b:b + 1], 0.2, 2)
        assert torch.equal(ob[0], out[b]) and torch.equal(lb[0], lse[b]), b
