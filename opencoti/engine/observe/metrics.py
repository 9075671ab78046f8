"""Per-session experienced decode tps, aggregate throughput, context headroom, counters (docs/polykv.md).

Definitions (what every number means):

* **Experienced tps of a session** (``tps_ewma``): a sample is one *inter-token interval* ``dt``
  between two consecutive accepted generated tokens of the same request; the first token of a
  request closes its prefill and starts a new chain, so prefill time and the gap between turns
  are never counted (llama.cpp's ``predicted_per_second`` uses the same intervals). The estimate
  is an exponentially weighted *harmonic* rate over a window::

      window  = the last ``window_tokens`` intervals (default 128), further cut to those that
                ended within ``window_s`` (default 2 s) of the session's newest token
                (whichever is smaller; the newest interval is always kept)
      weights = exp(-(t_newest - t_i) / tau_s)         (tau_s defaults to window_s)
      tps     = sum(w_i) / sum(w_i * dt_i)

  A plain mean of ``1/dt`` would overstate the rate of a jittery stream (Jensen); the weighted
  harmonic form equals tokens / seconds when the weights are flat, so over a window that covers
  a whole request at a steady rate it equals ``timings.predicted_per_second``.
* **Warming**: a session with a request in flight (waiting, prefilling or decoding) whose current
  request has no interval yet (fewer than ``min_samples``). Its ``tps_ewma`` reads 0; it is
  excluded from ``mean_active_tps`` and counted in ``n_warming``.
* **Active**: decoding and not warming. ``mean_active_tps`` is the mean ``tps_ewma`` over them.
  Continuous batching gives every decoding session one token per step, so this is one number for
  the whole engine; every pool's floor compares against it.
* **Aggregate tps**: generated tokens per second of the whole engine over the last
  ``aggregate_window_s``, from per-step token counts (see ``RateWindow``). ``prefill_tps`` is the
  same for computed prompt tokens (pool materializations included).
* **Context**: ``ctx_used`` = tokens of the session's context (pool prefix + own suffix + generated),
  ``ctx_total`` = the engine's per-sequence context limit, ``ctx_headroom_tokens`` =
  ``min(ctx_total - ctx_used, free KV cells)`` where free KV cells = free pages plus pages the
  engine would reclaim (idle sessions' own pages, evictable pools). ``compaction_pressure`` (0..1) =
  ``max(KV occupancy, ctx_used / ctx_total)``: it approaches 1 when either the shared cache or this
  session's own context is about to run out, so an orchestrator compacts before the wall.

Everything here runs on the engine's step thread (listener callbacks, and the facade's ``run_on_step_thread``).
The estimators (``tps``) take explicit timestamps, so tests drive them with a scripted clock.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator

from ..requests import Job, SessionState
from .tps import RateWindow, SessionTps, TpsConfig
from ..speculation import acceptance
from ..polykv.view import PolyKVView

__all__ = ["Activity", "Metrics", "RateWindow", "SessionTps", "TpsConfig"]

log = logging.getLogger("opencoti.metrics")


# ============================================================================ engine adapter
@dataclass
class Activity:
    """Who is decoding right now (engine-wide)."""

    mean_active_tps: float | None  # None when no session is active
    n_active: int  # decoding, measured
    n_warming: int  # in flight, not measured yet
    n_decoding: int  # decode batch size (active + warming that are decoding)
    tps_by_session: dict  # session_id -> tps of active sessions
    n_inflight: int = 0  # generation requests in flight (waiting, prefilling or decoding)


class Metrics:
    """Listens to the engine core and answers tps / context / counter questions.

    Built by the Engine at start-up; all methods run on the step thread. It reads the core only
    through ``PolyKVView`` (polykv/view.py).
    """

    def __init__(self, core: PolyKVView, config: TpsConfig | None = None, *, clock: Callable[[], float] = time.perf_counter,
                 wall_clock: Callable[[], float] = time.time):
        self.core = core
        self.cfg = config or TpsConfig()
        self.clock = clock  # the clock of the core's token events (time.perf_counter)
        self.wall_clock = wall_clock
        self.meters: dict[str, SessionTps] = {}
        self.aggregate = RateWindow(self.cfg.aggregate_window_s)
        self.prefill = RateWindow(self.cfg.aggregate_window_s)
        self._step_tokens = 0
        # model_steps / step_seqs / draft_verifications: llama.cpp's n_decode, n_busy_slots, spec_decode_num_drafts
        self.totals = {"decode_steps": 0, "prefill_tokens_computed": 0, "generated_tokens": 0, "model_steps": 0,
                       "step_seqs": 0, "draft_verifications": 0}
        self.pool_counters: dict[int, dict] = {}
        self.history: deque[dict] = deque(maxlen=self.cfg.global_history_len)
        self.session_history: OrderedDict[str, deque] = OrderedDict()
        self._last_hist = -math.inf
        self.listener_errors = 0
        self._t_submit: dict[str, float] = {}  # session id -> submit time of its request in flight
        self.ttft_ms: dict[str, float] = {}  # session id -> time to first token of its latest request
        core.listeners.append(self._on_event)

    def configure(self, **kw) -> dict:
        """Change the windows (validated); existing samples are kept and re-read with the new windows.
        Without arguments, only reads the current settings."""
        if not kw:
            return asdict(self.cfg)
        cfg = self.cfg.updated(**kw)
        self.cfg = cfg
        for m in self.meters.values():
            m.reconfigure(cfg)
        self.aggregate.window_s = self.prefill.window_s = cfg.aggregate_window_s
        self.history = deque(self.history, maxlen=cfg.global_history_len)
        for sid, h in self.session_history.items():
            self.session_history[sid] = deque(h, maxlen=cfg.history_len)
        return asdict(cfg)

    # ---------------------------------------------------------------- events (step thread)
    def _on_event(self, event: str, data: dict) -> None:
        try:
            if event == "token":
                self._on_token(data["job"], data["now"])
            elif event == "step":
                self._on_step(data["stats"])
            elif event == "submit":
                self._on_submit(data["job"])
        except Exception:  # noqa: BLE001 - metrics must never take a request down
            self.listener_errors += 1
            log.exception("metrics listener failed on %r", event)

    def _pool_counter(self, pool_id: int) -> dict:
        c = self.pool_counters.get(pool_id)
        if c is None:
            c = self.pool_counters[pool_id] = {"queries": 0, "prefix_cache_hits": 0, "prompt_tokens": 0,
                                               "cached_prompt_tokens": 0, "generated_tokens": 0}
        return c

    def _on_submit(self, job) -> None:
        info = job.info
        if job.session is not None:
            self._t_submit[job.session.session_id] = self.clock()
            m = self.meters.get(job.session.session_id)
            if info is not None and m is not None and m.value() > 0:
                info.session_tps = m.value()  # the rate the session decoded at before this request
        if info is None or info.pool_id is None:
            return
        c = self._pool_counter(info.pool_id)
        c["queries"] += 1
        c["prompt_tokens"] += info.prompt_tokens
        c["cached_prompt_tokens"] += info.cached_prefix_tokens
        if info.cached_prefix_tokens > 0:
            c["prefix_cache_hits"] += 1

    def _on_token(self, job, now: float) -> None:
        session = job.session
        if session is None:
            return
        m = self.meters.get(session.session_id)
        if m is None:
            m = self.meters[session.session_id] = SessionTps(self.cfg)
        m.on_token(now, job)
        if len(job.generated) == 1:
            t0 = self._t_submit.pop(session.session_id, None)
            if t0 is not None:
                self.ttft_ms[session.session_id] = max(0.0, now - t0) * 1e3
        self._step_tokens += 1
        self.totals["generated_tokens"] += 1
        if session.pool_id is not None:
            self._pool_counter(session.pool_id)["generated_tokens"] += 1

    def _on_step(self, stats) -> None:
        now = self.clock()
        if self._step_tokens:
            self.aggregate.add(now, self._step_tokens)
            self._step_tokens = 0
        if stats.num_prefill_tokens:
            self.prefill.add(now, stats.num_prefill_tokens)
            self.totals["prefill_tokens_computed"] += stats.num_prefill_tokens
        if stats.num_seqs and stats.num_decode:
            self.totals["decode_steps"] += 1
        if stats.num_seqs:
            self.totals["model_steps"] += 1
            self.totals["step_seqs"] += stats.num_seqs
            self.totals["draft_verifications"] += getattr(stats, "num_drafted", 0)
        if now - self._last_hist >= self.cfg.history_interval_s:
            self._last_hist = now
            self._sample_history(now)

    # ---------------------------------------------------------------- queries (step thread)
    def generation_jobs(self) -> Iterator[Any]:  # Jobs whose session is set (typed Any: not narrowed)
        """The unfinished requests of sessions in flight: running, then waiting (admission reads them)."""
        sch = self.core.scheduler
        for job in list(sch.running) + list(sch.waiting):
            if isinstance(job, Job) and job.session is not None and job.finish_reason is None:
                yield job

    def session_tps(self, session_id: str, job=None) -> float:
        """tps_ewma as reported: 0 while warming, the last value when idle."""
        m = self.meters.get(session_id)
        if m is None:
            return 0.0
        if job is not None and not m.is_fresh(job):
            return 0.0
        return m.value()

    def activity(self) -> Activity:
        tps: dict[str, float] = {}
        n_warming = n_decoding = n_inflight = 0
        for job in self.generation_jobs():
            n_inflight += 1
            sid = job.session.session_id
            m = self.meters.get(sid)
            fresh = m is not None and m.is_fresh(job)
            decoding = job.state == SessionState.DECODE and job.started
            if decoding:
                n_decoding += 1
            if decoding and fresh and m is not None:  # (fresh: m is not None)
                tps[sid] = m.value()
            elif not fresh:
                n_warming += 1
        mean = sum(tps.values()) / len(tps) if tps else None
        return Activity(mean, len(tps), n_warming, n_decoding, tps, n_inflight)

    def kv_cells(self, keep_pool=None) -> dict:
        """KV cells (tokens) of the engine: total, free (free pages plus what ``reclaim`` would free
        on demand: prefix-cache pages, idle sessions' own pages and evictable pools, except ``keep_pool`` and its
        ancestors, which a new session on ``keep_pool`` would use), and reserved (pages running
        requests still need to reach their max_tokens). ``available`` = free - reserved."""
        core, kv = self.core, self.core.kv
        ps = core.page_size
        now = time.monotonic()
        keep = set()
        while keep_pool is not None:
            keep.add(keep_pool.pool_id)
            keep_pool = keep_pool.parent
        reclaimable = sum(len(s.seq.owned_pages) for s in core.sessions.values() if s.is_idle and s.seq.page_table)
        reclaimable += sum(len(p.seq.owned_pages) for p in core.tree.pools.values()
                           if p.residency == "resident" and not p.pinned and p.pool_id not in keep
                           and not core.auto_pinned(p, now))
        reclaimable += core.tables.num_cache_only()  # pages only the prefix cache holds
        reserved = 0
        for job in self.generation_jobs():
            if job.params.max_tokens is None:
                continue
            final = min(job.prompt_len + job.params.max_tokens, core.max_context)
            have = len(job.seq.page_table) if job.started else job.timings.cache_n // ps
            reserved += max(0, -(-final // ps) - have)
        total = kv.num_pages * ps
        free = (kv.num_free + reclaimable) * ps
        return {"total": total, "free": free, "reserved": reserved * ps,
                "available": max(0, free - reserved * ps), "free_now": kv.num_free * ps}

    def session_row(self, s, cells: dict) -> dict:
        job = s.job
        meter = self.meters.get(s.session_id)
        ctx_used = len(job.seq.tokens) if job is not None else len(s.seq.tokens)
        ctx_total = self.core.max_context
        occupancy = 1.0 - cells["free"] / cells["total"] if cells["total"] else 1.0
        return {
            "session_id": s.session_id,
            "pool_id": s.pool_id,
            "tps_ewma": self.session_tps(s.session_id, job),
            "warming": job is not None and not (meter is not None and meter.is_fresh(job)),
            "ctx_used": ctx_used,
            "ctx_total": ctx_total,
            "ctx_headroom_tokens": max(0, min(ctx_total - ctx_used, cells["free"])),
            "compaction_pressure": _clamp01(max(occupancy, ctx_used / ctx_total if ctx_total else 1.0)),
            "generated_tokens": meter.total_tokens if meter is not None else 0,
            "ttft_ms": self.ttft_ms.get(s.session_id),
            "state": s.state.value,
            # RAM, disk (the KV tier) or nowhere, and the tokens of each
            **self.core.tables.kv_location(s.seq, getattr(s, "spilled_keys", ())),
            **acceptance(job.draft_state if job is not None else None),  # its request's speculative drafts
        }

    def snapshot(self) -> dict:
        """``{ts, aggregate_tps, mean_active_tps, n_warming, sessions: [...]}`` plus
        ``n_active``, ``prefill_tps``, KV cells and the engine-wide ``compaction_pressure``."""
        now = self.clock()
        act = self.activity()
        cells = self.kv_cells()
        rows = [self.session_row(s, cells) for _, s in sorted(self.core.sessions.items())]
        occupancy = 1.0 - cells["free"] / cells["total"] if cells["total"] else 1.0
        return {
            "ts": self.wall_clock(),
            "aggregate_tps": self.aggregate.rate(now),
            "mean_active_tps": act.mean_active_tps,  # None when no session is active (as in /capacity)
            "n_active": act.n_active,
            "n_warming": act.n_warming,
            "n_decoding": act.n_decoding,
            "prefill_tps": self.prefill.rate(now),
            "kv_free_cells": cells["free"],
            "kv_total_cells": cells["total"],
            "compaction_pressure": _clamp01(max([occupancy] + [r["compaction_pressure"] for r in rows])),
            "sessions": rows,
        }

    # ---------------------------------------------------------------- history
    def _sample_history(self, now: float) -> None:
        act = self.activity()
        ts = self.wall_clock()
        self.history.append({"ts": ts, "aggregate_tps": self.aggregate.rate(now),
                             "mean_active_tps": act.mean_active_tps, "n_active": act.n_active,
                             "n_warming": act.n_warming, "n_decoding": act.n_decoding,
                             "prefill_tps": self.prefill.rate(now)})
        for job in self.generation_jobs():
            s = job.session
            h = self.session_history.get(s.session_id)
            if h is None:
                h = self.session_history[s.session_id] = deque(maxlen=self.cfg.history_len)
                while len(self.session_history) > self.cfg.max_session_histories:
                    self.session_history.popitem(last=False)
            else:
                self.session_history.move_to_end(s.session_id)
            h.append({"ts": ts, "tps_ewma": act.tps_by_session.get(s.session_id, 0.0),
                      "ctx_used": len(job.seq.tokens), "pool_id": s.pool_id, "state": job.state.value})
        for sid in [sid for sid in self.meters if sid not in self.core.sessions]:
            del self.meters[sid]  # released sessions (their history stays, bounded)
            self.ttft_ms.pop(sid, None)
            self._t_submit.pop(sid, None)

    def history_view(self, session_id: str | None = None, since: float | None = None) -> dict:
        """The sampled time series: engine-wide points and per-session points (``ts`` >= since)."""
        def cut(points):
            return [dict(p) for p in points if since is None or p["ts"] >= since]

        if session_id is not None:
            return {"session_id": session_id, "points": cut(self.session_history.get(session_id, ()))}
        return {"interval_s": self.cfg.history_interval_s, "aggregate": cut(self.history),
                "sessions": {sid: cut(h) for sid, h in self.session_history.items()}}

    # ---------------------------------------------------------------- counters & exposition
    def counters(self) -> dict:
        """Lifetime counters: engine totals and per pool (kept after a pool is released)."""
        core = self.core
        totals = {**core.counters, **self.totals}
        pools = {}
        for pid, c in sorted(self.pool_counters.items()):
            pool = core.tree.pools.get(pid)
            pools[pid] = {**c, "live": pool is not None}
        return {"totals": totals, "pools": pools}

    def prometheus(self) -> str:
        """Prometheus text exposition (labels: pool only, never session: bounded cardinality)."""
        core = self.core
        act = self.activity()
        now = self.clock()
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, v in samples:
                lines.append(f"{name}{labels} {float(v):.6g}")

        per_pool: dict[int, float] = {}
        per_pool_sessions: dict[int, int] = {}
        for job in self.generation_jobs():
            pid = job.session.pool_id
            if pid is not None and job.session.session_id in act.tps_by_session:
                per_pool[pid] = per_pool.get(pid, 0.0) + act.tps_by_session[job.session.session_id]
        live = sorted(core.tree.pools.values(), key=lambda p: p.pool_id)
        for p in live:
            per_pool_sessions[p.pool_id] = len(p.sessions)
        lab = lambda pid: f'{{pool="{pid}"}}'  # noqa: E731
        # a released pool leaves no series (its lifetime counters stay in counters())
        live_counters = [(pid, c) for pid, c in sorted(self.pool_counters.items()) if pid in core.tree.pools]
        metric("opencoti_polykv:aggregate_tps", "gauge", "Engine decode tokens/s (recent window)",
               [("", self.aggregate.rate(now))])
        # no sample while no session is active: 0.0 would read as "infinitely slow" (docs/polykv.md)
        metric("opencoti_polykv:mean_active_tps", "gauge", "Mean experienced decode tps of active sessions",
               [] if act.mean_active_tps is None else [("", act.mean_active_tps)])
        metric("opencoti_polykv:sessions_warming", "gauge", "Sessions in flight without a tps sample yet",
               [("", act.n_warming)])
        metric("opencoti_polykv:gen_throughput_tps", "gauge", "Sum of experienced decode tps per pool",
               [(lab(p.pool_id), per_pool.get(p.pool_id, 0.0)) for p in live])
        metric("opencoti_polykv:pool_kv_bytes", "gauge", "KV bytes a pool owns (its [D, L) range)",
               [(lab(p.pool_id), len(p.seq.owned_pages) * core.kv.page_bytes) for p in live])
        metric("opencoti_polykv:pool_sessions", "gauge", "Sessions attached to a pool",
               [(lab(p.pool_id), per_pool_sessions[p.pool_id]) for p in live])
        metric("opencoti_polykv:prefix_cache_hits_total", "counter", "Requests that reused cached prefix tokens",
               [(lab(pid), c["prefix_cache_hits"]) for pid, c in live_counters])
        metric("opencoti_polykv:queries_total", "counter", "Requests attached to a pool",
               [(lab(pid), c["queries"]) for pid, c in live_counters])
        for key in ("prompt_tokens", "cached_prompt_tokens", "generated_tokens"):
            metric(f"opencoti_{key}_total", "counter", f"Lifetime {key.replace('_', ' ')}",
                   [("", core.counters[key])])
        return "\n".join(lines) + "\n"


def _clamp01(x: float) -> float:
    return 0.0 if x < 0 else 1.0 if x > 1 else float(x)
