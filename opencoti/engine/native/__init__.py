"""Native CPU kernels (``kernels.cpp``): int4 / int8 weight-only projections, paged decode attention and
the shared part of cascade (shared-prefix) attention over fp32, fp16, bf16 or q8 (int8 + a scale per
vector) KV pages.

The C++ source ships with the package and is compiled on first use by the machine's C++ compiler
(``g++``/``c++``, ``-O3 -march=native -fopenmp``: the build is specific to this CPU) into the cache
directory, keyed by a hash of the source, the flags, the compiler and the CPU's model and flags; later
loads reuse it (``scripts/setup.sh`` builds it once at set-up). It is called through ``ctypes``
(the GIL is released for the call) with the thread count torch uses at that moment; the library links
the OpenMP runtime torch already loaded, so both share one pool of threads.

Nothing depends on it: when there is no compiler, the build fails, or ``OPENCOTI_NATIVE=0``,
:func:`lib` returns None and the engine uses torch's kernels (the reason is in :func:`status`).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger("opencoti.engine")

SOURCE = Path(__file__).with_name("kernels.cpp")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-fno-math-errno"]
ABI_VERSION = 9

_lock = threading.Lock()
_state: dict = {"lib": None, "tried": False, "reason": "not built yet", "path": None}

_P, _I64, _F, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


class OcProj(ctypes.Structure):
    """One projection's weights for the fused decode layer (``OcProj`` in kernels.cpp)."""

    _fields_ = [("kind", ctypes.c_int64), ("w", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64)]


_SIGNATURES = {
    "oc_abi_version": ([], _INT),
    "oc_simd": ([], _INT),
    "oc_gemm_min_rows": ([_I64, _I64, _P, _P], None),
    "oc_act_rows": ([_I64, _I64, _P, _P], None),
    "oc_i16_rows": ([_I64, _P], None),
    "oc_q4_matmul": ([_P, _I64, _I64, _P, _I64, _P, _P, _INT], None),
    "oc_q8_matmul": ([_P, _I64, _I64, _P, _P, _I64, _P, _P, _INT], None),
    "oc_paged_decode": ([_P, _P, _I64, _I64, _I64, _I64, _P, _P, _P, _I64, _P, _I64, _F, _P, _P, _INT, _INT], None),
    "oc_cascade_groups": ([_P, _I64, _I64, _I64, _P, _P, _I64, _I64, _P, _P, _P, _P, _F, _P, _P, _INT, _INT], None),
    "oc_kv_store": ([_INT, _P, _P, _I64, _I64], None),
    "oc_q8_dequant": ([_P, _I64, _I64, _P, _INT], None),
    "oc_decode_layer": ([_P, _I64, _I64, _P, _P, _F, _P, _P, _P, _P, _P, _P, _P, _P, _I64, _P, _I64, _I64, _I64,
                         _I64, _F, _INT, _INT], None),
    "oc_decode_layer_cascade": ([_P, _I64, _I64, _P, _P, _F, _P, _P, _P, _P, _P, _P, _P, _P, _I64, _P, _I64, _I64,
                                 _I64, _I64, _F, _INT, _INT, _I64, _P, _P, _P, _P], None),
}


# The KV cache element types the attention kernels read and write (``KvType`` in kernels.cpp).
KV_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3}  # int8: q8 pages (kv/q8.py)


def kv_type(dtype: torch.dtype) -> int | None:
    """The kernels' code for a KV cache of ``dtype``; None when they cannot read it."""
    return KV_TYPES.get(dtype)


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_signature() -> str:
    model = flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = line.split(":", 1)[1].strip()
                if model and flags:
                    break
    except OSError:
        pass
    return f"{platform.machine()} {model} {flags}"


def _build_dir() -> Path:
    from ..model.loader import cache_root

    return cache_root() / "native"


def _key(cxx: str, flags: list[str] | None = None) -> str:
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = "?"
    h = hashlib.sha256(SOURCE.read_bytes())
    for part in (" ".join(flags or FLAGS), version, _cpu_signature(), str(ABI_VERSION)):
        h.update(part.encode())
    return ("x" if flags and flags != FLAGS else "") + h.hexdigest()[:16]


def build(extra_flags: tuple[str, ...] = (), out_dir: Path | None = None) -> Path:
    """Compile the library for this machine (or find it already built); raises RuntimeError if it can't.

    ``extra_flags`` (e.g. ``-mno-avx2 -mno-fma``: the portable scalar code, which the tests build
    too) become part of the file's key. A new build of the default flags removes the older builds
    it replaces (another source, compiler or CPU) from the cache folder."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++/c++/clang++) on PATH: install one (Debian/Ubuntu: "
                           "apt-get install g++) for the native int4/int8 kernels")
    flags = [*FLAGS, *extra_flags]
    out_dir = out_dir or _build_dir()
    out = out_dir / f"opencoti_kernels-{_key(cxx, flags)}.so"
    if out.exists():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    log.info("building the native CPU kernels for this machine (once; a few seconds) ...")
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *flags, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, out)  # atomic: a concurrent loader sees the whole file or none
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    if not extra_flags:
        _remove_stale(out)
    return out


def _remove_stale(current: Path) -> None:
    """Older default builds next to ``current`` (a process that still maps one keeps its pages)."""
    for old in current.parent.glob("opencoti_kernels-*.so"):
        if old != current and not old.name.startswith("opencoti_kernels-x"):
            try:
                old.unlink()
            except OSError:
                pass


def openmp_runtimes() -> list[str]:
    """The OpenMP runtime files mapped into this process (libgomp / libiomp / libomp)."""
    found = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                path = line.rsplit(" ", 1)[-1].strip()
                name = os.path.basename(path)
                if name.startswith(("libgomp", "libiomp", "libomp")) and path not in found:
                    found.append(path)
    except OSError:
        pass
    return found


def _check_openmp(before: list[str]) -> None:
    """The library must share torch's OpenMP runtime: two runtimes in one process each keep a pool of
    spinning threads on the same cores (and libgomp and libiomp disagree on thread counts)."""
    after = openmp_runtimes()
    new = [p for p in after if p not in before]
    if before and new:
        raise RuntimeError(f"the kernels loaded another OpenMP runtime ({', '.join(new)}) than torch's "
                           f"({', '.join(before)})")


def load(path: Path) -> ctypes.CDLL:
    """A built library, its functions typed (e.g. one built with :func:`build`'s ``extra_flags``)."""
    return _load(path)


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, (args, res) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    if lib.oc_abi_version() != ABI_VERSION:
        raise RuntimeError(f"library ABI {lib.oc_abi_version()} != {ABI_VERSION}")
    return lib


def lib() -> ctypes.CDLL | None:
    """The loaded library, building it on first use; None when unavailable (see :func:`status`)."""
    if _state["tried"]:
        return _state["lib"]
    with _lock:
        if not _state["tried"]:
            if os.environ.get("OPENCOTI_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
                _state["reason"] = "disabled by OPENCOTI_NATIVE=0"
            else:
                try:
                    path = build()
                    before = openmp_runtimes()
                    loaded = _load(path)
                    _check_openmp(before)
                    _state["lib"], _state["path"] = loaded, str(path)
                    _state["reason"] = "ok" if _state["lib"].oc_simd() else "ok (no AVX2/FMA/F16C: scalar code)"
                except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
                    _state["reason"] = f"unavailable: {e}"
                    log.warning("native kernels unavailable (%s): the int4 and int8 weight formats run torch's "
                                "kernels, several times slower on CPU", e)
            _state["tried"] = True
    return _state["lib"]


def status() -> dict:
    lib()
    return {"available": _state["lib"] is not None, "reason": _state["reason"], "path": _state["path"]}


def build_id() -> str | None:
    """Identifies the built library (source, flags, compiler, CPU): kernel timings depend on it."""
    lib()
    return Path(_state["path"]).stem.rsplit("-", 1)[-1] if _state["path"] else None


def threads() -> int:
    return max(1, torch.get_num_threads())


def gemm_min_rows(q4: int | None = None, q8: int | None = None) -> tuple[int, int]:
    """The row counts from which the int4 / int8 projections fill fp32 panels instead of running the
    row kernels (None: unchanged); returns the ones before. The library's defaults are measured (see
    kernels.cpp); tests and A/B timings set them."""
    lb = lib()
    if lb is None:
        raise RuntimeError(f"native kernels {status()['reason']}")
    a, b = ctypes.c_int64(), ctypes.c_int64()
    lb.oc_gemm_min_rows(q4 or 0, q8 or 0, ctypes.byref(a), ctypes.byref(b))
    return a.value, b.value


def act_rows(q4: int | None = None, q8: int | None = None) -> tuple[int, int]:
    """The largest row counts for which the int4 / int8 projections quantize the activations to int8
    per block of 32 (llama.cpp's Q8 blocks) and use integer dot products (None: unchanged; 0: off);
    returns the ones before. Tests and A/B timings set them."""
    lb = lib()
    if lb is None:
        raise RuntimeError(f"native kernels {status()['reason']}")
    a, b = ctypes.c_int64(), ctypes.c_int64()
    lb.oc_act_rows(-1 if q4 is None else q4, -1 if q8 is None else q8, ctypes.byref(a), ctypes.byref(b))
    return a.value, b.value


def i16_rows(rows: int | None = None) -> int:
    """The largest row count for which the int4 / int8 projections use the int16-activation row
    kernels (in pairs of rows: each row's result is independent of the others); None: unchanged.
    Returns the one before."""
    lb = lib()
    if lb is None:
        raise RuntimeError(f"native kernels {status()['reason']}")
    old = ctypes.c_int64()
    lb.oc_i16_rows(-1 if rows is None else rows, ctypes.byref(old))
    return old.value


def ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
