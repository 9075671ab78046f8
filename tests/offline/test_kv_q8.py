"""8-bit KV pages (``kv_dtype="q8"``, ``kv/q8.py``): the quantization and its rounding (torch and the
native kernels, bit for bit), the native decode over q8 pages against a float64 reference, the budget
in real bytes and /props, the engine's outputs on q8 pages (pools, the prefix cache, sessions), and
KV files keyed by the KV dtype. (The checks shared with fp16 / bf16 pages: test_kv_dtype.py.)"""

from __future__ import annotations

import argparse

import pytest
import torch
from starlette.testclient import TestClient

from opencoti.engine import EngineConfig, SamplingParams, native
from opencoti.engine.attention import q8
from opencoti.engine.kv.gate import kv_gate
from opencoti.engine.kv.pages import PagePool

LIB = native.lib()


def _ref_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The q8 rule computed element by element in float64 from fp32 operands: the values and scales."""
    out, scales = [], []
    for row in x.reshape(-1, x.shape[-1]).tolist():
        amax = max(abs(v) for v in row)
        s = float(torch.tensor(amax, dtype=torch.float32) / 127)  # an fp32 division
        div = s if s > 0 else 1.0
        vals = []
        for v in row:
            r = float(torch.tensor(v, dtype=torch.float32) / torch.tensor(div, dtype=torch.float32))
            vals.append(max(-127, min(127, round(r))))  # Python's round: half to even
        out.append(vals)
        scales.append(s)
    return torch.tensor(out, dtype=torch.int8), torch.tensor(scales, dtype=torch.float32)


def _hard_vectors(d: int = 16) -> torch.Tensor:
    """Vectors whose quantization is easy to get wrong: ties at a scale of 1, a zero vector, one
    value, negative maxima, tiny and huge magnitudes, random ones."""
    ties = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 3.5, 4.5, 0.0, -0.0, 64.5, -64.5,
                         5.5])[:d]
    rows = [ties, torch.zeros(d), torch.eye(d)[3] * 7.0, -torch.arange(d, dtype=torch.float32),
            torch.linspace(-1e-30, 1e-30, d), torch.linspace(-1.0, 1.0, d) * 3e38]
    torch.manual_seed(2)
    rand = torch.cat([torch.randn(200, d) * s for s in (1e-6, 1e-3, 1.0, 100.0, 1e5)])
    return torch.cat([torch.stack(rows), rand])


def test_quantize_follows_the_rule():
    x = _hard_vectors()
    got = q8.quantize(x)
    vals, scales = _ref_quantize(x)
    assert got.shape == (x.shape[0], 16 + 4) and got.dtype == torch.int8
    assert torch.equal(got[:, :16], vals)
    assert torch.equal(got[:, 16:].contiguous().view(torch.float32)[:, 0], scales)
    assert got[0, :16].tolist()[:7] == [127, 0, 2, 2, 0, -2, -2]  # ties to even
    assert not got[1].any()  # a zero vector: zero values, zero scale
    err = (q8.dequantize(got) - x).abs()
    assert bool((err <= scales[:, None] / 2 * (1 + 1e-6)).all())  # at most half a step off


@pytest.mark.parametrize("which", ["native", "scalar"])
@pytest.mark.parametrize("d", [16, 20, 64])
def test_native_q8_writes_are_torch_bit_for_bit(which, d, request):
    lib = LIB if which == "native" else request.getfixturevalue("scalar_lib")
    x = _hard_vectors(d) if d <= 16 else torch.randn(500, d) * torch.logspace(-6, 5, 500)[:, None]
    got = torch.full((x.shape[0], d + 4), 99, dtype=torch.int8)
    lib.kv_store(got, x.contiguous())
    assert torch.equal(got, q8.quantize(x))


@pytest.mark.parametrize("which", ["native", "scalar"])
@pytest.mark.parametrize("d", [16, 20, 64])
def test_native_dequantize_is_torch_bit_for_bit(which, d, request):
    """The one-pass native dequantization (``q8.dequantize`` on CPU) gives torch's q * s exactly."""
    lib = LIB if which == "native" else request.getfixturevalue("scalar_lib")
    t = q8.quantize(torch.randn(300, 3, d) * torch.logspace(-6, 5, 300)[:, None, None])
    want = t[..., :d].float() * t[..., d:].contiguous().view(torch.float32)
    got = lib.q8_dequant(t)
    assert got.shape == (300, 3, d) and got.dtype == torch.float32
    assert torch.equal(got, want)
    assert torch.equal(q8.dequantize(t), want) and q8.dequantize(t, torch.bfloat16).dtype == torch.bfloat16
    assert torch.equal(q8.dequantize(t[::2]), want[::2])  # not contiguous: torch's ops


@pytest.mark.parametrize("which", ["native", "scalar"])
def test_native_decode_over_q8_pages_with_a_tail(which, request):
    """A head dimension that is not a multiple of 8 (the kernels' scalar tail) against float64."""
    lib = LIB if which == "native" else request.getfixturevalue("scalar_lib")
    h, hkv, d, ps = 4, 2, 20, 4
    torch.manual_seed(3)
    k, v = torch.randn(16, ps, hkv, d) * 3, torch.randn(16, ps, hkv, d)
    kc, vc = q8.quantize(k), q8.quantize(v)
    kf, vf = q8.dequantize(kc).double(), q8.dequantize(vc).double()
    page_idx = torch.tensor([[4, 2, 11, 0, 5], [7, 1, 0, 0, 0]], dtype=torch.int64)
    lens = torch.tensor([19, 5], dtype=torch.int64)
    q, rows = torch.randn(2, h, d), torch.tensor([0, 1], dtype=torch.int64)
    out, lse = torch.empty(2, h, d), torch.empty(2, h)
    lib.paged_decode(q, rows, kc, vc, page_idx, lens, 0.3, out, lse)
    for b in range(2):
        keys = torch.cat([kf[p] for p in page_idx[b]])[: lens[b]].repeat_interleave(h // hkv, 1)
        vals = torch.cat([vf[p] for p in page_idx[b]])[: lens[b]].repeat_interleave(h // hkv, 1)
        s = torch.einsum("hd,nhd->hn", q[b].double(), keys) * 0.3
        assert torch.allclose(out[b].double(), torch.einsum("hn,nhd->hd", s.softmax(-1), vals), atol=1e-5)
        assert torch.allclose(lse[b].double(), s.logsumexp(-1), atol=1e-5)


def test_serve_flag_and_config_take_q8():
    from opencoti.server.serve import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["--kv-dtype", "q8"]).kv_dtype == "q8"
    assert EngineConfig(kv_dtype="q8").kv_dtype == "q8"


def test_the_budget_counts_q8_bytes(make_engine):
    """A q8 page holds head_dim + 4 bytes per vector: the same MiB hold 4 D / (D + 4) times the
    tokens of fp32 pages; /props names the dtype and the bytes per token."""
    from opencoti.server import create_app

    e32 = make_engine(kv_budget_tokens=None, kv_budget_mib=1.0, kv_dtype="fp32")
    e8 = make_engine(kv_budget_tokens=None, kv_budget_mib=1.0, kv_dtype="q8")
    d = e8.model.dims
    bpt = 2 * d.num_layers * d.num_kv_heads * (d.head_dim + 4)
    assert e8.kv.k_cache.dtype == torch.int8 and e8.kv.k_cache.shape[-1] == d.head_dim + 4
    assert e8.kv.page_bytes == e8.kv.page_size * bpt == PagePool.bytes_per_token(
        d.num_layers, d.num_kv_heads, d.head_dim, torch.int8) * e8.kv.page_size
    assert e8.kv.num_pages * e8.kv.page_bytes <= 2**20 < (e8.kv.num_pages + 1) * e8.kv.page_bytes
    assert e8.kv.k_cache.numel() + e8.kv.v_cache.numel() == e8.kv.num_pages * e8.kv.page_bytes  # real bytes
    assert e8.kv.num_pages > 3 * e32.kv.num_pages
    with TestClient(create_app(e8), raise_server_exceptions=False) as c:
        polykv = c.get("/props").json()["opencoti"]["polykv"]
    assert polykv["kv_dtype"] == "q8" and polykv["kv_bytes_per_token"] == bpt
    assert polykv["kv_budget_tokens"] == e8.kv.num_pages * e8.kv.page_size
    e8.create_pool(tokens=list(range(3, 40)))
    st = e8.pools()  # what the dashboard draws
    assert st["kv_pages_used"] >= e8.kv.pages_for(37)
    assert st["kv_bytes_used"] == st["kv_pages_used"] * e8.kv.page_size * bpt


def test_bundled_shape_is_at_most_llama_cpp_q8_0():
    """SmolLM2-135M's KV (30 layers, 3 KV heads of 64): 12,240 bytes per token, as llama.cpp's q8_0
    (34 bytes per 32 values)."""
    assert PagePool.bytes_per_token(30, 3, 64, torch.int8) == 12240 == 30 * 2 * 3 * 64 // 32 * 34


def test_tiny_model_logits_with_q8_pages(make_engine):
    """The KV gate's metrics on the tiny model: perplexity within 1 %, logits close, the same greedy
    token at >= 90 % of the positions (random tiny weights: logits of size ~1-5 and a nearly flat
    distribution, so the top two are often within q8's ~0.05 of each other; the bundled model's
    check is in tests/live/test_kv_dtype_bundled.py)."""
    eng = make_engine()
    ids = [(i * 37 + 11) % 250 + 3 for i in range(96)]
    m = kv_gate(eng.model, ids, torch.int8, page_size=4)
    assert m["kv_dtype"] == "q8"
    assert m["max_abs_logit_diff"] < 0.3, m
    assert m["top1_agreement"] >= 0.9 and abs(m["ppl_ratio"] - 1) < 0.01, m


def test_engine_on_q8_pages_pools_and_prefix_cache(make_engine):
    """On q8 pages, generation through a pool's shared pages and through the prefix cache (pages
    written by an earlier request) gives what a fresh engine computing each prompt alone gives."""
    root = list(range(3, 40))
    prompts = [root + [50 + i] * (3 + i) for i in range(3)]
    params = SamplingParams.greedy(10, ignore_eos=True, logprobs=1)
    eng = make_engine(kv_dtype="q8")
    pool = eng.create_pool(tokens=root)
    outs = [eng.generate(p, pool_id=pool.pool_id, params=params) for p in prompts]
    again = eng.generate(prompts[0], params=params)  # through the prefix cache
    assert again.info.cached_prefix_tokens >= len(root)
    for p, a in zip(prompts + [prompts[0]], outs + [again]):
        alone = make_engine(kv_dtype="q8", prefix_cache=False).generate(p, params=params)
        assert a.token_ids == alone.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, alone.logprobs)) < 1e-4


def test_q8_kv_files(make_engine, tmp_path):
    """A pinned pool's KV saved from q8 pages loads back into a q8 engine (it computes the
    same tokens without recomputing the pool); a q8 file is never loaded into an fp16 engine, nor an fp16 file into a q8 one."""
    from opencoti.engine.persist import kvfile

    state = tmp_path / "state"
    root = list(range(5, 40))
    prompt = root + [70, 71]
    e = make_engine(state_dir=str(state), kv_dtype="q8")
    p = e.create_pool(tokens=root, pinned=True)
    r = e.generate(prompt, params=SamplingParams.greedy(3))
    e.shutdown()
    path = state / "kv" / f"{p.pool_id}.kv"
    head = kvfile.read_header(path)
    assert head["kv"]["kv_dtype"] == "q8" and head["dtype"] == "int8"
    assert head["shape"][-1] == e.kv.head_dim + 4

    e = make_engine(state_dir=str(state), kv_dtype="q8")
    assert e.persister.stats["kv_loaded_pools"] == 1 and e.pool(p.pool_id).residency == "resident"
    r2 = e.generate(prompt, pool_id=p.pool_id, params=SamplingParams.greedy(3))
    assert r2.token_ids == r.token_ids and r2.info.cached_prefix_tokens >= len(root)
    e.shutdown()

    e = make_engine(state_dir=str(state), kv_dtype="fp16")
    assert e.persister.stats["kv_loaded_pools"] == 0  # the q8 file is not loaded ...
    assert e.pool(p.pool_id).residency == "evicted" and not path.exists()  # ... and it is dropped
    e.generate(prompt, pool_id=p.pool_id, params=SamplingParams.greedy(3))
    e.persister.kv_writer.flush()
    assert kvfile.read_header(path)["kv"]["kv_dtype"] == "float16"
    e.shutdown()

    e = make_engine(state_dir=str(state), kv_dtype="q8")
    assert e.persister.stats["kv_loaded_pools"] == 0 and e.pool(p.pool_id).residency == "evicted"
