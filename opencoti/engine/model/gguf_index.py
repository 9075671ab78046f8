"""What the engine reads from a GGUF file: the architecture and each tensor's name, type, shape and
bytes (memory-mapped, not copied).

gguf-py's ``GGUFReader`` builds numpy views for every item of every metadata array; on the bundled
model (a 49152-token vocabulary and 48900 merges) that took 9.2 s of the 11.8 s an int4 engine
needed to prepare its weights (cProfile: ``_build_fields`` -> ``memmap.__array_finalize__``). This
reads the header with ``struct`` and steps over the arrays it does not need (~0.1 s).
"""

from __future__ import annotations

import hashlib
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_MAGIC = b"GGUF"
# GGUF metadata value types (gguf.constants.GGUFValueType): struct formats of the scalars
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]   # GGUF order: shape[0] is the length of a row
    type_name: str           # ggml type, e.g. "Q4_1", "F32"
    data: np.ndarray         # its bytes (uint8, read-only view of the file)
    offset: int = 0          # of its first byte in the file


class GGUFIndex:
    """The header of a GGUF file: ``metadata`` (scalars and strings; arrays are skipped), ``tensors``
    and ``tokenizer_digest`` (a hash of every ``tokenizer.*`` key and value as stored: files that share
    a tokenizer share it). Raises ``ValueError`` on a file that is not a little-endian GGUF v2/v3 file."""

    def __init__(self, path: str | Path):
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        with open(path, "rb") as f:
            try:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as exc:  # an empty file
                raise ValueError("not a GGUF file (empty)") from exc
        self._off = 0
        if self._take(4) != _MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        version = self._scalar("<I")
        if version & 0xFFFF == 0:
            raise ValueError("big-endian GGUF files are not supported")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = self._scalar("<Q"), self._scalar("<Q")
        self.metadata: dict[str, int | float | bool | str] = {}
        tokenizer = hashlib.sha256()
        for _ in range(n_kv):
            at = self._off
            key = self._string()
            vtype = self._scalar("<I")
            value = self._value(vtype)
            if key.startswith("tokenizer."):  # the tokenizer's keys and values, as stored
                tokenizer.update(self._mm[at:self._off])
            if value is not None:
                self.metadata[key] = value
        self.tokenizer_digest = tokenizer.hexdigest()[:16]
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._scalar("<I")
            dims = tuple(self._scalar("<Q") for _ in range(n_dims))
            infos.append((name, dims, self._scalar("<I"), self._scalar("<Q")))
        align = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        if align <= 0 or align & (align - 1):
            raise ValueError(f"invalid general.alignment {align}: must be a power of two")
        start = -(-self._off // align) * align
        self.tensors: list[GGUFTensor] = []
        for name, dims, gtype, offset in infos:
            try:
                qtype = GGMLQuantizationType(gtype)
            except ValueError as exc:
                raise ValueError(f"tensor {name!r} has an unknown ggml type {gtype}") from exc
            block, size = GGML_QUANT_SIZES[qtype]
            n = math.prod(dims)
            nbytes = n // block * size
            at = start + offset
            if at + nbytes > len(self._mm):
                raise ValueError(f"tensor {name!r} runs past the end of the file (truncated?)")
            data = np.frombuffer(self._mm, dtype=np.uint8, count=nbytes, offset=at)
            self.tensors.append(GGUFTensor(name, dims, qtype.name, data, at))

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ValueError("the file has no general.architecture")
        return arch

    # ------------------------------------------------------------------ header parsing
    def _take(self, n: int) -> bytes:
        if self._off + n > len(self._mm):
            raise ValueError("the GGUF header ends early (truncated file?)")
        b = self._mm[self._off:self._off + n]
        self._off += n
        return b

    def _scalar(self, fmt: str):
        size = struct.calcsize(fmt)
        if self._off + size > len(self._mm):
            raise ValueError("the GGUF header ends early (truncated file?)")
        (v,) = struct.unpack_from(fmt, self._mm, self._off)
        self._off += size
        return v

    def _string(self) -> str:
        return self._take(self._scalar("<Q")).decode("utf-8", errors="replace")

    def _value(self, vtype: int):
        if vtype in _SCALARS:
            return self._scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self._string()
        if vtype != _ARRAY:
            raise ValueError(f"unknown GGUF metadata value type {vtype}")
        etype, count = self._scalar("<I"), self._scalar("<Q")
        if etype in _SCALARS:  # stepped over: nothing the engine reads is an array
            self._off += count * struct.calcsize(_SCALARS[etype])
            if self._off > len(self._mm):
                raise ValueError("the GGUF header ends early (truncated file?)")
        elif etype == _STRING:  # the vocabulary, the merges: lengths only
            mm, off, unpack = self._mm, self._off, struct.Struct("<Q").unpack_from
            try:
                for _ in range(count):
                    off += 8 + unpack(mm, off)[0]
            except struct.error:
                off = len(mm) + 1
            if off > len(mm):
                raise ValueError("the GGUF header ends early (truncated file?)")
            self._off = off
        else:
            for _ in range(count):
                self._value(etype)
        return None
