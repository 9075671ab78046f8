"""Quantized weight containers, quantizers and GGUF block decoders (device-independent, CPU tensors).

Two containers, both for a linear weight ``W [N out, K in]``:

* :class:`Int8Weight`: per output channel, symmetric: ``W[n, k] = q[n, k] * scale[n]`` (q int8).
* :class:`Int4Weight`: groups of ``group`` inputs, asymmetric, in the convention of torch's int4
  kernels: ``W[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g]`` with ``g = k // group`` and
  q in 0..15 (stored one value per uint8; kernels pack them their own way).

GGUF blocks map onto these without going through float weights where the format allows it:
Q4_0 (``d * (q - 8)``), Q4_1 (``d * q + m``) and Q4_K (``d*sc * q - dmin*m`` per 32) are exactly
int4 with group 32 (Q4_1: ``scale = d, zero = m + 8 d``). Other types (Q8_0, Q6_K, ...) are
dequantized by gguf's own code and quantized to the target format.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

INT4_GROUP = 32


@dataclass
class Int8Weight:
    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]


@dataclass
class Int4Weight:
    q: torch.Tensor  # uint8 [N, K], values 0..15
    scale: torch.Tensor  # float32 [N, K // group]
    zero: torch.Tensor  # float32 [N, K // group]
    group: int = INT4_GROUP

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        q = self.q.float().view(n, k // self.group, self.group) - 8.0
        return (q * self.scale[..., None] + self.zero[..., None]).view(n, k)


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-channel int8 (round to nearest; an all-zero row gets scale 1)."""
    w = w.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(q.contiguous(), scale.contiguous())


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> Int4Weight:
    """Asymmetric min/max int4 per group of ``group`` inputs (like GGUF Q4_1)."""
    w = w.detach().float()
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4 needs the input size ({k}) to be a multiple of the group size {group}")
    g = w.view(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15.0)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8).view(n, k)
    return Int4Weight(q.contiguous(), scale.contiguous(), (lo + 8.0 * scale).contiguous(), group)


def cat_rows(parts: list) -> "Int8Weight | Int4Weight | torch.Tensor":
    """Concatenate weights along the output dimension (fused q/k/v, gate/up); all of one kind."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts, 0)
    if any(type(p) is not type(first) for p in parts):
        raise TypeError("cannot fuse weights of different formats")
    if isinstance(first, Int8Weight):
        return Int8Weight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))
    if any(p.group != first.group for p in parts):
        raise TypeError("cannot fuse int4 weights with different group sizes")
    return Int4Weight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                      torch.cat([p.zero for p in parts]), first.group)


def permute_rows(w, perm: torch.Tensor):
    """Reorder the output rows of a float or quantized weight."""
    if isinstance(w, torch.Tensor):
        return w[perm].contiguous()
    if isinstance(w, Int8Weight):
        return Int8Weight(w.q[perm].contiguous(), w.scale[perm].contiguous())
    return Int4Weight(w.q[perm].contiguous(), w.scale[perm].contiguous(), w.zero[perm].contiguous(), w.group)


# ---------------------------------------------------------------------------------------- GGUF blocks
# Layouts from ggml (block sizes in bytes): Q4_0 = fp16 d + 16 B nibbles (18), Q4_1 = fp16 d, fp16 m +
# 16 B (20), Q4_K = 256 values: fp16 d, fp16 dmin, 12 B packed 6-bit scales/mins, 128 B nibbles (144).
# In Q4_0/Q4_1 byte j holds value j (low nibble) and value j + 16 (high nibble).

EXACT_INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] values (low nibbles first, then high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def gguf_block_to_int4(type_name: str, data: np.ndarray, n: int, k: int) -> Int4Weight:
    """Decode GGUF Q4_0 / Q4_1 / Q4_K rows (``data`` uint8 [n, bytes per row]) into int4, exactly."""
    data = np.ascontiguousarray(data, dtype=np.uint8).reshape(n, -1)
    if type_name in ("Q4_0", "Q4_1"):
        bs = 18 if type_name == "Q4_0" else 20
        blocks = data.reshape(n, k // 32, bs)
        d = _f16(blocks[..., 0:2]).reshape(n, k // 32)
        if type_name == "Q4_0":
            zero = np.zeros_like(d)
            qs = blocks[..., 2:]
        else:
            m = _f16(blocks[..., 2:4]).reshape(n, k // 32)
            zero = m + 8.0 * d
            qs = blocks[..., 4:]
        q = _nibbles32(qs).reshape(n, k)
        return Int4Weight(torch.from_numpy(q.astype(np.uint8)), torch.from_numpy(d.copy()),
                          torch.from_numpy(zero.astype(np.float32)), 32)
    if type_name == "Q4_K":
        blocks = data.reshape(n, k // 256, 144)
        d = _f16(blocks[..., 0:2]).reshape(n, k // 256, 1)
        dmin = _f16(blocks[..., 2:4]).reshape(n, k // 256, 1)
        sc_raw = blocks[..., 4:16].astype(np.int32)  # [n, S, 12]
        sc = np.empty(sc_raw.shape[:-1] + (8,), np.int32)
        mn = np.empty_like(sc)
        sc[..., :4] = sc_raw[..., 0:4] & 63
        mn[..., :4] = sc_raw[..., 4:8] & 63
        sc[..., 4:] = (sc_raw[..., 8:12] & 0x0F) | ((sc_raw[..., 0:4] >> 6) << 4)
        mn[..., 4:] = (sc_raw[..., 8:12] >> 4) | ((sc_raw[..., 4:8] >> 6) << 4)
        qs = blocks[..., 16:].reshape(n, k // 256, 4, 32)  # 4 chunks of 64 values: low nibbles, high
        q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, k)  # sub-blocks 2j (low), 2j+1 (high)
        scale = (d * sc).reshape(n, k // 32)
        zero = (8.0 * d * sc - dmin * mn).reshape(n, k // 32)
        return Int4Weight(torch.from_numpy(q.astype(np.uint8)), torch.from_numpy(scale.astype(np.float32)),
                          torch.from_numpy(zero.astype(np.float32)), 32)
    raise ValueError(f"GGUF type {type_name} has no exact int4 form")


def gguf_dequantize(type_name: str, data: np.ndarray, n: int, k: int) -> torch.Tensor:
    """Any GGUF tensor type to float32 [n, k] with gguf's own decoder."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType[type_name]
    return torch.from_numpy(np.ascontiguousarray(dequantize(data, qtype), dtype=np.float32).reshape(n, k))
