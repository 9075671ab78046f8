"""Recorder: samples the engine's state during a demo run (over a ``PolyKVClient``, so the same code
records an in-process engine or a remote ``opencoti serve``) and collects what the scenario reports
(phases, gate decisions, model calls, pools made, compactions).

Everything the report shows comes from here; nothing is computed from assumptions. One sample is

    {t, aggregate_tps, mean_active_tps, n_active, n_warming, n_decoding,          # GET /polykv/tps
     sessions: [{session_id, pool_id, tps_ewma, warming, state, ctx_used}],
     kv_pages_used, kv_pages_total, kv_bytes_used, page_size,                     # GET /polykv/pools
     pools: [{pool_id, parent, branch_pos, prefix_len, own_kv_bytes, subtree_kv_bytes, label,
              sessions: [{session_id, ctx_used, suffix_n_tokens, marginal_kv_bytes, state}]}],
     agents: {name: state}}                                                        # the scenario's own view

``t`` is this process's wall clock (``time.time()``); engine timestamps (admission events) are
shifted onto it by the offset measured between the engine's snapshot ``ts`` and the local clock
(zero in-process; the clock skew to a remote server otherwise).
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from typing import Any, Callable

log = logging.getLogger("opencoti.demo")

# the fields of a pool / session kept per sample (the rest of the status is not needed by the report)
_POOL_KEYS = ("pool_id", "parent", "branch_pos", "prefix_len", "own_len", "own_kv_bytes", "subtree_kv_bytes",
              "label", "residency")
_POOL_SESSION_KEYS = ("session_id", "ctx_used", "suffix_n_tokens", "marginal_kv_bytes", "state")
_SESSION_KEYS = ("session_id", "pool_id", "tps_ewma", "warming", "state", "ctx_used", "ctx_total",
                 "compaction_pressure")
_TPS_KEYS = ("aggregate_tps", "mean_active_tps", "n_active", "n_warming", "n_decoding", "prefill_tps")


def _dump(x: Any) -> dict:
    return x.model_dump() if hasattr(x, "model_dump") else dict(x)


def pages_for(tokens: int, page_size: int) -> int:
    """KV pages a private sequence of ``tokens`` tokens occupies (the allocator's granularity)."""
    return -(-max(int(tokens), 0) // max(int(page_size), 1))


def kv_accounting(pools_status: dict) -> dict:
    """KV bytes of one pool-tree status (one atomic ``pools()`` answer), by ownership, plus what the
    same sessions would hold without sharing.

    * ``used``: physical bytes in use (``kv_bytes_used``).
    * ``pools``: bytes the pools own (each its ``[D, L)``); ``sessions``: bytes the pool sessions own
      (their suffixes); ``other``: the rest of ``used`` (sessions without a pool, which share
      nothing, and released pools still referenced).
    * ``without_sharing``: every pool session holding its whole context privately
      (``pages(ctx_used) * page_bytes``) plus ``other`` (already private).
    * ``saved`` = ``without_sharing - used``.
    """
    used = int(pools_status.get("kv_bytes_used") or 0)
    pages = int(pools_status.get("kv_pages_used") or 0)
    ps = int(pools_status.get("page_size") or 1)
    page_bytes = pools_status.get("page_bytes") or (used // pages if pages else 0)
    own = sum(int(p.get("own_kv_bytes") or 0) for p in pools_status.get("pools", ()))
    sess = full = n_sessions = 0
    for p in pools_status.get("pools", ()):
        for s in p.get("sessions", ()):
            n_sessions += 1
            sess += int(s.get("marginal_kv_bytes") or 0)
            full += pages_for(s.get("ctx_used") or 0, ps) * page_bytes
    other = max(used - own - sess, 0)
    without = full + other
    return {"used": used, "pools": own, "sessions": sess, "other": other, "without_sharing": without,
            "saved": without - used, "page_bytes": page_bytes, "page_size": ps, "n_pool_sessions": n_sessions}


def compact_pools(status: dict) -> list[dict]:
    """The per-pool fields a sample keeps."""
    out = []
    for p in status.get("pools", ()):
        d = {k: p.get(k) for k in _POOL_KEYS}
        d["sessions"] = [{k: s.get(k) for k in _POOL_SESSION_KEYS} for s in p.get("sessions", ())]
        out.append(d)
    return out


class Recorder:
    """Samples ``client`` every ``interval_s`` seconds in a thread and keeps the scenario's log.

    ``client``: a ``PolyKVClient`` (either transport). All methods are thread-safe; the live view
    reads ``latest`` and ``feed`` while the scenario writes.
    """

    def __init__(self, client: Any, *, interval_s: float = 0.25, clock: Callable[[], float] = time.time):
        self.client = client
        self.interval_s = interval_s
        self.clock = clock
        self.t0 = clock()
        self.t_end: float | None = None
        self.samples: list[dict] = []
        self.last_status: dict | None = None  # the pools() answer of the latest sample
        self.events: list[dict] = []  # engine admission events, ts on the local clock
        self.phases: list[dict] = []
        self.decisions: list[dict] = []  # the capacity gates' decisions
        self.requests: list[dict] = []  # every model call
        self.pool_ops: list[dict] = []  # pools created / forked / released
        self.compactions: list[dict] = []
        self.agents: dict[str, dict] = {}  # name -> {state, pool_id, session_id, role, t}
        self.feed: list[dict] = []  # human-readable lines for the views: {t, kind, text}
        self.errors: list[str] = []
        self.info: dict = {}  # model, transport, page size, ... (set by the runner)
        self._offsets: list[float] = []
        self._events_since: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- sampling
    @property
    def clock_offset(self) -> float:
        """Engine clock minus local clock (median over the samples; 0 before the first)."""
        with self._lock:
            return statistics.median(self._offsets) if self._offsets else 0.0

    def sample_once(self) -> dict:
        """Take one sample now (also what the sampling thread does)."""
        t_before = self.clock()
        snap = _dump(self.client.tps())
        status = _dump(self.client.pools())
        t = self.clock()
        mid = (t_before + t) / 2
        sample = {"t": t}
        for k in _TPS_KEYS:
            sample[k] = snap.get(k)
        sample["sessions"] = [{k: s.get(k) for k in _SESSION_KEYS} for s in snap.get("sessions", ())]
        for k in ("kv_pages_used", "kv_pages_total", "kv_bytes_used", "page_size"):
            sample[k] = status.get(k)
        sample["pools"] = compact_pools(status)
        sample["kv"] = kv_accounting(status)
        with self._lock:
            self.last_status = status  # the pools() answer of the latest sample, whole
            sample["agents"] = {name: a["state"] for name, a in self.agents.items()}
            if snap.get("ts"):
                self._offsets.append(float(snap["ts"]) - mid)
                if len(self._offsets) > 64:
                    self._offsets = self._offsets[-64:]
            self.samples.append(sample)
        self._poll_events()
        return sample

    def _poll_events(self) -> None:
        evs = self.client.events(since=self._events_since)
        off = self.clock_offset
        with self._lock:
            seen = {(e["ts_engine"], e["event"], e.get("pool_id"), e.get("session_id")) for e in self.events[-256:]}
            for e in evs:
                key = (e.get("ts"), e.get("event"), e.get("pool_id"), e.get("session_id"))
                if key in seen:
                    continue
                row = {k: v for k, v in e.items() if k not in ("t",)}
                row["ts_engine"] = e.get("ts")
                row["t"] = float(e.get("ts") or 0.0) - off
                self.events.append(row)
                self._events_since = max(self._events_since or 0.0, float(e.get("ts") or 0.0))
                text = _event_text(row)
                if text:
                    self.feed.append({"t": row["t"], "kind": "event", "text": text})

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            try:
                self.sample_once()
            except Exception as e:  # noqa: BLE001 - a failed sample must not stop the run
                with self._lock:
                    self.errors.append(f"sample failed: {type(e).__name__}: {e}")
                log.debug("sample failed", exc_info=True)
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t)))

    def start(self) -> "Recorder":
        self.t0 = self.clock()
        self._thread = threading.Thread(target=self._run, name="opencoti-demo-recorder", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling; take one last sample (the run's final state)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            self.sample_once()
        except Exception as e:  # noqa: BLE001
            self.errors.append(f"final sample failed: {type(e).__name__}: {e}")
        self.t_end = self.clock()

    @property
    def latest(self) -> dict | None:
        with self._lock:
            return self.samples[-1] if self.samples else None

    # ---------------------------------------------------------------- the scenario's log
    def _line(self, kind: str, text: str, t: float | None = None) -> None:
        self.feed.append({"t": self.clock() if t is None else t, "kind": kind, "text": text})

    def phase(self, name: str, text: str = "", **data) -> None:
        """A scenario step begins (``name``: a short id, ``text``: what happens)."""
        t = self.clock()
        with self._lock:
            self.phases.append({"t": t, "name": name, "text": text, **data})
            self._line("phase", f"{name}: {text}" if text else name, t)

    def note(self, text: str) -> None:
        with self._lock:
            self._line("note", text)

    def decision(self, agent: str, pool_id: int | None, decision: str, cap: dict | None = None, **data) -> None:
        """A capacity gate decided (``spawn`` / ``wait`` / ``hold``) for ``agent`` on ``pool_id``."""
        cap = cap or {}
        row = {"t": self.clock(), "agent": agent, "pool_id": pool_id, "decision": decision,
               "reason": cap.get("reason"), "can_admit": cap.get("can_admit"), "settling": cap.get("settling"),
               "mean_active_tps": cap.get("mean_active_tps"),
               "projected_mean_tps_if_admitted": cap.get("projected_mean_tps_if_admitted"),
               "headroom_sessions": cap.get("headroom_sessions"), "n_pool_sessions": cap.get("n_pool_sessions"),
               "guaranteed": cap.get("guaranteed"), **data}
        with self._lock:
            self.decisions.append(row)
            self._line("decision", _decision_text(row), row["t"])
            a = self.agents.get(agent)
            if a is not None:
                a["reason"] = row["reason"] if decision != "spawn" else None

    def agent(self, name: str, state: str, **data) -> None:
        """An agent's lifecycle: ``waiting`` (at a gate), ``running``, ``done``."""
        with self._lock:
            a = self.agents.setdefault(name, {"name": name, "t_created": self.clock()})
            a.update(data)
            a["state"] = state
            a.setdefault("history", []).append((self.clock(), state))

    def request(self, row: dict) -> None:
        """One finished model call (see ``runner.RequestLog``)."""
        with self._lock:
            self.requests.append(row)
            self._line("request", _request_text(row), row.get("t_end"))

    def pool_op(self, op: str, pool: dict, **data) -> None:
        """A pool was created / forked / released (``pool``: its status)."""
        row = {"t": self.clock(), "op": op, **{k: pool.get(k) for k in _POOL_KEYS if k in pool}, **data}
        with self._lock:
            self.pool_ops.append(row)
            self._line("pool", _pool_text(row), row["t"])

    def compaction(self, row: dict) -> None:
        row = {"t": self.clock(), **row}
        with self._lock:
            self.compactions.append(row)
            self._line("compaction", (f"compacted {row.get('agent')}: pool {row.get('old_pool_id')} -> "
                                      f"{row.get('new_pool_id')}, context {row.get('ctx_before')} -> "
                                      f"{row.get('ctx_after')} tokens, KV pages {row.get('kv_pages_before')} -> "
                                      f"{row.get('kv_pages_after')}"), row["t"])

    def feed_since(self, index: int) -> tuple[list[dict], int]:
        """Feed lines from ``index`` on, and the next index."""
        with self._lock:
            return list(self.feed[index:]), len(self.feed)

    def snapshot(self) -> dict:
        """Everything recorded (JSON-able): what ``report.build_report`` reads."""
        with self._lock:
            return {"t0": self.t0, "t_end": self.t_end if self.t_end is not None else self.clock(),
                    "info": dict(self.info), "samples": list(self.samples), "events": list(self.events),
                    "phases": list(self.phases), "decisions": list(self.decisions),
                    "requests": list(self.requests), "pool_ops": list(self.pool_ops),
                    "compactions": list(self.compactions),
                    "agents": {k: {**v, "history": list(v.get("history", []))} for k, v in self.agents.items()},
                    "clock_offset": statistics.median(self._offsets) if self._offsets else 0.0,
                    "errors": list(self.errors)}


# ============================================================================ feed texts (pure)
def _fmt(x: Any, nd: int = 1) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def _event_text(e: dict) -> str | None:
    ev = e.get("event")
    pid = e.get("pool_id")
    if ev == "admit":
        return f"engine: pool {pid} admitted new session {e.get('session_id')} (settle window opens)"
    if ev == "settle_end":
        drop = e.get("drop")
        return (f"engine: pool {pid} settled by {e.get('by')} after {_fmt(e.get('settle_ms'), 0)} ms "
                f"(mean {_fmt(e.get('mean_at_admit'))} -> {_fmt(e.get('mean_settled'))} tok/s"
                + (f", drop {_fmt(drop, 2)}" if drop is not None else "") + ")")
    if ev == "policy":
        return (f"engine: pool {pid} policy floor={_fmt(e.get('target_tps_per_session'))} tok/s "
                f"mode={e.get('mode')} settle={e.get('settle_tokens')} tokens")
    if ev in ("hold", "rejected", "guaranteed", "overcommit", "warned"):
        return f"engine: pool {pid} {ev} ({e.get('reason') or e.get('kind') or ''})"
    return None


def _decision_text(d: dict) -> str:
    proj = d.get("projected_mean_tps_if_admitted")
    extra = f", projected {_fmt(proj)} tok/s" if proj is not None else ""
    verb = {"spawn": "admitted", "wait": "waits", "hold": "held"}.get(d["decision"], d["decision"])
    return f"gate: {d['agent']} {verb} on pool {d['pool_id']} ({d.get('reason') or ''}{extra})"


def _request_text(r: dict) -> str:
    return (f"{r.get('agent')}: {r.get('completion_tokens')} tokens on pool {r.get('pool_id')}, "
            f"{r.get('cached_tokens')}/{r.get('prompt_tokens')} prompt tokens cached, "
            f"TTFT {_fmt(r.get('ttft_ms'), 0)} ms, {_fmt(r.get('decode_tps'))} tok/s")


def _pool_text(p: dict) -> str:
    if p["op"] == "release":
        return f"pool {p.get('pool_id')} released ({p.get('label') or ''})"
    kind = p.get("kind") or p["op"]
    rng = f"[{p.get('branch_pos')}, {p.get('prefix_len')})"
    parent = f" from pool {p.get('parent')}" if p.get("parent") is not None else ""
    return f"pool {p.get('pool_id')} {kind}{parent}: {p.get('label') or ''} owns {rng}"
