"""Shared helpers for the benchmarks: import path, timing, statistics, machine description,
a printed table and JSON output to ``benchmarks/results/<machine-id>/<name>.json`` (committed: the
numbers in the docs are generated from these files by ``benchmarks/report.py``).

The benchmark scripts are run as ``.venv/bin/python benchmarks/bench_<name>.py`` or through
``opencoti bench <name>`` (runpy), so they put the repository root and this folder on
``sys.path`` themselves before importing this module and ``opencoti``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"

if str(REPO_ROOT) not in sys.path:  # `import opencoti` from a checkout, wherever we are run from
    sys.path.insert(0, str(REPO_ROOT))

import opencoti  # noqa: E402,F401 - before torch: sets the OpenMP wait policy for everything measured here


# ============================================================================ child processes
_CHILDREN: list[subprocess.Popen] = []
_AT_EXIT = False


def track(proc: subprocess.Popen) -> subprocess.Popen:
    """A server or worker this benchmark started: stopped when the benchmark exits in any way but SIGKILL
    (done, an exception, Ctrl-C, or SIGTERM from ``timeout`` or ``kill``, which ends the run through its
    ``finally`` blocks; ``stop_children`` at exit). Returns ``proc``."""
    global _AT_EXIT
    if not _AT_EXIT:
        import atexit

        atexit.register(stop_children)
        _AT_EXIT = True
    _CHILDREN.append(proc)
    return proc


def stop_children(grace_s: float = 30.0) -> None:
    """SIGTERM every tracked process still running (its process group when it leads one: a server's own
    children), then SIGKILL what has not exited after ``grace_s``."""
    import signal

    def send(p: subprocess.Popen, sig: int) -> None:
        try:
            if os.getpgid(p.pid) == p.pid:
                os.killpg(p.pid, sig)
            else:
                os.kill(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    live = [p for p in _CHILDREN if p.poll() is None]
    for p in live:
        send(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in live:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            send(p, signal.SIGKILL)
            p.wait()
    _CHILDREN.clear()


def install_exit_handlers() -> None:
    """SIGTERM exits through ``finally`` blocks and ``stop_children`` (Python's default dies at once).
    Installed at import when a benchmark script is the program run (not when a test imports this
    module: there SIGTERM must stay pytest's)."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


_MAIN = getattr(sys.modules.get("__main__"), "__file__", None)
if _MAIN and Path(_MAIN).resolve().parent == BENCH_DIR:
    install_exit_handlers()


# ============================================================================ command line
def base_parser(description: str) -> argparse.ArgumentParser:
    """Options every benchmark takes: --dtype, --threads, --device, --weights, --quick, --out."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weights/activations/KV dtype (our engine and, where used, transformers)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads for everything in the process (default: torch's default)")
    p.add_argument("--device", default="auto", help="engine device: auto|cpu|cuda")
    p.add_argument("--weights", default="auto", choices=["auto", "fp32", "bf16", "int8", "int4"],
                   help="engine projection weight format (EngineConfig.weights)")
    p.add_argument("--quick", action="store_true", help="a short smoke run (fewer tokens/repeats)")
    p.add_argument("--out", default=None, help="JSON output path (default: benchmarks/results/<name>.json)")
    return p


def set_threads(n: int | None) -> None:
    import torch

    if n is not None:
        torch.set_num_threads(n)


def make_engine(args, **config):
    """The bundled model with page size 16 and the dtype/device/threads/weights given on the command line."""
    from opencoti.engine import Engine, EngineConfig

    config.setdefault("weights", getattr(args, "weights", "auto"))
    cfg = EngineConfig(page_size=16, dtype=args.dtype, device=args.device, num_threads=args.threads, **config)
    return Engine(cfg, progress=lambda msg: log(f"engine: {msg}"))


# ============================================================================ timing & stats
def now() -> float:
    return time.perf_counter()


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def summarize(values: Sequence[float]) -> dict:
    """median / min / max / all of a list of repeated measurements."""
    vals = [float(v) for v in values]
    if not vals:
        return {"median": None, "min": None, "max": None, "values": []}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "values": vals}


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


# ============================================================================ machine
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# SIMD / matrix features that decide which CPU kernels are fast (the full list goes to the JSON)
FLAGS_OF_INTEREST = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx_vnni",
                     "amx_bf16", "amx_int8", "neon", "asimd", "sve")


def cpu_flags() -> list[str]:
    """The CPU feature flags from /proc/cpuinfo (``flags`` on x86, ``Features`` on ARM)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].split()
    except OSError:
        pass
    return []


def _git_rev() -> dict:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except Exception:  # noqa: BLE001 - git missing or not a checkout
        return {"commit": None, "dirty": None}


def machine_info() -> dict:
    """What the numbers were measured on (load average included: a busy machine skews them)."""
    import torch

    flags = cpu_flags()
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_flags_of_interest": [f for f in FLAGS_OF_INTEREST if f in flags],
        "cpu_flags": " ".join(flags),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "git": _git_rev(),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    return info


def describe_machine(info: dict) -> str:
    load = info.get("loadavg")
    load_s = "/".join(f"{x:.2f}" for x in load) if load else "?"
    dev = info["cuda"] or "cpu"
    simd = "/".join(info.get("cpu_flags_of_interest") or []) or "?"
    return (f"{info['cpu']} [{simd}] ({info['cpu_affinity'] or info['cpu_count']} cores usable), device {dev}, "
            f"torch {info['torch']} ({info['torch_threads']} threads), transformers {info.get('transformers')}, "
            f"python {info['python']}, load avg {load_s}")


# ============================================================================ output
def fmt(x: Any, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    if isinstance(x, int):
        return f"{x:,}"
    return str(x)


def print_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], title: str | None = None) -> None:
    """A plain fixed-width table on stdout: first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + [[c if isinstance(c, str) else fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    if title:
        print(f"\n{title}")
    print(line(cells[0]))
    print("  ".join("-" * w for w in widths))
    for r in cells[1:]:
        print(line(r))


def check_mark(value: float | None, target: float) -> str:
    if value is None:
        return "n/a"
    return "PASS" if value >= target else "FAIL"


def smaps(pid: int) -> list[dict]:
    """``/proc/<pid>/smaps``, one dict per mapping: ``start`` (hex), ``size`` (bytes, from the address
    range), ``path`` ("" for anonymous memory) and ``rss`` (bytes). Raises OSError off Linux."""
    out: list[dict] = []
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split(maxsplit=5)
        if head and "-" in head[0] and not head[0].endswith(":") and len(head) >= 5:
            lo, hi = head[0].split("-")
            out.append({"start": lo, "size": int(hi, 16) - int(lo, 16),
                        "path": head[5].strip() if len(head) > 5 else "", "rss": 0})
        elif head[:1] == ["Rss:"] and out:
            out[-1]["rss"] = int(head[1]) * 1024
    return out


def machine_id() -> str:
    """A folder name for this machine's results: CPU model, usable cores and a hash of the CPU flags
    (e.g. ``amd-epyc-9b14-2c-1a2b3c4d``); ``OPENCOTI_MACHINE_ID`` overrides it."""
    import hashlib
    import re

    if os.environ.get("OPENCOTI_MACHINE_ID"):
        return re.sub(r"[^a-z0-9._-]+", "-", os.environ["OPENCOTI_MACHINE_ID"].lower())
    model = re.sub(r"\(r\)|\(tm\)|cpu|processor|[0-9]+-core", " ", _cpu_model().lower())
    model = re.sub(r"[^a-z0-9]+", "-", model).strip("-")[:40] or platform.machine()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    flags = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:8]
    return f"{model}-{cores}c-{flags}"


def results_dir() -> Path:
    return RESULTS_DIR / machine_id()


def load_snapshot() -> dict:
    """The load average and the busiest other processes now (recorded before and after a run)."""
    snap: dict[str, Any] = {"loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None}
    try:
        ps = subprocess.run(["ps", "-eo", "pcpu,comm", "--sort=-pcpu", "--no-headers"], capture_output=True,
                            text=True, timeout=10).stdout.splitlines()
        snap["top"] = [line.strip() for line in ps[:5]]
    except (OSError, subprocess.SubprocessError):
        snap["top"] = None
    return snap


def history_stamp(time_text: str) -> str:
    """A kept run's file-name stamp: its recorded time, digits and the T only (``20261206T101500``)."""
    import re

    return re.sub(r"[^0-9T]", "", str(time_text))[:15] or "unknown"


def keep_earlier(path: Path) -> Path | None:
    """Move an earlier result at ``path`` to ``<its folder>/history/<stem>-<its time>.json`` (every run
    is kept; the report lists them and judges targets on each); the new location, or None."""
    if not path.exists():
        return None
    try:
        when = json.loads(path.read_text()).get("time", "")
    except (OSError, ValueError):
        when = ""
    dest = path.parent / "history" / f"{path.stem}-{history_stamp(when or time.strftime('%Y%m%dT%H%M%S'))}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    n = 1
    while dest.exists():  # two runs in one second: both kept
        dest = dest.with_name(f"{path.stem}-{history_stamp(when)}-{n}.json")
        n += 1
    path.replace(dest)
    return dest


_WRITTEN: set[Path] = set()  # results this process wrote: rewritten in place, not kept as earlier runs


def write_json(name: str, payload: dict, out: str | None = None) -> Path:
    """Write a result; an earlier one at the same path is kept in ``history/`` first (:func:`keep_earlier`).
    A reduced run (``config.quick``) with no ``out`` (a script run by hand with ``--quick``) writes
    ``<name>_quick.json``: never the full result."""
    quick = bool((payload.get("config") or {}).get("quick")) and not name.endswith("_quick")
    path = Path(out) if out else results_dir() / f"{name}{'_quick' if quick else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.resolve().is_relative_to(RESULTS_DIR.resolve()) and path.resolve() not in _WRITTEN:
        keep_earlier(path)  # not a file this process wrote before (bench_cluster writes after every round)
    _WRITTEN.add(path.resolve())
    payload = {"benchmark": name, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine_id": machine_id(),
               "load_at_end": load_snapshot(), **payload}
    path.write_text(json.dumps(payload, indent=2, default=_json_default) + "\n")
    return path


def _json_default(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, tuple):
        return list(o)
    if hasattr(o, "as_dict"):
        return o.as_dict()
    return repr(o)


# ============================================================================ baselines that must not reuse
def fresh_salt(tag: str) -> str:
    """A ``cache_salt`` no other request has: the request shares no cached KV (the automatic prefix
    cache keys its pages by salt), so a "no pool" / "full prefill" baseline computes every token."""
    import uuid

    return f"bench-{tag}-{uuid.uuid4().hex}"


def assert_cache_n(values: Iterable[int], expected: int, what: str) -> None:
    """Raise unless every request of a run found exactly ``expected`` prompt tokens in cache
    (``timings["cache_n"]``): 0 for a baseline that must compute everything, P for an attach."""
    values = list(values)
    bad = [v for v in values if v != expected]
    if bad:
        raise RuntimeError(f"{what}: expected {expected} cached prompt tokens per request, got {values}; "
                           f"the comparison would not measure what it says")


def rotated(items: Sequence[Any], rnd: int) -> list:
    """The order of round ``rnd``: ``items`` rotated left by ``rnd``, so each goes first once every
    ``len(items)`` rounds and drift in the machine's load does not always hit the same one."""
    k = rnd % len(items)
    return list(items[k:]) + list(items[:k])


def run_threads(n: int, fn: Callable[[int], Any]) -> None:
    """``fn(0) .. fn(n - 1)`` on ``n`` threads started together; returns when all have ended."""
    import threading

    ts = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of one call."""
    t0 = now()
    r = fn()
    return now() - t0, r
