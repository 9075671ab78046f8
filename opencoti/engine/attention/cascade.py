"""Shared-prefix ("cascade") attention plan: read each shared KV range once per step.

Sequences attached to the same pool hold the same leading page ids (pages are shared by
refcount, never copied), so the sharing structure is exactly the trie of the batch's page
tables. Each trie node shared by >= 2 sequences becomes a *group*: all query rows of its
sequences attend to its pages in one batched call (the prefix KV is read once), each sequence
attends to its private remainder on its own, and the partial results are merged exactly with
their log-sum-exp. A session under a nested pool tree gets one partial per level.

Shared pages are always full pages strictly before every query position of the sequences
that share them (a shared prefix ends at a page boundary; the partial page is copied), so
group attention needs no mask.

The plan is also expressed in FlashInfer's multi-level cascade format (per level:
``qo_indptr``, ``kv_indptr``, ``kv_indices``, ``kv_last_page_len``) over the sequences
reordered by ``order`` (trie DFS order, so every group's query rows are contiguous); the last
level holds each sequence's private pages. A sequence with fewer shared levels than the
deepest gets an empty group (no pages, ``kv_last_page_len`` 0) at the levels it lacks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SharedGroup:
    seqs: list[int]  # entry indices in the batch (every row of each member sequence)
    page_start: int  # first page index (in each member's table) of the shared run
    pages: list[int]  # the shared page ids
    level: int


@dataclass
class CascadePlan:
    groups: list[SharedGroup]
    private_start: list[int]  # per entry: first page index of its private remainder (its sequence's)
    order: list[int]  # entries in trie DFS order (a sequence's rows together)
    num_levels: int
    levels: list[dict] = field(default_factory=list)  # FlashInfer format, one dict per level
    saved_tokens: int = 0  # KV token reads avoided per layer versus the plain backend


def _build_trie(tables: list[list[int]], seqs: list[int], depth: int, start: int, groups: list[SharedGroup],
                private_start: list[int], order: list[int], min_pages: int) -> None:
    """Split ``seqs`` (all sharing tables[...][:start]) by their next pages."""
    by_page: dict[int, list[int]] = {}
    for s in seqs:
        t = tables[s]
        if start < len(t):
            by_page.setdefault(t[start], []).append(s)
        else:
            private_start[s] = start
            order.append(s)
    for members in by_page.values():
        if len(members) == 1:
            private_start[members[0]] = start
            order.append(members[0])
            continue
        # longest common run of pages from `start` among the members
        end = start + 1
        while all(end < len(tables[s]) for s in members) and len({tables[s][end] for s in members}) == 1:
            end += 1
        # the last page of every table is private (it is being written); keep one page back
        end = min(end, min(len(tables[s]) - 1 for s in members))
        if end - start < min_pages:
            for s in members:
                private_start[s] = start
                order.append(s)
            continue
        groups.append(SharedGroup(seqs=list(members), page_start=start, pages=list(tables[members[0]][start:end]),
                                  level=depth))
        _build_trie(tables, members, depth + 1, end, groups, private_start, order, min_pages)


def build_cascade_plan(page_tables: list[list[int]], kv_lens: list[int], qo_lens: list[int], page_size: int,
                       min_shared_pages: int = 1, seq_of: list[int] | None = None) -> CascadePlan:
    """The plan over the batch's entries. ``seq_of`` (per entry, its sequence): entries of one sequence
    -- a speculative draft's rows, each a decode row over the same page table -- are planned as that
    sequence (its first entry's table, the shortest, decides what is shared), and all of them attend to
    the same shared runs; the spared reads count sequences, not rows. So a session's rows use
    shared-prefix attention exactly when its one-row decode steps would: alone, never."""
    n = len(page_tables)
    seq_of = list(range(n)) if seq_of is None else seq_of
    if len(seq_of) != n:
        raise ValueError(f"seq_of has {len(seq_of)} entries for {n} page tables")
    rows_of: dict[int, list[int]] = {}
    for i, s in enumerate(seq_of):
        rows_of.setdefault(s, []).append(i)
    firsts = [rows[0] for rows in rows_of.values()]
    groups: list[SharedGroup] = []
    private_start = [0] * n
    order: list[int] = []
    _build_trie(page_tables, firsts, 0, 0, groups, private_start, order, min_shared_pages)
    saved = sum((len(g.seqs) - 1) * len(g.pages) * page_size for g in groups)
    if len(firsts) < n:  # expand each sequence to its entries
        for g in groups:
            g.seqs = [i for f in g.seqs for i in rows_of[seq_of[f]]]
        for f in firsts:
            for i in rows_of[seq_of[f]]:
                private_start[i] = private_start[f]
        order = [i for f in order for i in rows_of[seq_of[f]]]
    num_levels = 1 + max((g.level + 1 for g in groups), default=0)
    plan = CascadePlan(groups=groups, private_start=private_start, order=order, num_levels=num_levels)
    plan.saved_tokens = saved
    plan.levels = _flashinfer_levels(plan, page_tables, kv_lens, qo_lens, page_size)
    return plan


def _flashinfer_levels(plan: CascadePlan, page_tables, kv_lens, qo_lens, page_size) -> list[dict]:
    """Per level, groups over the query tokens of the DFS-ordered sequences."""
    pos = {s: i for i, s in enumerate(plan.order)}
    cum = [0]
    for s in plan.order:
        cum.append(cum[-1] + qo_lens[s])
    per_seq: list[list[SharedGroup | None]] = [[None] * (plan.num_levels - 1) for _ in page_tables]
    for g in plan.groups:
        for s in g.seqs:
            per_seq[s][g.level] = g
    levels = []
    for lvl in range(plan.num_levels):
        qo, kv_indptr, kv_indices, last = [0], [0], [], []
        i = 0
        order = plan.order
        while i < len(order):
            s = order[i]
            shared = per_seq[s][lvl] if lvl < plan.num_levels - 1 else None
            if shared is not None:
                j = i
                while j < len(order) and per_seq[order[j]][lvl] is shared:
                    j += 1
                qo.append(cum[j])
                kv_indices.extend(shared.pages)
                kv_indptr.append(len(kv_indices))
                last.append(page_size)
                i = j
                continue
            if lvl < plan.num_levels - 1:  # no shared range at this level: empty group
                qo.append(cum[i + 1])
                kv_indptr.append(len(kv_indices))
                last.append(0)
            else:  # private remainder
                pages = page_tables[s][plan.private_start[s]:]
                qo.append(cum[i + 1])
                kv_indices.extend(pages)
                kv_indptr.append(len(kv_indices))
                last.append(kv_lens[s] - (len(page_tables[s]) - 1) * page_size)
            i += 1
        assert all(pos[plan.order[k]] == k for k in range(len(plan.order)))
        levels.append({
            "qo_indptr": torch.tensor(qo, dtype=torch.int32),
            "kv_indptr": torch.tensor(kv_indptr, dtype=torch.int32),
            "kv_indices": torch.tensor(kv_indices, dtype=torch.int32),
            "kv_last_page_len": torch.tensor(last, dtype=torch.int32),
        })
    return levels
