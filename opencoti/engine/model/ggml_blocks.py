"""Random ggml blocks for the synthetic GGUF files (``synthetic.py``): the GGML type ids and block
geometry, a tensor's plan (``TensorPlan``) and its data, made chunk by chunk from its own random
stream. Quantized tensors are generated directly as ggml blocks (random quants, random fp16 scales,
valid 6-bit k-quant sub-block scales), never by quantizing floats, with every weight of mean 0 and the
plan's std. Only numpy and the standard library are used.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

CHUNK_BYTES = 16 << 20  # generate at most this much tensor data at a time

# GGML type ids and block geometry: (block elements, block bytes)
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14
TYPE_NAMES = {F32: "F32", F16: "F16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1",
              Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}
BLOCKS = {F32: (1, 4), F16: (1, 2), Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24),
          Q8_0: (32, 34), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}
# llama-quantize's fallbacks when a row (ne[0]) is not a multiple of the block size
FALLBACK = {Q4_K: Q5_0, Q5_K: Q5_1, Q6_K: Q8_0}

@dataclass(frozen=True)
class TensorPlan:
    """One tensor of the file: its GGUF name, numpy-order shape (rows, cols), ggml type and how to fill it."""

    name: str
    shape: tuple[int, ...]
    qtype: int
    kind: str  # "weight" (std sigma, zero mean) | "norm" (around `scale`) | "bias" | "rope_freqs"
    sigma: float = 0.0
    scale: float = 1.0

    @property
    def nbytes(self) -> int:
        per, size = BLOCKS[self.qtype]
        n = int(np.prod(self.shape))
        return n // per * size


# ---------------------------------------------------------------------------
# random ggml blocks
# ---------------------------------------------------------------------------


def _rng(seed: int, name: str) -> np.random.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    words = [int.from_bytes(digest[i:i + 4], "little") for i in range(0, 16, 4)]
    return np.random.Generator(np.random.PCG64DXSM(np.random.SeedSequence(words)))


def _random_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    raw = rng.bit_generator.random_raw((n + 7) // 8)
    return np.asarray(raw, dtype="<u8").view(np.uint8)[:n]


def _unit(col: np.ndarray) -> np.ndarray:
    """Two random bytes per row -> float64 uniform in [0, 1)."""
    return (col[:, 0].astype(np.float64) + 256.0 * col[:, 1]) / 65536.0


# per-block scale spread: d = base * u, u uniform in [0.75, 1.25); E[u^2] = 1 + 1/48
_U_RMS = math.sqrt(1.0 + 1.0 / 48.0)
# E[(q - center)^2] for uniform random quants
_EQ2 = {Q4_0: 21.5, Q4_1: 21.25, Q5_0: 85.5, Q5_1: 85.25, Q8_0: 5461.5, Q4_K: 21.25, Q5_K: 85.25, Q6_K: 341.5}
_SC_K_RMS = math.sqrt(47.5 ** 2 + (32 ** 2 - 1) / 12)  # 6-bit sub-block scales uniform in 32..63
_SC_6_RMS = math.sqrt(63.5 ** 2 + (64 ** 2 - 1) / 12)  # Q6_K int8 scales: +-(32..95)


def _fp16(x: np.ndarray) -> np.ndarray:
    return _half(x).view(np.uint8).reshape(-1, 2)


def _half(x: np.ndarray) -> np.ndarray:
    """float64 -> float16 through float32: both casts round to nearest even in hardware (F16C) and in
    numpy's software path alike, so the bits do not depend on the CPU."""
    return x.astype(np.float32).astype(np.float16)


def _sign(col: np.ndarray) -> np.ndarray:
    return np.where(col & 1, -1.0, 1.0)


def _fill_blocks(qtype: int, blocks: np.ndarray, sigma: float) -> None:
    """Turn rows of random bytes (one ggml block each) into valid blocks of weights with std ``sigma``.

    The quant payload stays random (any bit pattern is a valid quant); the
    scales are overwritten, their randomness taken from the bytes they replace.
    """
    if qtype in (Q4_0, Q5_0, Q8_0):  # w = d * (q - center), d of random sign: zero mean
        base = sigma / (math.sqrt(_EQ2[qtype]) * _U_RMS)
        d = base * (0.75 + 0.5 * _unit(blocks[:, 0:2])) * _sign(blocks[:, 2])
        blocks[:, 0:2] = _fp16(d)
    elif qtype in (Q4_1, Q5_1):  # w = d * q + m, m = -center * d: zero mean
        base = sigma / (math.sqrt(_EQ2[qtype]) * _U_RMS)
        d = _half(base * (0.75 + 0.5 * _unit(blocks[:, 0:2])))
        center = 7.5 if qtype == Q4_1 else 15.5
        blocks[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
        blocks[:, 2:4] = _fp16(-center * d.astype(np.float64))
    elif qtype in (Q4_K, Q5_K):  # w = d*sc*q - dmin*m, m = sc and dmin = center * d: w = d*sc*(q - center)
        base = sigma / (math.sqrt(_EQ2[qtype]) * _SC_K_RMS * _U_RMS)
        d = _half(base * (0.75 + 0.5 * _unit(blocks[:, 0:2])))
        center = 7.5 if qtype == Q4_K else 15.5
        blocks[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
        blocks[:, 2:4] = _fp16(center * d.astype(np.float64))
        sc = 32 + (blocks[:, 4:12] & 31)  # 8 sub-block scales (= mins), 6-bit
        packed = np.empty((blocks.shape[0], 12), dtype=np.uint8)
        packed[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
        packed[:, 4:8] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
        packed[:, 8:12] = (sc[:, 4:8] & 15) | ((sc[:, 4:8] & 15) << 4)
        blocks[:, 4:16] = packed
    elif qtype == Q6_K:  # w = d * sc * (q - 32), sc int8 of random sign: zero mean
        base = sigma / (math.sqrt(_EQ2[qtype]) * _SC_6_RMS * _U_RMS)
        d = base * (0.75 + 0.5 * _unit(blocks[:, 208:210]))
        raw = blocks[:, 192:208]
        sc = (32 + (raw >> 2).astype(np.int16)) * np.where(raw & 1, -1, 1).astype(np.int16)  # +-(32..95)
        blocks[:, 192:208] = sc.astype(np.int8).view(np.uint8)
        blocks[:, 208:210] = _fp16(d)
    else:
        raise ValueError(f"no block generator for ggml type {qtype}")


def _triangular(rng: np.random.Generator, n: int) -> np.ndarray:
    """Zero-mean, unit-std values from two uniforms: plain float64 arithmetic, so the same bits on any
    CPU (``standard_normal`` takes exp/log from the platform's math library in its tails)."""
    return (rng.random(n) + rng.random(n) - 1.0) * math.sqrt(6.0)


def chunk_rows(plan: TensorPlan) -> list[tuple[int, int]]:
    """The tensor's data as (first row, rows) chunks of at most about CHUNK_BYTES (one chunk for 1-D)."""
    if len(plan.shape) == 1:
        return [(0, 1)]
    rows, cols = plan.shape
    per, size = BLOCKS[plan.qtype]
    row_bytes = max(cols // per * size, cols * 16 if plan.qtype in (F16, F32) else 0)  # drawn as 2 float64
    step = max(1, CHUNK_BYTES // row_bytes)
    return [(r, min(step, rows - r)) for r in range(0, rows, step)]


def make_chunk(plan: TensorPlan, seed: int, index: int, rows: int, rope_factors: np.ndarray | None) -> np.ndarray:
    """Chunk ``index`` of the tensor's data (``rows`` rows); each chunk has its own random stream,
    so chunks can be made in parallel and the bytes do not depend on how many threads made them."""
    rng = _rng(seed, f"{plan.name}#{index}")
    if plan.kind == "rope_freqs":
        assert rope_factors is not None
        return rope_factors.astype("<f4")
    if plan.kind in ("norm", "bias"):
        n = int(np.prod(plan.shape))
        if plan.kind == "norm":
            return (plan.scale * (1.0 + 0.1 * (rng.random(n) - 0.5))).astype("<f4")
        return (plan.sigma * _triangular(rng, n)).astype("<f4")
    cols = plan.shape[1]
    if plan.qtype in (F16, F32):
        values = plan.sigma * _triangular(rng, rows * cols)
        return _half(values) if plan.qtype == F16 else values.astype("<f4")
    per, size = BLOCKS[plan.qtype]
    blocks = _random_bytes(rng, rows * (cols // per) * size).reshape(-1, size)
    _fill_blocks(plan.qtype, blocks, plan.sigma)
    return blocks
