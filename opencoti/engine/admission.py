"""Admission control per pool: policies, ``capacity()``, settle windows, drop forecast, the gate.

Spec §4.4 / §6 / §13.3 (P6b context arm) / §14.2 (P7). A pool's capacity report answers "does one
more agent (a NEW session) fit?" from four arms, checked in this order:

1. **Context arm** (hard, never bypassed): ``expected_tokens`` beyond the KV cells available
   (free + reclaimable - reserved for running requests' remaining ``max_tokens``) or beyond the
   context left after the pool prefix -> ``"context headroom exhausted"``.
2. **Guaranteed minimum**: fewer sessions attached than ``guarantee_min_sessions`` -> admit
   (``"guaranteed minimum"``), bypassing settling, the floor and the KV-headroom arm, so a new or
   freshly forked pool always gets its first agent (no deadlock by construction).
3. **Settling**: after each new-session admit the pool is settling until that session has decoded
   ``settle_tokens`` tokens or ``settle_max_ms`` passed -> ``"measurement settling"`` (wait; the
   tps signal has not absorbed the last admit yet).
4. **KV headroom** (marginal per-session KV: ``headroom_sessions`` = available cells / the pool's
   per-session suffix size) and the **tps floor**: the projected mean tps after one more admit must
   stay >= ``target_tps_per_session``.

Projection (all tps numbers are *experienced decode tps*, see ``metrics.py``):

* ``projected_mean_tps_model`` = ``mean * step_s(B) / step_s(B + 1)`` with the step-cost model fitted
  from measured step stats (``metrics.StepCostModel``; ``mean * n/(n+1)`` until two batch sizes
  were seen), B = the current decode batch size.
* ``projected_mean_tps_measured`` = ``mean - drop_per_admit_ewma`` once the pool has absorbed >= 1
  admit: when a settle completes, ``drop = max(0, mean_at_admit - mean_now) / admits`` is folded
  into a per-pool EWMA (alpha 0.3). The floor uses the measured projection when it exists.
* **Idle estimate**: when nothing is decoding (every agent between turns) but the pool has
  sessions attached and a fresh (< 30 s) settled mean, the projection starts from that mean
  (``projected_idle_estimate: true``); a stale sample means the pool is genuinely idle.

Enforcement (``mode="enforced"``) happens in ``EngineCore.admission_gate`` for requests that start
a NEW session on the pool; a known session (continuation) is never gated; ``overcommit=True``
bypasses everything but the context arm. ``on_saturation``: ``reject`` -> ``PoolSaturatedError``
(429, ``retry_after``); ``warn`` -> admitted, ``info.admission`` carries the warning and
``sessions_remaining``; ``queue`` -> held FIFO until capacity returns or ``queue_timeout_ms``.
Settling is never a reject: the request is held (bounded by ``settle_max_ms`` + 1 s) and then
re-evaluated without the settling arm.

Holding never blocks the step thread: a held request's future simply stays pending; the
controller keeps it in the pool's FIFO and re-tries it (as a command on the step thread) when a
request finishes, a settle completes, the policy changes, a deadline passes, or every
``poll_s`` (to notice released sessions/pools, which raise no event).
"""

from __future__ import annotations

import logging
import math
import threading
from collections import deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import asdict, dataclass, field, fields
from typing import Callable

from .errors import InvalidRequestError, OpencotiError, PoolSaturatedError

log = logging.getLogger("opencoti.admission")

ADVISORY, ENFORCED = "advisory", "enforced"
REJECT, WARN, QUEUE = "reject", "warn", "queue"

REASON_OK = "ok"
REASON_GUARANTEED = "guaranteed minimum"
REASON_SETTLING = "measurement settling"
REASON_FLOOR = "projected mean tps below floor"
REASON_FLOOR_IDLE = "projected mean tps below floor (idle estimate)"
REASON_KV = "kv headroom exhausted"
REASON_CONTEXT = "context headroom exhausted"

DROP_ALPHA = 0.3  # spec §14.2
IDLE_FRESH_S = 30.0  # a settled mean younger than this feeds the idle estimate
SETTLE_HOLD_GRACE_S = 1.0  # an enforced settling hold lasts at most settle_max_ms + this


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ============================================================================ policy
@dataclass(frozen=True)
class AdmissionPolicy:
    """Per-pool admission policy (spec §4.4 + P7 §14).

    target_tps_per_session: the floor on experienced decode tps (None = no floor).
    mode: "advisory" (report only, never rejects) or "enforced" (gate new sessions).
    on_saturation: what the enforced gate does with a new session that does not fit:
        "reject" (PoolSaturatedError, 429), "warn" (admit, with a warning), "queue" (hold FIFO).
    guarantee_min_sessions: below this many attached sessions a new one is always admitted
        (the context arm still applies).
    settle_tokens / settle_max_ms: the settle window after each new-session admit.
    queue_timeout_ms: how long ``queue`` holds a request before failing it with PoolSaturatedError.
    """

    target_tps_per_session: float | None = None
    mode: str = ADVISORY
    on_saturation: str = REJECT
    guarantee_min_sessions: int = 1
    settle_tokens: int = 48
    settle_max_ms: float = 5000.0
    queue_timeout_ms: float = 30000.0

    def __post_init__(self) -> None:
        def check(cond: bool, msg: str) -> None:
            if not cond:
                raise InvalidRequestError(msg)

        t = self.target_tps_per_session
        check(t is None or (_is_number(t) and 0 < t <= 1e6),
              f"target_tps_per_session must be a positive number of tokens/s (or null), got {t!r}")
        check(self.mode in (ADVISORY, ENFORCED), f"mode must be advisory|enforced, got {self.mode!r}")
        check(self.on_saturation in (REJECT, WARN, QUEUE),
              f"on_saturation must be reject|warn|queue, got {self.on_saturation!r}")
        check(_is_int(self.guarantee_min_sessions) and 0 <= self.guarantee_min_sessions <= 1_000_000,
              f"guarantee_min_sessions must be a non-negative integer, got {self.guarantee_min_sessions!r}")
        check(_is_int(self.settle_tokens) and 1 <= self.settle_tokens <= 1_000_000,
              f"settle_tokens must be a positive integer, got {self.settle_tokens!r}")
        check(_is_number(self.settle_max_ms) and 0 < self.settle_max_ms <= 3_600_000,
              f"settle_max_ms must be a positive number of milliseconds (<= 1 h), got {self.settle_max_ms!r}")
        check(_is_number(self.queue_timeout_ms) and 0 < self.queue_timeout_ms <= 86_400_000,
              f"queue_timeout_ms must be a positive number of milliseconds (<= 24 h), got {self.queue_timeout_ms!r}")

    def updated(self, **kw) -> "AdmissionPolicy":
        names = [f.name for f in fields(self)]
        bad = sorted(set(kw) - set(names))
        if bad:
            raise InvalidRequestError(f"unknown admission setting(s) {bad}; known: {names}")
        return AdmissionPolicy(**{**asdict(self), **kw})

    def as_dict(self) -> dict:
        return asdict(self)


# ============================================================================ per-pool state
@dataclass
class Settle:
    """An open settle window: the pool is absorbing its last new-session admit."""

    t_admit: float
    session_id: str
    mean_at_admit: float | None  # mean_active_tps just before the admit (None: nothing measured)
    tokens: int = 0  # tokens the admitted session decoded since its admit
    admits: int = 1  # admits folded into this window (an admit while settling extends it)


def fold_drop(drop_ewma: float | None, samples: int, drop: float, alpha: float = DROP_ALPHA) -> tuple[float, int]:
    """Fold one measured per-admit drop into the EWMA (the first sample initializes it)."""
    drop = max(0.0, drop)
    if drop_ewma is None or samples == 0:
        return drop, 1
    return alpha * drop + (1 - alpha) * drop_ewma, samples + 1


class PoolState:
    """Admission state of one pool: policy, settle window, drop forecast, last settled mean, queue."""

    def __init__(self, pool_id: int):
        self.pool_id = pool_id
        self.policy = AdmissionPolicy()
        self.settle: Settle | None = None
        self.drop_ewma: float | None = None
        self.drop_samples = 0
        self.last_settled_mean: float | None = None
        self.last_settled_t: float | None = None
        self.marginal_ewma: float | None = None  # tokens a finished session held beyond the prefix
        self.queue: deque[Held] = deque()
        self.counts = {"admits": 0, "admitted": 0, "guaranteed": 0, "overcommit": 0, "warned": 0, "rejected": 0,
                       "held": 0, "queue_timeouts": 0, "settles": 0}

    def settle_remaining_s(self, now: float) -> float | None:
        if self.settle is None:
            return None
        return max(0.0, self.settle.t_admit + self.policy.settle_max_ms / 1e3 - now)

    def start_settle(self, now: float, session_id: str, mean_now: float | None) -> None:
        """A new session was admitted. An admit while settling extends the window (and the drop
        measured at its end is shared by all the admits it absorbed)."""
        s = self.settle
        if s is None:
            self.settle = Settle(now, session_id, mean_now)
        else:
            s.t_admit, s.session_id, s.tokens, s.admits = now, session_id, 0, s.admits + 1
        self.counts["admits"] += 1

    def end_settle(self, now: float, mean_now: float | None, fold: bool) -> dict:
        """Close the window; fold the measured drop when asked and measurable. Returns an event row."""
        s = self.settle
        self.settle = None
        self.counts["settles"] += 1
        drop = None
        if fold and s.mean_at_admit is not None and mean_now is not None:
            drop = max(0.0, (s.mean_at_admit - mean_now) / s.admits)
            self.drop_ewma, self.drop_samples = fold_drop(self.drop_ewma, self.drop_samples, drop)
        if mean_now is not None:
            self.last_settled_mean, self.last_settled_t = mean_now, now
        return {"session_id": s.session_id, "admits": s.admits, "mean_at_admit": s.mean_at_admit,
                "mean_settled": mean_now, "drop": drop, "drop_per_admit_ewma": self.drop_ewma,
                "settle_ms": (now - s.t_admit) * 1e3, "tokens": s.tokens}


# ============================================================================ the math
@dataclass
class CapacityInputs:
    """Everything ``compute_capacity`` needs, measured at one instant (pure data: tests script it)."""

    policy: AdmissionPolicy
    mean: float | None  # mean_active_tps (engine-wide; None when no session is active)
    n_active: int = 0
    n_warming: int = 0
    n_decoding: int = 0  # decode batch size
    n_pool_sessions: int = 0  # sessions attached to the pool (idle ones included)
    settle_remaining_s: float | None = None  # None: not settling
    drop_ewma: float | None = None
    drop_samples: int = 0
    last_settled_mean: float | None = None
    last_settled_age_s: float | None = None
    ratio: Callable[[int, int], float] = field(default=lambda n, k: n / (n + k) if n > 0 else 1.0)
    available_cells: int = 0  # free + reclaimable - reserved
    free_cells: int = 0  # free + reclaimable
    total_cells: int = 1
    marginal_tokens: int = 1  # KV tokens one more session of this pool is expected to own
    expected_tokens: int | None = None
    context_left: int | None = None  # max_context - pool prefix
    largest_session_share: float = 0.0  # max ctx_used / ctx_total over the pool's sessions
    known_session: bool = False
    idle_fresh_s: float = IDLE_FRESH_S


def compute_capacity(x: CapacityInputs) -> dict:
    """The capacity report of spec §4.4 + §14.2 + §13.3 (see the module docstring)."""
    p = x.policy
    floor = p.target_tps_per_session
    model = measured = None
    idle_estimate = False
    base, n = x.mean, x.n_decoding
    if base is None and x.n_pool_sessions > 0 and x.last_settled_mean is not None \
            and x.last_settled_age_s is not None and x.last_settled_age_s < x.idle_fresh_s:
        base, n, idle_estimate = x.last_settled_mean, x.n_pool_sessions, True
    if base is not None:
        model = base * x.ratio(max(n, 1), 1)
        if x.drop_samples:
            measured = max(0.0, base - x.drop_ewma)
    projected = measured if measured is not None else model

    marginal = max(int(x.marginal_tokens), 1)
    headroom_sessions = max(0, x.available_cells) // marginal
    kv_headroom_pct = 100.0 * x.free_cells / x.total_cells if x.total_cells else 0.0
    occupancy = 1.0 - x.free_cells / x.total_cells if x.total_cells else 1.0
    pressure = min(1.0, max(0.0, occupancy, x.largest_session_share))

    # how many more sessions the floor allows (measured drop when known, else the step model)
    tps_headroom = None
    if floor is not None and base is not None:
        if measured is not None:
            d = x.drop_ewma or 0.0
            tps_headroom = int((base - floor) // d) if d > 0 else (headroom_sessions if base >= floor else 0)
            tps_headroom = max(0, tps_headroom)
        else:
            k = 0
            while k < 4096 and base * x.ratio(max(n, 1), k + 1) >= floor:
                k += 1
            tps_headroom = k
    sessions_remaining = headroom_sessions if tps_headroom is None else min(headroom_sessions, tps_headroom)

    ctx_limit = x.available_cells if x.context_left is None else min(x.available_cells, x.context_left)
    context_ok = x.expected_tokens is None or x.expected_tokens <= ctx_limit
    guaranteed = x.n_pool_sessions < p.guarantee_min_sessions
    settling = x.settle_remaining_s is not None
    if not context_ok:
        can, reason = False, REASON_CONTEXT
    elif guaranteed:
        can, reason = True, REASON_GUARANTEED
    elif settling:
        can, reason = False, REASON_SETTLING
    elif headroom_sessions < 1:
        can, reason = False, REASON_KV
    elif floor is not None and projected is not None and projected < floor:
        can, reason = False, REASON_FLOOR_IDLE if idle_estimate else REASON_FLOOR
    else:
        can, reason = True, REASON_OK
    return {
        "can_admit": can,
        "reason": reason,
        "projected_mean_tps_if_admitted": projected,
        "projected_mean_tps_model": model,
        "projected_mean_tps_measured": measured,
        "projected_idle_estimate": idle_estimate,
        "drop_per_admit_ewma": x.drop_ewma,
        "drop_samples": x.drop_samples,
        "mean_active_tps": x.mean,
        "target_tps_per_session": floor,
        "headroom_sessions": headroom_sessions,
        "tps_headroom_sessions": tps_headroom,
        "sessions_remaining": sessions_remaining,
        "marginal_tokens_per_session": marginal,
        "kv_headroom_pct": kv_headroom_pct,
        "kv_free_cells": x.free_cells,
        "kv_available_cells": max(0, x.available_cells),
        "kv_total_cells": x.total_cells,
        "expected_tokens": x.expected_tokens,
        "context_ok": context_ok,
        "settling": settling,
        "settle_remaining_ms": x.settle_remaining_s * 1e3 if settling else 0.0,
        "n_active": x.n_active,
        "n_warming": x.n_warming,
        "n_decoding": x.n_decoding,
        "n_pool_sessions": x.n_pool_sessions,
        "guaranteed": guaranteed and context_ok,
        "known_session": x.known_session,
        "compaction_pressure": pressure,
        "mode": p.mode,
        "on_saturation": p.on_saturation,
    }


# ============================================================================ the controller
@dataclass(eq=False)
class Held:
    """A request the enforced gate holds (settling or queued). Its future is the caller's."""

    args: tuple
    kwargs: dict
    future: Future
    pool_id: int | None = None
    t_hold: float | None = None  # first held at
    wake_at: float | None = None  # re-evaluate at the latest then
    deadline: float | None = None  # queue timeout


class _Hold(Exception):
    """Raised by the gate (inside ``EngineCore.submit``, before any commit): hold this request."""

    def __init__(self, pool_id: int, kind: str, wake_at: float | None = None, deadline: float | None = None):
        super().__init__(kind)
        self.pool_id, self.kind, self.wake_at, self.deadline = pool_id, kind, wake_at, deadline


class AdmissionController:
    """Owns the per-pool policies and state, the gate, and the hold queues of one engine."""

    poll_s = 0.5  # while requests are held: re-check at least this often (releases raise no event)

    def __init__(self, engine, metrics, *, clock: Callable[[], float] | None = None):
        self.engine = engine
        self.core = engine.core
        self.metrics = metrics
        self.clock = clock or metrics.clock
        self.states: dict[int, PoolState] = {}
        self.events: deque[dict] = deque(maxlen=4096)
        self._settling: dict[str, int] = {}  # session id -> pool id of the open settle window
        self._last_gate: tuple[int | None, bool] | None = None
        self._current: Held | None = None
        self._decision: dict | None = None
        self._last_tick = -math.inf
        self._closed = False
        self._drain_posted = False
        self._next_wake: float | None = None
        self._wake = threading.Event()
        self._timer: threading.Thread | None = None
        self.listener_errors = 0
        self.core.admission_gate = self._gate
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
        if st.queue:
            self._post_drain()
        return {"pool_id": pool_id, **st.policy.as_dict()}

    def policy(self, pool_id: int) -> dict:
        self.core.tree.get(pool_id)
        st = self.states.get(pool_id)
        return {"pool_id": pool_id, **(st.policy if st else AdmissionPolicy()).as_dict()}

    def capacity(self, pool_id: int, expected_tokens: int | None = None, session_id: str | None = None) -> dict:
        """The capacity report of pool ``pool_id`` (spec §4.4, §13.3, §14.2)."""
        if expected_tokens is not None and not (_is_int(expected_tokens) and expected_tokens >= 0):
            raise InvalidRequestError(f"expected_tokens must be a non-negative integer, got {expected_tokens!r}")
        if session_id is not None and not isinstance(session_id, str):
            raise InvalidRequestError("session_id must be a string")
        pool = self.core.tree.get(pool_id)
        st = self.state(pool_id)
        cap = self._capacity(pool, st, expected_tokens, self.clock(), known=session_id in self.core.sessions
                             if session_id is not None else False)
        cap["pool_id"] = pool_id
        cap["n_queued"] = len(st.queue)
        return cap

    def events_view(self, pool_id: int | None = None, since: float | None = None) -> list[dict]:
        return [dict(e) for e in self.events
                if (pool_id is None or e["pool_id"] == pool_id) and (since is None or e["ts"] >= since)]

    def submit(self, *args, **kwargs) -> Future:
        """``EngineCore.submit`` through the gate, from any thread: the future resolves with the Job
        (or the error) once the request is admitted, which may be later for a held request."""
        entry = Held(args, kwargs, Future())
        cmd = self.engine._submit(self._submit_command, entry)
        # the command fails without running when the engine shuts down first: fail the request too
        cmd.add_done_callback(lambda f: f.exception() is not None and self._fail(entry, f.exception()))
        return entry.future

    def close(self, error: Exception) -> None:
        """Engine shutdown (step thread): fail every held request, stop the timer."""
        self._closed = True
        for st in self.states.values():
            while st.queue:
                self._fail(st.queue.popleft(), error)
        self._wake.set()

    # ---------------------------------------------------------------- capacity inputs
    def _capacity(self, pool, st: PoolState, expected_tokens: int | None, now: float,
                  ignore_settling: bool = False, known: bool = False) -> dict:
        core, m = self.core, self.metrics
        act = m.activity()
        self._expire(st, now, act.mean_active_tps)
        if act.mean_active_tps is not None and st.settle is None:
            st.last_settled_mean, st.last_settled_t = act.mean_active_tps, now
        cells = m.kv_cells(keep_pool=pool)
        ps = core.page_size
        largest = 0.0
        suffixes = []
        for sid in pool.sessions:
            s = core.sessions.get(sid)
            if s is None:
                continue
            job = s.job
            used = len(job.seq.tokens) if job is not None else len(s.seq.tokens)
            largest = max(largest, used / core.max_context)
            final = used
            if job is not None and job.params is not None and job.params.max_tokens is not None:
                final = max(used, min(job.prompt_len + job.params.max_tokens, core.max_context))
            suffixes.append(max(final - pool.prefix_len, 0))
        cands = [ps] if expected_tokens is None else [ps, expected_tokens]
        if suffixes:
            cands.append(sum(suffixes) / len(suffixes))
        if st.marginal_ewma is not None:
            cands.append(st.marginal_ewma)
        partial = 1 if pool.prefix_len % ps else 0  # the pool's partial last page is copied per session
        marginal = (-(-int(math.ceil(max(cands))) // ps) + partial) * ps
        x = CapacityInputs(
            policy=st.policy, mean=act.mean_active_tps, n_active=act.n_active, n_warming=act.n_warming,
            n_decoding=act.n_decoding, n_pool_sessions=len(pool.sessions),
            settle_remaining_s=None if ignore_settling else st.settle_remaining_s(now),
            drop_ewma=st.drop_ewma, drop_samples=st.drop_samples, last_settled_mean=st.last_settled_mean,
            last_settled_age_s=None if st.last_settled_t is None else now - st.last_settled_t,
            ratio=m.step_model.ratio, available_cells=cells["available"], free_cells=cells["free"],
            total_cells=cells["total"], marginal_tokens=marginal, expected_tokens=expected_tokens,
            context_left=core.max_context - pool.prefix_len, largest_session_share=largest, known_session=known)
        cap = compute_capacity(x)
        if known:  # a continuation is never gated (spec §14.2): the report says so
            cap["can_admit"], cap["reason"] = cap["context_ok"], REASON_OK if cap["context_ok"] else REASON_CONTEXT
        return cap

    def _expire(self, st: PoolState, now: float, mean_now: float | None) -> None:
        if st.settle is not None and now >= st.settle.t_admit + st.policy.settle_max_ms / 1e3:
            self._end_settle(st, now, mean_now, fold=True, by="time")

    def _end_settle(self, st: PoolState, now: float, mean_now: float | None, fold: bool, by: str) -> None:
        sid = st.settle.session_id
        if self._settling.get(sid) == st.pool_id:
            del self._settling[sid]
        row = st.end_settle(now, mean_now, fold)
        self._event(st.pool_id, "settle_end", by=by, **row)
        if st.queue:
            self._post_drain()

    # ---------------------------------------------------------------- events (step thread)
    def _event(self, pool_id: int | None, name: str, **data) -> None:
        self.events.append({"ts": self.metrics.wall_clock(), "t": self.clock(), "pool_id": pool_id, "event": name,
                            **data})

    def _on_event(self, event: str, data: dict) -> None:
        try:
            if event == "token":
                self._on_token(data["job"])
            elif event == "step":
                self._on_step()
            elif event == "submit":
                self._on_submit(data["job"])
            elif event == "finish":
                self._on_finish(data["job"])
        except Exception:  # noqa: BLE001 - admission bookkeeping must never take a request down
            self.listener_errors += 1
            log.exception("admission listener failed on %r", event)

    def _on_submit(self, job) -> None:
        gate, self._last_gate = self._last_gate, None
        if gate is None or job.session is None:
            return
        pool_id, is_new = gate
        if pool_id is None or not is_new or job.session.pool_id != pool_id:
            return
        st = self.state(pool_id)
        now = self.clock()
        mean = self.metrics.activity().mean_active_tps
        self._expire(st, now, mean)
        if st.settle is not None and self._settling.get(st.settle.session_id) == pool_id:
            del self._settling[st.settle.session_id]
        st.start_settle(now, job.session.session_id, mean)
        self._settling[job.session.session_id] = pool_id
        self._event(pool_id, "admit", session_id=job.session.session_id, mean_at_admit=mean,
                    admits_in_window=st.settle.admits)

    def _on_token(self, job) -> None:
        if not self._settling or job.session is None:
            return
        st = self.states.get(self._settling.get(job.session.session_id))
        if st is None or st.settle is None:
            return
        st.settle.tokens += 1
        if st.settle.tokens >= st.policy.settle_tokens:
            self._end_settle(st, self.clock(), self.metrics.activity().mean_active_tps, fold=True, by="tokens")

    def _on_finish(self, job) -> None:
        s = job.session
        if s is None:
            return
        pool = self.core.tree.pools.get(s.pool_id) if s.pool_id is not None else None
        if pool is not None:
            st = self.state(pool.pool_id)
            suffix = max(len(job.seq.tokens) - pool.prefix_len, 0)
            st.marginal_ewma = suffix if st.marginal_ewma is None else 0.7 * st.marginal_ewma + 0.3 * suffix
            if st.settle is None and self.metrics.meters.get(s.session_id) is not None \
                    and self.metrics.meters[s.session_id].is_fresh(job):
                # the mean as it was just before this request left (it counts itself): a short
                # burst between ticks still leaves the pool a settled sample for the idle estimate
                act = self.metrics.activity()
                tps = dict(act.tps_by_session)
                tps[s.session_id] = self.metrics.meters[s.session_id].value()
                st.last_settled_mean, st.last_settled_t = sum(tps.values()) / len(tps), self.clock()
        st = self.states.get(self._settling.get(s.session_id))
        if st is not None and st.settle is not None:
            # the admitted session left before the window closed: its load is gone; keep the
            # measurement only if it stayed for at least half the window
            self._end_settle(st, self.clock(), self.metrics.activity().mean_active_tps,
                             fold=st.settle.tokens >= st.policy.settle_tokens // 2, by="finish")
        if any(st.queue for st in self.states.values()):
            self._post_drain()

    def _on_step(self) -> None:
        now = self.clock()
        for pid in set(self._settling.values()):
            st = self.states.get(pid)
            if st is not None and st.settle is not None and st.settle_remaining_s(now) == 0.0:
                self._expire(st, now, self.metrics.activity().mean_active_tps)
        if now - self._last_tick < 0.25:
            return
        self._last_tick = now
        act = None
        for pid, st in list(self.states.items()):
            pool = self.core.tree.pools.get(pid)
            if pool is None:
                if not st.queue:
                    del self.states[pid]
                    for sid in [sid for sid, p in self._settling.items() if p == pid]:
                        del self._settling[sid]
                continue
            if st.settle is None and pool.sessions:
                act = act or self.metrics.activity()
                if act.mean_active_tps is not None:
                    st.last_settled_mean, st.last_settled_t = act.mean_active_tps, now

    # ---------------------------------------------------------------- the gate (step thread)
    def _gate(self, pool, session_id, is_new_session: bool, prompt_len: int, params, overcommit: bool) -> None:
        self._last_gate = (pool.pool_id if pool is not None else None, is_new_session)
        self._decision = None
        if pool is None or not is_new_session:
            return
        st = self.states.get(pool.pool_id)
        if st is None or st.policy.mode != ENFORCED:
            return
        policy, entry, now = st.policy, self._current, self.clock()
        expected = max(prompt_len - pool.prefix_len, 1) + (params.max_tokens or 0)
        t_hold = entry.t_hold if entry is not None and entry.t_hold is not None else now
        ignore_settling = now >= t_hold + policy.settle_max_ms / 1e3 + SETTLE_HOLD_GRACE_S
        cap = self._capacity(pool, st, expected, now, ignore_settling=ignore_settling)
        reason = cap["reason"]
        if overcommit:
            if reason == REASON_CONTEXT:
                raise self._saturated(st, cap, now, "overcommit does not bypass the context arm: ")
            self._decide(st, "overcommit", cap)
            return
        if st.queue and (entry is None or st.queue[0] is not entry):
            if entry is None:
                raise self._saturated(st, cap, now, f"{len(st.queue)} requests are queued for this pool: ")
            raise _Hold(pool.pool_id, "behind")
        if cap["can_admit"]:
            self._decide(st, "guaranteed" if cap["guaranteed"] else "admitted", cap)
            return
        if reason == REASON_SETTLING:
            if entry is None:
                raise self._saturated(st, cap, now)
            bound = t_hold + policy.settle_max_ms / 1e3 + SETTLE_HOLD_GRACE_S
            raise _Hold(pool.pool_id, "settling", wake_at=min(now + cap["settle_remaining_ms"] / 1e3, bound))
        if policy.on_saturation == QUEUE:
            deadline = t_hold + policy.queue_timeout_ms / 1e3
            if entry is None:
                raise self._saturated(st, cap, now)
            if now >= deadline:
                st.counts["queue_timeouts"] += 1
                raise self._saturated(st, cap, now, f"timed out after {policy.queue_timeout_ms / 1e3:g} s in the "
                                                    f"admission queue of pool {pool.pool_id}: ")
            raise _Hold(pool.pool_id, "queued", wake_at=deadline, deadline=deadline)
        if policy.on_saturation == WARN and reason != REASON_CONTEXT:
            self._decide(st, "warned", cap)
            return
        raise self._saturated(st, cap, now)

    def _decide(self, st: PoolState, decision: str, cap: dict) -> None:
        key = {"admitted": "admitted", "guaranteed": "guaranteed", "overcommit": "overcommit", "warned": "warned"}
        st.counts[key[decision]] += 1
        warning = None
        if decision == "warned":
            warning = f"pool {st.pool_id} is saturated ({cap['reason']}); admitted anyway (on_saturation=warn)"
        elif decision == "overcommit" and not cap["can_admit"]:
            warning = f"pool {st.pool_id}: {cap['reason']}; admitted by overcommit"
        self._decision = {"decision": decision, "reason": cap["reason"], "warning": warning,
                          "sessions_remaining": cap["sessions_remaining"],
                          "projected_mean_tps_if_admitted": cap["projected_mean_tps_if_admitted"],
                          "held_ms": 0.0}
        if decision != "admitted":
            self._event(st.pool_id, decision, reason=cap["reason"])
            if warning:
                log.warning(warning)

    def _saturated(self, st: PoolState, cap: dict, now: float, prefix: str = "") -> PoolSaturatedError:
        st.counts["rejected"] += 1
        retry = self._retry_after(st, cap, now)
        proj = cap["projected_mean_tps_if_admitted"]
        detail = cap["reason"]
        if cap["reason"] in (REASON_FLOOR, REASON_FLOOR_IDLE):
            detail += f" ({proj:.2f} < {st.policy.target_tps_per_session:g} tokens/s)"
        elif cap["reason"] == REASON_CONTEXT:
            detail += f" ({cap['expected_tokens']} tokens expected, {cap['kv_available_cells']} KV cells available)"
        self._event(st.pool_id, "rejected", reason=cap["reason"], retry_after=retry)
        return PoolSaturatedError(f"{prefix}pool {st.pool_id} cannot admit a new session: {detail}; "
                                  f"retry after {retry:.1f} s", retry_after=retry, pool_id=st.pool_id,
                                  reason=cap["reason"], capacity=cap)

    def _retry_after(self, st: PoolState, cap: dict, now: float) -> float:
        """Seconds until the pool is likely to change: the settle window's end, else the soonest
        expected finish of a decoding request (remaining max_tokens / its tps)."""
        if cap["settling"]:
            return max(0.5, cap["settle_remaining_ms"] / 1e3)
        best = None
        for job in self.metrics._generation_jobs():
            mt = job.params.max_tokens
            tps = self.metrics.session_tps(job.session.session_id, job) or cap["mean_active_tps"] or 0.0
            if mt is not None and tps > 0:
                eta = max(0, mt - len(job.generated)) / tps
                best = eta if best is None else min(best, eta)
        if best is None:
            best = st.policy.settle_max_ms / 1e3
        return min(60.0, max(0.5, best))

    # ---------------------------------------------------------------- holding (step thread)
    def _try(self, entry: Held) -> bool:
        """Submit through the gate. True when done (admitted or failed), False when held."""
        fut = entry.future
        if fut.done():
            return True  # the caller cancelled while held
        self._current = entry
        try:
            job = self.core.submit(*entry.args, **entry.kwargs)
        except _Hold as h:
            now = self.clock()
            st = self.state(h.pool_id)
            if entry.t_hold is None:
                entry.t_hold = now
                st.counts["held"] += 1
                self._event(h.pool_id, "hold", kind=h.kind, queue_len=len(st.queue))
            entry.pool_id, entry.wake_at = h.pool_id, h.wake_at
            if h.deadline is not None:
                entry.deadline = h.deadline
            elif st.policy.on_saturation == QUEUE and entry.deadline is None:
                entry.deadline = entry.t_hold + st.policy.queue_timeout_ms / 1e3
            return False
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            self._fail(entry, e)
            return True
        finally:
            self._current = None
        decision, self._decision = self._decision, None
        if decision is not None:
            if entry.t_hold is not None:
                decision["held_ms"] = (self.clock() - entry.t_hold) * 1e3
            job.info.admission = decision
        try:
            fut.set_result(job)
        except InvalidStateError:  # cancelled at this very moment: nobody reads the stream
            self.core.cancel(job)
        return True

    @staticmethod
    def _fail(entry: Held, error: BaseException) -> None:
        try:
            entry.future.set_exception(error)
        except InvalidStateError:
            pass

    def _submit_command(self, entry: Held) -> None:
        if not self._try(entry):
            self.states[entry.pool_id].queue.append(entry)
            self._schedule()

    def _drain(self) -> None:
        """Re-try held requests, FIFO per pool (a command on the step thread)."""
        self._drain_posted = False
        if self._closed:
            return
        now = self.clock()
        for pid, st in list(self.states.items()):
            q = st.queue
            while q and self._try(q[0]):
                q.popleft()
            for e in list(q)[1:]:
                if e.future.done():
                    q.remove(e)
                elif e.deadline is not None and now >= e.deadline:
                    q.remove(e)
                    st.counts["queue_timeouts"] += 1
                    self._fail(e, PoolSaturatedError(
                        f"timed out after {st.policy.queue_timeout_ms / 1e3:g} s in the admission queue of pool {pid}",
                        retry_after=1.0, pool_id=pid, reason="queue timeout"))
        self._schedule()

    def _post_drain(self) -> None:
        if self._drain_posted or self._closed:
            return
        self._drain_posted = True
        try:
            self.engine._submit(self._drain)
        except OpencotiError:  # engine closed
            self._drain_posted = False

    def _schedule(self) -> None:
        """Set the timer to the earliest deadline of a held request (or the poll period)."""
        held = [e for st in self.states.values() for e in st.queue]
        if not held:
            self._next_wake = None
            return
        now = self.clock()
        wake = now + self.poll_s
        for e in held:
            for t in (e.wake_at, e.deadline):
                if t is not None:
                    wake = min(wake, t)
        self._next_wake = wake
        if self._timer is None:
            self._timer = threading.Thread(target=self._timer_loop, name="opencoti-admission", daemon=True)
            self._timer.start()
        self._wake.set()

    def _timer_loop(self) -> None:
        while not self._closed:
            nw = self._next_wake
            timeout = None if nw is None else max(0.0, nw - self.clock())
            if self._wake.wait(timeout):
                self._wake.clear()
                continue  # the schedule changed: recompute
            if self._closed:
                return
            if self._next_wake is not None and self.clock() >= self._next_wake - 1e-3:
                self._next_wake = None
                self._post_drain()
