"""tps estimators: the window settings, one session's experienced tps, an events-per-second window.

Definitions are in ``metrics`` (the module docstring). The classes take explicit timestamps, so
tests drive them with a scripted clock.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, fields

from ..checks import is_int as _is_int, is_number as _is_number
from ..errors import InvalidRequestError


# ============================================================================ configuration
@dataclass(frozen=True)
class TpsConfig:
    """Windows of the tps estimators and the time-series history.

    window_tokens / window_s: a session's EWMA uses at most the last ``window_tokens`` intervals
        and only those within ``window_s`` of its newest token (whichever is smaller).
    tau_s: time constant of the EWMA weights (None = window_s).
    min_samples: intervals of the current request before a session stops warming.
    aggregate_window_s: window of the aggregate (and prefill) throughput.
    history_interval_s: period of the sampled time series (taken on engine steps).
    history_len: points kept per session; global_history_len: points of the engine-wide series.
    max_session_histories: sessions whose series are kept (least recently updated dropped first).
    """

    window_tokens: int = 128
    window_s: float = 2.0
    tau_s: float | None = None
    min_samples: int = 1
    aggregate_window_s: float = 2.0
    history_interval_s: float = 0.5
    history_len: int = 600
    global_history_len: int = 7200
    max_session_histories: int = 256

    def __post_init__(self) -> None:
        def check(cond: bool, msg: str) -> None:
            if not cond:
                raise InvalidRequestError(msg)

        check(_is_int(self.window_tokens) and 1 <= self.window_tokens <= 100_000,
              f"window_tokens must be an integer in [1, 100000], got {self.window_tokens!r}")
        for name in ("window_s", "aggregate_window_s", "history_interval_s"):
            v = getattr(self, name)
            check(_is_number(v) and 0 < v <= 3600, f"{name} must be a number of seconds in (0, 3600], got {v!r}")
        check(self.tau_s is None or (_is_number(self.tau_s) and 0 < self.tau_s <= 1e9),
              f"tau_s must be None or a positive number of seconds, got {self.tau_s!r}")
        check(_is_int(self.min_samples) and 1 <= self.min_samples <= 1000,
              f"min_samples must be an integer in [1, 1000], got {self.min_samples!r}")
        for name in ("history_len", "global_history_len", "max_session_histories"):
            v = getattr(self, name)
            check(_is_int(v) and 1 <= v <= 1_000_000, f"{name} must be an integer in [1, 1000000], got {v!r}")

    @property
    def tau(self) -> float:
        return self.tau_s if self.tau_s is not None else self.window_s

    def updated(self, **kw) -> "TpsConfig":
        names = {f.name for f in fields(self)}
        bad = sorted(set(kw) - names)
        if bad:
            raise InvalidRequestError(f"unknown tps setting(s) {bad}; known: {sorted(names)}")
        return TpsConfig(**{**asdict(self), **kw})


# ============================================================================ estimators
class SessionTps:
    """Experienced decode tps of one session (see the module docstring for the definition)."""

    __slots__ = ("cfg", "_t", "_dt", "last_t", "chain_key", "chain_intervals", "total_tokens", "_cache")

    def __init__(self, cfg: TpsConfig):
        self.cfg = cfg
        self._t: deque[float] = deque(maxlen=cfg.window_tokens)  # end time of each interval
        self._dt: deque[float] = deque(maxlen=cfg.window_tokens)
        self.last_t: float | None = None
        self.chain_key: object = None  # identifies the request whose chain is open
        self.chain_intervals = 0  # intervals of the current request
        self.total_tokens = 0  # accepted generated tokens, lifetime
        self._cache: float | None = None

    def reconfigure(self, cfg: TpsConfig) -> None:
        self.cfg = cfg
        self._t = deque(self._t, maxlen=cfg.window_tokens)
        self._dt = deque(self._dt, maxlen=cfg.window_tokens)
        self._cache = None

    def on_token(self, t: float, chain_key: object = None) -> None:
        """One accepted generated token at time ``t``. A new ``chain_key`` (a new request) starts a
        new chain: the interval since the previous request's last token is not a sample."""
        self.total_tokens += 1
        if chain_key is not self.chain_key or self.last_t is None:
            self.chain_key = chain_key
            self.chain_intervals = 0
        else:
            self._t.append(t)
            self._dt.append(max(t - self.last_t, 1e-9))
            self.chain_intervals += 1
            self._cache = None
        self.last_t = t

    def is_fresh(self, chain_key: object) -> bool:
        """Has the request ``chain_key`` produced enough intervals to be measured (not warming)?"""
        return chain_key is self.chain_key and self.chain_intervals >= self.cfg.min_samples

    def value(self) -> float:
        """The EWMA in tokens/s over the window (0.0 before the first interval)."""
        if self._cache is not None:
            return self._cache
        if not self._t:
            return 0.0
        newest = self._t[-1]
        cut = newest - self.cfg.window_s
        tau = self.cfg.tau
        num = den = 0.0
        for t, dt in zip(reversed(self._t), reversed(self._dt)):
            if t < cut and num > 0:
                break
            w = math.exp(-(newest - t) / tau)
            num += w
            den += w * dt
        self._cache = num / den if den > 0 else 0.0
        return self._cache


class RateWindow:
    """Events per second over the last ``window_s`` from timestamped counts ``(t, n)``.

    The rate is ``sum(n after b) / (now - t_b)`` where ``b`` is the last entry at or before
    ``now - window_s`` (the window's left edge; the counts after it were produced in
    ``(t_b, now]``), or the first entry of the current busy period when there is none (a gap
    longer than the window starts a new busy period). It decays to 0 once nothing arrives.
    """

    __slots__ = ("window_s", "_q")

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._q: deque[tuple[float, int]] = deque()

    def add(self, t: float, n: int) -> None:
        if n > 0:
            self._q.append((t, n))

    def rate(self, now: float) -> float:
        q, edge = self._q, now - self.window_s
        while len(q) >= 2 and q[1][0] <= edge:
            q.popleft()  # keep one entry at or before the edge: the reference point
        if len(q) >= 2 and q[0][0] <= edge and q[1][0] - q[0][0] > self.window_s:
            q.popleft()  # the reference ended an earlier busy period: this one starts at q[0]
        if len(q) < 2:
            return 0.0
        span = now - q[0][0]
        return sum(n for _, n in list(q)[1:]) / span if span > 0 else 0.0
