"""8-bit KV pages (``EngineConfig.kv_dtype = "q8"``): int8 values with one fp32 scale per (token, KV
head) vector, the way llama.cpp's q8_0 holds a block.

Layout: the page tensors are int8 ``[layers, pages, page_size, num_kv_heads, head_dim + 4]``; the
first ``head_dim`` bytes of a vector are its values ``q`` and the last 4 its scale ``s`` (an fp32,
native byte order): the vector is ``q * s``. Every page operation (copy, snapshot, persistence,
swapping) moves whole vectors, so it needs nothing else. Writing a vector ``x``: ``s = max|x| / 127``
and ``q = round_half_even(x / s)`` (0 for an all-zero vector), computed in fp32; the native kernels
(``engine/native/kernels.cpp``) round identically. Bytes per vector: ``head_dim + 4`` (68 for 64
dimensions, llama.cpp's q8_0 takes 2 x 34 for the same 64 values).

One scale per vector (rather than per block of 32 values, as q8_0) keeps every head dimension
valid and the kernels' inner loops a plain dot product; the accuracy it gives is measured by the
KV gate (``engine/kv/gate.py``, ``benchmarks/bench_kv_dtype.py``).
"""

from __future__ import annotations

import torch

DTYPE = torch.int8  # the element type of q8 pages (the KV dtype torch sees)
SCALE_BYTES = 4  # an fp32 scale after each vector's values


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements per (token, KV head) vector in a cache of ``dtype``."""
    return head_dim + SCALE_BYTES if dtype == DTYPE else head_dim


def name(dtype: torch.dtype) -> str:
    """The KV dtype's name in /props, KV files and logs: ``q8``, ``float16``, ..."""
    return "q8" if dtype == DTYPE else str(dtype).removeprefix("torch.")


def quantize(x: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` (any float dtype) as q8 vectors ``[..., D + 4]`` int8."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / 127
    div = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (x / div).round_().clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.contiguous().view(torch.int8)], dim=-1)


def dequantize(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q8 vectors ``[..., D + 4]`` as ``[..., D]`` values of ``dtype`` (computed in fp32; on CPU in one
    pass by the native kernels when they are built: the same values, about 2x faster than torch's
    three passes)."""
    d = t.shape[-1] - SCALE_BYTES
    if t.device.type == "cpu" and t.is_contiguous() and t.numel() and d > 0:
        from .. import native

        ops = native.lib()
        if ops is not None:
            out = ops.q8_dequant.default(t)
            return out if dtype == torch.float32 else out.to(dtype)
    scale = t[..., -SCALE_BYTES:].contiguous().view(torch.float32)  # [..., 1]
    return (t[..., :-SCALE_BYTES].float() * scale).to(dtype)
