"""PagePool: preallocated per-layer K/V storage addressed by page id, with a refcounted allocator.

Layout: ``k_cache`` / ``v_cache`` are ``[num_layers, num_pages, page_size, num_kv_heads, head_dim]``
(FlashInfer's NHD paged layout per layer); 8-bit (q8) pages are int8 with ``head_dim + 4`` bytes per
vector, the last 4 its scale (``kv/q8.py``). A page is referenced by every page table that holds it
(pools, sessions); it returns to the free list when its refcount drops to 0. Allocation is
check-then-commit: ``can_allocate(n)`` then ``allocate(n)``, which never partially succeeds.
"""

from __future__ import annotations

import math
import mmap
from typing import Iterable, Sequence

import torch

from ..errors import CapacityError
from ..attention import q8


def zeros_on_demand(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose memory is committed as it is written. On CPU it lies in an anonymous
    memory map: the OS hands out zero pages when first touched, so a KV cache holds resident memory
    for the pages in use (up to the highest page id used), not for its whole budget."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    private = getattr(mmap, "MAP_PRIVATE", None)  # POSIX: private anonymous memory (else Windows' paging file)
    mem = mmap.mmap(-1, nbytes) if private is None else mmap.mmap(-1, nbytes, flags=private | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mem, dtype=dtype).view(shape)


class PagePool:
    """The KV store and its page allocator. Mutated only by the engine's step thread."""

    def __init__(self, *, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        if num_pages < 1:
            raise ValueError("num_pages must be >= 1")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype  # torch.int8: q8 pages
        self.device = torch.device(device)
        shape = (num_layers, num_pages, page_size, num_kv_heads, q8.row_width(head_dim, dtype))
        self.k_cache = zeros_on_demand(shape, dtype, self.device)  # [L, P, S, Hkv, D] (q8: D + 4)
        self.v_cache = zeros_on_demand(shape, dtype, self.device)  # [L, P, S, Hkv, D] (q8: D + 4)
        self.refcount = [0] * num_pages
        # Kept sorted descending while clean and popped from the end, so a multi-page allocation
        # gets an ascending run of ids when one is free: attention then reads a pool's pages as
        # a zero-copy slice instead of gathering them every layer.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._free_sorted = True
        # pages written at least once: on CPU (zeros_on_demand) the memory they made resident stays
        # resident after they are freed, so the process grows toward the budget as the cache fills
        self._touched = bytearray(num_pages)
        self.num_touched = 0

    # ---- sizes -------------------------------------------------------------------------
    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * q8.row_width(head_dim, dtype) * elem

    @property
    def dtype_name(self) -> str:
        """``q8``, ``float16``, ... (as /props and KV files name it)."""
        return q8.name(self.dtype)

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    def memory(self) -> dict:
        """The KV store's memory: ``reserved_bytes`` (the cap: every page of the budget, address space
        taken at start), ``resident_bytes`` (memory it holds now: on CPU the pages written at least
        once, since the OS commits them on first write and they stay committed when freed; on an
        accelerator the whole reservation, allocated at start), ``used_bytes`` (pages in use now,
        the prefix cache's included) and ``allocation`` (``on_demand`` | ``at_start``)."""
        reserved = self.num_pages * self.page_bytes
        on_demand = self.device.type == "cpu"
        return {"reserved_bytes": reserved,
                "resident_bytes": self.num_touched * self.page_bytes if on_demand else reserved,
                "used_bytes": self.num_used * self.page_bytes,
                "touched_pages": self.num_touched if on_demand else self.num_pages,
                "allocation": "on_demand" if on_demand else "at_start"}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---- allocation --------------------------------------------------------------------
    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free pages (refcount 1 each). All or nothing."""
        if n < 0:
            raise ValueError("n must be >= 0")
        if n > len(self._free):
            raise CapacityError(f"KV cache exhausted: need {n} pages, {len(self._free)} free")
        if n > 1 and not self._free_sorted:
            self._free.sort(reverse=True)
            self._free_sorted = True
        pages = [self._free.pop() for _ in range(n)]
        touched = self._touched
        for p in pages:
            self.refcount[p] = 1
            if not touched[p]:
                touched[p] = 1
                self.num_touched += 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        for p in pages:
            if self.refcount[p] <= 0:
                raise RuntimeError(f"incref of free page {p}")
            self.refcount[p] += 1

    def decref(self, pages: Iterable[int]) -> None:
        for p in pages:
            rc = self.refcount[p] - 1
            if rc < 0:
                raise RuntimeError(f"decref of free page {p}")
            self.refcount[p] = rc
            if rc == 0:
                self._free.append(p)
                self._free_sorted = False

    def copy_page(self, src: int, dst: int) -> None:
        """Copy one page's K/V in every layer (used for the partial last page of a shared prefix)."""
        self.k_cache[:, dst].copy_(self.k_cache[:, src])
        self.v_cache[:, dst].copy_(self.v_cache[:, src])

    # ---- checks ------------------------------------------------------------------------
    def check_integrity(self, page_tables: Sequence[Sequence[int]] | None = None) -> None:
        """Assert free + referenced == total and no negative refcounts.

        With ``page_tables`` (every page table that holds references), also assert that each
        page's refcount equals the number of tables holding it.
        """
        free = set(self._free)
        assert len(free) == len(self._free), "duplicate page on the free list"
        for p, rc in enumerate(self.refcount):
            assert rc >= 0, f"negative refcount on page {p}"
            assert (rc == 0) == (p in free), f"page {p}: refcount {rc} but free={p in free}"
        assert len(free) + sum(1 for rc in self.refcount if rc > 0) == self.num_pages
        if page_tables is not None:
            counts = [0] * self.num_pages
            for table in page_tables:
                for p in table:
                    counts[p] += 1
            for p in range(self.num_pages):
                assert counts[p] == self.refcount[p], (
                    f"page {p}: refcount {self.refcount[p]} but held by {counts[p]} page tables")
