"""Buffers for the snapshots of reclaimed pages: the step thread copies a run of pages into one before it
frees them, the tier's I/O thread writes it to disk, and the buffer is then used again.

Why. Reclaiming pages copies them on the step thread, so the step that reclaims pays for the copy.
Profiled on the step thread (``benchmarks/results/intel-xeon-2c-fc7df03f/tier48_step/staging_probe.py``):
copying 64 pages of the bundled model into a new tensor that lives until it is written cost ~0.40 ms a
page, into a buffer used again ~0.009 ms - the rest was the kernel faulting in and zeroing fresh memory
(big blocks go back to the kernel when freed). A fresh buffer is mapped directly (``mmap``), freed with
its tensor.

A buffer is used again only when nothing else holds its memory: the tier hands out views of a pending
snapshot to a request that reads its pages back (``DiskTier.fetch``), and such a view can outlive the
write. So a buffer the writer gives back waits until the storage's use count says the pool's own tensor
is its only holder (the count sees tensors - views, ``.numpy()`` arrays, memoryviews -; code that kept
a view's bare ``untyped_storage()`` would not be seen: none does). At most ``keep_bytes`` of free
buffers are kept and at most ``keep_bytes`` of given-back ones wait for their readers (the oldest are
forgotten past that: their memory goes back to the kernel once the reader is done); the rest go back
to the kernel at once.
"""

from __future__ import annotations

import mmap
import threading
from typing import Sequence

import torch

DEFAULT_KEEP_MIB = 128
"""Free buffers kept for the next reclaims: half the snapshots the tier lets wait for the disk
(``tier.DEFAULT_PENDING_MIB``): ~5 runs of 64 pages of the bundled model's fp16 KV (~5,400 tokens)."""

_use_count = getattr(torch._C, "_storage_Use_Count", None)  # (torch's own count of a storage's holders)


def _holders(flat: torch.Tensor) -> int:
    return int(_use_count(flat.untyped_storage()._cdata)) if _use_count is not None else -1


def _fresh(nbytes: int) -> torch.Tensor:
    """A flat uint8 buffer of ``nbytes`` mapped directly from the kernel (freed with the tensor)."""
    return torch.frombuffer(mmap.mmap(-1, max(1, nbytes)), dtype=torch.uint8)


AVAILABLE = _use_count is not None
"""Whether buffers can be used again at all (without torch's count, the tier copies into fresh memory)."""


class Buffer:
    """A flat buffer and its storage's use count when only the pool holds it."""

    __slots__ = ("flat", "alone")

    def __init__(self, nbytes: int):
        self.flat = _fresh(nbytes)
        self.alone = _holders(self.flat)

    def unshared(self) -> bool:
        """Whether no view of it is alive (a torch without the count: never, so never used again)."""
        return self.alone >= 0 and _holders(self.flat) == self.alone


class Staging:
    def __init__(self, keep_bytes: int = DEFAULT_KEEP_MIB * 2**20):
        self.keep_bytes = max(0, int(keep_bytes))
        self._lock = threading.Lock()
        self._free: list[Buffer] = []  # buffers nothing else holds
        self._returned: list[Buffer] = []  # given back by the writer, perhaps still viewed by a reader
        self.stats = {"staging_reused": 0, "staging_fresh": 0}

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> tuple[torch.Tensor, Buffer]:
        """A contiguous tensor of ``shape`` and ``dtype`` (its content undefined) and the buffer behind
        it (``give`` it back once written)."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        buf = None
        with self._lock:
            self._collect()
            fits = [b for b in self._free if b.flat.numel() >= nbytes]
            if fits:
                buf = min(fits, key=lambda b: b.flat.numel())
                self._free.remove(buf)
                self.stats["staging_reused"] += 1
        if buf is None:
            buf = Buffer(nbytes)
            self.stats["staging_fresh"] += 1
        return buf.flat[:nbytes].view(dtype).view(tuple(shape)), buf

    def snapshot(self, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, tuple[Buffer, Buffer]]:
        """The K and V of ``pages`` (``[L, n, ps, H, D]`` each, copied from the caches along dim 1) in
        buffers of the pool, and those buffers (``give`` each back once written)."""
        shape = (k_cache.shape[0], len(pages), *k_cache.shape[2:])
        (k, kb), (v, vb) = (self.take(shape, k_cache.dtype) for _ in range(2))
        torch.index_select(k_cache, 1, pages, out=k)
        torch.index_select(v_cache, 1, pages, out=v)
        return k, v, (kb, vb)

    def give(self, buf: Buffer | None) -> None:
        """The writer is done with ``buf`` (its snapshot written, or dropped): kept for the next snapshot,
        or let go (so buffers are not held after reclaims stop)."""
        if buf is not None:
            with self._lock:
                self._returned.append(buf)
                self._collect()

    def _collect(self) -> None:
        still = []
        for buf in self._returned:
            if not buf.unshared():
                still.append(buf)  # a reader's view of it is alive: not yet
            elif sum(b.flat.numel() for b in self._free) + buf.flat.numel() <= self.keep_bytes:
                self._free.append(buf)
            # (else: dropped - its memory goes back to the kernel)
        while sum(b.flat.numel() for b in still) > self.keep_bytes:
            still.pop(0)  # (forgotten: freed when its reader lets go)
        self._returned = still

    @property
    def kept_bytes(self) -> int:
        """Bytes of the buffers the pool holds, free or waiting for a reader."""
        with self._lock:
            return sum(b.flat.numel() for b in self._free + self._returned)
