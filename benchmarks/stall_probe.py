#!/usr/bin/env python
"""`opencoti serve` with two probes that say what delays the event loop (``bench_health.py --probe``).

1. A watchdog thread wakes every 2 ms. When it gets the GIL back late (> ``STALL_MS``, 30), some
   thread held the GIL in one long call (or the process got no CPU): it logs where every thread is
   - the one that held the GIL has just let go, its frame sits right after the long call. It also
   samples the main thread's stack every 2 ms.
2. A task on the event loop sleeps 5 ms at a time. When it wakes late, the loop was busy (or could
   not get the GIL): it logs the main-thread samples of that interval - what the loop was running.
3. Garbage collections longer than ``STALL_MS`` (they hold the GIL) are logged with their generation.
4. With ``STALL_CCALLS=1``, every call into C (a builtin, an extension function) that took longer
   than ``STALL_MS`` is logged with its thread and caller (``sys.setprofile`` in every thread: slower
   Python, exact culprits). Calls that release the GIL while they wait (sleeps, locks, I/O, torch
   kernels) show up too: read them against the GIL waits of the same moment.

Usage: ``STALL_LOG=stalls.log python benchmarks/stall_probe.py --port 8080 [serve options]``.
``summarize(path, since)`` turns the log into the longest stalls and their stacks.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import os
import re
import sys
import threading
import time
import traceback

STALL = float(os.environ.get("STALL_MS", "30")) / 1e3
SAMPLES: collections.deque = collections.deque(maxlen=4000)


def _short(frame, n: int = 6) -> str:
    st = traceback.extract_stack(frame)[-n:]
    return " <- ".join(f"{fs.filename.split('site-packages/')[-1]}:{fs.lineno} {fs.name}" for fs in reversed(st))


def _watchdog(log, main: int) -> None:
    me = threading.get_ident()
    while True:
        t = time.perf_counter()
        time.sleep(0.002)
        now = time.perf_counter()
        late = now - t - 0.002
        frames = sys._current_frames()
        if main in frames:
            SAMPLES.append((now, _short(frames[main], 5)))
        if late > STALL:
            names = {th.ident: th.name for th in threading.enumerate()}
            out = [f"--- GIL wait {late * 1e3:.0f} ms at {time.time():.3f}"]
            out += [f"  [{names.get(tid, tid)}] {_short(f)}" for tid, f in frames.items() if tid != me]
            log.write("\n".join(out) + "\n")
            log.flush()


async def _loop_monitor(log) -> None:
    while True:
        t = time.perf_counter()
        await asyncio.sleep(0.005)
        now = time.perf_counter()
        lag = now - t - 0.005
        if lag > STALL:
            seen = collections.Counter(s for ts, s in list(SAMPLES) if t <= ts <= now)
            out = [f"=== LOOP lag {lag * 1e3:.0f} ms at {time.time():.3f} ({sum(seen.values())} samples of the "
                   "main thread)"]
            out += [f"  {n:3d} x {s}" for s, n in seen.most_common(4)]
            log.write("\n".join(out) + "\n")
            log.flush()


def _gc_timer(log):
    started = [0.0]

    def callback(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
            return
        took = time.perf_counter() - started[0]
        if took > STALL:
            log.write(f"--- GC {took * 1e3:.0f} ms at {time.time():.3f}: generation {info.get('generation')}, "
                      f"{info.get('collected')} collected\n")
            log.flush()

    return callback


def _ccall_profiler(log):
    """A profile function (``sys.setprofile``) logging each C call longer than ``STALL``."""
    local = threading.local()

    def prof(frame, event, arg):
        if event == "c_call":
            try:
                local.starts.append(time.perf_counter())
            except AttributeError:
                local.starts = [time.perf_counter()]
        elif event in ("c_return", "c_exception"):
            starts = getattr(local, "starts", None)
            if not starts:
                return
            took = time.perf_counter() - starts.pop()
            if took > STALL:
                name = getattr(arg, "__qualname__", None) or getattr(arg, "__name__", repr(arg))
                mod = getattr(arg, "__module__", None) or type(getattr(arg, "__self__", None)).__name__
                log.write(f"--- CCALL {took * 1e3:.0f} ms at {time.time():.3f}: {mod}.{name} "
                          f"[{threading.current_thread().name}]\n  {_short(frame, 8)}\n")
                log.flush()

    return prof


def summarize(path: str, since: float = 0.0, until: float = float("inf"), top: int = 8) -> list[str]:
    """The ``top`` longest stalls logged between ``since`` and ``until`` (time.time()), with their stacks."""
    try:
        text = open(path).read()
    except OSError:
        return []
    entries = []
    for block in re.split(r"\n(?=---|===)", text):
        m = re.match(r"(?:---|===) (GIL wait|LOOP lag|GC|CCALL) (\d+) ms at ([\d.]+)", block)
        if m and since <= float(m.group(3)) <= until:
            entries.append((int(m.group(2)), block))
    entries.sort(key=lambda e: -e[0])
    return [block for _, block in entries[:top]]


def main() -> int:
    log = open(os.environ.get("STALL_LOG", "stalls.log"), "w")
    threading.Thread(target=_watchdog, args=(log, threading.main_thread().ident), daemon=True,
                     name="stall-watchdog").start()
    gc.callbacks.append(_gc_timer(log))
    if os.environ.get("STALL_CCALLS") == "1":
        prof = _ccall_profiler(log)
        threading.setprofile(prof)
        sys.setprofile(prof)
    sys.path.insert(0, os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")))
    from opencoti.server import state

    start = state.ServerState.start

    def start_with_monitor(self, *a, **kw):  # runs on the event loop (the app's lifespan)
        asyncio.get_running_loop().create_task(_loop_monitor(log))
        return start(self, *a, **kw)

    state.ServerState.start = start_with_monitor
    from opencoti.cli import main as cli_main

    return cli_main(["serve", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
