"""Admission vocabulary: the per-pool policy, its validation, and the named reasons and constants."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from ..checks import is_int, is_number
from ..errors import InvalidRequestError

ADVISORY, ENFORCED = "advisory", "enforced"
REJECT, WARN, QUEUE = "reject", "warn", "queue"
ADAPTIVE, CONSERVATIVE = "adaptive", "conservative"

REASON_OK = "ok"
REASON_GUARANTEED = "guaranteed minimum"
REASON_SETTLING = "measurement settling"
REASON_FLOOR = "projected mean tps below floor"
REASON_FLOOR_IDLE = "projected mean tps below floor (idle estimate)"
REASON_UNCERTAIN = "next admit may cross the floor (uncertain drop)"
REASON_UNMEASURED = "batch size not yet measured enough"
REASON_KV = "kv headroom exhausted"
REASON_CONTEXT = "context headroom exhausted"
REASON_QUEUE_TIMEOUT = "queue timeout"
FLOOR_REASONS = (REASON_FLOOR, REASON_FLOOR_IDLE, REASON_UNCERTAIN)
UNKNOWN = "unknown"  # sessions_remaining when a floor is set and nothing is measured to project from

IDLE_FRESH_S = 30.0  # a settled mean younger than this feeds the idle estimate
SETTLE_HOLD_GRACE_S = 1.0  # an enforced settling hold lasts at most settle_max_ms + this


# (low, high) of the numeric fields: integers in [low, high], numbers in (low, high] (the OpenAPI
# schema of POST /polykv/pools/{id}/admission is made from these)
RANGES = {"target_tps_per_session": (0, 1e6), "guarantee_min_sessions": (0, 1_000_000),
          "settle_tokens": (1, 1_000_000), "settle_max_ms": (0, 3_600_000), "queue_timeout_ms": (0, 86_400_000)}


@dataclass(frozen=True)
class AdmissionPolicy:
    """Per-pool admission policy.

    target_tps_per_session: the floor on experienced decode tps (None = no floor). Only a pool with
        a floor is ever held for "measurement settling"; on other pools settle windows still measure
        (and are reported) but never block.
    mode: "advisory" (report only, never refuses) or "enforced" (gate sessions new to the pool).
    on_saturation: what the enforced gate does with a new session that does not fit:
        "reject" (PoolSaturatedError, 429), "warn" (admit, with a warning), "queue" (hold FIFO).
    guarantee_min_sessions: while the pool has fewer attached sessions than this AND the engine has
        fewer requests in flight than this, a new session is always admitted (the context arm
        still applies). Speed is shared by the whole engine, so the promise is checked against the
        engine's load: N pools guaranteeing 1 session each do not force N sessions past the floor.
    settle_tokens / settle_max_ms: the settle window after each new-session admit (at most; the
        adaptive forecast ends it as soon as the new batch size's step time is known well enough).
    forecast: how the tps after one more admit is projected: "adaptive" (the engine's step time
        per batch size, learned online, with an upper confidence bound; see ``forecast``) or
        "conservative" (mean * n/(n+1) until a measured per-admit drop exists, then mean - drop).
    queue_timeout_ms: how long ``queue`` holds a request before failing it with PoolSaturatedError.
    """

    target_tps_per_session: float | None = None
    mode: str = ADVISORY
    on_saturation: str = REJECT
    guarantee_min_sessions: int = 1
    settle_tokens: int = 48
    settle_max_ms: float = 5000.0
    queue_timeout_ms: float = 30000.0
    forecast: str = ADAPTIVE

    def __post_init__(self) -> None:
        def check(cond: bool, msg: str) -> None:
            if not cond:
                raise InvalidRequestError(msg)

        t = self.target_tps_per_session
        lo, hi = RANGES["target_tps_per_session"]
        check(t is None or (is_number(t) and lo < t <= hi),
              f"target_tps_per_session must be a positive number of tokens/s up to {hi:g} (or null), got {t!r}")
        check(self.mode in (ADVISORY, ENFORCED), f"mode must be advisory|enforced, got {self.mode!r}")
        check(self.on_saturation in (REJECT, WARN, QUEUE),
              f"on_saturation must be reject|warn|queue, got {self.on_saturation!r}")
        lo, hi = RANGES["guarantee_min_sessions"]
        check(is_int(self.guarantee_min_sessions) and lo <= self.guarantee_min_sessions <= hi,
              f"guarantee_min_sessions must be an integer from {lo} to {hi:,}, got {self.guarantee_min_sessions!r}")
        lo, hi = RANGES["settle_tokens"]
        check(is_int(self.settle_tokens) and lo <= self.settle_tokens <= hi,
              f"settle_tokens must be an integer from {lo} to {hi:,}, got {self.settle_tokens!r}")
        lo, hi = RANGES["settle_max_ms"]
        check(is_number(self.settle_max_ms) and lo < self.settle_max_ms <= hi,
              f"settle_max_ms must be a positive number of milliseconds (<= 1 h), got {self.settle_max_ms!r}")
        lo, hi = RANGES["queue_timeout_ms"]
        check(is_number(self.queue_timeout_ms) and lo < self.queue_timeout_ms <= hi,
              f"queue_timeout_ms must be a positive number of milliseconds (<= 24 h), got {self.queue_timeout_ms!r}")
        check(self.forecast in (ADAPTIVE, CONSERVATIVE),
              f"forecast must be adaptive|conservative, got {self.forecast!r}")

    @property
    def has_floor(self) -> bool:
        return self.target_tps_per_session is not None

    def updated(self, **kw) -> "AdmissionPolicy":
        names = [f.name for f in fields(self)]
        bad = sorted(set(kw) - set(names))
        if bad:
            raise InvalidRequestError(f"unknown admission setting(s) {bad}; known: {names}")
        return AdmissionPolicy(**{**asdict(self), **kw})

    def as_dict(self) -> dict:
        return asdict(self)
