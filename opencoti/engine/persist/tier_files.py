"""The disk tier's files (``tier.py``): a ``Segment`` (one file: consecutive pages of one chain, its
state from queued to written, failed or dropped, and what a prefetch read of it) and the reading of a
segment's file, checked against the engine's identity, its tokens, the pages' layout and its checksum.
The reader thread calls ``read_segment`` with the layout (``kv_layout``), never touching the pages;
the I/O thread ``write_segment``, a window at a time through the step pacer (``pacer.py``), with
``O_DIRECT`` where the filesystem allows it (``body_writer.py``). And the tier's disk budget
(``tier_budget_mib``).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from . import kvfile
from .pacer import StepPacer

PENDING, WRITTEN, FAILED, DROPPED = "pending", "written", "failed", "dropped"


class Segment:
    """One file: ``n`` consecutive pages of one chain."""

    __slots__ = ("name", "keys", "tokens", "start", "parent_key", "nbytes", "k", "v", "state", "reading", "loaded",
                 "load_error", "tail", "bufs", "ahead")

    def __init__(self, name: str, keys: list[bytes], tokens: list[int], start: int, parent_key: bytes,
                 nbytes: int, k: torch.Tensor, v: torch.Tensor, tail: bool = False):
        self.name, self.keys, self.tokens, self.start, self.parent_key = name, keys, tokens, start, parent_key
        self.nbytes = nbytes
        self.k: torch.Tensor | None = k  # [L, n, ps, H, D] until written (then read from the file)
        self.v: torch.Tensor | None = v
        self.state = PENDING
        self.reading = False  # a prefetch of it is in flight (the reader thread)
        self.loaded: tuple[torch.Tensor, torch.Tensor] | None = None  # what the prefetch read (checked)
        self.load_error: str | None = None  # why the prefetch could not use it
        self.tail = tail  # one partial last page (valid for its tokens), not full pages
        self.bufs: tuple | None = None  # the staging buffers behind k and v (given back once written)
        self.ahead = False  # written ahead: a copy of pages still in RAM (until a reclaim takes them)


def kv_layout(kv) -> tuple:
    """What reading a segment needs of the KV pages (the reader thread never touches them)."""
    return kv.num_layers, kv.page_size, kv.num_kv_heads, kv.k_cache.shape[-1], kv.dtype


def read_segment(path: Path, seg: Segment, identity: dict | None, layout: tuple
                  ) -> tuple[torch.Tensor, torch.Tensor] | str:
    """A segment file's K and V (``[L, n, ps, H, D]`` each; a tail's ``[L, 1, len(tokens), H, D]``),
    checked (identity, tokens, layout, checksum); or why it cannot be used."""
    layers, ps, heads, width, dtype_t = layout
    got = kvfile.read_checked(path, identity, seg.tokens)
    n = len(seg.keys)
    per_page = len(seg.tokens) if seg.tail else ps
    shape = [layers, n * per_page, heads, width]
    dtype = kvfile.np_dtype(dtype_t)
    if isinstance(got, str):
        return got
    head, body = got
    if head.get("shape") != shape or head.get("start") != seg.start or dtype is None \
            or head.get("dtype") != str(dtype_t).replace("torch.", ""):
        return "its header names another layout (shape, dtype or position)"
    count = int(np.prod(shape))
    if len(body) < 2 * count * np.dtype(dtype).itemsize:
        return "shorter than its header says"
    arr = torch.from_numpy(np.frombuffer(body, dtype=dtype, count=2 * count).reshape(2, *shape))
    if dtype_t == torch.bfloat16:
        arr = arr.view(torch.bfloat16)
    arr = arr.view(2, layers, n, per_page, heads, width)
    return arr[0], arr[1]


class _Dropped(Exception):
    """The segment was dropped (evicted, the tier closed) while its file was being written."""


def write_segment(path: Path, seg: Segment, identity: dict | None, pacer: StepPacer) -> bool:
    """Write a segment's file (the I/O thread): its K and V, tokens, position and where it hangs, a chunk
    a turn of ``pacer`` (between the engine's steps). A segment dropped meanwhile stops at its next chunk,
    its temporary file removed: its turns go to the segments still wanted. True: written with ``O_DIRECT``."""
    assert seg.k is not None and seg.v is not None
    L, n, ps, H, D = seg.k.shape  # (a tail: ps is its slots)
    where = {"parent_key": seg.parent_key.hex(), "pages": n, "page_size": ps}
    if seg.tail:
        where = {"parent_key": seg.parent_key.hex(), "tail": True, "slots": ps}

    def paced(work) -> None:
        if seg.state != PENDING:
            raise _Dropped
        pacer.run(work)

    info: dict = {}
    try:
        kvfile.write_kv(path, seg.k.reshape(L, n * ps, H, D), seg.v.reshape(L, n * ps, H, D), seg.start,
                        seg.tokens, store_tokens=True, durable=False, extra={"kv": identity, "tier": where},
                        chunk_bytes=pacer.chunk_bytes, paced=paced, direct=True,
                        info=info)
    except _Dropped:
        path.with_name(path.name + ".tmp").unlink(missing_ok=True)
    return bool(info.get("direct"))


DEFAULT_KV_DISK_BUDGET_MIB = 4096.0  # ~180k tokens of the bundled model's fp16 KV, ~130k of a 1B model's


def tier_budget_mib(config, directory: Path) -> float:
    """The tier's disk budget: ``kv_disk_budget_mib``, or (None) the default capped at half the
    space free on ``directory``'s disk now, so the tier never fills a disk others write to."""
    if config.kv_disk_budget_mib is not None:
        return float(config.kv_disk_budget_mib)
    try:
        st = os.statvfs(directory)
        free_mib = st.f_bavail * st.f_frsize / 2**20
    except (OSError, AttributeError):
        return DEFAULT_KV_DISK_BUDGET_MIB
    return min(DEFAULT_KV_DISK_BUDGET_MIB, free_mib / 2)
