"""The native CPU kernels (engine/native) against torch references, and the fallback without them."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from opencoti.engine import SamplingParams, native
from opencoti.engine.attention.base import SeqBatchEntry, build_metadata
from opencoti.engine.attention.torch_backend import TorchAttentionBackend
from opencoti.engine.kv.pages import PagePool
from opencoti.engine.model import kernels
from opencoti.engine.model.qformats import gguf_block_to_int4, quantize_int4, quantize_int8

# The build needs only a C++ compiler, which the set-up machine has (gcc is on every supported
# machine); a failure to build is a failure here, not a skip.
LIB = native.lib()


def test_library_builds_here():
    st = native.status()
    assert st["available"], st["reason"]
    assert LIB.oc_abi_version() == native.ABI_VERSION


@pytest.fixture(params=["default", "rows", "panels"])
def gemm_path(request):
    """The projections as the library picks (panels from 32 rows for int4, 48 for int8), or forced onto the row
    kernels or the panels at every row count."""
    forced = {"default": (None, None), "rows": (10 ** 9, 10 ** 9), "panels": (1, 1)}[request.param]
    before = native.gemm_min_rows(*forced)
    yield request.param
    native.gemm_min_rows(*before)


@pytest.fixture(params=["default", "int8-activations"])
def act_path(request):
    """The activation paths as built (int16 up to 31 rows) or with the int8-activation path on."""
    before = native.act_rows(*((31, 4) if request.param != "default" else (None, None)))
    yield request.param
    native.act_rows(*before)


@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 9, 17, 24, 31, 32, 47, 48, 97])
@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("bias", [False, True])
def test_projection_kernels_match_dequantized_weights(fmt, T, bias, gemm_path, act_path):
    torch.manual_seed(T)
    n, k = 40, 96
    w = torch.randn(n, k) * 0.05
    b = torch.randn(n) if bias else None
    wq = kernels.to_format(w, fmt)
    kern = kernels.build("native_q4" if fmt == "int4" else "native_q8", wq, b, act_dtype=torch.float32, device="cpu")
    x = torch.randn(T, k)
    ref = x.double() @ wq.dequantize().double().T + (0 if b is None else b.double())
    y = kern(x)
    assert y.shape == (T, n) and y.dtype == torch.float32
    err = (y.double() - ref).abs()
    i8_rows = native.act_rows()[0 if fmt == "int4" else 1]
    if gemm_path != "panels" and T <= i8_rows:
        # activations rounded to int8 per block of 32 (scale amax / 127): each is off by at most half a
        # step, so |error| <= sum over blocks of amax / 254 * sum |w| of the block (+ fp32 slack)
        amax = x.double().view(T, k // 32, 32).abs().amax(-1)                       # [T, blocks]
        wabs = wq.dequantize().double().abs().view(n, k // 32, 32).sum(-1)          # [n, blocks]
        bound = (amax / 254) @ wabs.T
        assert bool((err <= bound * 1.001 + 1e-4 * ref.abs().max()).all()), float((err - bound).max())
        assert (err.max() / ref.abs().max()).item() < 2e-2
    else:
        # fp32 accumulation of exact weights (int4 scales stored as fp16: relative 2^-11 per block)
        tol = 2e-3 if fmt == "int4" else 2e-4  # up to 31 rows: activations as int16 per block of 32
        assert (err.max() / ref.abs().max()).item() < tol
    assert kern.nbytes == (n * k // 32 * 20 if fmt == "int4" else n * k + n * 4) + (n * 4 if bias else 0)


def test_gemm_row_thresholds_are_set_and_restored():
    before = native.gemm_min_rows()
    assert before == (32, 48)  # the measured defaults (kernels.cpp)
    try:
        assert native.gemm_min_rows(7, None) == before
        assert native.gemm_min_rows() == (7, 48)
    finally:
        native.gemm_min_rows(*before)
    assert native.gemm_min_rows() == before


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(fmt):
    """Up to 31 rows (a decode batch, a speculative draft's rows): each row's output is bit for bit
    what it is alone, so greedy outputs do not change with the batch."""
    assert native.i16_rows() == 31
    torch.manual_seed(3)
    w = torch.randn(64, 576) * 0.05
    kern = kernels.build("native_q4" if fmt == "int4" else "native_q8", kernels.to_format(w, fmt), None,
                         act_dtype=torch.float32, device="cpu")
    x = torch.randn(31, 576)
    alone = torch.cat([kern(x[i:i + 1]) for i in range(31)])
    for T in (2, 3, 4, 5, 8, 9, 16, 31):
        assert torch.equal(kern(x[:T]), alone[:T]), T
    before = native.i16_rows(2)  # the fp32 row path from three rows on: not the same numbers
    try:
        assert not torch.equal(kern(x[:8]), alone[:8])
    finally:
        native.i16_rows(before)
    assert native.i16_rows() == 31


def test_q4_blocks_hold_gguf_q4_1_bytes():
    """A GGUF Q4_1 row decoded to int4 and packed gives the file's own bytes, regrouped per row:
    all nibbles, then all scales d, then all offsets m."""
    rng = np.random.default_rng(0)
    n, k = 6, 64
    d = rng.uniform(0.001, 0.05, (n, k // 32)).astype(np.float16)
    m = (-8 * d.astype(np.float32) * rng.uniform(0.5, 1.5, d.shape)).astype(np.float16)
    qs = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
    raw = np.concatenate([d.view(np.uint8).reshape(n, -1, 2), m.view(np.uint8).reshape(n, -1, 2), qs], -1)
    w4 = gguf_block_to_int4("Q4_1", raw.reshape(n, -1), n, k)
    regrouped = np.concatenate([qs.reshape(n, -1), d.view(np.uint8).reshape(n, -1), m.view(np.uint8).reshape(n, -1)], -1)
    assert kernels.pack_q4_blocks(w4).numpy().tobytes() == regrouped.tobytes()


def test_q4_rejects_what_it_cannot_serve():
    w4 = quantize_int4(torch.randn(8, 64), group=64)
    with pytest.raises(RuntimeError, match="groups of 32"):
        kernels.build("native_q4", w4, None, act_dtype=torch.float32, device="cpu")
    with pytest.raises(RuntimeError, match="fp32 activations"):
        kernels.build("native_q8", quantize_int8(torch.randn(8, 64)), None, act_dtype=torch.bfloat16, device="cpu")
    huge = quantize_int4(torch.randn(4, 32) * 1e6)
    with pytest.raises(RuntimeError, match="fp16 range"):
        kernels.build("native_q4", huge, None, act_dtype=torch.float32, device="cpu")


def test_native_kernels_are_candidates_on_cpu():
    assert kernels.candidates("int4", torch.device("cpu"))[0] == "native_q4"
    assert kernels.candidates("int8", torch.device("cpu"))[0] == "native_q8"


H, HKV, D = 6, 2, 16


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("cascade", ["off", "on"])
@pytest.mark.parametrize("seed", [0, 1])
def test_paged_decode_matches_torch(page_size, cascade, seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    kv = PagePool(num_layers=1, num_pages=2048, page_size=page_size, num_kv_heads=HKV, head_dim=D,
                  dtype=torch.float32)
    kv.k_cache.normal_()
    kv.v_cache.normal_()
    shared = kv.allocate(-(-40 // page_size))
    entries = []
    for i in range(7):
        private = rng.randint(1, 3 * page_size + 5)
        base = list(shared) if i % 3 else []
        kv_len = len(base) * page_size + private
        table = base + kv.allocate(kv.pages_for(kv_len) - len(base))
        q_len = 3 if i == 4 else 1  # one prefill row among the decode rows
        entries.append(SeqBatchEntry(table, kv_len - q_len, q_len))
    T = sum(e.num_new for e in entries)
    q, k, v = torch.randn(T, H, D), torch.randn(T, HKV, D), torch.randn(T, HKV, D)
    outs = {}
    for use_native in (False, True):
        be = TorchAttentionBackend(cascade=cascade, min_saved_tokens=1, native=use_native)
        meta = build_metadata(entries, page_size)
        be.plan(meta, num_heads=H, num_kv_heads=HKV, head_dim=D)
        assert be.last_used_cascade == (cascade == "on")
        outs[use_native] = be.forward(0, q, k, v, kv.k_cache[0], kv.v_cache[0], meta, 0.25)
    assert (outs[True] - outs[False]).abs().max().item() <= 1e-5


def test_paged_decode_lse_and_empty_rows():
    """The log-sum-exp the cascade merge needs (natural log), and a row with no keys (-inf, zeros)."""
    torch.manual_seed(3)
    ps, n_keys = 4, 11
    k_cache, v_cache = torch.randn(8, ps, HKV, D), torch.randn(8, ps, HKV, D)
    page_idx = torch.tensor([[5, 2, 7], [0, 0, 0]], dtype=torch.int64)
    lens = torch.tensor([n_keys, 0], dtype=torch.int64)
    q = torch.randn(2, H, D)
    rows = torch.tensor([0, 1], dtype=torch.int64)
    out = torch.full((2, H, D), 7.0)
    lse = torch.zeros(2, H)
    LIB.oc_paged_decode(q.data_ptr(), rows.data_ptr(), 2, H, HKV, D, k_cache.data_ptr(), v_cache.data_ptr(),
                        page_idx.data_ptr(), 3, lens.data_ptr(), ps, 0.5, out.data_ptr(), lse.data_ptr(),
                        native.kv_type(torch.float32), 2)
    keys = k_cache[page_idx[0]].reshape(-1, HKV, D)[:n_keys]
    vals = v_cache[page_idx[0]].reshape(-1, HKV, D)[:n_keys]
    rep = keys.repeat_interleave(H // HKV, dim=1).transpose(0, 1)  # [H, n, D]
    s = (q[0][:, None, :] * rep).sum(-1) * 0.5  # [H, n]
    ref = torch.softmax(s, -1)[..., None].mul(vals.repeat_interleave(H // HKV, dim=1).transpose(0, 1)).sum(1)
    assert torch.allclose(out[0], ref, atol=1e-5)
    assert torch.allclose(lse[0], torch.logsumexp(s, -1), atol=1e-5)
    assert bool((out[1] == 0).all()) and bool(torch.isinf(lse[1]).all())


def test_engine_output_same_with_and_without_native(make_engine):
    """Greedy decoding of the fp32 tiny model: native attention on and off give the same tokens."""
    prompts = [list(range(3, 3 + n)) for n in (5, 23, 40)]
    results = {}
    for use_native in (True, False):
        eng = make_engine()
        eng.backend.native = use_native
        results[use_native] = [eng.generate(p, params=SamplingParams.greedy(12, ignore_eos=True)).token_ids
                               for p in prompts]
    assert results[True] == results[False]


def test_disabled_falls_back_to_torch_kernels():
    code = ("from opencoti.engine import native; from opencoti.engine.model import kernels; import torch;"
            "print(native.status()['reason']); print(kernels.candidates('int4', torch.device('cpu')))")
    env = {**os.environ, "OPENCOTI_NATIVE": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "disabled by OPENCOTI_NATIVE=0" in out.stdout and "native_q4" not in out.stdout


def test_missing_compiler_is_a_clear_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        native.build()


@pytest.mark.parametrize("weights", ["int4", "int8"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_decode_layers_match_layer_by_layer(make_engine, monkeypatch, tmp_path, weights, arch):
    """Decode steps through one native call per layer give the tokens and logprobs of the
    layer-by-layer path (same weights, same kernels)."""
    monkeypatch.setenv("OPENCOTI_AUTOTUNE", "0")  # the first kernel of each format: the native one
    monkeypatch.setenv("OPENCOTI_CACHE", str(tmp_path))  # no kernel choices cached from earlier runs
    prompts = [list(range(3, 3 + n)) for n in (5, 23, 40)]
    params = SamplingParams.greedy(10, ignore_eos=True)
    params.logprobs = 3
    runs = {}
    # with fp32 activations into the projections: the int8-activation kernels round each input to a
    # step of amax / 127, so a last-bit difference of the two paths' norms can move a value by a step
    before = native.act_rows(0, 0)
    try:
        for fused in (True, False):
            eng = make_engine(model=f"tiny:{arch}", weights=weights)
            model = eng.model
            assert model.fused_layers is not None
            if not fused:
                model.fused_layers = None
            runs[fused] = [eng.generate(p, params=params) for p in prompts]
    finally:
        native.act_rows(*before)
    for a, b in zip(runs[True], runs[False]):
        assert a.token_ids == b.token_ids
        for da, db in zip(a.logprobs, b.logprobs):
            assert abs(da.logprob - db.logprob) < 1e-3  # fp32 rounding order (norms, RoPE, SiLU) differs


def test_int8_activation_rows_are_set_and_restored():
    before = native.act_rows()
    assert before == (0, 0)  # off by default: it fails the accuracy gate on the bundled model (kernels.cpp)
    try:
        assert native.act_rows(31, None) == before
        assert native.act_rows() == (31, 0)
    finally:
        native.act_rows(*before)
    assert native.act_rows() == before


def test_fused_path_not_taken_where_it_does_not_apply(make_engine, monkeypatch, tmp_path):
    monkeypatch.setenv("OPENCOTI_AUTOTUNE", "0")
    monkeypatch.setenv("OPENCOTI_CACHE", str(tmp_path))
    eng = make_engine(model="tiny:qwen3", weights="int4")  # per-head q/k norms: layer by layer
    assert eng.model.fused_layers is None
    eng = make_engine(weights="fp32")  # torch's fp32 kernels
    assert eng.model.fused_layers is None


@pytest.mark.parametrize("T", [1, 2, 5, 33, 50])
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_scalar_build_computes_the_projections(scalar_lib, fmt, T):
    torch.manual_seed(T)
    n, k = 24, 64
    wq = kernels.to_format(torch.randn(n, k) * 0.05, fmt)
    x = torch.randn(T, k)
    b = torch.randn(n)
    y = torch.empty(T, n)
    if fmt == "int4":
        blocks = kernels.build("native_q4", wq, None, act_dtype=torch.float32, device="cpu").blocks
        scalar_lib.oc_q4_matmul(x.data_ptr(), T, k, blocks.data_ptr(), n, b.data_ptr(), y.data_ptr(), 2)
    else:
        kern = kernels.build("native_q8", wq, None, act_dtype=torch.float32, device="cpu")
        scalar_lib.oc_q8_matmul(x.data_ptr(), T, k, kern.q.data_ptr(), kern.scale.data_ptr(), n, b.data_ptr(),
                                y.data_ptr(), 2)
    ref = x.double() @ wq.dequantize().double().T + b.double()
    tol = 2e-3 if fmt == "int4" else 2e-4  # int4 scales and offsets stored as fp16 (relative 2^-11 per block)
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < tol


def test_scalar_build_computes_paged_decode_attention(scalar_lib):
    torch.manual_seed(0)
    H, Hkv, D, S, P = 4, 2, 16, 4, 6
    k_cache, v_cache = torch.randn(P, S, Hkv, D), torch.randn(P, S, Hkv, D)
    q = torch.randn(2, H, D)
    page_idx = torch.tensor([[3, 1, 0], [5, 2, 4]], dtype=torch.int64)
    lens = torch.tensor([9, 5], dtype=torch.int64)
    rows = torch.tensor([0, 1], dtype=torch.int64)
    out, lse = torch.empty(2, H, D), torch.empty(2, H)
    scalar_lib.oc_paged_decode(q.data_ptr(), rows.data_ptr(), 2, H, Hkv, D, k_cache.data_ptr(), v_cache.data_ptr(),
                               page_idx.data_ptr(), 3, lens.data_ptr(), S, 0.25, out.data_ptr(), lse.data_ptr(),
                               native.kv_type(torch.float32), 2)
    for b in range(2):
        keys = torch.cat([k_cache[p] for p in page_idx[b]])[: lens[b]]  # [n, Hkv, D]
        vals = torch.cat([v_cache[p] for p in page_idx[b]])[: lens[b]]
        kk, vv = keys.repeat_interleave(H // Hkv, 1), vals.repeat_interleave(H // Hkv, 1)
        s = torch.einsum("hd,nhd->hn", q[b], kk) * 0.25
        assert torch.allclose(out[b], torch.einsum("hn,nhd->hd", s.softmax(-1), vv), atol=1e-5)
        assert torch.allclose(lse[b], s.logsumexp(-1), atol=1e-5)


def test_a_second_openmp_runtime_is_refused(monkeypatch):
    with pytest.raises(RuntimeError, match="another OpenMP runtime"):
        monkeypatch.setattr(native, "openmp_runtimes", lambda: ["/x/libgomp.so.1", "/y/libiomp5.so"])
        native._check_openmp(["/x/libgomp.so.1"])
    monkeypatch.setattr(native, "openmp_runtimes", lambda: ["/x/libgomp.so.1"])
    native._check_openmp(["/x/libgomp.so.1"])  # the same runtime: fine


def test_this_process_runs_one_openmp_runtime():
    runtimes = native.openmp_runtimes()
    assert len(runtimes) == 1, runtimes  # torch's, shared by the kernels


def test_a_new_build_removes_the_builds_it_replaces(tmp_path):
    old, scalar, current = (tmp_path / f"opencoti_kernels-{n}.so" for n in ("aaaa", "xbbbb", "cccc"))
    for p in (old, scalar, current):
        p.write_bytes(b"")
    native._remove_stale(current)
    assert not old.exists() and scalar.exists() and current.exists()
