"""What one more session costs everyone: the engine's step time per batch size, learned online.

Every decoding session gets one token per engine step, so a session's experienced tps is about
1 / (step time), and admitting one more session changes everyone's tps by the ratio of the step
times at B and B + 1 sequences in flight. ``StepForecast`` keeps, per batch size, exponentially
weighted statistics of the measured pure-decode step time (mean, variance, effective samples) and
projects the step time at B + 1 with an upper confidence bound:

* **measured**: B + 1 was seen often enough: its mean + z standard errors.
* **extrapolated**: B + 1 was not seen, but two or more batch sizes were: a weighted least-squares
  line through their means (slope >= 0, never below the step time at B), + z standard errors of
  the prediction plus the line's residual spread.
* **conservative**: only B was seen: a full share per session, ``s_B * (B + 1) / B`` (the bound),
  with the midpoint ``s_B * (B + 1/2) / B`` as the estimate.

``kind`` tells which; a batch size beyond every size seen, or seen for fewer than ``THIN`` steps,
is the **frontier**: the controller may probe it when the estimate passes the floor (that is how
the curve is learned, and how a bound that is wide only for lack of samples narrows; it never
probes further than one size past what it has measured). The same statistics size the settle
windows: after an admit the pool waits until the step time at the new batch size is known to
``precision`` (relative), i.e. ``(z * cv / precision)^2`` steps, within the policy's settle bound.
``calibration`` relates measured step times to the tps sessions experience (prefill steps and
per-token overheads make it a little below 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Z = 2.0  # standard errors in a bound (about 97.5 % one-sided)
ALPHA = 0.05  # weight of a new step in the per-batch-size statistics (about 40 steps of memory)
SLOW_ALPHA = 0.005  # a second, slow mean per batch size: a bound never forgets a recent slowdown
MIN_SAMPLES = 6  # steps at a batch size before it counts as measured
PRECISION = 0.03  # relative precision of the step time a settle window waits for
MIN_SETTLE_TOKENS = 4
THIN = 100  # a batch size measured over fewer steps may be probed again (its bound is still wide)


@dataclass
class BatchStats:
    n: int = 0  # steps seen (lifetime)
    mean: float = 0.0
    var: float = 0.0
    slow: float = 0.0  # the slow mean (SLOW_ALPHA)

    def add(self, x: float, alpha: float) -> None:
        self.n += 1
        if self.n == 1:
            self.mean, self.var, self.slow = x, 0.0, x
            return
        a = max(alpha, 1.0 / self.n)  # a plain mean while few samples exist
        d = x - self.mean
        self.mean += a * d
        self.var = (1 - a) * (self.var + a * d * d)
        self.slow += max(SLOW_ALPHA, 1.0 / self.n) * (x - self.slow)

    @property
    def upper(self) -> float:
        """The mean a bound starts from: the long-run mean, or the recent one when it is
        significantly slower (a slowdown now, beyond what the noise explains). A noisy neighbour
        that went quiet a moment ago stays in the long-run mean: it will be back."""
        if self.mean > self.slow + Z * self.se:
            return self.mean
        return self.slow

    @property
    def se_slow(self) -> float:
        """Standard error of the long-run mean."""
        n = min(float(self.n), 2.0 / SLOW_ALPHA - 1)
        return math.sqrt(self.var / n) if self.n > 1 else self.mean

    @property
    def n_eff(self) -> float:
        return min(float(self.n), 2.0 / ALPHA - 1)

    @property
    def se(self) -> float:
        return math.sqrt(self.var / self.n_eff) if self.n > 1 else self.mean

    @property
    def cv(self) -> float:
        return math.sqrt(self.var) / self.mean if self.mean > 0 else 0.0


@dataclass(frozen=True)
class Projection:
    """The step time at ``b_to`` sequences (estimate and upper bound) and how it was obtained."""

    b_from: int
    b_to: int
    now_s: float | None  # step time at b_from (None: not measured)
    est_s: float | None
    bound_s: float | None
    kind: str  # measured | extrapolated | conservative | none
    frontier: bool  # b_to is beyond every batch size measured

    def ratio(self, bound: bool = True) -> float | None:
        """Factor on a session's tps from b_from to b_to (<= 1), or None."""
        s = self.bound_s if bound else self.est_s
        if self.now_s is None or s is None or s <= 0:
            return None
        return min(1.0, self.now_s / s)


class StepForecast:
    """Engine-wide step-time statistics per batch size (fed with every pure-decode step)."""

    def __init__(self, *, z: float = Z, alpha: float = ALPHA, min_samples: int = MIN_SAMPLES):
        self.z, self.alpha, self.min_samples = z, alpha, min_samples
        self.stats: dict[int, BatchStats] = {}
        self.calibration = 1.0  # experienced tps x step time, when steady
        self.calibration_samples = 0

    def observe(self, batch: int, prefill_tokens: int, total_s: float) -> None:
        if batch < 1 or prefill_tokens or total_s <= 0:
            return
        st = self.stats.get(batch)
        if st is None:
            st = self.stats[batch] = BatchStats()
        st.add(total_s, self.alpha)

    def calibrate(self, mean_tps: float, batch: int) -> None:
        """A steady sample: the experienced mean tps while ``batch`` sequences decode."""
        st = self.stats.get(batch)
        if st is None or st.n < self.min_samples or mean_tps <= 0:
            return
        c = min(1.0, max(0.5, mean_tps * st.mean))
        self.calibration_samples += 1
        a = max(0.1, 1.0 / self.calibration_samples)
        self.calibration += a * (c - self.calibration)

    def measured(self, batch: int) -> BatchStats | None:
        st = self.stats.get(batch)
        return st if st is not None and st.n >= self.min_samples else None

    def tps(self, batch: int) -> float | None:
        """Experienced tps expected at ``batch`` (measured sizes only)."""
        st = self.measured(batch)
        return None if st is None else self.calibration / st.mean

    def project(self, b: int, k: int = 1) -> Projection:
        """The step time when the batch grows from ``b`` to ``b + k``."""
        to = b + k
        known = {x: st for x, st in self.stats.items() if st.n >= self.min_samples}
        frontier = not known or to > max(known)
        m = {x: st.upper for x, st in known.items()}  # long-run means (or a significant slowdown now)
        now_s = m.get(b)
        st = known.get(to)
        if st is not None:
            bound = m[to] + self.z * st.se_slow
            if now_s is not None and to > b:
                bound = max(bound, now_s)
            return Projection(b, to, now_s, m[to], bound, "measured", st.n < THIN)
        if len(known) >= 2:
            xs = sorted(known)
            w = [min(known[x].n, 2.0 / SLOW_ALPHA) for x in xs]
            sw = sum(w)
            mx = sum(wi * x for wi, x in zip(w, xs)) / sw
            my = sum(wi * m[x] for wi, x in zip(w, xs)) / sw
            sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs))
            slope = max(0.0, sum(wi * (x - mx) * (m[x] - my) for wi, x in zip(w, xs)) / sxx) if sxx else 0.0
            est = my + slope * (to - mx)
            below = [x for x in xs if x < to]
            if len(below) >= 2:  # the local slope of the two nearest sizes (a knee bends the curve up)
                x1, x2 = below[-2], below[-1]
                est = max(est, m[x2] + max((m[x2] - m[x1]) / (x2 - x1), 0.0) * (to - x2))
            if below:
                est = max(est, m[below[-1]])  # never cheaper than a smaller batch measured
            resid = math.sqrt(sum(wi * (m[x] - (my + slope * (x - mx))) ** 2 for wi, x in zip(w, xs)) / sw)
            se = math.sqrt(sum((known[x].se_slow ** 2) for x in xs) / len(xs))
            lever = 1.0 + (to - mx) ** 2 / sxx if sxx else 2.0
            bound = est + self.z * math.sqrt(lever) * (se + resid)
            return Projection(b, to, now_s, est, bound, "extrapolated", frontier)
        if now_s is not None and b > 0:
            return Projection(b, to, now_s, now_s * (b + k / 2) / b, now_s * (b + k) / b, "conservative", frontier)
        return Projection(b, to, now_s, None, None, "none", frontier)

    def settle_tokens(self, batch: int, cap: int) -> int:
        """Steps needed at ``batch`` for its mean step time to be known to PRECISION (at least 4, at most cap)."""
        st = self.stats.get(batch)
        cvs = [s.cv for s in self.stats.values() if s.n >= self.min_samples]
        cv = st.cv if st is not None and st.n >= self.min_samples else (max(cvs) if cvs else 0.1)
        need = math.ceil((self.z * cv / PRECISION) ** 2)
        return min(cap, max(MIN_SETTLE_TOKENS, need))

    def as_dict(self) -> dict:
        return {"calibration": self.calibration,
                "per_batch": {b: {"n": s.n, "mean_s": s.mean, "cv": s.cv} for b, s in sorted(self.stats.items())}}
