"""Attention metadata in FlashInfer's paged format.

One step computes ``T`` new tokens for ``B`` sequences. Sequence ``i`` contributes
``qo_lens[i]`` new query tokens (rows ``qo_indptr[i]:qo_indptr[i+1]`` of the flat batch) and
attends to ``kv_lens[i]`` tokens (its cached prefix plus the new ones) stored in the pages
``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``; the last page holds ``kv_last_page_len[i]`` tokens
(1 <= last_page_len <= page_size, as FlashInfer requires). Both backends consume this.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass
class SeqBatchEntry:
    """One sequence's share of a step: its page table and which token range it computes."""

    page_table: Sequence[int]
    num_cached: int  # tokens whose KV is already in cache (positions [0, num_cached))
    num_new: int  # tokens computed this step (positions [num_cached, num_cached + num_new))
    # another row of the previous entry's sequence (a speculative draft's rows: one decode row per
    # position over the same page table); shared-prefix planning treats them as one sequence
    same_seq: bool = False


@dataclass
class AttentionMetadata:
    page_size: int
    qo_indptr: torch.Tensor  # [B+1] int32
    kv_indptr: torch.Tensor  # [B+1] int32
    kv_indices: torch.Tensor  # [nnz_pages] int32
    kv_last_page_len: torch.Tensor  # [B] int32
    positions: torch.Tensor  # [T] int64, RoPE position of each new token
    slot_mapping: torch.Tensor  # [T] int64, page_id * page_size + offset where each new K/V goes
    qo_lens: list[int]
    kv_lens: list[int]
    page_tables: list[list[int]]  # per sequence, the pages covering [0, kv_len)
    seq_of: list[int] = field(default_factory=list)  # per entry, its sequence (entries marked same_seq share one)
    backend_state: dict = field(default_factory=dict)  # per-step plan cached by the backend
    cascade: object = None  # CascadePlan when this step uses shared-prefix attention

    @property
    def num_seqs(self) -> int:
        return len(self.qo_lens)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.qo_lens))


def build_metadata(entries: Sequence[SeqBatchEntry], page_size: int, device: torch.device | str = "cpu") -> AttentionMetadata:
    """Build the step's metadata. Each page table must cover ``num_cached + num_new`` tokens."""
    qo_lens: list[int] = []
    kv_lens: list[int] = []
    tables: list[list[int]] = []
    qo_indptr, kv_indptr, kv_indices, last_len = [0], [0], [], []
    positions: list[int] = []
    slots: list[int] = []
    seq_of: list[int] = []
    for i, e in enumerate(entries):
        if e.same_seq:  # the next decode row of the previous entry's sequence, over the same table
            prev = entries[i - 1] if i > 0 else None
            if (prev is None or e.num_new != 1 or e.num_cached != prev.num_cached + prev.num_new
                    or list(e.page_table[:len(tables[-1])]) != tables[-1]):
                raise ValueError("a same_seq entry must be the next decode row (one token, right after the "
                                 "previous entry's, over a page table that extends it) of the previous entry")
        seq_of.append(seq_of[-1] if e.same_seq else (seq_of[-1] + 1 if seq_of else 0))
        kv_len = e.num_cached + e.num_new
        n_pages = -(-kv_len // page_size)
        if e.num_new < 1:
            raise ValueError("each sequence in a step computes at least one token")
        if len(e.page_table) < n_pages:
            raise ValueError(f"page table covers {len(e.page_table) * page_size} tokens, need {kv_len}")
        table = list(e.page_table[:n_pages])
        qo_lens.append(e.num_new)
        kv_lens.append(kv_len)
        tables.append(table)
        qo_indptr.append(qo_indptr[-1] + e.num_new)
        kv_indptr.append(kv_indptr[-1] + n_pages)
        kv_indices.extend(table)
        last_len.append(kv_len - (n_pages - 1) * page_size)
        for pos in range(e.num_cached, kv_len):
            positions.append(pos)
            slots.append(table[pos // page_size] * page_size + pos % page_size)
    i32, i64 = torch.int32, torch.int64
    return AttentionMetadata(
        page_size=page_size,
        qo_indptr=torch.tensor(qo_indptr, dtype=i32, device=device),
        kv_indptr=torch.tensor(kv_indptr, dtype=i32, device=device),
        kv_indices=torch.tensor(kv_indices, dtype=i32, device=device),
        kv_last_page_len=torch.tensor(last_len, dtype=i32, device=device),
        positions=torch.tensor(positions, dtype=i64, device=device),
        slot_mapping=torch.tensor(slots, dtype=i64, device=device),
        qo_lens=qo_lens,
        kv_lens=kv_lens,
        page_tables=tables,
        seq_of=seq_of,
    )
