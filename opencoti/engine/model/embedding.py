"""The input embedding of a GGUF model kept in the file's own blocks (Q8_0, or any other type).

A GGUF's ``token_embd.weight`` is often Q8_0 (blocks of 32 int8 values with an fp16 scale: 8.5
bits a value). The converted checkpoint holds it dequantized in fp32; kept that way the table of
SmolLM2-135M (49152 x 576) takes 113 MB, next to the output head built from the same weights.
:class:`Q8Embedding` keeps the int8 values and fp16 scales (30 MB) and dequantizes only the rows a
step looks up, with the arithmetic of gguf's own decoder (``float32(d) * float32(q)``), the one the
conversion used: the rows are bit for bit those of the fp32 table (checked against it at load).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

log = logging.getLogger("opencoti.engine")

Q8_BLOCK = 32
_Q8_BLOCK_BYTES = 2 + Q8_BLOCK  # fp16 scale, 32 int8 values
_CHECK_ROWS = 4096  # rows compared with the fp32 table per chunk at load


class Q8Embedding:
    """An embedding table [V, hidden] in Q8_0 blocks; reads like the fp32 table it replaces
    (``index_select``, row indexing, ``shape``, ``dtype``) and returns rows in ``dtype``."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, dtype: torch.dtype):
        if q.dtype != torch.int8 or q.dim() != 2 or q.shape[1] % Q8_BLOCK:
            raise ValueError(f"Q8Embedding needs int8 [V, K] values with K a multiple of {Q8_BLOCK}")
        if d.dtype != torch.float16 or tuple(d.shape) != (q.shape[0], q.shape[1] // Q8_BLOCK):
            raise ValueError("Q8Embedding needs one fp16 scale per block of 32 values")
        self.q, self.dtype = q, dtype
        self.d = d.float()[..., None]  # fp16 -> fp32 is exact; [V, K / 32, 1]: one op less per lookup

    @classmethod
    def from_blocks(cls, data: np.ndarray, vocab: int, hidden: int, dtype: torch.dtype,
                    device: torch.device | str = "cpu") -> "Q8Embedding":
        """From a GGUF Q8_0 tensor's bytes (uint8, ``vocab`` rows of ``hidden`` values); copied, so
        nothing of the file's memory map stays referenced."""
        blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(vocab, hidden // Q8_BLOCK, _Q8_BLOCK_BYTES)
        d = torch.from_numpy(blocks[..., :2].copy().view(np.float16).reshape(vocab, hidden // Q8_BLOCK))
        q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(vocab, hidden))
        return cls(q.to(device), d.to(device), dtype)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.d.nbytes

    def _rows(self, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        n, k = q.shape
        x = q.view(n, k // Q8_BLOCK, Q8_BLOCK).float().mul_(d).view(n, k)
        return x if self.dtype == torch.float32 else x.to(self.dtype)

    def index_select(self, dim: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` [T] -> [T, hidden]; ids out of range raise IndexError as the table's did."""
        if dim != 0:
            raise ValueError("an embedding table is looked up by rows (dim 0)")
        return self._rows(self.q.index_select(0, ids), self.d.index_select(0, ids))

    def __getitem__(self, rows) -> torch.Tensor:
        """Rows by index, slice or index tensor (dequantized)."""
        q, d = self.q[rows], self.d[rows]
        if q.dim() == 1:
            return self._rows(q[None], d[None])[0]
        return self._rows(q, d)

    def dense(self) -> torch.Tensor:
        """The whole table in ``dtype`` (what the fp32 path would hold)."""
        return torch.cat([self[i:i + _CHECK_ROWS] for i in range(0, self.shape[0], _CHECK_ROWS)])

    def equals(self, table: torch.Tensor) -> bool:
        """True when every row is bit for bit the row of ``table`` (compared in chunks)."""
        if tuple(table.shape) != tuple(self.shape) or table.dtype != self.dtype:
            return False
        bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[table.element_size()]
        for i in range(0, self.shape[0], _CHECK_ROWS):
            ref = table[i:i + _CHECK_ROWS].to(self.device).contiguous()
            if not torch.equal(self[i:i + _CHECK_ROWS].view(bits), ref.view(bits)):
                return False
        return True


class BlockEmbedding:
    """An embedding table [V, hidden] kept in a GGUF's own blocks of any type (Q4_K, Q6_K, F16, ...):
    the rows a step looks up are decoded with gguf's own decoder (the values llama.cpp reads). A
    table of 128256 x 4096 takes 2.1 GB in fp32, 0.43 GB in Q6_K."""

    def __init__(self, raw: torch.Tensor, type_name: str, hidden: int, dtype: torch.dtype):
        if raw.dtype != torch.uint8 or raw.dim() != 2:
            raise ValueError("BlockEmbedding needs uint8 [V, row bytes] blocks")
        self.raw, self.type_name, self.hidden, self.dtype = raw, type_name, hidden, dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.raw.shape[0], self.hidden))

    @property
    def device(self) -> torch.device:
        return self.raw.device

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes

    def _rows(self, raw: torch.Tensor) -> torch.Tensor:
        from .gguf_weights import decode_rows

        x = decode_rows(self.type_name, raw.cpu().numpy(), self.hidden)
        return x.to(device=self.raw.device, dtype=self.dtype)

    def index_select(self, dim: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` [T] -> [T, hidden]; ids out of range raise IndexError as the table's did."""
        if dim != 0:
            raise ValueError("an embedding table is looked up by rows (dim 0)")
        return self._rows(self.raw.index_select(0, ids))

    def __getitem__(self, rows) -> torch.Tensor:
        raw = self.raw[rows]
        if raw.dim() == 1:
            return self._rows(raw[None])[0]
        return self._rows(raw)

    def dense(self) -> torch.Tensor:
        return torch.cat([self[i:i + _CHECK_ROWS] for i in range(0, self.shape[0], _CHECK_ROWS)])


def gguf_embedding(weight, dtype: torch.dtype, device) -> "Q8Embedding | BlockEmbedding | torch.Tensor":
    """The input embedding of a GGUF file (``weight``: its ``token_embd``, a ``GGUFWeight``) in the
    file's own blocks: Q8_0 as a :class:`Q8Embedding`, an F32 table as a tensor, any other type as a
    :class:`BlockEmbedding`. Read once, copied out of the file (nothing stays mapped)."""
    vocab, hidden = weight.shape
    raw = weight.raw()
    if weight.type_name == "Q8_0" and hidden % Q8_BLOCK == 0:
        return Q8Embedding.from_blocks(raw, vocab, hidden, dtype, device)
    if weight.type_name == "F32" or (weight.type_name in ("F16", "BF16") and dtype != torch.float32):
        from .gguf_weights import decode_rows

        return decode_rows(weight.type_name, raw, hidden).to(device=device, dtype=dtype)
    return BlockEmbedding(torch.from_numpy(raw).to(device), weight.type_name, hidden, dtype)
