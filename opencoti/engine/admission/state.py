"""Per-pool admission state: the policy, the open settle window, the learned drop, the hold queue."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

from .policy import AdmissionPolicy

DROP_ALPHA = 0.3  # weight of a new per-admit drop sample in the EWMA


@dataclass
class Settle:
    """An open settle window: the pool is absorbing its last new-session admit."""

    t_admit: float
    session_id: str
    mean_at_admit: float | None  # mean_active_tps just before the admit (None: nothing measured)
    tokens: int = 0  # tokens the admitted session decoded since its admit
    admits: int = 1  # admits folded into this window (an admit while settling extends it)
    batch: int = 0  # requests in flight after the admit (the batch size being measured)
    have: int = 0  # steps the forecast had measured at that batch size before the admit


def fold_drop(drop_ewma: float | None, samples: int, drop: float, alpha: float = DROP_ALPHA) -> tuple[float, int]:
    """Fold one measured per-admit drop into the EWMA (the first sample initializes it)."""
    drop = max(0.0, drop)
    if drop_ewma is None or samples == 0:
        return drop, 1
    return alpha * drop + (1 - alpha) * drop_ewma, samples + 1


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
    last_try: float | None = None  # last evaluated at


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

    def settle_deadline(self) -> float | None:
        return None if self.settle is None else self.settle.t_admit + self.policy.settle_max_ms / 1e3

    def settle_remaining_s(self, now: float) -> float | None:
        d = self.settle_deadline()
        return None if d is None else max(0.0, d - now)

    def start_settle(self, now: float, session_id: str, mean_now: float | None, batch: int = 0,
                     have: int = 0) -> Settle:
        """A new session was admitted. An admit while settling extends the window (and the drop
        measured at its end is shared by all the admits it absorbed). Returns the open window."""
        s = self.settle
        if s is None:
            s = self.settle = Settle(now, session_id, mean_now, batch=batch, have=have)
        else:
            s.t_admit, s.session_id, s.tokens, s.admits, s.batch = now, session_id, 0, s.admits + 1, batch
            s.have = have
        self.counts["admits"] += 1
        return s

    def end_settle(self, now: float, mean_now: float | None, fold: bool) -> dict:
        """Close the window; fold the measured drop when asked and measurable. Returns an event row."""
        s = self.settle
        assert s is not None, "end_settle closes the open window"
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
