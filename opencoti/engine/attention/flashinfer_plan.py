"""Host-side planning for the FlashInfer backend: the index arrays its kernels consume.

Pure functions over the step's page tables (no CUDA, no flashinfer), so they are unit-tested
on CPU. All arrays are CPU int32 tensors; the kernel wrappers copy them to the device when
they plan.

Plain step: one request per sequence, ``kv_last_page_len`` in [1, page_size] (FlashInfer's
rule; an empty request would be ``(num_pages - 1) * page_size + last_page_len`` tokens, which
older FlashInfer releases compute as negative).

Cascade step (see ``cascade.py``): the plan's ``levels`` are in FlashInfer's multi-level
format over the sequences in trie DFS ``order``, so the query rows are first permuted into
that order (``perm``) and the output permuted back (``inv_perm``). At a shared level a
sequence without a shared range has an *empty group* (0 pages, last_page_len 0), which
FlashInfer's paged kernels cannot express portably. We drop those requests and run the level
on the remaining rows only (``LevelPlan.rows``, gathered from the permuted queries); their
partial results are merged into just those rows. A level where every sequence has a group
keeps ``rows = None`` (no gather), and a plan whose shared levels are all like that is
``dense``: it can also run through ``MultiLevelCascadeAttentionWrapper`` unchanged.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch

_I32 = torch.int32
_I64 = torch.int64

MIB = 2**20
DEFAULT_WORKSPACE_MIB = 128  # FlashInfer's recommended float workspace (split-kv partial outputs)
MIN_WORKSPACE_MIB = 16
MAX_WORKSPACE_MIB = 4096
INT_WORKSPACE_BYTES = 8 * MIB  # each FlashInfer wrapper allocates this much on the device (+ as much pinned)
WORKSPACE_ENV = "OPENCOTI_FLASHINFER_WORKSPACE_MIB"


class PagedArrays(NamedTuple):
    """One batch of paged-attention requests in FlashInfer's CSR format (CPU int32)."""

    qo_indptr: torch.Tensor  # [B+1] query rows of request i: qo_indptr[i]:qo_indptr[i+1]
    kv_indptr: torch.Tensor  # [B+1] pages of request i: kv_indices[kv_indptr[i]:kv_indptr[i+1]]
    kv_indices: torch.Tensor  # [nnz_pages]
    kv_last_page_len: torch.Tensor  # [B] tokens in the request's last page, 1..page_size

    @property
    def num_requests(self) -> int:
        return self.kv_last_page_len.shape[0]

    @property
    def num_rows(self) -> int:
        return int(self.qo_indptr[-1])

    def kv_lens(self, page_size: int) -> list[int]:
        """Tokens each request attends to, as FlashInfer computes it from the page arrays."""
        pages = (self.kv_indptr[1:] - self.kv_indptr[:-1]).tolist()
        last = self.kv_last_page_len.tolist()
        return [max(n - 1, 0) * page_size + lp if n > 0 else 0 for n, lp in zip(pages, last)]


def _cumsum(counts: Sequence[int]) -> list[int]:
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


def paged_arrays(page_tables: Sequence[Sequence[int]], kv_lens: Sequence[int], qo_lens: Sequence[int],
                 page_size: int, page_start: Sequence[int] | None = None,
                 order: Sequence[int] | None = None) -> PagedArrays:
    """Requests over ``page_tables[s][page_start[s]:]`` for each sequence ``s`` in ``order``.

    ``kv_lens[s]`` counts the sequence's tokens from position 0; its pages from ``page_start[s]``
    on hold ``kv_lens[s] - page_start[s] * page_size`` of them, which must be >= 1.
    """
    seqs = list(range(len(page_tables))) if order is None else list(order)
    indices: list[int] = []
    kv_counts, last = [], []
    for s in seqs:
        start = 0 if page_start is None else page_start[s]
        n_pages = -(-kv_lens[s] // page_size)
        if n_pages > len(page_tables[s]):
            raise ValueError(f"sequence {s}: page table covers {len(page_tables[s]) * page_size} tokens, "
                             f"needs {kv_lens[s]}")
        if kv_lens[s] - start * page_size < 1:
            raise ValueError(f"sequence {s}: no tokens left after page {start}")
        indices.extend(page_tables[s][start:n_pages])
        kv_counts.append(n_pages - start)
        last.append(kv_lens[s] - (n_pages - 1) * page_size)
    return PagedArrays(
        qo_indptr=torch.tensor(_cumsum([qo_lens[s] for s in seqs]), dtype=_I32),
        kv_indptr=torch.tensor(_cumsum(kv_counts), dtype=_I32),
        kv_indices=torch.tensor(indices, dtype=_I32),
        kv_last_page_len=torch.tensor(last, dtype=_I32),
    )


def check_paged_arrays(arrays: PagedArrays, page_size: int, num_pages: int | None = None) -> None:
    """Raise ValueError unless ``arrays`` satisfy what FlashInfer's paged kernels assume."""
    qo, kvp, idx, last = arrays
    for name, t in zip(PagedArrays._fields, arrays):
        if t.dtype != _I32 or t.dim() != 1:
            raise ValueError(f"{name} must be a 1-D int32 tensor, got {t.dtype} {tuple(t.shape)}")
    b = last.shape[0]
    if qo.shape[0] != b + 1 or kvp.shape[0] != b + 1:
        raise ValueError(f"indptr lengths {qo.shape[0]}, {kvp.shape[0]} do not match {b} requests")
    if int(qo[0]) != 0 or int(kvp[0]) != 0:
        raise ValueError("indptr arrays must start at 0")
    if b and (bool((qo[1:] < qo[:-1]).any()) or bool((kvp[1:] <= kvp[:-1]).any())):
        raise ValueError("qo_indptr must be non-decreasing and every request needs >= 1 page")
    if int(kvp[-1]) != idx.shape[0]:
        raise ValueError(f"kv_indptr[-1] = {int(kvp[-1])} but there are {idx.shape[0]} kv_indices")
    if b and (bool((last < 1).any()) or bool((last > page_size).any())):
        raise ValueError(f"kv_last_page_len must be in [1, {page_size}], got {last.tolist()}")
    if num_pages is not None and idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= num_pages):
        raise ValueError(f"kv_indices out of range [0, {num_pages})")


def dfs_row_permutation(order: Sequence[int], qo_lens: Sequence[int]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Query-row permutation into the sequences' ``order`` and its inverse (None when identity).

    ``q_dfs = q[perm]``; ``out = out_dfs[inv_perm]``.
    """
    if list(order) == list(range(len(qo_lens))):
        return None, None
    start = _cumsum(qo_lens)
    perm = [r for s in order for r in range(start[s], start[s] + qo_lens[s])]
    if sorted(perm) != list(range(start[-1])):
        raise ValueError("order must be a permutation of the sequences")
    perm_t = torch.tensor(perm, dtype=_I64)
    inv = torch.empty_like(perm_t)
    inv[perm_t] = torch.arange(len(perm), dtype=_I64)
    return perm_t, inv


@dataclass
class LevelPlan:
    """One cascade level: requests over (a subset of) the DFS-ordered query rows."""

    arrays: PagedArrays
    rows: torch.Tensor | None  # int64 positions in the DFS row order; None = every row, in order
    causal: bool  # only the private (last) level: shared pages precede every query position
    is_decode: bool  # every request has exactly one query row (the decode kernel applies)


@dataclass
class StepPlan:
    """What the FlashInfer backend runs this step."""

    kind: str  # "decode" | "prefill" (plain paged attention) | "cascade"
    num_rows: int
    page_size: int
    arrays: PagedArrays | None = None  # plain kinds
    levels: list[LevelPlan] = field(default_factory=list)  # cascade: shared levels, then the private one
    perm: torch.Tensor | None = None  # cascade: DFS row order (None = identity)
    inv_perm: torch.Tensor | None = None

    @property
    def is_dense(self) -> bool:
        """Every cascade level covers every row: MultiLevelCascadeAttentionWrapper can run it."""
        return self.kind == "cascade" and all(lv.rows is None for lv in self.levels)

    def multilevel_arrays(self) -> list[PagedArrays]:
        if not self.is_dense:
            raise ValueError("only a dense cascade plan maps onto MultiLevelCascadeAttentionWrapper")
        return [lv.arrays for lv in self.levels]


def _compact_level(level: dict, page_size: int) -> tuple[PagedArrays, torch.Tensor | None]:
    """Drop the empty groups (0 pages) of a shared level; rows None when there are none."""
    qo = level["qo_indptr"].tolist()
    kvp = level["kv_indptr"].tolist()
    last = level["kv_last_page_len"].tolist()
    counts = [kvp[i + 1] - kvp[i] for i in range(len(last))]
    keep = [i for i, c in enumerate(counts) if c > 0]
    indices = level["kv_indices"].to(_I32)
    if len(keep) == len(counts):
        arrays = PagedArrays(level["qo_indptr"].to(_I32), level["kv_indptr"].to(_I32), indices,
                             level["kv_last_page_len"].to(_I32))
        return arrays, None
    rows = [r for i in keep for r in range(qo[i], qo[i + 1])]
    arrays = PagedArrays(
        qo_indptr=torch.tensor(_cumsum([qo[i + 1] - qo[i] for i in keep]), dtype=_I32),
        kv_indptr=torch.tensor(_cumsum([counts[i] for i in keep]), dtype=_I32),
        kv_indices=indices,  # empty groups contribute no indices
        kv_last_page_len=torch.tensor([last[i] for i in keep], dtype=_I32),
    )
    return arrays, torch.tensor(rows, dtype=_I64)


def build_step_plan(page_tables: Sequence[Sequence[int]], kv_lens: Sequence[int], qo_lens: Sequence[int],
                    page_size: int, cascade_plan=None) -> StepPlan:
    """The step's kernel inputs: plain paged attention, or the cascade plan's levels."""
    num_rows = int(sum(qo_lens))
    if cascade_plan is None:
        arrays = paged_arrays(page_tables, kv_lens, qo_lens, page_size)
        kind = "decode" if all(q == 1 for q in qo_lens) else "prefill"
        return StepPlan(kind=kind, num_rows=num_rows, page_size=page_size, arrays=arrays)
    perm, inv = dfs_row_permutation(cascade_plan.order, qo_lens)
    levels: list[LevelPlan] = []
    for level in cascade_plan.levels[:-1]:
        arrays, rows = _compact_level(level, page_size)
        if arrays.num_requests == 0:
            continue
        check_paged_arrays(arrays, page_size)
        levels.append(LevelPlan(arrays=arrays, rows=rows, causal=False,
                                is_decode=bool((arrays.qo_indptr[1:] - arrays.qo_indptr[:-1] == 1).all())))
    private = cascade_plan.levels[-1]
    arrays = PagedArrays(*(private[name].to(_I32) for name in PagedArrays._fields))
    check_paged_arrays(arrays, page_size)
    if arrays.num_rows != num_rows:
        raise ValueError(f"cascade plan covers {arrays.num_rows} query rows, the step has {num_rows}")
    levels.append(LevelPlan(arrays=arrays, rows=None, causal=True, is_decode=all(q == 1 for q in qo_lens)))
    return StepPlan(kind="cascade", num_rows=num_rows, page_size=page_size, levels=levels, perm=perm, inv_perm=inv)


# -------------------------------------------------------------------------------- workspace sizing
def float_workspace_bytes(mib: float | None = None) -> int:
    """Size of the float workspace shared by all wrappers: ``mib``, else ``$OPENCOTI_FLASHINFER_WORKSPACE_MIB``,
    else 128 MiB; whole MiB in [16, 4096]."""
    source = "workspace_mib"
    if mib is None:
        env = os.environ.get(WORKSPACE_ENV)
        if env:
            source = WORKSPACE_ENV
            try:
                mib = float(env)
            except ValueError:
                raise ValueError(f"{WORKSPACE_ENV} must be a number of MiB, got {env!r}") from None
        else:
            mib = DEFAULT_WORKSPACE_MIB
    if not (MIN_WORKSPACE_MIB <= mib <= MAX_WORKSPACE_MIB):
        raise ValueError(f"{source} must be in [{MIN_WORKSPACE_MIB}, {MAX_WORKSPACE_MIB}] MiB, got {mib}")
    return int(-(-mib // 1)) * MIB


def workspace_device_bytes(float_bytes: int, num_wrappers: int) -> int:
    """Device memory the backend's workspaces take: the shared float buffer + one int buffer per wrapper."""
    return float_bytes + num_wrappers * INT_WORKSPACE_BYTES
