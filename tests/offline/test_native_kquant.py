"""The native k-quant projections (``ggml_matmul``, ``kernels.NativeKQuant``): a GGUF's Q4_K / Q6_K rows read
as the file stores them, against gguf-py's own decoding of the same bytes; the argument checks; the
scalar build; a Q4_K_M model served from its blocks (one projection for a q/k/v whose v is Q6_K), the
fused decode step equal to the layer-by-layer one, and the int4 / int8 fallback without the library."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from gguf_blocks import random_blocks
from opencoti.engine import native
from opencoti.engine.model import weights
from opencoti.engine.model.gguf_weights import GGUFWeight, decode_rows, gguf_format, read_form
from opencoti.engine.model.kernels import NativeKQuant
from opencoti.engine.model.loader import load_model
from opencoti.engine.model.qformats import KQuantRows, Q4Blocks, cat_rows
from opencoti.engine.model.synthetic import write_gguf

LIB = native.lib()
TYPE_ID = {"Q4_K": 12, "Q6_K": 14}


def rows(type_name: str, n: int, k: int, seed: int) -> KQuantRows:
    raw = random_blocks(type_name, n, k, seed)
    return KQuantRows(torch.from_numpy(raw.reshape(-1).copy()), [(type_name, n)], k)


def reference(x: torch.Tensor, w: KQuantRows, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.double() @ w.dequantize().double().T
    return y if bias is None else y + bias.double()


def q8k(x: torch.Tensor) -> torch.Tensor:
    """x as the default path rounds it: int8 per super-block of 256 (|x| max / 127, to nearest even)."""
    xs = x.double().reshape(x.shape[0], -1, 256)
    d = xs.abs().amax(-1, keepdim=True) / 127
    return (torch.round(xs / d.clamp_min(1e-300)) * d).reshape(x.shape)


def close(y: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> bool:
    """Within the int16 activations' rounding (15 bits a block of 32) of the exact products."""
    return bool(((y.double() - ref).abs().max() <= rel * ref.abs().max()).item())


@pytest.fixture
def int16_path():
    """The int16-activation row kernels up to 31 rows, fp32 panels from 32 (the default: int8 per 256)."""
    old = native.kquant_i8_rows(0)
    yield
    native.kquant_i8_rows(old)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("T", [1, 2, 3, 5, 8, 31, 32, 40])
@pytest.mark.parametrize("k", [256, 1024])
def test_matmul_matches_gguf_decoding(type_name, T, k):
    """The default path: the products of the file's values with x rounded to int8 per 256 (Q8_K), exactly
    up to fp32 accumulation; the rounding itself costs about 1 % of the largest output at most."""
    w = rows(type_name, 37, k, seed=T + k)
    x = torch.randn(T, k, generator=torch.Generator().manual_seed(T))
    bias = torch.randn(37)
    y = LIB.ggml_matmul(x, w.data, w.table(), bias)
    assert y.shape == (T, 37) and y.dtype == torch.float32
    assert close(y, reference(q8k(x), w, bias), rel=2e-6), (type_name, T, k)
    assert close(y, reference(x, w, bias), rel=2e-2) and not close(y, reference(x, w, bias), rel=1e-4)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("T", [1, 5, 31, 32, 40])
def test_int16_rows_and_panels_match_gguf_decoding(type_name, T, int16_path):
    w = rows(type_name, 37, 1024, seed=T)
    x = torch.randn(T, 1024, generator=torch.Generator().manual_seed(T))
    bias = torch.randn(37)
    assert close(LIB.ggml_matmul(x, w.data, w.table(), bias), reference(x, w, bias)), (type_name, T)


def test_a_tiny_or_zero_super_block_is_zeros():
    """A super-block of activations whose |x| max is 0 quantizes to zeros (no division by zero)."""
    for type_name in ("Q4_K", "Q6_K"):
        w = rows(type_name, 8, 512, seed=9)
        x = torch.randn(2, 512, generator=torch.Generator().manual_seed(9))
        x[:, :256] = 0
        y = LIB.ggml_matmul(x, w.data, w.table(), None)
        assert torch.isfinite(y).all() and close(y, reference(q8k(x).nan_to_num(0.0), w), rel=2e-6)


def test_decoded_values_are_ggufs():
    """The container's decoding (what the panels and the fallback use) is gguf-py's, value for value."""
    from gguf import GGMLQuantizationType as GT
    from gguf.quants import dequantize

    for type_name in ("Q4_K", "Q6_K"):
        raw = random_blocks(type_name, 5, 512, seed=3)
        w = KQuantRows(torch.from_numpy(raw.reshape(-1).copy()), [(type_name, 5)], 512)
        ref = np.asarray(dequantize(raw, GT[type_name]), dtype=np.float32).reshape(5, 512)
        assert torch.equal(w.dequantize(), torch.from_numpy(ref))


def test_rows_do_not_depend_on_their_neighbours():
    """Up to 31 rows (a decode batch, a draft) each row gets the bits it gets alone."""
    for type_name in ("Q4_K", "Q6_K"):
        w = rows(type_name, 64, 512, seed=1)
        x = torch.randn(7, 512, generator=torch.Generator().manual_seed(2))
        together = LIB.ggml_matmul(x, w.data, w.table(), None)
        for t in range(7):
            alone = LIB.ggml_matmul(x[t:t + 1].contiguous(), w.data, w.table(), None)
            assert torch.equal(together[t], alone[0]), (type_name, t)


def test_segments_of_two_types_are_one_projection():
    q = rows("Q4_K", 48, 512, seed=4)
    v = rows("Q6_K", 16, 512, seed=5)
    fused = cat_rows([q, rows("Q4_K", 16, 512, seed=6), v])
    assert fused.segments == [("Q4_K", 64), ("Q6_K", 16)] and fused.shape == (80, 512)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(7))
    bias = torch.randn(80)
    y = LIB.ggml_matmul(x, fused.data, fused.table(), bias)
    assert close(y, reference(q8k(x), fused, bias), rel=2e-6)
    assert torch.equal(y[:, :48], LIB.ggml_matmul(x, q.data, q.table(), bias[:48]))
    # many rows (the panels) too
    x40 = torch.randn(40, 512, generator=torch.Generator().manual_seed(8))
    assert close(LIB.ggml_matmul(x40, fused.data, fused.table(), None), reference(q8k(x40), fused), rel=2e-6)


def test_arguments_are_checked():
    w = rows("Q4_K", 4, 512, seed=0)
    x = torch.randn(2, 512)
    with pytest.raises(RuntimeError, match="segments' bytes"):
        LIB.ggml_matmul(x, w.data, [12, 5, 512], None)
    with pytest.raises(RuntimeError, match="ggml type 13"):
        LIB.ggml_matmul(x, w.data, [13, 4, 512], None)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        LIB.ggml_matmul(torch.randn(2, 288), w.data, [12, 4, 288], None)
    with pytest.raises(RuntimeError, match="rows must be >= 1"):
        LIB.ggml_matmul(x, w.data, [12, 0, 512], None)
    with pytest.raises(RuntimeError, match=r"\(ggml type, rows, k\) per segment"):
        LIB.ggml_matmul(x, w.data, [12, 4], None)
    with pytest.raises(RuntimeError, match="same in every segment"):
        LIB.ggml_matmul(x, torch.cat([w.data, w.data[:4 * 144]]), [12, 4, 512, 12, 2, 256], None)
    with pytest.raises(RuntimeError, match="x dimension 1"):
        LIB.ggml_matmul(torch.randn(2, 256), w.data, w.table(), None)
    with pytest.raises(RuntimeError, match="data must be uint8"):
        LIB.ggml_matmul(x, w.data.view(torch.int8), w.table(), None)
    with pytest.raises(RuntimeError, match="bias dimension 0"):
        LIB.ggml_matmul(x, w.data, w.table(), torch.zeros(3))
    with pytest.raises(ValueError, match="hold 1152 bytes"):
        KQuantRows(w.data[:-1], [("Q4_K", 4)], 512)
    meta = LIB.ggml_matmul(torch.empty(3, 512, device="meta"), torch.empty(w.data.numel(), dtype=torch.uint8,
                                                                             device="meta"), w.table(), None)
    assert meta.shape == (3, 4) and meta.is_meta


def test_scalar_build_matches(scalar_lib):
    """The portable code (no AVX2: each weight row decoded, then fp32 dots) computes the same function."""
    for type_name in ("Q4_K", "Q6_K"):
        w = rows(type_name, 21, 512, seed=11)
        for T in (1, 4, 40):
            x = torch.randn(T, 512, generator=torch.Generator().manual_seed(T))
            assert close(scalar_lib.ggml_matmul(x, w.data, w.table(), None), reference(x, w), rel=1e-5)


# ------------------------------------------------------------------------------------ a Q4_K_M model
@pytest.fixture(scope="module")
def q4km_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "m-q4km.gguf"
    # 8 layers: llama-quantize's Q4_K_M rule gives layers 0, 3, 6, 7 a Q6_K v and down
    write_gguf(path, arch="llama", hidden=256, layers=8, ffn=768, heads=4, kv_heads=2, tied=False, mix="Q4_K_M",
               seed=2)
    return path


@pytest.fixture(scope="module")
def q4km(q4km_path, tmp_path_factory):
    return load_model(q4km_path, cache_dir=str(tmp_path_factory.mktemp("cache")))


def _build(loaded, fmt: str):
    return weights.build_forward(loaded, weights=fmt, dtype=torch.float32, device="cpu", max_positions=128,
                                 adapt_threads=False)


def test_a_fused_projection_is_read_into_one_buffer(q4km, monkeypatch):
    """q/k/v (rows permuted for llama's q and k) and gate/up are read straight into their places in one
    buffer: the fused weight is that buffer (no concatenated copy), byte for byte the parts' own rows."""
    from opencoti.engine.model.gguf_weights import read_parts

    monkeypatch.delenv("OPENCOTI_KQUANT", raising=False)
    state = q4km.state_dict
    for names in (["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["mlp.gate_proj", "mlp.up_proj"]):
        parts = [state[f"model.layers.0.{n}.weight"] for n in names]
        read = read_parts(parts, "int4")
        fused = cat_rows(read)
        assert fused.data.data_ptr() == read[0].data.data_ptr()
        assert torch.equal(fused.data, torch.cat([p.to_kquant().data for p in parts]))
    q = state["model.layers.0.self_attn.q_proj.weight"]
    assert q.row_perm is not None  # llama's rotary order put back on the rows read into the buffer
    with pytest.raises(ValueError, match="contiguous bytes"):
        q.raw(out=np.empty(q.nbytes - 1, dtype=np.uint8))


def test_opting_out_q4_k_is_int4_blocks_and_q6_k_int8(q4km, monkeypatch):
    """OPENCOTI_KQUANT=0: Q4_K as int4 blocks, Q6_K (and a projection holding one) as int8 rows."""
    monkeypatch.setenv("OPENCOTI_AUTOTUNE", "0")
    monkeypatch.setenv("OPENCOTI_KQUANT", "0")
    model = _build(q4km, "int4")
    kinds = set(model.kernel_names.values())
    assert "int4:native_kquant" not in kinds and "int4:native_q4" in kinds and "int8:native_q8" in kinds


def test_k_quants_as_stored_are_the_default_on_cpu_only(q4km, monkeypatch):
    monkeypatch.delenv("OPENCOTI_KQUANT", raising=False)
    state = q4km.state_dict
    qkv = [state[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]
    assert read_form(qkv) == "kquant" and read_form(qkv, "cpu") == "kquant"
    # the kernel is a CPU one: elsewhere Q4_K is int4 blocks and a projection with a Q6_K part int8
    assert read_form(qkv, "cuda") == ("q4" if qkv[2].type_name == "Q4_K" else None)
    assert gguf_format(qkv, "int4", torch.device("cuda:0")) == ("int4" if qkv[2].type_name == "Q4_K" else "int8")


def test_a_q4km_model_runs_from_its_blocks(q4km, monkeypatch):
    monkeypatch.setenv("OPENCOTI_AUTOTUNE", "0")
    monkeypatch.delenv("OPENCOTI_KQUANT", raising=False)
    state = q4km.state_dict
    v_types = [state[f"model.layers.{i}.self_attn.v_proj.weight"].type_name for i in range(8)]
    assert "Q6_K" in v_types and "Q4_K" in v_types and state["lm_head.weight"].type_name == "Q6_K"
    model = _build(q4km, "int4")
    assert set(model.kernel_names.values()) == {"int4:native_kquant"}
    assert isinstance(model.lm_head, NativeKQuant) and model.lm_head.segments == [("Q6_K", 49152)]
    for i, layer in enumerate(model.layers):
        want = [("Q4_K", 512)] if v_types[i] == "Q4_K" else [("Q4_K", 384), ("Q6_K", 128)]
        assert layer.qkv.segments == want, i
    # the bytes held are the file's own (the embedding aside)
    file_bytes = sum(w.nbytes for n, w in state.items() if n.endswith("_proj.weight") or n == "lm_head.weight")
    held = model.tensor_bytes()
    assert held["projections"] + held["output head"] == file_bytes + sum(
        L.qkv.table_t.nbytes + L.o.table_t.nbytes + L.gate_up.table_t.nbytes + L.down.table_t.nbytes
        for L in model.layers) + model.lm_head.table_t.nbytes
    # the logits are those of the file's values: an fp32 model of gguf's decoding, within activation rounding:
    # int8 per 256 (the default, llama.cpp's Q8_K) well inside the accuracy gate, int16 per 32 ten times closer
    ref = _build(q4km, "fp32")
    ids = torch.tensor(q4km.tokenizer.encode("A k-quant model served from the bytes of its file, as stored.")[:40])
    ref_logits = ref.dense_logits(ids)
    m = weights.gate_metrics(ref_logits, model.dense_logits(ids), ids, 64)
    assert m["kl"] < weights.GATE_KL_MAX / 2 and m["top1_agreement_clear"] >= weights.GATE_TOP1_MIN, m
    old = native.kquant_i8_rows(0)
    try:
        m16 = weights.gate_metrics(ref_logits, model.dense_logits(ids), ids, 64)
    finally:
        native.kquant_i8_rows(old)
    assert m16["kl"] < 1e-3 and m16["top1_agreement_clear"] == 1.0 and m16["kl"] < m["kl"] / 5, (m16, m)


@pytest.mark.parametrize("path", ["int8", "int16"])
def test_fused_decode_step_equals_the_layer_path(q4km_path, make_engine, monkeypatch, tmp_path, path):
    """Decode steps through ``decode_layers`` (k-quant segments in the fused layer) give the tokens and
    logprobs of the layer-by-layer path (the same kernels). With int8 activations an fp32 rounding apart
    before the kernel can move a value across a rounding boundary of x8 (a step of |x| max / 127), so the
    logprobs agree to that step; with int16 ones to fp32 rounding order."""
    old = native.kquant_i8_rows(0 if path == "int16" else None)
    try:
        _fused_equals_layers(q4km_path, make_engine, monkeypatch, tmp_path, 3e-3 if path == "int16" else 0.1)
    finally:
        native.kquant_i8_rows(old)


def _fused_equals_layers(q4km_path, make_engine, monkeypatch, tmp_path, tol):
    from opencoti.engine import SamplingParams

    monkeypatch.setenv("OPENCOTI_AUTOTUNE", "0")
    monkeypatch.setenv("OPENCOTI_CACHE", str(tmp_path))
    monkeypatch.setenv("OPENCOTI_KQUANT", "1")
    params = SamplingParams.greedy(8, ignore_eos=True)
    params.logprobs = 3
    runs = {}
    for fused in (True, False):
        eng = make_engine(model=str(q4km_path), weights="int4", kv_budget_tokens=1024)
        assert eng.model.fused_layers is not None
        assert any(len(L.qkv.segments) == 2 for L in eng.model.layers)
        if not fused:
            eng.model.fused_layers = None
        runs[fused] = [eng.generate(list(range(7, 7 + n)), params=params) for n in (5, 19)]
    for a, b in zip(runs[True], runs[False]):
        assert a.token_ids == b.token_ids
        for da, db in zip(a.logprobs, b.logprobs):
            assert abs(da.logprob - db.logprob) < tol


def test_without_the_library_q4_k_is_int4_blocks_and_q6_k_int8(q4km, monkeypatch):
    monkeypatch.setenv("OPENCOTI_AUTOTUNE", "0")
    monkeypatch.setenv("OPENCOTI_KQUANT", "1")
    state = q4km.state_dict
    qkv = [state[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]
    assert gguf_format(qkv, "int4") == "int4"
    monkeypatch.setattr(native, "lib", lambda: None)
    assert gguf_format(qkv, "int4") == ("int8" if qkv[2].type_name == "Q6_K" else "int4")
    q = state["model.layers.1.self_attn.q_proj.weight"]
    assert isinstance(q, GGUFWeight) and isinstance(q.to_int4(), Q4Blocks)
    assert torch.allclose(q.to_int4().dequantize(), decode_rows("Q4_K", q.raw(), 256), rtol=0, atol=2e-3)


def test_the_activation_rounding_is_chosen_at_load_and_a_bad_value_refused(monkeypatch):
    import subprocess
    import sys

    code = "from opencoti.engine import native; native.lib(); print(native.kquant_i8_rows())"
    env = {**os.environ, "OPENCOTI_KQUANT_ACTIVATIONS": "int16"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split()[-1] == "0", out.stderr[-2000:]
    env["OPENCOTI_KQUANT_ACTIVATIONS"] = "int4"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "OPENCOTI_KQUANT_ACTIVATIONS must be int8 or int16, got 'int4'" in out.stderr
    monkeypatch.setenv("OPENCOTI_KQUANT_ACTIVATIONS", "int8")
    assert native.kquant_activations() == "int8" and native.kquant_i8_rows() > 31  # the default: every row count
