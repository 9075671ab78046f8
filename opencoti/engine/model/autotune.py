"""Per-shape kernel choice by measurement, cached per machine.

For a weight format and a projection shape ``[N, K]``, every kernel that can serve it here
(``kernels.candidates``) is timed on synthetic weights of that shape at batch 1 and 8 (decode
steps) and 128 (a prefill chunk), with enough copies to stream more than the last-level cache,
as a model's weights do, best of a few rounds; the kernel with the smallest ``t(1) + t(8) +
t(128)`` wins (a format that decodes fast but prefills slowly, as the CPU int4 kernel does on
AVX2, must not win on decode alone: agent workloads are mostly prompt). Results are cached in
``<cache>/autotune.json`` under a key made of the CPU model and flags (or GPU name), the torch
version and the thread count, so a machine measures each shape once (about a second per shape).

``OPENCOTI_AUTOTUNE=0`` turns measuring off: the first kernel that builds is used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from . import kernels

log = logging.getLogger("opencoti.engine")

STREAM_BYTES = 48 << 20  # synthetic weights per timing pass: more than a typical L3
MAX_COPIES = 16
TIMED_FP32_BYTES = 64 << 20  # rows of a shape timed at most: this many bytes of its weights in fp32
BATCHES = (1, 8, 128)  # two decode batch sizes and a prefill chunk
PRUNE_FACTOR = 4.0  # slower than this x the fastest at one batch size: not timed at the larger ones
# a kernel a caller prefers (``choose(prefer=...)``: the native kernel, whose use by every layer lets a
# decode step run all layers in one fused call, a gain no per-shape timing sees) is taken while its
# t(1) + t(8) + t(128) stays within this factor of the fastest kernel's
PREFER_MARGIN = 1.25


def machine_key(device: torch.device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        hw = torch.cuda.get_device_name(device)
    else:
        model, flags = "", ""
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = line.split(":", 1)[1].strip()
        except OSError:
            pass
        model = model or platform.processor() or platform.machine()
        hw = f"{model} {hashlib.sha256(flags.encode()).hexdigest()[:8]}"
    return f"{hw} | torch {torch.__version__}"


def select(timings: dict[str, list[float]], order: tuple[str, ...]) -> str:
    """The kernel with the least ``t(1) + t(8) + t(128)``; ties (and untimed kernels) go by ``order``."""
    if not timings:
        raise ValueError("no kernel could be built")
    return min(timings, key=lambda k: (sum(timings[k]), order.index(k) if k in order else len(order)))


_BUILDS: dict[tuple, bool] = {}  # (kernel, n, k, act dtype, device, native build) -> builds (Autotuner._builds)


class Autotuner:
    """Chooses and remembers a kernel per (format, shape) for one device and thread count."""

    def __init__(self, device, act_dtype: torch.dtype, cache_file: Path | None = None, measure: bool | None = None):
        self.device = torch.device(device)
        self.act_dtype = act_dtype
        self.cache_file = cache_file
        if measure is None:
            measure = os.environ.get("OPENCOTI_AUTOTUNE", "1") not in ("0", "false", "no")
        self.measure = measure
        self.key = machine_key(self.device)
        self._cache = self._load()
        self._dirty = False
        self.results: dict[str, dict[str, list[float]]] = {}

    def entry(self, fmt: str, n: int, k: int) -> str:
        threads = torch.get_num_threads() if self.device.type == "cpu" else 0
        batches = ",".join(map(str, BATCHES))
        names = kernels.candidates(fmt, self.device)
        cands = ",".join(names)  # a new kernel here, or a rebuilt native one: measure again
        if any(n.startswith("native_") for n in names):
            from .. import native

            cands += f" native={native.build_id()}"
        return (f"{fmt} {n}x{k} act={str(self.act_dtype).replace('torch.', '')} threads={threads} batches={batches}"
                f" kernels={cands}")

    def timings(self, fmt: str, n: int, k: int) -> dict[str, list[float]]:
        """``{kernel: [t(b) for b in BATCHES]}`` for ``fmt`` at shape [n, k] (measured once, then cached)."""
        order = kernels.candidates(fmt, self.device)
        entry = self.entry(fmt, n, k)
        timings = self._cache.get(self.key, {}).get(entry)
        if timings is None or not set(timings) <= set(order):
            timings = self._time(fmt, n, k, order) if self.measure else {}
            if self.measure and timings:
                self._cache.setdefault(self.key, {})[entry] = timings
                self._dirty = True
        self.results[entry] = timings
        return timings

    def choose(self, fmt: str, n: int, k: int, prefer: str | None = None) -> str:
        """Kernel name for ``fmt`` at shape [n, k]: the fastest measured (nothing is measured when
        there is only one candidate); ``prefer``: that kernel while it is within ``PREFER_MARGIN`` of
        the fastest."""
        order = kernels.candidates(fmt, self.device)
        timings = self.timings(fmt, n, k) if len(order) > 1 else {}
        if not timings:  # measuring off, or nothing measurable: the first kernel that builds
            for name in order:
                if self._builds(name, n, k):
                    return name
            raise RuntimeError(f"no kernel serves {fmt} weights of shape {n}x{k} on {self.device}")
        best = select(timings, order)
        if prefer is not None and prefer != best and prefer in timings \
                and sum(timings[prefer]) <= PREFER_MARGIN * sum(timings[best]):
            return prefer
        return best

    def _builds(self, name: str, n: int, k: int) -> bool:
        """Whether kernel ``name`` builds for [n, k] here: tried once per process (a kernel's build on
        zeros, e.g. oneDNN's weight reorder, was most of the construction time of a small model)."""
        from .. import native

        key = (name, n, k, self.act_dtype, str(self.device), native.build_id())
        if key not in _BUILDS:
            try:
                kernels.build(name, torch.zeros(n, k), None, act_dtype=self.act_dtype, device=self.device)
                _BUILDS[key] = True
            except (RuntimeError, ValueError):
                _BUILDS[key] = False
        return _BUILDS[key]

    def _time(self, fmt: str, n: int, k: int, order: tuple[str, ...], rounds: int = 5) -> dict[str, list[float]]:
        """Best-of-``rounds`` seconds per call at each batch size; the candidates take turns within
        each round, so a burst of load from elsewhere hits them alike."""
        gen = torch.Generator().manual_seed(n * 131 + k)
        # a large shape (a model's output head: 49152 x 4096 is 805 MB in fp32) is timed on a slice of
        # its rows and the times scaled by the rows: every candidate kernel is held at once, so timing
        # the whole matrix took more memory at start than the model's weights (the peak of a first start)
        rows = min(n, max(64, TIMED_FP32_BYTES // (4 * k) // 64 * 64))
        scale = n / rows
        n = rows
        built: dict[str, list] = {}
        for name in order:
            try:
                first = kernels.build(name, torch.randn(n, k, generator=gen) * 0.02, None, act_dtype=self.act_dtype,
                                      device=self.device)
            except (RuntimeError, ValueError) as exc:
                log.debug("kernel %s can't serve %s %dx%d: %s", name, fmt, n, k, exc)
                continue
            copies = max(1, min(MAX_COPIES, STREAM_BYTES // max(first.nbytes, 1)))
            built[name] = [first] + [kernels.build(name, torch.randn(n, k, generator=gen) * 0.02, None,
                                                   act_dtype=self.act_dtype, device=self.device)
                                     for _ in range(copies - 1)]
        if len(built) == 1:  # nothing to choose from: time it once for the format estimates
            rounds = 2
        xs = {b: torch.randn(b, k, device=self.device).to(self.act_dtype) for b in BATCHES}
        best = {name: [float("inf")] * len(BATCHES) for name in built}
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        alive = list(built)
        for i, b in enumerate(BATCHES):  # batch by batch: a kernel far behind at one size is not timed at
            for name in alive:           # the next, larger one (a software bf16 GEMM takes minutes at 128)
                built[name][0](xs[b])  # warm-up
            for _ in range(rounds):
                for name in alive:
                    sync()
                    t0 = time.perf_counter()
                    for kern in built[name]:
                        kern(xs[b])
                    sync()
                    best[name][i] = min(best[name][i], (time.perf_counter() - t0) / len(built[name]))
            fastest = min(best[name][i] for name in alive)
            alive = [name for name in alive if best[name][i] <= PRUNE_FACTOR * fastest]
        return {name: [t * scale for t in ts] for name, ts in best.items()}

    def remembered(self, entry: str):
        """A value stored with :meth:`remember` for this machine (e.g. an accuracy-gate result)."""
        return self._cache.get(self.key, {}).get(entry)

    def remember(self, entry: str, value) -> None:
        self._cache.setdefault(self.key, {})[entry] = value
        self._dirty = True

    # ------------------------------------------------------------------ cache file
    def _load(self) -> dict:
        if self.cache_file is None:
            return {}
        try:
            data = json.loads(self.cache_file.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def save(self) -> None:
        if not self._dirty or self.cache_file is None:
            return
        try:
            self.cache_file.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".autotune-", dir=self.cache_file.parent)
            with os.fdopen(fd, "w") as f:
                json.dump(self._merge_on_disk(), f, indent=1, sort_keys=True)
            os.chmod(tmp, 0o644)
            os.replace(tmp, self.cache_file)
            self._dirty = False
        except OSError as exc:  # a read-only cache is not an error: we measure again next time
            log.warning("could not write the kernel autotune cache %s: %s", self.cache_file, exc)

    def _merge_on_disk(self) -> dict:
        disk = self._load()
        for key, entries in self._cache.items():
            disk.setdefault(key, {}).update(entries)
        return disk
