"""How many CPU threads the step thread's torch should use, adapted to the cores it actually gets.

Why: each GEMM of a decode step is split evenly over an OpenMP team. When another process keeps
one of the cores busy, the worker sharing that core gets about half of it, and every parallel
region waits for it at the barrier; with ~120 regions per step the step takes several times as
long as on a single thread (measured on the 2-core target: see docs/benchmarks.md). No static
setting fixes this: the right count depends on what the neighbours do, so it is measured.

* :func:`usable_cpus`: the CPUs this process may run on (``os.sched_getaffinity``), capped by a
  cgroup CPU quota (v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``), rounded up.
* :class:`ThreadAdapter`: a small online tuner run around each step. It keeps a running
  per-token step time for each thread count and each batch-size class, uses the fastest, and
  re-tries the others now and then (more often when the current one gets slower than it was),
  so it moves to fewer threads within a few steps of a neighbour taking a core and back when it
  leaves.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch


def _cgroup_quota_cpus(root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """CPUs allowed by the tightest cgroup CPU quota on this process's path (None = no quota)."""
    best: float | None = None
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, rel = parts
        rel = rel.lstrip("/")
        if hier == "0" and controllers == "":  # cgroup v2
            base = root
            files: list[tuple[str, str | None]] = [("cpu.max", None)]
        elif "cpu" in controllers.split(","):  # cgroup v1
            base = root / controllers if (root / controllers).is_dir() else root / "cpu"
            files = [("cpu.cfs_quota_us", "cpu.cfs_period_us")]
        else:
            continue
        d = base / rel
        while True:
            quota = _read_quota(d, files[0])
            if quota is not None:
                best = quota if best is None else min(best, quota)
            if d == base or d.parent == d:
                break
            d = d.parent
    return best


def _read_quota(d: Path, spec) -> float | None:
    name, period_name = spec
    try:
        if period_name is None:
            quota, period = (d / name).read_text().split()[:2]
            if quota == "max":
                return None
            return int(quota) / int(period)
        quota = int((d / name).read_text().strip())
        if quota <= 0:
            return None
        return quota / int((d / period_name).read_text().strip())
    except (OSError, ValueError):
        return None


def usable_cpus() -> int:
    """CPUs this process can use: its affinity mask, capped by the cgroup CPU quota (rounded up)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = _cgroup_quota_cpus()
    if quota is not None:
        n = min(n, max(1, math.ceil(quota)))
    return max(1, n)


def _bucket(tokens: int) -> int:
    return 0 if tokens <= 1 else 1 if tokens <= 16 else 2


class ThreadAdapter:
    """Online choice of the torch thread count for the step thread (call around each step).

    ``before(tokens)`` sets the count for the coming step; ``after(tokens, seconds)`` records it.
    Times are per token within a batch-size class (1 token, 2-16, more), smoothed (EWMA).
    Exploration: after ``explore_every`` steps on the current best (doubling up to
    ``max_explore_every`` while it stays best, back to the minimum when it slows down by 30%),
    one step runs on another count (the one measured least recently); an exploration sample
    replaces that count's estimate when it is better (the old value may be stale) and is averaged
    in when worse (one unlucky step must not rule a count out); steps on the best are smoothed.
    """

    def __init__(self, max_threads: int | None = None, *, explore_every: int = 8, max_explore_every: int = 64,
                 alpha: float = 0.3, set_threads=torch.set_num_threads):
        self.max_threads = max(1, max_threads or usable_cpus())
        self.choices = list(range(1, self.max_threads + 1)) if self.max_threads <= 4 else sorted(
            {1, self.max_threads // 4, self.max_threads // 2, self.max_threads - 1, self.max_threads} - {0})
        self.min_every, self.max_every, self.alpha = explore_every, max_explore_every, alpha
        self._set = set_threads
        self.est: dict[int, dict[int, float]] = {b: {} for b in range(3)}
        self.floor: dict[int, float] = {}
        self.seen: dict[tuple[int, int], int] = {}
        self.every = {b: explore_every for b in range(3)}
        self.count = {b: 0 for b in range(3)}
        self.steps = 0
        self.current = self.max_threads
        self.best = {b: self.max_threads for b in range(3)}
        self.switches = 0
        self._set(self.current)

    def _pick(self, b: int) -> int:
        if len(self.choices) == 1:
            return self.choices[0]
        self.count[b] += 1
        if self.count[b] >= self.every[b]:
            self.count[b] = 0
            others = [n for n in self.choices if n != self.best[b]]
            return min(others, key=lambda n: self.seen.get((b, n), -1))  # least recently measured
        return self.best[b]

    def before(self, tokens: int) -> int:
        n = self._pick(_bucket(tokens))
        if n != self.current:
            self._set(n)
            self.current = n
            self.switches += 1
        return n

    def after(self, tokens: int, seconds: float) -> None:
        self.steps += 1
        b, n = _bucket(tokens), self.current
        per_tok = seconds / max(tokens, 1)
        est = self.est[b]
        if n not in est:
            est[n] = per_tok
        elif n != self.best[b]:  # exploration sample: a better one counts fully (the old value may be
            est[n] = per_tok if per_tok < est[n] else 0.5 * (est[n] + per_tok)  # stale), a worse one half
        else:
            est[n] = (1 - self.alpha) * est[n] + self.alpha * per_tok
        self.seen[(b, n)] = self.steps
        best = min(est, key=lambda n: est[n])
        if best != self.best[b]:
            self.best[b] = best
            self.every[b] = self.min_every
            self.floor[b] = est[best]
        elif n == best:
            floor = self.floor.get(b)
            if floor is None or est[n] < floor:
                self.floor[b] = est[n]
            elif est[n] > 1.3 * floor:  # the current choice got slower: look around soon
                self.every[b] = self.min_every
                self.floor[b] = est[n]
        else:  # an exploration step confirmed the current best: explore less often
            self.every[b] = min(self.every[b] * 2, self.max_every)

    def state(self) -> dict:
        return {"threads": self.current, "max_threads": self.max_threads, "best": dict(self.best),
                "switches": self.switches,
                "per_token_ms": {b: {n: round(v * 1e3, 3) for n, v in e.items()} for b, e in self.est.items()}}
