"""KV pages in 16 and 8 bits (``EngineConfig.kv_dtype`` / ``--kv-dtype``): the budget in real bytes,
attention over fp16 / bf16 / q8 pages (torch and native, the fused decode layers included) against
fp32 pages holding the same values, the native kernels' rounding against torch's, KV files keyed by
the KV dtype, /props. (q8's own checks: test_kv_q8.py.)"""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch
from starlette.testclient import TestClient

from opencoti.engine import EngineConfig, SamplingParams, native
from opencoti.engine.attention.base import SeqBatchEntry, build_metadata
from opencoti.engine.attention.torch_backend import TorchAttentionBackend
from opencoti.engine.errors import InvalidRequestError
from opencoti.engine.attention import q8
from opencoti.engine.kv.gate import kv_gate, paged_logits
from opencoti.engine.kv.pages import PagePool
from opencoti.engine.model import fused as fused_mod

LIB = native.lib()
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "q8": torch.int8}
H, HKV, D = 6, 2, 16


def test_bad_kv_dtype_is_a_clear_error():
    for bad in ("float8", "FP16", "Q8", "int8", "q4", 16, None, ""):
        with pytest.raises(InvalidRequestError, match="kv_dtype must be auto\\|fp32\\|fp16\\|bf16\\|q8"):
            EngineConfig(kv_dtype=bad)
    assert EngineConfig(kv_dtype="fp16").kv_dtype == "fp16"


def test_auto_is_fp16_under_fp32_activations(make_engine):
    from opencoti.engine.api.build import resolve_kv_dtype

    eng = make_engine()
    assert eng.dtype == torch.float32 and eng.kv.k_cache.dtype == eng.kv.v_cache.dtype == torch.float16
    assert resolve_kv_dtype("auto", torch.bfloat16) == torch.bfloat16  # CUDA's default activations
    assert resolve_kv_dtype("fp32", torch.float32) == torch.float32


def test_serve_flag():
    from opencoti.server.serve import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["--kv-dtype", "bf16"]).kv_dtype == "bf16"
    assert p.parse_args([]).kv_dtype == EngineConfig().kv_dtype
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-dtype", "int3"])


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_the_budget_counts_real_bytes(make_engine, name):
    """The same MiB hold twice the tokens in 16 bits; /props says the dtype and the bytes."""
    from opencoti.server import create_app

    e32 = make_engine(kv_budget_tokens=None, kv_budget_mib=1.0, kv_dtype="fp32")
    e16 = make_engine(kv_budget_tokens=None, kv_budget_mib=1.0, kv_dtype=name)
    assert e16.kv.k_cache.dtype == e16.kv.v_cache.dtype == DTYPES[name]
    assert e16.kv.page_bytes * 2 == e32.kv.page_bytes
    assert 2 * e32.kv.num_pages <= e16.kv.num_pages <= 2 * e32.kv.num_pages + 1  # whole pages in 1 MiB
    assert e16.kv.num_pages * e16.kv.page_bytes <= 2**20 < (e16.kv.num_pages + 1) * e16.kv.page_bytes
    with TestClient(create_app(e16), raise_server_exceptions=False) as c:
        polykv = c.get("/props").json()["opencoti"]["polykv"]
    d = e16.model.dims
    assert polykv["kv_dtype"] == str(DTYPES[name]).removeprefix("torch.")
    assert polykv["kv_bytes_per_token"] == 2 * d.num_layers * d.num_kv_heads * d.head_dim * 2
    assert polykv["kv_budget_tokens"] == e16.kv.num_pages * e16.kv.page_size


def _rounded(x: torch.Tensor, dtype) -> torch.Tensor:
    """``x`` as a cache of ``dtype`` holds it, back in fp32."""
    return q8.dequantize(q8.quantize(x)) if dtype == torch.int8 else x.to(dtype).float()


def _values(cache: torch.Tensor) -> torch.Tensor:
    """The fp32 values a cache holds ([..., D])."""
    return q8.dequantize(cache) if cache.dtype == torch.int8 else cache.float()


def _random_pages(dtype, page_size=4, seed=0):
    torch.manual_seed(seed)
    kv = PagePool(num_layers=1, num_pages=64, page_size=page_size, num_kv_heads=HKV, head_dim=D, dtype=dtype)
    for cache in (kv.k_cache, kv.v_cache):
        x = torch.randn(*cache.shape[:-1], D)
        cache.copy_(q8.quantize(x) if dtype == torch.int8 else x)
    return kv


def _decode_ref(q, k_cache, v_cache, page_idx, lens, scale):
    """Attention of each row over its pages, in float64 from the cache's own (rounded) values."""
    out = []
    k_cache, v_cache = _values(k_cache), _values(v_cache)
    for b in range(q.shape[0]):
        keys = torch.cat([k_cache[p] for p in page_idx[b]])[: lens[b]].double()
        vals = torch.cat([v_cache[p] for p in page_idx[b]])[: lens[b]].double()
        kk, vv = keys.repeat_interleave(H // HKV, 1), vals.repeat_interleave(H // HKV, 1)
        s = torch.einsum("hd,nhd->hn", q[b].double(), kk) * scale
        out.append((torch.einsum("hn,nhd->hd", s.softmax(-1), vv), s.logsumexp(-1)))
    return out


@pytest.mark.parametrize("name", ["fp16", "bf16", "q8"])
@pytest.mark.parametrize("which", ["native", "scalar"])
def test_native_paged_decode_reads_16_and_8_bit_pages(name, which, request):
    lib = LIB if which == "native" else request.getfixturevalue("scalar_lib")
    kv = _random_pages(DTYPES[name])
    page_idx = torch.tensor([[3, 1, 9, 0], [5, 2, 4, 7]], dtype=torch.int64)
    lens = torch.tensor([13, 6], dtype=torch.int64)
    q, rows = torch.randn(2, H, D), torch.tensor([0, 1], dtype=torch.int64)
    out, lse = torch.empty(2, H, D), torch.empty(2, H)
    lib.paged_decode(q, rows, kv.k_cache[0], kv.v_cache[0], page_idx, lens, 0.25, out, lse)
    for b, (o, ls) in enumerate(_decode_ref(q, kv.k_cache[0], kv.v_cache[0], page_idx, lens, 0.25)):
        assert torch.allclose(out[b].double(), o, atol=1e-5) and torch.allclose(lse[b].double(), ls, atol=1e-5)


def _hard_values() -> torch.Tensor:
    """Values whose rounding to 16 bits is easy to get wrong: ties, subnormals, overflow, inf, NaN."""
    special = [0.0, -0.0, 1.0, -2.5, 65504.0, 65520.0, 65519.99, 1e6, -1e6, 6.1e-5, 6.0e-8, 2.9e-8, 3.0e-8,
               1e-10, -1e-45, float("inf"), float("-inf"), float("nan"), 1.0 + 2**-11, 1.0 + 3 * 2**-11,
               1.0 + 2**-8, 1.0 + 3 * 2**-8, 3.0e38, -3.4e38]
    torch.manual_seed(1)
    rand = torch.cat([torch.randn(4000) * s for s in (1e-6, 1e-3, 1.0, 100.0, 1e5)])
    return torch.cat([torch.tensor(special, dtype=torch.float32), rand])


@pytest.mark.parametrize("name", ["fp16", "bf16"])
@pytest.mark.parametrize("which", ["native", "scalar"])
def test_native_kv_writes_round_as_torch_does(name, which, request):
    lib = LIB if which == "native" else request.getfixturevalue("scalar_lib")
    x = _hard_values()
    got = torch.empty(x.shape, dtype=DTYPES[name])
    lib.kv_store(got, x)
    want = x.to(DTYPES[name])
    nan = torch.isnan(want)
    assert bool(torch.isnan(got)[nan].all())
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


@pytest.mark.parametrize("name", ["fp16", "bf16", "q8"])
@pytest.mark.parametrize("cascade", ["off", "on"])
def test_backend_over_16_and_8_bit_pages_matches_fp32_pages(name, cascade):
    """The torch backend (native decode on and off, cascade on and off) writes K/V rounded to the
    cache dtype (q8: quantized) and attends like fp32 pages holding the same rounded values."""
    entries = [SeqBatchEntry([0, 1, 2, 3, 4], 17, 1), SeqBatchEntry([0, 1, 2, 5, 6], 14, 3),
               SeqBatchEntry([0, 1, 2, 7], 15, 1)]
    T = sum(e.num_new for e in entries)
    torch.manual_seed(5)
    q, k, v = torch.randn(T, H, D), torch.randn(T, HKV, D), torch.randn(T, HKV, D)
    outs = []
    for dtype, use_native in ((DTYPES[name], True), (DTYPES[name], False), (torch.float32, False)):
        kv = _random_pages(DTYPES[name])
        if dtype == torch.float32:  # the same rounded values, held in fp32
            kv32 = _random_pages(torch.float32)
            kv32.k_cache.copy_(_values(kv.k_cache)), kv32.v_cache.copy_(_values(kv.v_cache))
            kv, kn, vn = kv32, _rounded(k, DTYPES[name]), _rounded(v, DTYPES[name])
        else:
            kn, vn = k, v
        be = TorchAttentionBackend(cascade=cascade, min_saved_tokens=1, native=use_native)
        meta = build_metadata(entries, 4)
        be.plan(meta, num_heads=H, num_kv_heads=HKV, head_dim=D)
        outs.append(be.forward(0, q, kn, vn, kv.k_cache[0], kv.v_cache[0], meta, 0.25))
        if dtype == torch.int8:
            assert torch.equal(kv.k_cache[0].view(-1, HKV, D + 4)[meta.slot_mapping], q8.quantize(k))
            assert torch.equal(kv.v_cache[0].view(-1, HKV, D + 4)[meta.slot_mapping], q8.quantize(v))
        elif dtype != torch.float32:
            assert torch.equal(kv.k_cache[0].view(-1, HKV, D)[meta.slot_mapping], k.to(dtype))
    assert (outs[0] - outs[2]).abs().max().item() <= 1e-5
    assert (outs[1] - outs[2]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_tiny_model_logits_with_16_bit_pages(make_engine, name):
    """Logits over a text through the paged cache (a prefill step, then decode steps) with 16-bit
    pages against fp32 pages: close, and the same greedy token at every position."""
    eng = make_engine()
    ids = [(i * 37 + 11) % 250 + 3 for i in range(96)]
    m = kv_gate(eng.model, ids, DTYPES[name], page_size=4)
    bound = 0.05 if name == "fp16" else 0.3  # random tiny weights, logits of size ~1-5
    assert m["max_abs_logit_diff"] < bound, m
    assert m["top1_agreement"] == 1.0 and abs(m["ppl_ratio"] - 1) < 0.01, m


def test_engine_outputs_with_fp16_pages(make_engine):
    """Greedy generation (prefill and decode, shared prefixes) on fp16 pages gives the fp32 pages'
    tokens on the tiny model, with logprobs within 1e-2."""
    prompts = [list(range(3, 3 + n)) for n in (5, 23, 40)]
    params = SamplingParams.greedy(12, ignore_eos=True, logprobs=1)
    runs = {}
    for name in ("fp32", "fp16"):
        eng = make_engine(kv_dtype=name)
        runs[name] = [eng.generate(p, params=params) for p in prompts]
    for a, b in zip(runs["fp32"], runs["fp16"]):
        assert a.token_ids == b.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-2


@pytest.mark.parametrize("name", ["fp16", "bf16", "q8"])
def test_fused_decode_layers_take_16_and_8_bit_pages(make_engine, monkeypatch, tmp_path, name):
    """The fused native decode layer runs on 16-bit and q8 pages (it writes and reads them itself)
    and gives the layer-by-layer path's tokens and logprobs."""
    monkeypatch.setenv("OPENCOTI_AUTOTUNE", "0")
    monkeypatch.setenv("OPENCOTI_CACHE", str(tmp_path))
    taken = []
    real = fused_mod.decode_step
    monkeypatch.setattr(fused_mod, "decode_step", lambda *a, **k: taken.append(real(*a, **k)) or taken[-1])
    prompts = [list(range(3, 3 + n)) for n in (5, 23, 40)]
    params = SamplingParams.greedy(10, ignore_eos=True, logprobs=3)
    runs = {}
    for fused in (True, False):
        eng = make_engine(weights="int4", kv_dtype=name)
        assert eng.model.fused_layers is not None
        if not fused:
            eng.model.fused_layers = None
        taken.clear()
        runs[fused] = [eng.generate(p, params=params) for p in prompts]
        assert any(taken) == fused
    # the two paths' K/V differ in the last fp32 bits (other projection kernels, and how the compiler
    # vectorized them for this CPU), which can move a stored value across a rounding boundary: for q8
    # one step of its vector's scale (1/254 of its largest value), for bf16 one of its 8 mantissa bits
    # (2^-8 relative; measured 1.06e-3 on an AVX-512 machine); fp16 keeps 11 bits (measured: 1.36e-3 at
    # most since the decode attention kernel sums in another order, 6.9e-4 before: one stored value
    # across a rounding boundary, carried through the tiny random model)
    bound = {"q8": 1e-2, "bf16": 4e-3}.get(name, 3e-3)
    for a, b in zip(runs[True], runs[False]):
        assert a.token_ids == b.token_ids
        for da, db in zip(a.logprobs, b.logprobs):
            assert abs(da.logprob - db.logprob) < bound


def test_paged_logits_refuses_a_one_token_text(make_engine):
    with pytest.raises(ValueError, match="at least 2 tokens"):
        paged_logits(make_engine().model, [5], torch.float16)


def test_kv_files_are_keyed_by_the_kv_dtype(make_engine, tmp_path):
    """A pinned pool's KV saved from fp16 pages loads back into an fp16 engine (the same bits); a
    file from an fp32 engine is never loaded into an fp16 one (recomputed, then saved for fp16)."""
    from opencoti.engine.persist import kvfile

    state = tmp_path / "state"
    root = list(range(5, 40))
    prompt = root + [70, 71]
    e = make_engine(state_dir=str(state), kv_dtype="fp32")
    p = e.create_pool(tokens=root, pinned=True)
    e.generate(prompt, params=SamplingParams.greedy(3))
    e.shutdown()
    path = state / "kv" / f"{p.pool_id}.kv"
    assert kvfile.read_header(path)["kv"]["kv_dtype"] == "float32"

    e = make_engine(state_dir=str(state), kv_dtype="fp16")
    assert e.persister.stats["kv_loaded_pools"] == 0  # the fp32 file is not loaded ...
    assert e.pool(p.pool_id).residency == "evicted" and not path.exists()  # ... and it is dropped
    r = e.generate(prompt, pool_id=p.pool_id, params=SamplingParams.greedy(3))
    assert r.info.rematerialized_pools == [p.pool_id]
    e.persister.kv_writer.flush()
    head = kvfile.read_header(path)
    assert head["kv"]["kv_dtype"] == head["dtype"] == "float16"
    saved = np.fromfile(path, dtype="<f2", offset=kvfile.HEADER, count=2 * int(np.prod(head["shape"])))
    e.shutdown()

    e = make_engine(state_dir=str(state), kv_dtype="fp16")
    assert e.persister.stats["kv_loaded_pools"] == 1 and e.pool(p.pool_id).residency == "resident"
    r2 = e.generate(prompt, pool_id=p.pool_id, params=SamplingParams.greedy(3))
    assert r2.token_ids == r.token_ids and r2.info.cached_prefix_tokens >= len(root)
    assert saved.size == 2 * len(root) * e.kv.num_layers * e.kv.num_kv_heads * e.kv.head_dim
