"""GGUF blocks of any type for tests, made from random bytes."""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as GT

# fp16 fields of each block type (byte offsets): what random bytes must not fill with inf / NaN
_FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q8_0": (0,)}


def random_blocks(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random GGUF rows of ``type_name`` (uint8 [n, row bytes]): random bytes with sane fp16 scales
    (gguf-py cannot quantize k-quants, and any bytes are valid nibbles and 6-bit scales)."""
    block, size = gguf.GGML_QUANT_SIZES[GT[type_name]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for at in _FP16_FIELDS[type_name]:
        raw[..., at:at + 2] = (rng.random((n, k // block, 1)) * 0.01 + 1e-3).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)
