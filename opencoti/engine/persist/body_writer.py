"""How a KV file's bytes reach the disk: a window at a time, each checksummed inside the pacer's turn, and -
for the disk tier - with ``O_DIRECT`` where the filesystem allows it.

Why ``O_DIRECT``. A buffered write is the kernel copying the bytes into the page cache on the writing
thread's CPU, and on a CPU the engine's step uses every core: measured on a 2-core AMD EPYC while one
session decoded (``benchmarks/results/*/tier48_share/interference_direct.py``), steps overlapping a buffered
90 MiB write were ~9x a quiet step, steps overlapping the same bytes written with ``O_DIRECT`` (256 KiB
at a time, the device copying them) ~1.2x. So with a direct file only the checksum and the copy into an
aligned staging buffer take the pacer's turn; the write itself runs beside the steps.

The file is the same byte for byte either way: the body goes in ``ALIGN``-multiple windows at
``HEADER`` (itself a multiple), the last window padded with zeros and the file then cut to its size,
the header written last at offset 0. A filesystem that refuses ``O_DIRECT`` (``EINVAL`` on open or on a
write: tmpfs on older kernels, some network filesystems) gets the rest of the file written buffered.
"""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path
from typing import Iterator

from .files import HEADER

ALIGN = 4096  # bytes: a direct write's offset, length and buffer address are multiples of this
O_DIRECT = getattr(os, "O_DIRECT", 0)  # (0: the platform has none; every file is written buffered)


def windows(parts: list[memoryview], step: int) -> Iterator[list[memoryview]]:
    """The parts' bytes, one part after another, in windows of ``step`` bytes (the last one shorter),
    each as the pieces of the parts it spans."""
    cur: list[memoryview] = []
    room = step
    for data in parts:
        at = 0
        while at < len(data):
            n = min(room, len(data) - at)
            cur.append(data[at:at + n])
            at += n
            room -= n
            if room == 0:
                yield cur
                cur, room = [], step
    if cur:
        yield cur


class BodySink:
    """Writes a KV file's body from offset ``HEADER``, then its header at 0. ``put`` takes a window's
    pieces (the pacer's work: on the step thread between steps). A direct file copies them into an
    aligned buffer there and ``send`` writes the full window on the I/O thread, beside the steps. A
    buffered file (a file written at once, or a filesystem that refuses ``O_DIRECT``) is written by
    ``put`` itself: its copy into the page cache then takes the pacer's turn, as measured best for
    buffered writes (a kernel copy beside a step slows it several times), though a disk that throttles
    buffered writes can then hold that step."""

    def __init__(self, path: Path, step: int, direct: bool):
        self.path = path
        self.direct = bool(direct and O_DIRECT and step % ALIGN == 0 and step > 0)
        self.fd = -1
        if self.direct:
            try:
                self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_DIRECT, 0o644)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.direct = False
        if not self.direct:
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.step = step
        self.buf: mmap.mmap | None = None
        self.view: memoryview | None = None
        if self.direct:
            try:  # page-aligned; room for a window padded to ALIGN and for the header
                self.buf = mmap.mmap(-1, -(-max(step, HEADER) // ALIGN) * ALIGN)
            except BaseException:
                os.close(self.fd)
                raise
            self.view = memoryview(self.buf)
        self.fill = 0  # bytes staged
        self.at = HEADER  # the file offset of the staged bytes (or of the next buffered write)

    def put(self, piece: memoryview) -> None:
        if self.view is None:
            self._pwrite(piece, self.at)
            self.at += len(piece)
            return
        self.view[self.fill:self.fill + len(piece)] = piece
        self.fill += len(piece)

    def send(self) -> None:
        """Write the staged window if it is full (direct files)."""
        if self.view is not None and self.fill >= self.step:
            self._pwrite(self.view[:self.fill], self.at)
            self.at += self.fill
            self.fill = 0

    def finish(self, header: bytes, durable: bool) -> None:
        """The last window (padded to ``ALIGN``, the file cut to its size after), then the header."""
        if self.view is not None:
            size = self.at + self.fill
            if self.fill:
                padded = -(-self.fill // ALIGN) * ALIGN
                self.view[self.fill:padded] = bytes(padded - self.fill)
                self._pwrite(self.view[:padded], self.at)
                os.ftruncate(self.fd, size)
            self.view[:HEADER] = header
            self._pwrite(self.view[:HEADER], 0)
        else:
            self._pwrite(memoryview(header), 0)
        if durable:
            os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.view is not None:
            self.view.release()
            self.view = None
        if self.buf is not None:
            try:
                self.buf.close()
            except BufferError:  # a slice of it is still held (an error's traceback): freed with it
                pass
            self.buf = None

    def _pwrite(self, data: memoryview, offset: int) -> None:
        while len(data):
            try:
                n = os.pwrite(self.fd, data, offset)
            except OSError as e:
                if not (self.direct and e.errno == errno.EINVAL):
                    raise
                self._go_buffered()  # the filesystem took the open but not the write
                continue
            if n <= 0:
                raise OSError(errno.EIO, f"{self.path}: a write wrote nothing")
            data, offset = data[n:], offset + n

    def _go_buffered(self) -> None:
        fd = os.open(self.path, os.O_WRONLY)
        os.close(self.fd)
        self.fd, self.direct = fd, False
