"""The admission controller of one engine: measures pools, runs plan -> decide -> commit, holds.

Everything runs on the engine's step thread. ``submit`` (any thread) posts a command that
prepares the request (``EngineCore.prepare``: validation and an ``AdmissionPlan``, no side
effect), measures the pool (``GateInputs``, from ``measure.py``), asks the pure ``decide`` and
then either commits (``EngineCore.commit``), keeps the request in the pool's FIFO hold queue, or
fails it.

Deadlines are driven by the step loop: ``tick(now)`` runs every loop iteration (it closes settle
windows that ran out, refreshes settled means, re-tries held requests when something changed or
a deadline passed) and ``next_deadline()`` tells the loop how long it may sleep. No other thread.

Its dependencies are given at construction, never found: the core (an ``AdmissionCore``: the
``PolyKVView`` it reads, plus prepare / commit / cancel), a ``PostToStepThread`` function (the
Engine's ``post_to_step_thread``, or the simulator's) and the metrics. It calls nothing of the
Engine but that function.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from concurrent.futures import Future, InvalidStateError
from typing import Any, Callable, Protocol

from ..checks import is_int
from ..errors import InvalidRequestError, PoolSaturatedError
from ..requests import Job
from ..observe.metrics import Metrics
from ..polykv.view import PolyKVView
from .capacity import compute_capacity
from .decide import ADMIT, HOLD, REJECT, AdmissionPlan, Decision, GateInputs, decide
from .forecast import StepForecast
from .measure import capacity_inputs, soonest_finish_s
from .policy import (ADAPTIVE, ENFORCED, QUEUE, REASON_CONTEXT, REASON_OK, REASON_QUEUE_TIMEOUT,
                     AdmissionPolicy)
from .state import Held, PoolState

log = logging.getLogger("opencoti.admission")


class PostToStepThread(Protocol):
    """Runs ``fn(*args)`` on the step thread: a Future of its result, failed without running once
    the engine shuts down (``Engine.post_to_step_thread``)."""

    def __call__(self, fn: Callable[..., Any], *args: Any) -> Future: ...


class Prepared(Protocol):
    """A request ``AdmissionCore.prepare`` validated: its plan, for ``decide``."""

    @property
    def plan(self) -> AdmissionPlan: ...


class AdmissionCore(PolyKVView, Protocol):
    """What the controller needs of the core: the read-only view, and the request path it drives
    (``EngineCore.prepare`` -> ``commit``, ``cancel``; the simulator's ``SimCore`` has the same)."""

    def prepare(self, *args: Any, **kwargs: Any) -> Prepared: ...

    def commit(self, req: Any, admission: dict | None = None) -> Job: ...

    def cancel(self, job: Job) -> None: ...

_COUNT = {"admitted": "admitted", "guaranteed": "guaranteed", "overcommit": "overcommit", "warned": "warned"}


class AdmissionController:
    """Owns the per-pool policies and state, the decisions, and the hold queues of one engine."""

    poll_s = 0.5  # while requests are held: re-check at least this often (releases raise no event)
    refresh_s = 0.25  # period of the settled-mean refresh

    def __init__(self, core: AdmissionCore, post: PostToStepThread, metrics: Metrics, *,
                 clock: Callable[[], float] | None = None):
        """``core``: the engine's EngineCore; ``post``: how a request from another thread reaches the
        step thread (see ``PostToStepThread``)."""
        self.core = core
        self._post = post
        self.metrics = metrics
        self.clock = clock or metrics.clock
        self.states: dict[int, PoolState] = {}
        self.events: deque[dict] = deque(maxlen=4096)
        self._settling: dict[str, int] = {}  # session id -> pool id of the open settle window
        self._last_refresh = -math.inf
        self._closed = False
        self._retry_due = False  # something changed: re-try held requests at the next tick
        self.forecast = StepForecast()  # engine-wide step time per batch size
        self._batch = (0, -math.inf)  # (requests in flight, since when): calibration needs a steady batch
        self.listener_errors = 0
        self.core.listeners.append(self._on_event)

    # ---------------------------------------------------------------- public (step thread)
    def state(self, pool_id: int) -> PoolState:
        st = self.states.get(pool_id)
        if st is None:
            st = self.states[pool_id] = PoolState(pool_id)
        return st

    def set_policy(self, pool_id: int, **policy) -> dict:
        self.core.tree.get(pool_id)  # PoolNotFoundError
        st = self.state(pool_id)
        st.policy = st.policy.updated(**policy)
        self._event(pool_id, "policy", **st.policy.as_dict())
        self._retry_due = bool(st.queue)
        return {"pool_id": pool_id, **st.policy.as_dict()}

    def policy(self, pool_id: int) -> dict:
        self.core.tree.get(pool_id)
        st = self.states.get(pool_id)
        return {"pool_id": pool_id, **(st.policy if st else AdmissionPolicy()).as_dict()}

    def capacity(self, pool_id: int, expected_tokens: int | None = None, session_id: str | None = None) -> dict:
        """The capacity report of pool ``pool_id``: would one more session new to the pool fit now?"""
        if expected_tokens is not None and not (is_int(expected_tokens) and expected_tokens >= 0):
            raise InvalidRequestError(f"expected_tokens must be a non-negative integer, got {expected_tokens!r}")
        if session_id is not None and not isinstance(session_id, str):
            raise InvalidRequestError("session_id must be a string")
        pool = self.core.tree.get(pool_id)
        now = self.clock()
        self._expire_all(now)
        st = self.state(pool_id)
        s = self.core.sessions.get(session_id) if session_id is not None else None
        known = s is not None and s.pool_id == pool_id
        inputs = capacity_inputs(self.core, self.metrics, self.forecast, pool, st, expected_tokens, now, known=known)
        cap = compute_capacity(inputs)
        if known:  # a continuation on its own pool is never gated: the report says so
            cap["can_admit"], cap["reason"] = cap["context_ok"], REASON_OK if cap["context_ok"] else REASON_CONTEXT
        cap["pool_id"] = pool_id
        cap["n_queued"] = len(st.queue)
        return cap

    def events_view(self, pool_id: int | None = None, since: float | None = None) -> list[dict]:
        return [dict(e) for e in self.events
                if (pool_id is None or e["pool_id"] == pool_id) and (since is None or e["ts"] >= since)]

    def submit(self, *args, **kwargs) -> Future:
        """``EngineCore`` prepare -> decide -> commit, from any thread: the future resolves with the
        Job (or the error) once the request is admitted, which may be later for a held request."""
        entry = Held(args, kwargs, Future())
        cmd = self._post(self._submit_command, entry)
        # the command fails without running when the engine shuts down first: fail the request too
        def failed(f: Future) -> None:
            error = f.exception()
            if error is not None:
                self._fail(entry, error)
        cmd.add_done_callback(failed)
        return entry.future

    def evaluate(self, plan: AdmissionPlan, now: float, entry: Held | None = None) -> Decision:
        """Measure the plan's pool and decide (``entry``: the held request, None: a caller that cannot wait)."""
        pid = plan.pool_id
        st = self.states.get(pid) if pid is not None else None
        if pid is None or not plan.gated or st is None or st.policy.mode != ENFORCED:
            return decide(plan, None)
        pool = self.core.tree.get(pid)
        self._expire(st, now)
        queued_ahead = len(st.queue)
        if entry is not None and entry in st.queue:
            queued_ahead = st.queue.index(entry)
        inputs = capacity_inputs(self.core, self.metrics, self.forecast, pool, st, plan.expected_tokens, now,
                                 prompt_len=plan.prompt_len)
        g = GateInputs(inputs, now,
                       can_hold=entry is not None,
                       held_since=entry.t_hold if entry is not None else None, queued_ahead=queued_ahead,
                       soonest_finish_s=soonest_finish_s(self.metrics))
        return decide(plan, g)

    def committed(self, plan: AdmissionPlan, decision: Decision, job: Job, now: float) -> None:
        """After the core committed ``plan``: count it and open the pool's settle window."""
        if plan.pool_id is None:
            return
        st = self.state(plan.pool_id)
        if decision.kind in _COUNT:
            st.counts[_COUNT[decision.kind]] += 1
        if decision.kind not in ("ungated", "admitted"):
            self._event(st.pool_id, decision.kind, reason=decision.reason)
            if decision.warning:
                log.warning(decision.warning)
        if plan.new_to_pool and job.session is not None:
            mean = self.metrics.activity().mean_active_tps
            self._expire(st, now)
            if st.settle is not None and self._settling.get(st.settle.session_id) == st.pool_id:
                del self._settling[st.settle.session_id]
            b = self.metrics.activity().n_inflight
            settle = st.start_settle(now, job.session.session_id, mean, b, self.forecast.measured_steps(b))
            self._settling[job.session.session_id] = st.pool_id
            self._event(st.pool_id, "admit", session_id=job.session.session_id, mean_at_admit=mean,
                        admits_in_window=settle.admits)

    def rejected(self, pool_id: int, decision: Decision) -> PoolSaturatedError:
        st = self.state(pool_id)
        st.counts["rejected"] += 1
        if decision.reason == REASON_QUEUE_TIMEOUT:
            st.counts["queue_timeouts"] += 1
        self._event(pool_id, "rejected", reason=decision.reason, retry_after=decision.retry_after)
        return decision.error(pool_id)

    def tick(self, now: float | None = None) -> None:
        """Step-loop hook: close settle windows that ran out, refresh settled means, forget released
        pools, and re-try held requests when something changed or a deadline passed."""
        if self._closed:
            return
        now = self.clock() if now is None else now
        try:
            self._expire_all(now)
            if now - self._last_refresh >= self.refresh_s:
                self._last_refresh = now
                self._refresh(now)
            nd = self._next_held_deadline()
            if self._retry_due or (nd is not None and now >= nd - 1e-3):
                self._retry_due = False
                self._retry_held(now)
        except Exception:  # noqa: BLE001 - admission bookkeeping must never stop the step loop
            self.listener_errors += 1
            log.exception("admission tick failed")

    def next_deadline(self) -> float | None:
        """The earliest time (controller clock) at which ``tick`` has work: a settle window's end,
        or a held request's wake-up, deadline or poll. None: nothing pending."""
        times = [d for st in self.states.values() if (d := st.settle_deadline()) is not None]
        nd = self._next_held_deadline()
        if nd is not None:
            times.append(nd)
        if self._retry_due:
            times.append(-math.inf)
        return min(times) if times else None

    def close(self, error: Exception) -> None:
        """Engine shutdown (step thread): fail every held request."""
        self._closed = True
        for st in self.states.values():
            while st.queue:
                self._fail(st.queue.popleft(), error)

    def _refresh(self, now: float) -> None:
        act = self.metrics.activity()
        b = act.n_inflight
        if b != self._batch[0]:
            self._batch = (b, now)
        elif (act.mean_active_tps is not None and not act.n_warming and not self._settling
              and now - self._batch[1] >= self.metrics.cfg.window_s):
            self.forecast.calibrate(act.mean_active_tps, b)  # the tps window covers only this batch size
        for pid, st in list(self.states.items()):
            pool = self.core.tree.pools.get(pid)
            if pool is None:
                if not st.queue:
                    del self.states[pid]
                    for sid in [sid for sid, p in self._settling.items() if p == pid]:
                        del self._settling[sid]
                continue
            if st.settle is None and pool.sessions:
                if act.mean_active_tps is not None:
                    st.last_settled_mean, st.last_settled_t = act.mean_active_tps, now

    # ---------------------------------------------------------------- settle windows
    def _expire_all(self, now: float) -> None:
        for pid in set(self._settling.values()):
            st = self.states.get(pid)
            if st is not None:
                self._expire(st, now)

    def _expire(self, st: PoolState, now: float) -> None:
        d = st.settle_deadline()
        if d is not None and now >= d:
            self._end_settle(st, now, self.metrics.activity().mean_active_tps, fold=True, by="time")

    def _end_settle(self, st: PoolState, now: float, mean_now: float | None, fold: bool, by: str) -> None:
        if st.settle is None:
            return  # no window open: nothing to close
        sid = st.settle.session_id
        if self._settling.get(sid) == st.pool_id:
            del self._settling[sid]
        row = st.end_settle(now, mean_now, fold)
        self._event(st.pool_id, "settle_end", by=by, **row)
        if st.queue:
            self._retry_due = True

    # ---------------------------------------------------------------- events (step thread)
    def _event(self, pool_id: int | None, name: str, **data) -> None:
        self.events.append({"ts": self.metrics.wall_clock(), "t": self.clock(), "pool_id": pool_id, "event": name,
                            **data})

    def _on_event(self, event: str, data: dict) -> None:
        try:
            if event == "token":
                self._on_token(data["job"])
            elif event == "step":
                st = data["stats"]
                if getattr(st, "num_draft", 0):
                    return  # a speculative step is not a plain decode step: the forecast stays plain (a lower bound)
                self.forecast.observe(st.num_seqs if st.num_decode == st.num_seqs else 0, st.num_prefill_tokens,
                                      st.total_s, getattr(st, "ctx_tokens", None))
            elif event == "finish":
                self._on_finish(data["job"])
        except Exception:  # noqa: BLE001 - admission bookkeeping must never take a request down
            self.listener_errors += 1
            log.exception("admission listener failed on %r", event)

    def _on_token(self, job: Job) -> None:
        if not self._settling or job.session is None:
            return
        st = self._settling_state(job.session.session_id)
        if st is None or st.settle is None:
            return
        st.settle.tokens += 1
        if st.settle.tokens >= self._settle_tokens(st):
            self._end_settle(st, self.clock(), self.metrics.activity().mean_active_tps, fold=True, by="tokens")

    def _settling_state(self, session_id: str) -> PoolState | None:
        """The state of the pool whose settle window ``session_id`` opened (None: it opened none)."""
        pid = self._settling.get(session_id)
        return self.states.get(pid) if pid is not None else None

    def _settle_tokens(self, st: PoolState) -> int:
        """Tokens the open settle window waits for: the policy's settle_tokens, or (adaptive) as
        many as the measured noise at the new batch size needs beyond the steps already measured
        there, within that."""
        settle = st.settle
        if st.policy.forecast != ADAPTIVE or settle is None:  # (called while a window is open)
            return st.policy.settle_tokens
        return self.forecast.settle_tokens(settle.batch, st.policy.settle_tokens, settle.have)

    def _on_finish(self, job: Job) -> None:
        s = job.session
        if s is None:
            return
        pool = self.core.tree.pools.get(s.pool_id) if s.pool_id is not None else None
        if pool is not None:
            st = self.state(pool.pool_id)
            suffix = max(len(job.seq.tokens) - pool.prefix_len, 0)
            st.marginal_ewma = suffix if st.marginal_ewma is None else 0.7 * st.marginal_ewma + 0.3 * suffix
            meter = self.metrics.meters.get(s.session_id)
            if st.settle is None and meter is not None and meter.is_fresh(job):
                # the mean as it was just before this request left (it counts itself): a short
                # burst between ticks still leaves the pool a settled sample for the idle estimate
                tps = dict(self.metrics.activity().tps_by_session)
                tps[s.session_id] = meter.value()
                st.last_settled_mean, st.last_settled_t = sum(tps.values()) / len(tps), self.clock()
        settling = self._settling_state(s.session_id)
        if settling is not None and settling.settle is not None:
            # the admitted session left before the window closed: its load is gone; keep the
            # measurement only if it stayed for at least half the window
            self._end_settle(settling, self.clock(), self.metrics.activity().mean_active_tps,
                             fold=settling.settle.tokens >= self._settle_tokens(settling) // 2,
                             by="finish")
        if any(st.queue for st in self.states.values()):
            self._retry_due = True

    # ---------------------------------------------------------------- plan -> decide -> commit
    def _try(self, entry: Held) -> int | None:
        """Prepare, decide, commit. None when done (admitted or failed), else the id of the pool
        whose hold queue keeps it."""
        fut = entry.future
        if fut.done():
            return None  # the caller cancelled while held
        try:
            req = self.core.prepare(*entry.args, **entry.kwargs)
            now = self.clock()
            d = self.evaluate(req.plan, now, entry)
            entry.last_try = now
            if d.action in (HOLD, REJECT):
                pid = req.plan.pool_id
                assert pid is not None, "only a gated plan (one that attaches to a pool) is held or rejected"
                if d.action == HOLD:
                    self._held(entry, pid, d, now)
                    return pid
                raise self.rejected(pid, d)
            held_ms = (now - entry.t_hold) * 1e3 if entry.t_hold is not None else 0.0
            job = self.core.commit(req, admission=d.info(held_ms))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            self._fail(entry, e)
            return None
        assert d.action == ADMIT
        self.committed(req.plan, d, job, now)
        try:
            fut.set_result(job)
        except InvalidStateError:  # cancelled at this very moment: nobody reads the stream
            self.core.cancel(job)
        return None

    def _held(self, entry: Held, pid: int, d: Decision, now: float) -> None:
        st = self.state(pid)
        if entry.t_hold is None:
            entry.t_hold = now
            st.counts["held"] += 1
            self._event(pid, "hold", kind=d.kind, queue_len=len(st.queue))
        entry.pool_id, entry.wake_at = pid, d.wake_at
        if d.deadline is not None:
            entry.deadline = d.deadline
        elif st.policy.on_saturation == QUEUE and entry.deadline is None:
            entry.deadline = entry.t_hold + st.policy.queue_timeout_ms / 1e3

    @staticmethod
    def _fail(entry: Held, error: BaseException) -> None:
        try:
            entry.future.set_exception(error)
        except InvalidStateError:
            pass

    def _submit_command(self, entry: Held) -> None:
        if self._closed:
            return
        pid = self._try(entry)
        if pid is not None:
            self.states[pid].queue.append(entry)

    def _retry_held(self, now: float) -> None:
        """Re-try held requests, FIFO per pool."""
        for pid, st in list(self.states.items()):
            q = st.queue
            while q and self._try(q[0]) is None:
                q.popleft()
            for e in list(q)[1:]:
                if e.future.done():
                    q.remove(e)
                elif e.deadline is not None and now >= e.deadline:
                    q.remove(e)
                    st.counts["queue_timeouts"] += 1
                    self._fail(e, PoolSaturatedError(
                        f"timed out after {st.policy.queue_timeout_ms / 1e3:g} s in the admission queue of pool {pid}",
                        retry_after=1.0, pool_id=pid, reason=REASON_QUEUE_TIMEOUT))

    def _next_held_deadline(self) -> float | None:
        best = None
        for st in self.states.values():
            for e in st.queue:
                for t in (e.wake_at, e.deadline, (e.last_try or e.t_hold or 0.0) + self.poll_s):
                    if t is not None and (best is None or t < best):
                        best = t
        return best
