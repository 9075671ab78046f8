"""plan -> decide: what the core knows about a request, and the pure admit / hold / reject decision.

``EngineCore.prepare`` builds an ``AdmissionPlan`` without side effects; the controller measures the
pool (``GateInputs``); ``decide`` answers; then the core commits (or the request waits or fails).
Nothing here reads a clock or mutates anything, so tests script every input.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import PoolSaturatedError
from .capacity import CapacityInputs, compute_capacity
from .policy import (ENFORCED, QUEUE, REASON_CONTEXT, REASON_QUEUE_TIMEOUT, REASON_SETTLING, SETTLE_HOLD_GRACE_S,
                     WARN, FLOOR_REASONS)

ADMIT, HOLD, REJECT = "admit", "hold", "reject"


@dataclass(frozen=True)
class AdmissionPlan:
    """A validated request as admission sees it (built by the core before anything is committed)."""

    pool_id: int | None  # the pool it attaches to (None: no pool)
    session_id: str | None
    new_to_pool: bool  # a new session, or a session moving onto this pool (a continuation is not)
    prompt_len: int
    prefix_len: int = 0  # the pool's prefix length
    max_tokens: int | None = None
    overcommit: bool = False

    @property
    def gated(self) -> bool:
        return self.pool_id is not None and self.new_to_pool

    @property
    def expected_tokens(self) -> int:
        """KV tokens the session will own beyond the pool prefix (its suffix + max_tokens)."""
        return max(self.prompt_len - self.prefix_len, 1) + (self.max_tokens or 0)


@dataclass(frozen=True)
class GateInputs:
    """The pool's measured capacity inputs plus where this request stands in time and queue."""

    capacity: CapacityInputs
    now: float
    can_hold: bool = True  # False: a caller that cannot wait (a would-be hold is refused)
    held_since: float | None = None  # first held at (None: a fresh request)
    queued_ahead: int = 0  # requests in the pool's hold queue ahead of this one
    soonest_finish_s: float | None = None  # soonest expected end of a running request (for retry_after)


@dataclass(frozen=True)
class Decision:
    action: str  # admit | hold | reject
    kind: str  # admit: ungated|admitted|guaranteed|overcommit|warned; hold: settling|queued|behind;
    #            reject: saturated|queue timeout
    reason: str
    capacity: dict | None = None
    warning: str | None = None
    message: str | None = None  # the error message of a reject
    retry_after: float | None = None
    wake_at: float | None = None  # a hold: re-evaluate at the latest then
    deadline: float | None = None  # a queued hold: fail at this time

    def error(self, pool_id: int | None) -> PoolSaturatedError:
        assert self.message is not None, "only a reject (which has a message) is an error"
        return PoolSaturatedError(self.message, retry_after=self.retry_after, pool_id=pool_id, reason=self.reason,
                                  capacity=self.capacity)

    def info(self, held_ms: float = 0.0) -> dict | None:
        """What the request carries as ``info.admission`` (None for an ungated request)."""
        if self.kind == "ungated" or self.capacity is None:
            return None
        cap = self.capacity
        return {"decision": self.kind, "reason": self.reason, "warning": self.warning,
                "sessions_remaining": cap["sessions_remaining"],
                "projected_mean_tps_if_admitted": cap["projected_mean_tps_if_admitted"], "held_ms": held_ms,
                "retry_after": self.retry_after}


UNGATED = Decision(ADMIT, "ungated", "ok")


def retry_after_s(cap: dict, soonest_finish_s: float | None, settle_max_ms: float) -> float:
    """Seconds until the pool is likely to change: the settle window's end, else the soonest
    expected finish of a running request, else one settle window; within [0.5, 60]."""
    if cap["settling"]:
        return max(0.5, cap["settle_remaining_ms"] / 1e3)
    best = soonest_finish_s if soonest_finish_s is not None else settle_max_ms / 1e3
    return min(60.0, max(0.5, best))


def _reject(plan: AdmissionPlan, g: GateInputs, cap: dict, prefix: str = "", reason: str | None = None) -> Decision:
    policy = g.capacity.policy
    retry = retry_after_s(cap, g.soonest_finish_s, policy.settle_max_ms)
    detail = cap["reason"]
    if cap["reason"] in FLOOR_REASONS and cap["projected_mean_tps_if_admitted"] is not None:
        detail += f" ({cap['projected_mean_tps_if_admitted']:.2f} < {policy.target_tps_per_session:g} tokens/s)"
    elif cap["reason"] == REASON_CONTEXT:
        detail += f" ({cap['expected_tokens']} tokens expected, {cap['kv_available_cells']} KV cells available)"
    msg = f"{prefix}pool {plan.pool_id} cannot admit a new session: {detail}; retry after {retry:.1f} s"
    kind = "queue timeout" if reason == REASON_QUEUE_TIMEOUT else "saturated"
    return Decision(REJECT, kind, reason or cap["reason"], cap, message=msg, retry_after=retry)


def decide(plan: AdmissionPlan, g: GateInputs | None) -> Decision:
    """Admit, hold or reject ``plan`` (pure). ``g`` None: the pool has no enforced policy.
    An admit that leaves no room for another new session carries ``retry_after`` (when the next
    one is likely to fit: the same estimate a 429 gives)."""
    d = _decide(plan, g)
    cap = d.capacity  # measured only with inputs (g)
    left = cap["sessions_remaining"] if cap is not None else None
    if d.action == ADMIT and cap is not None and g is not None and isinstance(left, int) and left <= 1:  # not when unknown
        d = replace(d, retry_after=retry_after_s(cap, g.soonest_finish_s, g.capacity.policy.settle_max_ms))
    return d


def _decide(plan: AdmissionPlan, g: GateInputs | None) -> Decision:
    if not plan.gated or g is None or g.capacity.policy.mode != ENFORCED:
        return UNGATED
    x, now = g.capacity, g.now
    policy = x.policy
    t_hold = g.held_since if g.held_since is not None else now
    settle_bound = t_hold + policy.settle_max_ms / 1e3 + SETTLE_HOLD_GRACE_S
    x = replace(x, expected_tokens=plan.expected_tokens)  # the context arm checks this request
    if now >= settle_bound:  # held as long as a settle may take: decide without the settling arm
        x = replace(x, settle_remaining_s=None)
    cap = compute_capacity(x)
    reason = cap["reason"]
    if plan.overcommit:
        if reason == REASON_CONTEXT:
            return _reject(plan, g, cap, "overcommit does not bypass the context arm: ")
        warning = None if cap["can_admit"] else f"pool {plan.pool_id}: {reason}; admitted by overcommit"
        return Decision(ADMIT, "overcommit", reason, cap, warning=warning)
    if g.queued_ahead:
        if not g.can_hold:
            return _reject(plan, g, cap, f"{g.queued_ahead} requests are queued for this pool: ")
        return Decision(HOLD, "behind", reason, cap)
    if cap["can_admit"]:
        return Decision(ADMIT, "guaranteed" if cap["guaranteed"] else "admitted", reason, cap)
    if reason == REASON_SETTLING:
        if not g.can_hold:
            return _reject(plan, g, cap)
        return Decision(HOLD, "settling", reason, cap, wake_at=min(now + cap["settle_remaining_ms"] / 1e3, settle_bound))
    if policy.on_saturation == QUEUE:
        deadline = t_hold + policy.queue_timeout_ms / 1e3
        if not g.can_hold:
            return _reject(plan, g, cap)
        if now >= deadline:
            return _reject(plan, g, cap, f"timed out after {policy.queue_timeout_ms / 1e3:g} s in the admission "
                                         f"queue of pool {plan.pool_id}: ", reason=REASON_QUEUE_TIMEOUT)
        return Decision(HOLD, "queued", reason, cap, wake_at=deadline, deadline=deadline)
    if policy.on_saturation == WARN and reason != REASON_CONTEXT:
        warning = f"pool {plan.pool_id} is saturated ({reason}); admitted anyway (on_saturation=warn)"
        return Decision(ADMIT, "warned", reason, cap, warning=warning)
    return _reject(plan, g, cap)
