"""KV of a token range on disk: save a pool's own KV ``[D, L)`` from its pages, load it back.

File format (``<pool_id>.kv``): a 4 KiB-aligned header (magic, JSON: dtype, shape, the hash of the
pool's tokens, so a file never loads into another prefix, and the identity of what computed the KV:
model, weight format, KV dtype, so KV saved under ``--weights int4`` never loads into an fp32
engine) followed by K then V as
``[num_layers, n_tokens, num_kv_heads, head_dim]`` raw little-endian arrays (q8 pages: int8 with
``head_dim + 4`` bytes per vector, see ``attention/q8.py``). Written to a
temporary file, fsync'ed, then renamed: a reader sees a complete file or none. The header carries
a checksum (CRC-32, about 1 GB/s: a 90 MiB file adds ~0.1 s to its load) of everything after it;
loading reads the file, checks the checksum, and only then copies token rows into the pages: a file
whose bytes changed on disk (or that has no checksum) is never loaded, the KV is recomputed instead.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
import zlib
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .body_writer import BodySink, windows
from .files import HEADER, MAGIC, fsync_dir, read_header

log = logging.getLogger("opencoti.engine.persist")

CHECKSUM = "crc32"  # of the bytes after the header (K, V, the stored tokens)

# bf16 travels as raw 16-bit words; int8 is q8 pages (attention/q8.py: head_dim + 4 bytes per vector, its scale included)
_NP = {torch.float32: "<f4", torch.float16: "<f2", torch.bfloat16: "<i2", torch.int8: "|i1"}


def np_dtype(dtype: torch.dtype) -> str | None:
    """The numpy dtype a KV file stores pages of ``dtype`` as (None: not storable)."""
    return _NP.get(dtype)


def tokens_digest(tokens: Sequence[int]) -> str:
    return hashlib.blake2b(np.asarray(tokens, dtype="<u4").tobytes(), digest_size=16).hexdigest()


def _slots(page_table: Sequence[int], page_size: int, start: int, end: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(start, end)
    pages = torch.tensor(list(page_table), dtype=torch.long)[pos // page_size]
    return pages.to(device), (pos % page_size).to(device)


def snapshot_kv(kv, page_table: Sequence[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies (on the CPU) of the K and V of positions ``[start, end)``: ``[layers, n, H, D]`` each.
    Gathered a page at a time (a position at a time took ~2x as long: it runs on the step thread)."""
    ps = kv.page_size
    first, last = start // ps, (end + ps - 1) // ps
    idx = torch.tensor(list(page_table[first:last]), dtype=torch.long, device=kv.k_cache.device)
    out = []
    for c in (kv.k_cache, kv.v_cache):
        g = c.index_select(1, idx)  # [L, pages, ps, H, D]
        g = g.reshape(g.shape[0], -1, *g.shape[3:])[:, start - first * ps:end - first * ps]
        out.append(g.contiguous().cpu())
    return out[0], out[1]


def write_kv(path: str | os.PathLike, k: torch.Tensor, v: torch.Tensor, start: int, tokens: Sequence[int], *,
             extra: dict | None = None, store_tokens: bool = False, durable: bool = True,
             chunk_bytes: int | None = None, paced: Callable[[Callable[[], None]], None] | None = None,
             direct: bool = False, info: dict | None = None) -> int:
    """Write a snapshot (see ``snapshot_kv``) atomically; returns the bytes written. ``store_tokens``
    appends the token ids themselves (``read_tokens``); ``extra`` goes into the header. ``durable``:
    fsync the file and its directory (a cache that is verified by its checksum when read, like the
    disk tier's files, skips it: the rename alone makes a process crash leave a whole file or none).
    ``chunk_bytes`` / ``paced``: the body is checksummed and written a window at a time, each window's
    work run by ``paced(work)`` (the disk tier's pacing, ``pacer.StepPacer.run``); the header, which
    holds the checksum, is written last. ``direct``: write with ``O_DIRECT`` where the filesystem allows it (``body_writer``:
    the checksum and a copy into an aligned buffer are the paced work, the write runs beside the steps;
    ``info["direct"]`` says whether it did)."""
    path = Path(path)
    meta = {"dtype": str(k.dtype).replace("torch.", ""), "shape": list(k.shape), "start": start,
            "end": start + k.shape[1], "tokens": tokens_digest(tokens), **(extra or {})}
    if store_tokens:
        meta["n_tokens_stored"] = len(tokens)
    body = [(t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy() for t in (k, v)]
    if store_tokens:
        body.append(np.asarray(tokens, dtype="<u4"))
    if len(MAGIC) + len(json.dumps({**meta, "checksum": {CHECKSUM: "0" * 8}}).encode()) + 1 > HEADER:
        raise ValueError("KV file header too large")
    tmp = path.with_name(path.name + ".tmp")
    crc = 0
    parts = [memoryview(np.ascontiguousarray(part).reshape(-1).view(np.uint8)) for part in body]  # type: ignore[arg-type]  # numpy's stubs give ndarray __buffer__ only for Python >= 3.12
    step = chunk_bytes or max(1, sum(len(d) for d in parts))
    sink = BodySink(tmp, step, direct)
    run = paced or (lambda fn: fn())
    try:
        for window in windows(parts, step):
            def work(window=window) -> None:
                nonlocal crc
                for piece in window:
                    crc = zlib.crc32(piece, crc)
                    sink.put(piece)
            run(work)
            sink.send()  # (a direct file: the device writes the window beside the steps)
        meta["checksum"] = {CHECKSUM: f"{crc:08x}"}
        sink.finish((MAGIC + json.dumps(meta).encode() + b"\n").ljust(HEADER, b"\0"), durable)
        if info is not None:
            info["direct"] = sink.direct  # (False where the filesystem refused O_DIRECT)
    except BaseException:
        sink.close()
        tmp.unlink(missing_ok=True)  # (a full disk, a dropped segment: no half-written file stays)
        raise
    sink.close()
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)
    return HEADER + 2 * k.numel() * k.element_size() + (4 * len(tokens) if store_tokens else 0)


def read_tokens(path: str | os.PathLike, head: dict) -> list[int] | None:
    """The token ids stored after the KV (files written with ``store_tokens``)."""
    n = head.get("n_tokens_stored")
    if not isinstance(n, int) or n < 0:
        return None
    sizes: dict[Any, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}
    itemsize = sizes.get(head.get("dtype"), 0)
    shape = head.get("shape")
    if not itemsize or not isinstance(shape, list):
        return None
    offset = HEADER + 2 * int(np.prod(shape)) * itemsize
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            raw = f.read(4 * n)
    except OSError:
        return None
    if len(raw) != 4 * n:
        return None
    return np.frombuffer(raw, dtype="<u4").astype(np.int64).tolist()


def save_kv(path: str | os.PathLike, kv, page_table: Sequence[int], start: int, end: int,
            tokens: Sequence[int]) -> int:
    """Write the KV of positions ``[start, end)`` held in ``page_table``; returns the bytes written."""
    k, v = snapshot_kv(kv, page_table, start, end)
    return write_kv(path, k, v, start, tokens)


def saved_weight_formats(*dirs: str | os.PathLike) -> dict[str, int]:
    """How many complete KV files in ``dirs`` each weight format computed (from their headers): a
    restart that keeps using that format keeps the files loadable."""
    counts: dict[str, int] = {}
    for d in dirs:
        for f in Path(d).glob("*.kv") if Path(d).is_dir() else ():
            fmt = ((read_header(f) or {}).get("kv") or {}).get("weights")
            if isinstance(fmt, str):
                counts[fmt] = counts.get(fmt, 0) + 1
    return counts


def header_matches(head: dict | None, start: int, tokens: Sequence[int], identity: dict | None) -> bool:
    """Whether a header names KV of ``tokens`` from ``start`` computed by ``identity`` (a header
    without the identity asked for does not match: its KV may come from other weights)."""
    return mismatch(head, start, tokens, identity) is None


def mismatch(head: dict | None, start: int, tokens: Sequence[int], identity: dict | None) -> str | None:
    """Why a header does not name KV of ``tokens`` from ``start`` computed by ``identity`` (None: it
    does), in words for the log: the file's own pool id (when its header has one) tells a swapped
    or renamed file from KV computed by another model, weight format or KV dtype."""
    if head is None:
        return "its header is unreadable (not a KV file, or cut short)"
    owner = head.get("pool_id")
    of = f" (its header says it holds the KV of pool {owner}: the file was swapped or renamed)" \
        if isinstance(owner, int) else ""
    if head.get("start") != start:
        return f"it starts at position {head.get('start')!r}, the pool's own KV at {start}{of}"
    if head.get("tokens") != tokens_digest(tokens):
        return f"it holds the KV of other tokens than the pool's (another prefix){of}"
    if identity is not None and head.get("kv") != identity:
        given = head.get("kv")
        theirs = given if isinstance(given, dict) else {}
        diff = [f"{k} {theirs.get(k)!r} (this engine: {identity[k]!r})" for k in identity if theirs.get(k) != identity[k]]
        return "it was computed by " + (", ".join(diff) if diff else "an engine that did not record its identity")
    return None


def matches(path: str | os.PathLike, start: int, tokens: Sequence[int], identity: dict | None) -> bool:
    return header_matches(read_header(path), start, tokens, identity)


def load_kv(path: str | os.PathLike, kv, page_table: Sequence[int], start: int, end: int,
            tokens: Sequence[int], *, identity: dict | None = None) -> bool:
    """Copy the saved KV of ``[start, end)`` into ``page_table``'s slots. False (and nothing
    written) when the file is missing or does not match (other tokens, dtype or shape, or - when
    ``identity`` is given - another model, weight format or KV dtype)."""
    head = read_header(path)
    dtype = _NP.get(kv.dtype)
    shape = [kv.num_layers, end - start, kv.num_kv_heads, kv.k_cache.shape[-1]]
    if (head is None or not header_matches(head, start, tokens, identity) or dtype is None or head.get("shape") != shape
            or head.get("dtype") != str(kv.dtype).replace("torch.", "")):
        return False
    count = int(np.prod(shape))
    data, problem = _checked_body(path, head)
    if problem is None and len(data) < 2 * count * np.dtype(dtype).itemsize:
        problem = "shorter than its header says"
    if problem is not None:
        log.warning("KV file %s not loaded: %s; the KV is recomputed", path, problem)
        return False
    arr = np.frombuffer(data, dtype=dtype, count=2 * count).reshape(2, *shape)
    pages, slots = _slots(page_table, kv.page_size, start, end, kv.k_cache.device)
    for i, cache in enumerate((kv.k_cache, kv.v_cache)):
        src = torch.from_numpy(arr[i])
        if kv.dtype == torch.bfloat16:
            src = src.view(torch.bfloat16)
        cache[:, pages, slots] = src.to(cache.device, non_blocking=False)
    return True


def read_checked(path: str | os.PathLike, identity: dict | None, tokens: Sequence[int]) -> tuple[dict, np.ndarray] | str:
    """The header and body of a KV file holding ``tokens`` computed by ``identity``, read once and
    checked against its checksum; or, in words for the log, why it cannot be used (missing, cut
    short, corrupt, another prefix or another engine)."""
    head = read_header(path)
    if head is None:
        return "it is missing or has no readable header" if not os.path.exists(path) else \
            "its header is unreadable (not a KV file, or cut short)"
    first = head.get("start")
    why = mismatch(head, first, tokens, identity) if isinstance(first, int) else "no start"
    if why is not None:
        return why
    data, problem = _checked_body(path, head)
    return problem if problem is not None else (head, data)


_READ_CHUNK = 4 << 20  # bytes a read call asks for
_READ_SPLIT = 8 << 20  # a body at least twice this size is read by two threads, one half each


def _read_body(path: str | os.PathLike, offset: int, size: int) -> np.ndarray | None:
    """``size`` bytes of ``path`` from ``offset`` into a new (uninitialized: no zero-fill pass)
    writable buffer, in chunks; a large body by two threads, each one half (one reader leaves the
    disk idle between its requests: two read a 128 MiB body from a cold page cache in ~0.6x the
    time here). None when the file ends before ``size`` bytes (it changed while it was read)."""
    data = np.empty(size, dtype=np.uint8)
    view = memoryview(data)  # type: ignore[arg-type]  # numpy's stubs give ndarray __buffer__ only for Python >= 3.12
    short = []

    def read(lo: int, hi: int) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            at = lo
            while at < hi:
                got = os.preadv(fd, [view[at:min(hi, at + _READ_CHUNK)]], offset + at)
                if got <= 0:
                    short.append(at)
                    return
                at += got
        finally:
            os.close(fd)

    if size >= 2 * _READ_SPLIT:
        half = size // 2 // 4096 * 4096
        other = threading.Thread(target=read, args=(half, size), name="opencoti-kv-read", daemon=True)
        other.start()
        read(0, half)
        other.join()
    else:
        read(0, size)
    return None if short else data


def _checked_body(path: str | os.PathLike, head: dict | None) -> tuple[np.ndarray, str | None]:
    """The bytes after the header and the problem with them (None: they match the checksum)."""
    empty = np.empty(0, dtype=np.uint8)
    want = (head or {}).get("checksum")
    if not isinstance(want, dict) or not isinstance(want.get(CHECKSUM), str):
        return empty, "it has no checksum (written by an older version)"
    try:
        data = _read_body(path, HEADER, max(0, os.stat(path).st_size - HEADER))  # writable: from_numpy needs no copy
    except OSError as e:
        return empty, f"cannot read it: {e}"
    if data is None:
        return empty, "it changed while it was read"
    if f"{zlib.crc32(data):08x}" != want[CHECKSUM]:  # type: ignore[arg-type]  # numpy's stubs give ndarray __buffer__ only for Python >= 3.12
        return data, "its checksum does not match its content (the file is corrupt)"
    return data, None


def verify(path: str | os.PathLike) -> str | None:
    """What is wrong with a KV file (no header, no checksum, another checksum), or None when its
    content is what was written. A file that does not exist is not checked (None)."""
    if not os.path.exists(path):
        return None
    head = read_header(path)
    if head is None:
        return "no readable header"
    return _checked_body(path, head)[1]


class KvWriter:
    """Writes and removes KV files on its own thread, in the order asked (the step thread only
    takes the snapshot, a memory copy)."""

    def __init__(self):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.errors = 0

    def _put(self, item) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="opencoti-kv-writer", daemon=True)
            self._thread.start()
        self._q.put(item)

    def save(self, path: Path, k: torch.Tensor, v: torch.Tensor, start: int, tokens: Sequence[int],
             identity: dict | None = None, extra: dict | None = None) -> None:
        """Write the file (``identity``: the header's ``kv``; ``extra``: more header fields)."""
        head = {**(extra or {}), **({} if identity is None else {"kv": identity})}
        self._put(("save", path, k, v, start, list(tokens), head))

    def drop(self, path: Path) -> None:
        self._put(("drop", path))

    def flush(self) -> None:
        """Wait until everything asked so far is on disk."""
        if self._thread is not None:
            done = threading.Event()
            self._q.put(("flush", done))
            done.wait()

    def close(self) -> None:
        if self._thread is not None:
            self._q.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            try:
                if item[0] == "save":
                    write_kv(*item[1:6], extra=item[6] or None)
                elif item[0] == "drop":
                    item[1].unlink(missing_ok=True)
                else:
                    item[1].set()
            except OSError as e:
                self.errors += 1
                log.warning("KV file %s: %s", item[1], e)
