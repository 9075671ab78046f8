"""Native CPU kernels (``kernels.cpp``): int4 / int8 weight-only projections, paged decode attention and
the shared part of cascade (shared-prefix) attention over fp32, fp16, bf16 or q8 (int8 + a scale per
vector) KV pages, and the fused decode layer.

They are registered as typed torch operators, ``torch.ops.opencoti.<name>`` (``ops.cpp``): each checks
its tensors (dtype, device, contiguity, shapes consistent with each other, the page ids, slots and rows
it follows) and raises a RuntimeError naming the argument, then runs the kernel with the thread count
torch uses at that moment (the dispatcher releases the GIL for the call). Each also has a Meta kernel
(the same dtype and shape checks, no data), which tracing with fake tensors runs.

The C++ sources ship with the package and are compiled on first use by the machine's C++ compiler
(``g++``/``c++``, ``-O3 -march=native -fopenmp``: the build is specific to this CPU) against the
installed torch's headers and libraries into the cache directory, keyed by a hash of the sources, the
flags, the compiler, the CPU's model and flags and the torch version; later loads reuse it
(``scripts/setup.sh`` builds it once at set-up). The library links the OpenMP runtime torch already
loaded, so both share one pool of threads.

Nothing depends on it: when there is no compiler, the build fails, or ``OPENCOTI_NATIVE=0``,
:func:`lib` returns None and the engine uses torch's kernels (the reason is in :func:`status`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from ..paths import cache_root

log = logging.getLogger("opencoti.engine")

SOURCE = Path(__file__).with_name("kernels.cpp")  # the kernels (torch-free)
OPS_SOURCE = Path(__file__).with_name("ops.cpp")  # their torch operators (includes kernels.cpp)
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++20", "-fno-math-errno"]
ABI_VERSION = 12
NAMESPACE = "opencoti"  # torch.ops.opencoti: the default build's operators

_lock = threading.Lock()
_state: dict = {"lib": None, "tried": False, "reason": "not built yet", "path": None}

# The KV cache element types the attention kernels read and write (``KvType`` in kernels.cpp).
KV_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3}  # int8: q8 pages (attention/q8.py)


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
    """``<cache root>/native`` (``paths.cache_root``: ``$OPENCOTI_CACHE``, else the user cache dir)."""
    return cache_root() / "native"


def _torch_flags() -> list[str]:
    """Compile and link flags for torch's headers and libraries (the installed torch's). The paths are
    the ones ``torch.utils.cpp_extension`` gives, found without importing it (it imports setuptools,
    which is not a runtime dependency)."""
    root = Path(torch.__file__).resolve().parent
    flags = [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    flags += [f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}"]
    lib = root / "lib"
    flags += [f"-L{lib}", f"-Wl,-rpath,{lib}"]
    return [*flags, "-ltorch", "-ltorch_cpu", "-lc10"]


def _key(cxx: str, flags: list[str] | None = None) -> str:
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = "?"
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(OPS_SOURCE.read_bytes())
    for part in (" ".join(flags or FLAGS), version, _cpu_signature(), str(ABI_VERSION), torch.__version__):
        h.update(part.encode())
    return ("x" if flags and flags != FLAGS else "") + h.hexdigest()[:16]


def namespace_of(path: Path) -> str:
    """The operator namespace of a built library: ``opencoti`` for the default flags, ``opencoti_x<key>``
    for a build of other flags (both can be loaded in one process)."""
    key = Path(path).stem.rsplit("-", 1)[-1]
    return f"{NAMESPACE}_{key}" if key.startswith("x") else NAMESPACE


def build(extra_flags: tuple[str, ...] = (), out_dir: Path | None = None) -> Path:
    """Compile the library for this machine (or find it already built); raises RuntimeError if it can't.

    ``extra_flags`` (e.g. ``-mno-avx2 -mno-fma``: the portable scalar code, which the tests build
    too) become part of the file's key, and its operators are registered under their own namespace
    (:func:`namespace_of`). A new build of the default flags removes the older builds it replaces
    (another source, compiler, CPU or torch) from the cache folder."""
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
    log.info("building the native CPU kernels for this machine (once; under a minute) ...")
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        cmd = [cxx, *flags, f"-DOC_OPS_NS={namespace_of(out)}", str(OPS_SOURCE), "-o", tmp, *_torch_flags()]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
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


def load(path: Path) -> Any:
    """Load a built library (e.g. one built with :func:`build`'s ``extra_flags``); returns its operator
    namespace (``torch.ops.<namespace_of(path)>``)."""
    torch.ops.load_library(str(path))
    ops = getattr(torch.ops, namespace_of(path))
    if ops.abi_version() != ABI_VERSION:
        raise RuntimeError(f"library ABI {ops.abi_version()} != {ABI_VERSION}")
    return ops


def lib() -> Any:
    """The operators (``torch.ops.opencoti``), building and loading the library on first use; None when
    unavailable (see :func:`status`)."""
    if _state["tried"]:
        return _state["lib"]
    activations = kquant_activations()  # a bad value is an error, never a silent fallback
    with _lock:
        if not _state["tried"]:
            if os.environ.get("OPENCOTI_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
                _state["reason"] = "disabled by OPENCOTI_NATIVE=0"
            else:
                try:
                    path = build()
                    before = openmp_runtimes()
                    loaded = load(path)
                    _check_openmp(before)
                    _state["lib"], _state["path"] = loaded, str(path)
                    if activations == "int16":
                        loaded.kquant_i8_rows(0)
                    _state["reason"] = "ok" if loaded.simd() else "ok (no AVX2/FMA/F16C: scalar code)"
                except (OSError, RuntimeError, AttributeError, ImportError, subprocess.SubprocessError) as e:
                    _state["reason"] = f"unavailable: {e}"
                    log.warning("native kernels unavailable (%s): the int4 and int8 weight formats run torch's "
                                "kernels, several times slower on CPU, and decode attention and q8 KV pages run "
                                "torch's ops; they need a C++ compiler (Debian/Ubuntu: apt-get install g++) and "
                                "the installed torch's headers (OPENCOTI_NATIVE=0 turns them off)", e)
            _state["tried"] = True
    return _state["lib"]


KQUANT_ACTIVATIONS_ENV = "OPENCOTI_KQUANT_ACTIVATIONS"  # "int8" (default, llama.cpp's) | "int16" (closer, slower)


def kquant_activations() -> str:
    """``OPENCOTI_KQUANT_ACTIVATIONS``: "int8" (the default: llama.cpp's 8 bits per 256 values) or "int16"
    (the k-quant projections keep 16 bits per block of 32 of their activations: int16 rows up to 31
    rows, fp32 panels above; closer to an exact forward, slower: docs/models.md). Anything else is a
    ValueError naming the variable."""
    want = os.environ.get(KQUANT_ACTIVATIONS_ENV, "int8").strip().lower()
    if want not in ("int8", "int16"):
        raise ValueError(f"{KQUANT_ACTIVATIONS_ENV} must be int8 or int16, got {want!r}")
    return want


def status() -> dict:
    lib()
    return {"available": _state["lib"] is not None, "reason": _state["reason"], "path": _state["path"]}


def build_id() -> str | None:
    """Identifies the built library (source, flags, compiler, CPU, torch): kernel timings depend on it."""
    lib()
    return Path(_state["path"]).stem.rsplit("-", 1)[-1] if _state["path"] else None


def _ops() -> Any:
    ops = lib()
    if ops is None:
        raise RuntimeError(f"native kernels {status()['reason']}")
    return ops


def gemm_min_rows(q4: int | None = None, q8: int | None = None) -> tuple[int, int]:
    """The row counts from which the int4 / int8 projections fill fp32 panels instead of running the
    row kernels (None: unchanged); returns the ones before. The library's defaults are measured (see
    kernels.cpp); tests and A/B timings set them."""
    a, b = _ops().gemm_min_rows(q4 or 0, q8 or 0)
    return a, b


def act_rows(q4: int | None = None, q8: int | None = None) -> tuple[int, int]:
    """The largest row counts for which the int4 / int8 projections quantize the activations to int8
    per block of 32 (llama.cpp's Q8 blocks) and use integer dot products (None: unchanged; 0: off);
    returns the ones before. Tests and A/B timings set them."""
    a, b = _ops().act_rows(-1 if q4 is None else q4, -1 if q8 is None else q8)
    return a, b


def i16_rows(rows: int | None = None) -> int:
    """The largest row count for which the int4 / int8 projections use the int16-activation row
    kernels (in pairs of rows: each row's result is independent of the others); None: unchanged.
    Returns the one before."""
    return int(_ops().i16_rows(-1 if rows is None else rows))


def kquant_i8_rows(rows: int | None = None) -> int:
    """The largest row count for which the k-quant projections (Q4_K / Q6_K as stored) quantize the
    activations to int8 per super-block of 256 (llama.cpp's Q8_K) and apply the sub-block scales in
    integers; more rows take the int16 path, then the fp32 panels (None: unchanged; 0: off). Returns the
    one before."""
    return int(_ops().kquant_i8_rows(-1 if rows is None else rows))
