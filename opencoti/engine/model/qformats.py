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
        n, k = self.q.shape
        return n, k

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
        n, k = self.q.shape
        return n, k

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        q = self.q.float().view(n, k // self.group, self.group) - 8.0
        return (q * self.scale[..., None] + self.zero[..., None]).view(n, k)


@dataclass
class Q4Blocks:
    """int4 weights already in the native kernel's layout (``kernels.pack_q4_blocks``): uint8
    ``[N, K/32 * 20]``, per row K/32 x 16 bytes of nibbles (byte j: value j low, j + 16 high), then
    K/32 fp16 scales d, then K/32 fp16 offsets m, ``W = d * q + m``. What a GGUF's Q4_0 / Q4_1 / Q4_K
    rows become by moving bytes (``gguf_to_q4_blocks``), without a one-byte-per-value copy."""

    blocks: torch.Tensor
    k: int

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.blocks.shape[0]), self.k)

    def to_int4(self) -> Int4Weight:
        n, k = self.shape
        nb = k // 32
        nib = self.blocks[:, :nb * 16].reshape(n, nb, 16)
        q = torch.cat([nib & 0x0F, nib >> 4], -1).reshape(n, k)
        dm = self.blocks[:, nb * 16:].contiguous().view(torch.float16).float().reshape(n, 2, nb)
        d, m = dm[:, 0].contiguous(), dm[:, 1]
        return Int4Weight(q.contiguous(), d, (m + 8.0 * d).contiguous(), 32)

    def dequantize(self) -> torch.Tensor:
        return self.to_int4().dequantize()


# GGUF k-quant types the native k-quant projections read as the file stores them (ggml type ids)
KQUANT_TYPES = {"Q4_K": 12, "Q6_K": 14}
KQUANT_BLOCK = {"Q4_K": 144, "Q6_K": 210}  # bytes per 256 values


@dataclass
class KQuantRows:
    """A projection's rows as a GGUF stores them in Q4_K / Q6_K super-blocks, in segments of one type
    each (``segments``: (type name, rows) in row order; a fused q/k/v whose v is Q6_K and q, k Q4_K has
    three, as Q4_K_M files have in some layers), the segments' bytes one after the other in ``data``
    (uint8, 1-D). The native k-quant kernel (``kernels.NativeKQuant``) reads them without conversion:
    4.5 bits a weight for Q4_K, 6.56 for Q6_K."""

    data: torch.Tensor
    segments: list[tuple[str, int]]
    k: int

    def __post_init__(self) -> None:
        if self.k % 256:
            raise ValueError(f"k-quant rows need the input size to be a multiple of 256, got {self.k}")
        want = sum(rows * self.k // 256 * KQUANT_BLOCK[t] for t, rows in self.segments)
        if self.data.dtype != torch.uint8 or self.data.dim() != 1 or self.data.numel() != want:
            raise ValueError(f"k-quant rows {self.segments} x {self.k} hold {want} bytes, got "
                             f"{self.data.dtype} {tuple(self.data.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(rows for _, rows in self.segments), self.k)

    def table(self) -> list[int]:
        """The segments as the native operators take them: (ggml type, rows, k) per segment, flattened."""
        return [v for t, rows in self.segments for v in (KQUANT_TYPES[t], rows, self.k)]

    def dequantize(self) -> torch.Tensor:
        parts, at = [], 0
        for t, rows in self.segments:
            nbytes = rows * self.k // 256 * KQUANT_BLOCK[t]
            parts.append(gguf_dequantize(t, self.data[at:at + nbytes].numpy().reshape(rows, -1), rows, self.k))
            at += nbytes
        return torch.cat(parts) if len(parts) > 1 else parts[0]


def cat_kquant(parts: list[KQuantRows]) -> KQuantRows:
    """Rows of several k-quant weights one after the other (adjacent segments of one type merged)."""
    if any(p.k != parts[0].k for p in parts):
        raise TypeError("cannot fuse k-quant weights with different input sizes")
    segments: list[tuple[str, int]] = []
    for p in parts:
        for t, rows in p.segments:
            if segments and segments[-1][0] == t:
                segments[-1] = (t, segments[-1][1] + rows)
            else:
                segments.append((t, rows))
    data = _adjacent(parts)
    return KQuantRows(torch.cat([p.data for p in parts]) if data is None else data, segments, parts[0].k)


def _adjacent(parts: list[KQuantRows]) -> torch.Tensor | None:
    """The one tensor the parts' bytes already are, one after the other in a single buffer (a fused
    projection read in place: ``gguf_weights.read_parts``), or None (they must be concatenated)."""
    first = parts[0].data
    if len(parts) == 1:
        return first
    base, size = first.untyped_storage(), 0
    for p in parts:
        d = p.data
        if d.untyped_storage().data_ptr() != base.data_ptr() or d.storage_offset() != first.storage_offset() + size:
            return None
        size += d.numel()
    return first.as_strided((size,), (1,), first.storage_offset()) if size <= base.nbytes() - first.storage_offset() \
        else None


def gguf_to_q4_blocks(type_name: str, raw: np.ndarray, n: int, k: int) -> Q4Blocks:
    """GGUF Q4_0 / Q4_1 / Q4_K rows (uint8 ``[n, row bytes]``) in the native int4 layout. Q4_0 and Q4_1
    are moved byte for byte (exact: Q4_0's offset ``-8 d`` is a power-of-two multiple of ``d``); a Q4_K
    sub-block's scale ``d * sc`` and offset ``-dmin * m`` (an fp16 times a 6-bit integer) are rounded to
    fp16, a relative error of at most 2^-11 on each (a 4-bit step is 1/15 of a block's range). The native
    operator (``gguf_q4_blocks``) does it where the library is built, else numpy."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, -1)
    ggml_type = {"Q4_0": 2, "Q4_1": 3, "Q4_K": 12}.get(type_name)  # ggml's type ids
    if ggml_type is not None:
        from .. import native  # here, not at the top: engine/native imports model/loader

        ops = native.lib()
        if ops is not None:  # the same bytes as the numpy code below (tests/offline/test_native_gguf.py)
            rows = torch.from_numpy(raw if raw.flags.writeable else raw.copy())
            return Q4Blocks(ops.gguf_q4_blocks(rows, ggml_type, k), k)
    nb = k // 32
    out = np.empty((n, nb * 20), np.uint8)
    nib = out[:, :nb * 16].reshape(n, nb, 16)
    d_out = out[:, nb * 16:nb * 18].view(np.float16).reshape(n, nb)
    m_out = out[:, nb * 18:].view(np.float16).reshape(n, nb)
    if type_name in ("Q4_0", "Q4_1"):
        bs = 18 if type_name == "Q4_0" else 20
        blocks = raw.reshape(n, nb, bs)
        nib[:] = blocks[..., bs - 16:]
        d = blocks[..., 0:2].copy().view(np.float16).reshape(n, nb)
        d_out[:] = d
        m_out[:] = (-8.0 * d.astype(np.float32)).astype(np.float16) if type_name == "Q4_0" else \
            blocks[..., 2:4].copy().view(np.float16).reshape(n, nb)
        return Q4Blocks(torch.from_numpy(out), k)
    if type_name != "Q4_K":
        raise ValueError(f"GGUF type {type_name} has no exact int4 form")
    ns = k // 256
    blocks = raw.reshape(n, ns, 144)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # [n, ns, 1]
    dmin = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    sc_raw = blocks[..., 4:16]
    sc = np.empty((n, ns, 8), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4] = sc_raw[..., 0:4] & 63
    mn[..., :4] = sc_raw[..., 4:8] & 63
    sc[..., 4:] = (sc_raw[..., 8:12] & 0x0F) | ((sc_raw[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (sc_raw[..., 8:12] >> 4) | ((sc_raw[..., 4:8] >> 6) << 4)
    with np.errstate(over="ignore"):
        d_out[:] = (d * sc).astype(np.float16).reshape(n, nb)
        m_out[:] = (-(dmin * mn)).astype(np.float16).reshape(n, nb)
    if not (np.isfinite(d_out).all() and np.isfinite(m_out).all()):
        raise ValueError("Q4_K scales out of fp16 range")
    qs = blocks[..., 16:].reshape(n, ns, 4, 32)  # 4 chunks of 32 bytes: sub-block 2c low nibbles, 2c+1 high
    lo, hi = qs[..., :16], qs[..., 16:]
    sub = nib.reshape(n, ns, 4, 2, 16)
    sub[..., 0, :] = (lo & 0x0F) | ((hi & 0x0F) << 4)
    sub[..., 1, :] = (lo >> 4) | (hi & 0xF0)
    return Q4Blocks(torch.from_numpy(out), k)


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


def cat_rows(parts: list) -> "Int8Weight | Int4Weight | Q4Blocks | KQuantRows | torch.Tensor":
    """Concatenate weights along the output dimension (fused q/k/v, gate/up); all of one kind."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts, 0)
    if any(type(p) is not type(first) for p in parts):
        raise TypeError("cannot fuse weights of different formats")
    if isinstance(first, KQuantRows):
        return cat_kquant(parts)
    if isinstance(first, Int8Weight):
        return Int8Weight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))
    if isinstance(first, Q4Blocks):
        if len(parts) == 1:
            return first
        if any(p.k != first.k for p in parts):
            raise TypeError("cannot fuse int4 weights with different input sizes")
        return Q4Blocks(torch.cat([p.blocks for p in parts]), first.k)
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
        d: np.ndarray = _f16(blocks[..., 0:2]).reshape(n, k // 32)
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
