"""Live views of a demo run: a rich terminal dashboard, or plain log lines when stdout is not a TTY.

Both read the ``Recorder`` (its latest sample and its feed of lines) from their own thread, so the
scenario never waits for the screen. ``make_view(stream)`` picks one:

* ``RichView``: the pool tree (own / subtree KV, the sessions on each pool with their tps, state
  and context), aggregate and mean tps against the floor, KV in use vs. without sharing, the agents
  waiting at a gate, and the admission decisions and scenario steps as they happen; a spinner with
  the loader's messages while the model loads / converts.
* ``PlainView``: every feed line as ``[  12.3s] kind  text``, plus a status line every few seconds.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, TextIO

from .recorder import Recorder

MiB = 2 ** 20


def _f(x: Any, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def status_line(sample: dict | None, floor: float | None) -> str:
    """One line: tps against the floor, sessions, agents waiting, KV used vs. without sharing (pure)."""
    if not sample:
        return "no sample yet"
    kv = sample.get("kv") or {}
    agents = sample.get("agents") or {}
    waiting = sum(1 for v in agents.values() if v == "waiting")
    running = sum(1 for v in agents.values() if v == "running")
    ratio = kv.get("without_sharing", 0) / kv["used"] if kv.get("used") else None
    mean = sample.get("mean_active_tps") if (sample.get("n_active") or 0) > 0 else None
    return (f"tps aggregate {_f(sample.get('aggregate_tps'))} | mean active {_f(mean)} | floor {_f(floor)} | "
            f"decoding {sample.get('n_decoding') or 0} warming {sample.get('n_warming') or 0} | "
            f"agents running {running} waiting {waiting} | KV {_f(kv.get('used', 0) / MiB)} MiB "
            f"(without sharing {_f(kv.get('without_sharing', 0) / MiB)} MiB"
            + (f", {ratio:.1f}x" if ratio else "") + ")")


def pool_tree_lines(sample: dict | None) -> list[tuple[int, str]]:
    """The pool tree as (depth, text) lines, sessions under their pool (pure; the rich view and
    the plain view's final dump use it)."""
    if not sample:
        return []
    pools = {p["pool_id"]: p for p in sample.get("pools", ())}
    tps = {s["session_id"]: s for s in sample.get("sessions", ())}
    kids: dict[Any, list[int]] = {}
    for p in pools.values():
        parent = p.get("parent") if p.get("parent") in pools else None
        kids.setdefault(parent, []).append(p["pool_id"])
    out: list[tuple[int, str]] = []

    def walk(pid: int, depth: int) -> None:
        p = pools[pid]
        out.append((depth, f"pool {pid} {p.get('label') or ''} [{p.get('branch_pos')}, {p.get('prefix_len')}) "
                           f"own {_f((p.get('own_kv_bytes') or 0) / MiB)} MiB, subtree "
                           f"{_f((p.get('subtree_kv_bytes') or 0) / MiB)} MiB"))
        for s in p.get("sessions", ()):
            row = tps.get(s["session_id"], {})
            state = row.get("state") or s.get("state")
            speed = "warming" if row.get("warming") else f"{_f(row.get('tps_ewma'))} tok/s"
            out.append((depth + 1, f"· {s['session_id']} {state} {speed if state != 'idle' else ''} "
                                   f"ctx {s.get('ctx_used')} own {_f((s.get('marginal_kv_bytes') or 0) / MiB, 2)} MiB"))
        for c in sorted(kids.get(pid, ())):
            walk(c, depth + 1)

    for root in sorted(kids.get(None, ())):
        walk(root, 0)
    return out


class PlainView:
    """Plain log lines (for pipes, CI logs and files)."""

    def __init__(self, stream: TextIO | None = None, status_every_s: float = 5.0, poll_s: float = 0.25):
        self.stream = stream or sys.stdout
        self.status_every_s = status_every_s
        self.poll_s = poll_s
        self.recorder: Recorder | None = None
        self.floor: float | None = None
        self._index = 0
        self._last_status = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = time.time()

    def print(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()

    def progress(self, message: str) -> None:
        """Model load / conversion progress."""
        self.print(f"[load] {message}")

    def loading(self):
        return _NullContext()

    def set_floor(self, floor: float | None) -> None:
        self.floor = floor

    def flush(self) -> None:
        """Print the feed lines not printed yet (and a status line when due)."""
        rec = self.recorder
        if rec is None:
            return
        lines, self._index = rec.feed_since(self._index)
        for ln in lines:
            self.print(f"[{ln['t'] - rec.t0:7.1f}s] {ln['kind']:<10} {ln['text']}")
        now = time.monotonic()
        if now - self._last_status >= self.status_every_s and rec.latest is not None:
            self._last_status = now
            self.print(f"[{rec.latest['t'] - rec.t0:7.1f}s] {'status':<10} {status_line(rec.latest, self.floor)}")

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.flush()

    def start(self, recorder: Recorder, title: str = "") -> None:
        self.recorder = recorder
        if title:
            self.print(title)
        self._thread = threading.Thread(target=self._run, name="opencoti-demo-view", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._last_status = -float("inf")  # the final status line
        self.flush()


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class RichView:
    """The rich dashboard (``rich.live.Live``, redrawn a few times a second)."""

    def __init__(self, console=None, refresh_per_second: float = 4.0, max_lines: int = 12):
        from rich.console import Console
        self.console = console or Console()
        self.refresh_per_second = refresh_per_second
        self.max_lines = max_lines
        self.recorder: Recorder | None = None
        self.floor: float | None = None
        self.title = ""
        self._live = None
        self._progress = None
        self._task = None

    # ---------------------------------------------------------------- loading
    def progress(self, message: str) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, description=message)
        else:
            self.console.log(message)

    def loading(self):
        """A spinner with the loader's latest message while the model loads / converts."""
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
        view = self

        class _Ctx:
            def __enter__(self_):
                view._progress = Progress(SpinnerColumn(), TextColumn("[bold]loading model[/] {task.description}"),
                                          TimeElapsedColumn(), console=view.console, transient=False)
                view._progress.start()
                view._task = view._progress.add_task("starting", total=None)
                return self_

            def __exit__(self_, *exc):
                view._progress.update(view._task, description="done")
                view._progress.stop()
                view._progress = view._task = None
                return False

        return _Ctx()

    def set_floor(self, floor: float | None) -> None:
        self.floor = floor

    def print(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False)

    # ---------------------------------------------------------------- the dashboard
    def render(self):
        """The dashboard renderable for the recorder's current state."""
        from rich.console import Group
        from rich.panel import Panel
        from rich.table import Table
        from rich.text import Text
        from rich.tree import Tree

        rec = self.recorder
        sample = rec.latest if rec is not None else None
        head = Text()
        if rec is not None:
            elapsed = (sample["t"] if sample else time.time()) - rec.t0
            phase = rec.phases[-1]["name"] if rec.phases else "starting"
            head.append(f"{self.title}  ", style="bold")
            head.append(f"{elapsed:6.1f}s  step: {phase}\n", style="cyan")
        head.append(status_line(sample, self.floor))
        # pool tree
        tree = Tree("[bold]pools[/] (own / subtree KV; sessions with tps, state, context)")
        nodes = {-1: tree}
        for depth, text in pool_tree_lines(sample):
            parent = nodes.get(depth - 1, tree)
            style = "green" if text.startswith("·") else "bold"
            nodes[depth] = parent.add(Text(text, style=style))
        # agents
        agents = Table(box=None, show_header=True, header_style="bold", pad_edge=False)
        for col in ("agent", "state", "pool", "tps / why waiting"):
            agents.add_column(col)
        tps = {s["session_id"]: s for s in (sample or {}).get("sessions", ())}
        if rec is not None:
            for name, a in list(rec.agents.items())[-14:]:
                row = tps.get(a.get("session_id") or "", {})
                speed = "warming" if row.get("warming") else _f(row.get("tps_ewma")) if row else "-"
                style = {"waiting": "yellow", "running": "green", "done": "dim"}.get(a["state"], "")
                extra = speed if a["state"] == "running" else (a.get("reason") or "") if a["state"] == "waiting" else ""
                agents.add_row(name, Text(a["state"], style=style), str(a.get("pool_id", "-")), extra[:40])
        # feed: decisions and steps
        feed = Text()
        if rec is not None:
            lines = [ln for ln in rec.feed if ln["kind"] in ("decision", "event", "phase", "compaction", "pool")]
            for ln in lines[-self.max_lines:]:
                color = {"decision": "yellow", "event": "magenta", "phase": "cyan", "compaction": "red",
                         "pool": "blue"}.get(ln["kind"], "")
                feed.append(f"{ln['t'] - rec.t0:6.1f}s ", style="dim")
                feed.append(ln["text"][:150] + "\n", style=color)
        grid = Table.grid(expand=True)
        grid.add_column(ratio=3)
        grid.add_column(ratio=2)
        grid.add_row(Panel(tree, title="pool tree"), Panel(agents, title="agents"))
        return Group(Panel(head, title="opencoti demo"), grid, Panel(feed, title="admission decisions & steps"))

    def start(self, recorder: Recorder, title: str = "") -> None:
        from rich.live import Live
        self.recorder = recorder
        self.title = title
        self._live = Live(get_renderable=self.render, console=self.console,
                          refresh_per_second=self.refresh_per_second, transient=False)
        self._live.start()

    def stop(self) -> None:
        if self._live is not None:
            self._live.refresh()
            self._live.stop()
            self._live = None


def make_view(stream: TextIO | None = None, *, plain: bool | None = None):
    """A ``RichView`` when ``stream`` (default stdout) is a terminal, else a ``PlainView``."""
    stream = stream or sys.stdout
    if plain is None:
        plain = not (hasattr(stream, "isatty") and stream.isatty())
    if plain:
        return PlainView(stream)
    from rich.console import Console
    return RichView(Console(file=stream))
