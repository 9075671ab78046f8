"""The native GGUF row conversions (``gguf_q4_blocks``, ``gguf_to_q8_rows``) against the numpy code they
replace: the same bytes for every type they take (random blocks, fp16 edge cases), and the numpy path
when the library is absent."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT
from gguf.quants import dequantize

from gguf_blocks import random_blocks
from opencoti.engine import native
from opencoti.engine.model import gguf_weights, qformats
from opencoti.engine.model.gguf_weights import GGUFWeight
from opencoti.engine.model.qformats import gguf_to_q4_blocks, quantize_int8

LIB = native.lib()
Q4_TYPES = ["Q4_0", "Q4_1", "Q4_K"]
Q8_TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
SHAPES = [(1, 256), (7, 512), (13, 4096)]


@pytest.fixture
def no_native(monkeypatch):
    """The library absent: the numpy code runs."""
    monkeypatch.setattr(native, "lib", lambda: None)


def rows_of(type_name: str, n: int, k: int, seed: int) -> np.ndarray:
    """uint8 [n, row bytes] of GGUF rows (float types: random values of a wide range, some rows zero)."""
    if type_name in ("F32", "F16", "BF16"):
        rng = np.random.default_rng(seed)
        w = (rng.standard_normal((n, k)) * np.exp(rng.uniform(-20, 8, (n, 1)))).astype(np.float32)
        w[::5] = 0.0
        if type_name == "F16":
            return w.astype(np.float16).view(np.uint8)
        if type_name == "BF16":
            return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return w.view(np.uint8)
    return random_blocks(type_name, n, k, seed)


def numpy_q4(type_name: str, raw: np.ndarray, n: int, k: int, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setattr(native, "lib", lambda: None)
        return gguf_to_q4_blocks(type_name, raw, n, k).blocks


def reference_q8(type_name: str, raw: np.ndarray, n: int, k: int) -> qformats.Int8Weight:
    """gguf-py's dequantize, then quantize_int8 (what the numpy path of GGUFWeight.to_int8 computes)."""
    w = np.ascontiguousarray(dequantize(raw, GT[type_name]), dtype=np.float32).reshape(n, k)
    return quantize_int8(torch.from_numpy(w))


def test_library_has_the_gguf_operators():
    assert LIB is not None, native.status()["reason"]
    assert hasattr(LIB, "gguf_q4_blocks") and hasattr(LIB, "gguf_to_q8_rows")


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("type_name", Q4_TYPES)
def test_q4_blocks_same_bytes_as_numpy(type_name, n, k, monkeypatch):
    raw = random_blocks(type_name, n, k, seed=n + k)
    got = gguf_to_q4_blocks(type_name, raw, n, k)
    assert got.shape == (n, k)
    ref = numpy_q4(type_name, raw, n, k, monkeypatch)
    assert torch.equal(got.blocks, ref)
    assert torch.equal(LIB.gguf_q4_blocks(torch.from_numpy(raw), int(GT[type_name]), k), ref)


@pytest.mark.parametrize("type_name", Q4_TYPES)
def test_q4_blocks_fp16_edge_cases(type_name, monkeypatch):
    """Scales over the whole finite fp16 range that does not overflow: subnormal results, ties to even,
    negative scales, zeros (Q4_K: d * sc and -(dmin * m) rounded to fp16; Q4_0: -8 d)."""
    n, k = 64, 512
    raw = random_blocks(type_name, n, k, seed=3).copy()
    rng = np.random.default_rng(4)
    bits = rng.integers(0, 1 << 16, raw.size, dtype=np.uint16)
    vals = bits.view(np.float16)
    bits = bits[np.isfinite(vals) & (np.abs(vals.astype(np.float32)) < 1000)]
    bits[:64] = [0, 0x8000, 1, 0x8001, 0x03FF, 0x0400, 0x3C01, 0x3C03] * 8  # zeros, subnormals, ties
    blocks = raw.reshape(n, -1, {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144}[type_name])
    fields = blocks[..., 0:4].copy()
    count = fields.size // 2
    fields.reshape(-1).view(np.uint16)[:] = bits[:count]
    if type_name == "Q4_0":
        blocks[..., 0:2] = fields[..., 0:2]
    else:
        blocks[..., 0:4] = fields
    ref = numpy_q4(type_name, raw, n, k, monkeypatch)
    assert torch.equal(gguf_to_q4_blocks(type_name, raw, n, k).blocks, ref)


def test_q4_k_scales_out_of_fp16_range_refused(monkeypatch):
    raw = random_blocks("Q4_K", 3, 256, seed=1).copy()
    raw[1, 0:2] = np.array([60000.0], np.float16).view(np.uint8)  # d * sc overflows fp16
    raw[1, 4] = 63
    with pytest.raises(ValueError, match="fp16 range"):
        gguf_to_q4_blocks("Q4_K", raw, 3, 256)
    with monkeypatch.context() as m, pytest.raises(ValueError, match="fp16 range"):
        m.setattr(native, "lib", lambda: None)
        gguf_to_q4_blocks("Q4_K", raw, 3, 256)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("type_name", Q8_TYPES)
def test_q8_rows_same_bits_as_gguf_dequantize_and_quantize_int8(type_name, n, k):
    raw = rows_of(type_name, n, k, seed=n * 7 + k)
    ref = reference_q8(type_name, raw, n, k)
    q, scale = LIB.gguf_to_q8_rows(torch.from_numpy(raw), int(GT[type_name]), k)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert torch.equal(scale, ref.scale)
    assert torch.equal(q, ref.q)


def test_q8_rows_zero_rows_and_big_tensor():
    """An all-zero row gets scale 1; many rows (every ulp of fused vs unfused arithmetic would show)."""
    n, k = 257, 4096
    for type_name in ("Q4_K", "Q5_K", "Q4_1", "Q6_K"):
        raw = random_blocks(type_name, n, k, seed=11).copy()
        bs = {"Q4_K": 144, "Q5_K": 176, "Q4_1": 20, "Q6_K": 210}[type_name]
        at = 208 if type_name == "Q6_K" else 0
        blocks = raw.reshape(n, -1, bs)
        blocks[3, :, at:at + 4 if type_name != "Q6_K" else at + 2] = 0  # d (and dmin / m) zero: a zero row
        ref = reference_q8(type_name, raw, n, k)
        assert ref.scale[3] == 1.0
        q, scale = LIB.gguf_to_q8_rows(torch.from_numpy(raw), int(GT[type_name]), k)
        assert torch.equal(scale, ref.scale) and torch.equal(q, ref.q), type_name


def write_tensor(tmp_path, raw: np.ndarray, offset: int = 96):
    path = tmp_path / "t.bin"
    path.write_bytes(b"\0" * offset + raw.tobytes() + b"\0" * 32)
    return path


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("permuted", [False, True])
@pytest.mark.parametrize("type_name", ["Q6_K", "Q4_K", "Q8_0", "F16", "Q5_K"])
def test_gguf_weight_to_int8_native_and_numpy_agree(type_name, permuted, chunked, tmp_path, monkeypatch):
    n, k = 24, 512
    if chunked:  # chunks of a few rows (and a last one shorter)
        monkeypatch.setattr(gguf_weights, "CHUNK_BYTES", 1000)  # 1-2 rows of these types
    raw = rows_of(type_name, n, k, seed=5)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0)) if permuted else None
    w = GGUFWeight(write_tensor(tmp_path, raw), "blk.0.ffn_down.weight", type_name, (n, k), 96, raw.size, perm)
    got = w.to_int8()
    rows = raw[perm.numpy()] if permuted else raw
    ref = reference_q8(type_name, rows, n, k)
    assert torch.equal(got.q, ref.q) and torch.equal(got.scale, ref.scale)
    monkeypatch.setattr(native, "lib", lambda: None)
    fallback = w.to_int8()
    assert torch.equal(fallback.q, ref.q) and torch.equal(fallback.scale, ref.scale)


def test_numpy_fallback_without_library(no_native):
    raw = random_blocks("Q4_K", 5, 512, seed=2)
    out = gguf_to_q4_blocks("Q4_K", raw, 5, 512)
    assert out.blocks.shape == (5, 16 * 20)
    assert torch.equal(out.blocks, LIB.gguf_q4_blocks(torch.from_numpy(raw), int(GT.Q4_K), 512))
    ref = qformats.gguf_block_to_int4("Q4_K", raw, 5, 512).dequantize()  # exact; fp16 scales: within 2^-11
    assert torch.allclose(out.dequantize(), ref, rtol=0, atol=2e-3 * float(ref.abs().max()))


def test_scalar_build_same_bytes(scalar_lib, monkeypatch):
    """The portable code (no AVX2 / F16C: software fp16 conversions) gives the same bytes."""
    for type_name in Q4_TYPES:
        raw = random_blocks(type_name, 9, 512, seed=8)
        ref = numpy_q4(type_name, raw, 9, 512, monkeypatch)
        assert torch.equal(scalar_lib.gguf_q4_blocks(torch.from_numpy(raw), int(GT[type_name]), 512), ref)
    for type_name in Q8_TYPES:
        raw = rows_of(type_name, 9, 512, seed=9)
        ref = reference_q8(type_name, raw, 9, 512)
        q, scale = scalar_lib.gguf_to_q8_rows(torch.from_numpy(raw), int(GT[type_name]), 512)
        assert torch.equal(q, ref.q) and torch.equal(scale, ref.scale), type_name


def test_operators_check_their_arguments():
    raw = torch.from_numpy(random_blocks("Q4_K", 2, 256, seed=0))
    with pytest.raises(RuntimeError, match="raw dimension 1"):
        LIB.gguf_q4_blocks(raw, int(GT.Q4_K), 512)
    with pytest.raises(RuntimeError, match="exact int4"):
        LIB.gguf_q4_blocks(raw, int(GT.Q6_K), 256)
    with pytest.raises(RuntimeError, match="not a GGUF type"):
        LIB.gguf_to_q8_rows(raw, int(GT.Q2_K), 256)
    with pytest.raises(RuntimeError, match="multiple"):
        LIB.gguf_to_q8_rows(raw, int(GT.Q4_K), 100)
    with pytest.raises(RuntimeError, match="uint8"):
        LIB.gguf_to_q8_rows(raw.view(torch.int8), int(GT.Q4_K), 256)
    meta = torch.empty(3, 210, dtype=torch.uint8, device="meta")
    q, scale = LIB.gguf_to_q8_rows(meta, int(GT.Q6_K), 256)
    assert q.shape == (3, 256) and q.dtype == torch.int8 and scale.shape == (3,)
    b = LIB.gguf_q4_blocks(torch.empty(3, 144, dtype=torch.uint8, device="meta"), int(GT.Q4_K), 256)
    assert b.shape == (3, 160) and b.is_meta
    empty = LIB.gguf_to_q8_rows(torch.empty(0, 34, dtype=torch.uint8), int(GT.Q8_0), 32)
    assert empty[0].shape == (0, 32)


def test_build_dir_is_under_the_cache_root(monkeypatch, tmp_path):
    from opencoti.engine.paths import cache_root

    monkeypatch.setenv("OPENCOTI_CACHE", str(tmp_path))
    assert native._build_dir() == cache_root() / "native" == tmp_path / "native"
    monkeypatch.delenv("OPENCOTI_CACHE")
    assert native._build_dir() == cache_root() / "native"
