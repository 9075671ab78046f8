"""What one more session costs everyone: the engine's step time per batch size, learned online.

Every decoding session gets one token per engine step, so a session's experienced tps is about
1 / (step time), and admitting one more session changes everyone's tps by the ratio of the step
times at B and B + 1 sequences in flight. ``StepForecast`` keeps, per batch size, exponentially
weighted statistics of the measured pure-decode step time (mean, variance, effective samples) and
projects the step time at B + 1 with an upper confidence bound.

A step is split into its *level* and a *stall*: the part beyond ``STALL_X`` times its batch size's
level (a preempted thread, a neighbour's burst of I/O, a page fault) does not depend on the batch
size, so it is pooled over all steps (``stalls``) instead of blurring one batch size's mean. On a
loaded machine a stall every ~15 steps makes the raw per-step spread several times the level's, and
a bound on the raw mean would need hundreds of steps per batch size to tell two sizes apart. The
expected step time at B is its level + the mean stall excess per step; its standard error combines
both. Projections:

* **measured**: B + 1 was seen often enough: its mean + z standard errors. A size seen for fewer
  than ``THIN`` steps (a probe's settle window; a warm-up with a stall in it) is blended with the
  line through the other sizes by their precisions, so one unlucky window does not close it.
* **extrapolated**: B + 1 was not seen, but two or more batch sizes were: a weighted least-squares
  line through their means (slope >= 0, never below the step time at B), + z standard errors of
  the prediction plus the line's residual spread.
* **conservative**: only B was seen: a full share per session, ``s_B * (B + 1) / B`` (the bound),
  with the midpoint ``s_B * (B + 1/2) / B`` as the estimate. On an idle engine (B = 0) that has
  measured one size x, the same rule from x: ``s_x * n / x`` for n > x sessions.

``kind`` tells which; a batch size beyond every size seen, or seen for fewer than ``THIN`` steps,
is the **frontier**: the controller may probe it when the estimate passes the floor (that is how
the curve is learned, and how a bound that is wide only for lack of samples narrows; it never
probes further than one size past what it has measured). The same statistics size the settle
windows: after an admit the pool waits until the step time at the new batch size is known to
``precision`` (relative), i.e. ``(z * cv / precision)^2`` steps, within the policy's settle bound.
``calibration`` relates measured step times to the tps sessions experience (prefill steps and
per-token overheads make it a little below 1); its samples (the mean tps over a short window x
the step time) are clipped against outliers on both sides and only their average is capped at 1:
a window holds a stall or not, and clipping only the samples above 1 biased it low by 5-15 % on
a noisy engine (every projection pessimistic, spawns held below what fits).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field

Z = 2.0  # standard errors in a bound (about 97.5 % one-sided)
ALPHA = 0.05  # weight of a new step in the per-batch-size statistics (about 40 steps of memory)
SLOW_ALPHA = 0.005  # a second, slow mean per batch size: a bound never forgets a recent slowdown
STALL_ALPHA = 0.002  # weight of a step in the engine-wide stall statistics (about 1000 steps)
STALL_X = 2.0  # a step longer than this x its batch size's level is a stall (its excess is engine-wide)
WARM = 8  # a batch size's first steps: clipped at STALL_X x their median (no level known yet)
MIN_SAMPLES = 6  # steps at a batch size before it counts as measured
PRECISION = 0.03  # relative precision of the step time a settle window waits for
MIN_SETTLE_TOKENS = 4
CAL_ALPHA = 0.1  # weight of a steady sample in the calibration
CTX_ALPHA = 0.002  # weight of a step in the context slope (about 1000 steps)
CTX_MIN_STEPS = 50  # steps before a context slope is used
THIN = 100  # a batch size measured over fewer steps may be probed again (its bound is still wide)


def weight(n: int, alpha: float) -> float:
    """The weight of the n-th sample in an exponentially weighted mean: a plain mean (1 / n) until
    that falls below ``alpha``."""
    return max(alpha, 1.0 / n)


def samples(n: int, alpha: float) -> float:
    """The samples an exponentially weighted mean of ``n`` effectively averages: at most 2 / alpha - 1."""
    return min(float(n), 2.0 / alpha - 1)


@dataclass
class Ewma:
    """An exponentially weighted mean and variance (a plain mean while few samples exist)."""

    n: int = 0
    mean: float = 0.0
    var: float = 0.0

    def add(self, x: float, alpha: float) -> None:
        self.n += 1
        a = weight(self.n, alpha)
        d = x - self.mean
        self.mean += a * d
        self.var = (1 - a) * (self.var + a * d * d) if self.n > 1 else 0.0

    def se(self, alpha: float) -> float:
        """Standard error of the mean (the samples it effectively averages: at most 2 / alpha - 1)."""
        n = samples(self.n, alpha)
        return math.sqrt(self.var / n) if self.n > 1 else self.mean


@dataclass
class BatchStats:
    """Step times at one batch size: the *level* (steps clipped at STALL_X x the level; what the
    batch size costs) as a fast and a slow exponentially weighted mean. The excess of a clipped step
    (a stall: the OS, a neighbour, a page fault) does not depend on the batch size and goes to the
    engine-wide ``Stalls``, so one rare long step does not blur the comparison of batch sizes."""

    n: int = 0  # steps seen (lifetime)
    mean: float = 0.0  # fast level (ALPHA)
    var: float = 0.0
    slow: float = 0.0  # slow level (SLOW_ALPHA)
    first: list = field(default_factory=list)  # the first WARM steps (raw)
    ctx: float = 0.0  # context tokens attended per step, weighted as ``mean`` (fast)
    ctx_slow: float = 0.0  # ... and as ``slow``

    def clip(self, x: float) -> float:
        """The level part of a step of ``x`` seconds (its excess is ``x - clip(x)``); during the
        warm-up, clipped at STALL_X x the median of the steps so far."""
        ref = statistics.median(self.first + [x]) if self.n < WARM else self.mean
        return min(x, STALL_X * ref)

    def add(self, x: float, alpha: float, ctx: float = 0.0) -> None:
        """Add a step: raw during the warm-up (re-clipped at their median), its level after."""
        self.n += 1
        a = weight(self.n, alpha)
        self.ctx += a * (ctx - self.ctx)
        self.ctx_slow += weight(self.n, SLOW_ALPHA) * (ctx - self.ctx_slow)
        if self.n <= WARM:  # a plain mean of the warm-up steps, re-clipped at their median
            self.first.append(x)
            ref = STALL_X * statistics.median(self.first)
            xs = [min(v, ref) for v in self.first]
            self.mean = self.slow = sum(xs) / len(xs)
            self.var = sum((v - self.mean) ** 2 for v in xs) / (len(xs) - 1) if len(xs) > 1 else 0.0
            return
        self.first = self.first[:0]
        d = x - self.mean
        self.mean += a * d
        self.var = (1 - a) * (self.var + a * d * d)
        self.slow += weight(self.n, SLOW_ALPHA) * (x - self.slow)

    @property
    def recent_slowdown(self) -> bool:
        return self.mean > self.slow + Z * self.se

    @property
    def upper(self) -> float:
        """The level a bound starts from: the long-run level, or the recent one when it is
        significantly slower (a slowdown now, beyond what the noise explains). A noisy neighbour
        that went quiet a moment ago stays in the long-run level: it will be back."""
        return self.mean if self.recent_slowdown else self.slow

    @property
    def upper_ctx(self) -> float:
        """The context tokens per step of the steps ``upper`` averages."""
        return self.ctx if self.recent_slowdown else self.ctx_slow

    @property
    def se_slow(self) -> float:
        """Standard error of the long-run level."""
        n = samples(self.n, SLOW_ALPHA)
        return math.sqrt(self.var / n) if self.n > 1 else self.mean

    @property
    def n_eff(self) -> float:
        return samples(self.n, ALPHA)

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
    # upper confidence bound of the step time at b_from: its level's, with the engine-wide stall
    # excess at its mean (the stalls' uncertainty is common to every batch size: it does not say
    # whether b_from is above a floor that b_from + 1 would cross)
    now_hi_s: float | None = None

    def ratio(self, bound: bool = True) -> float | None:
        """Factor on a session's tps from b_from to b_to (<= 1), or None."""
        s = self.bound_s if bound else self.est_s
        if self.now_s is None or s is None or s <= 0:
            return None
        return min(1.0, self.now_s / s)


@dataclass
class CtxSlope:
    """The step time per context token attended, pooled over batch sizes: a least-squares line
    through the origin of each step's deviation from its batch size's fast level against its
    context's deviation from the same weighting of contexts (both lag the same way while contexts
    grow, so the ratio is unbiased), exponentially weighted over about 1 / CTX_ALPHA steps, shrunk
    towards zero by its standard error."""

    n: int = 0
    sxx: float = 0.0
    sxy: float = 0.0
    syy: float = 0.0

    def add(self, dx: float, dy: float) -> None:
        self.n += 1
        a = weight(self.n, CTX_ALPHA)
        self.sxx += a * (dx * dx - self.sxx)
        self.sxy += a * (dx * dy - self.sxy)
        self.syy += a * (dy * dy - self.syy)

    @property
    def slope(self) -> float:
        if self.n < CTX_MIN_STEPS or self.sxx <= 0:
            return 0.0
        k = self.sxy / self.sxx
        n = samples(self.n, CTX_ALPHA)
        resid = max(0.0, self.syy - k * self.sxy)
        var = resid / (self.sxx * n)
        # shrunk towards 0 by its own uncertainty (k^2 / (k^2 + se^2)): the full slope where it is
        # well measured, little where it is noise; never negative (more context is never cheaper)
        return k * k * k / (k * k + var) if k > 0 else 0.0


class StepForecast:
    """Engine-wide step-time statistics per batch size (fed with every pure-decode step).

    The step time expected at a batch size is its level plus the engine-wide mean stall excess
    per step; its standard error combines both."""

    def __init__(self, *, z: float = Z, alpha: float = ALPHA, min_samples: int = MIN_SAMPLES):
        self.z, self.alpha, self.min_samples = z, alpha, min_samples
        self.stats: dict[int, BatchStats] = {}
        self.stalls = Ewma()  # excess seconds per step over the stall threshold (0 for most steps)
        self.ctx = CtxSlope()  # seconds per context token attended
        self._cal = 1.0  # experienced tps x step time, when steady (EWMA of the samples)
        self.calibration_samples = 0

    def observe(self, batch: int, prefill_tokens: int, total_s: float, ctx_tokens: int | None = None) -> None:
        """A step: ``batch`` sequences decoding (0: not a pure-decode step), ``ctx_tokens`` context
        tokens attended over (summed over the batch; None: not known, no context model)."""
        if batch < 1 or prefill_tokens or total_s <= 0:
            return
        st = self.stats.get(batch)
        if st is None:
            st = self.stats[batch] = BatchStats()
        level = st.clip(total_s)
        self.stalls.add(total_s - level, STALL_ALPHA)
        if ctx_tokens is not None and st.n >= WARM:
            self.ctx.add(ctx_tokens - st.ctx, level - st.mean)
        st.add(total_s if st.n < WARM else level, self.alpha, float(ctx_tokens or 0))

    @property
    def stall_s(self) -> float:
        """Mean stall excess per step (engine-wide)."""
        return self.stalls.mean if self.stalls.n else 0.0

    def step_s(self, st: BatchStats, fast: bool = False, ctx: float | None = None) -> float:
        """Expected step time at a batch size: its level (fast or bounding) + the mean stall excess;
        with ``ctx``, the level moved to that many context tokens along the context slope."""
        level = st.mean if fast else st.upper
        k = self.ctx.slope if ctx is not None else 0.0
        if k and ctx is not None:
            level = max(0.5 * level, level + k * (ctx - (st.ctx if fast else st.upper_ctx)))
        return level + self.stall_s

    def se(self, st: BatchStats) -> float:
        """Standard error of ``step_s``."""
        return math.sqrt(st.se_slow ** 2 + (self.stalls.se(STALL_ALPHA) if self.stalls.n > 1 else 0.0) ** 2)

    def calibrate(self, mean_tps: float, batch: int) -> None:
        """A steady sample: the experienced mean tps while ``batch`` sequences decode."""
        st = self.stats.get(batch)
        if st is None or st.n < self.min_samples or mean_tps <= 0:
            return
        # a sample over a short window is far noisier than the mean it estimates (a stall is in it
        # or not): clipped only against outliers, both ways, so that the average is not biased; the
        # average itself never says sessions get more than one token per step
        c = min(2.0, max(0.5, mean_tps * self.step_s(st, fast=True)))
        self.calibration_samples += 1
        a = weight(self.calibration_samples, CAL_ALPHA)
        self._cal += a * (c - self._cal)

    @property
    def calibration(self) -> float:
        """Experienced tps x step time (at most 1), learned from steady samples."""
        return min(1.0, self._cal)

    def measured(self, batch: int) -> BatchStats | None:
        st = self.stats.get(batch)
        return st if st is not None and st.n >= self.min_samples else None

    def tps(self, batch: int) -> float | None:
        """Experienced tps expected at ``batch`` (measured sizes only)."""
        st = self.measured(batch)
        return None if st is None else self.calibration / self.step_s(st, fast=True)

    def project(self, b: int, k: int = 1, ctx_now: float | None = None, ctx_new: float = 0.0) -> Projection:
        """The step time when the batch grows from ``b`` to ``b + k``. With ``ctx_now`` (context
        tokens of the ``b`` sequences in flight) and ``ctx_new`` (of each new one), every batch
        size's level is first moved to the context it would attend now (``x`` sequences of the
        current mean context), and the projection to ``ctx_now + k * ctx_new``: a level measured
        while sessions were long (or short) is not read as the cost of their number."""
        to = b + k
        known = {x: st for x, st in self.stats.items() if st.n >= self.min_samples}
        frontier = not known or to > max(known)
        slope = self.ctx.slope if ctx_now is not None else 0.0
        per_seq: float | None = None
        shift = 0.0  # the new sessions' context
        if slope and ctx_now is not None:
            per_seq = ctx_now / b if b > 0 else ctx_new
            shift = slope * (ctx_now + k * ctx_new - to * per_seq)
        # long-run means (or a significant slowdown now), at the context of now
        m = {x: self.step_s(st, ctx=None if per_seq is None else x * per_seq) for x, st in known.items()}
        now_s = m.get(b)
        hi = None if now_s is None else now_s + self.z * known[b].se_slow
        proj = self._project(b, k, to, known, m, frontier, now_s, hi)
        if shift and proj.est_s is not None and proj.bound_s is not None:  # (both or neither)
            # more sessions are never cheaper than now; with no step time at b measured (sessions of
            # another pool in flight), a shorter new context takes at most half the projection off,
            # as a level moved along the slope does (``step_s``): a step never costs nothing
            lo_est = now_s if now_s is not None and to > b else 0.5 * proj.est_s
            lo_bound = now_s if now_s is not None and to > b else 0.5 * proj.bound_s
            proj = dataclasses.replace(proj, est_s=max(lo_est, proj.est_s + shift),
                                       bound_s=max(lo_bound, proj.bound_s + shift))
        return proj

    def _project(self, b: int, k: int, to: int, known: dict, m: dict, frontier: bool, now_s: float | None,
                 hi: float | None) -> Projection:
        st = known.get(to)
        if st is not None:
            est, se = m[to], self.se(st)
            if st.n < THIN and len(known) >= 3:
                # a size measured over few steps (a probe's settle window, a warm-up with a stall in
                # it) is blended with the line through the other sizes, by their precisions: one
                # unlucky window does not close that size until it is measured again
                le, lse = self._line({x: v for x, v in known.items() if x != to}, to, m)
                if lse > 0 and se > 0:
                    wa, wb = 1 / se ** 2, 1 / lse ** 2
                    est, se = (wa * est + wb * le) / (wa + wb), (wa + wb) ** -0.5
            bound = est + self.z * se
            if now_s is not None and to > b:
                bound = max(bound, now_s)
            return Projection(b, to, now_s, est, bound, "measured", st.n < THIN, hi)
        if len(known) >= 2:
            est, sd = self._line(known, to, m)
            return Projection(b, to, now_s, est, est + self.z * sd, "extrapolated", frontier, hi)
        if now_s is not None and b > 0:
            return Projection(b, to, now_s, now_s * (b + k / 2) / b, now_s * (b + k) / b, "conservative", frontier,
                              hi)
        if b == 0 and len(known) == 1 and to > min(known):
            # idle, one size x measured (sessions that ran one at a time): the same full share per
            # session from x, so an idle engine reports room for more than the one size it has seen
            (x, _), = known.items()
            return Projection(b, to, now_s, m[x] * (x + (to - x) / 2) / x, m[x] * to / x, "conservative", frontier, hi)
        return Projection(b, to, now_s, None, None, "none", frontier, hi)

    def _line(self, known: dict, to: int, m: dict) -> tuple[float, float]:
        """(estimate, spread) of the step time at ``to`` from a weighted least-squares line through
        the step times ``m`` of two or more ``known`` sizes (slope >= 0, never below the nearest
        size under ``to``); the spread is the prediction's standard error plus the line's residual
        spread (a bound is the estimate + z spreads)."""
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
        se = math.sqrt(sum((self.se(known[x]) ** 2) for x in xs) / len(xs))
        lever = 1.0 + (to - mx) ** 2 / sxx if sxx else 2.0
        return est, math.sqrt(lever) * (se + resid)

    def need_steps(self, batch: int, cap: int) -> int:
        """Steps at ``batch`` for its level to be known to PRECISION (at least 4, at most cap)."""
        st = self.stats.get(batch)
        cvs = [s.cv for s in self.stats.values() if s.n >= self.min_samples]
        cv = st.cv if st is not None and st.n >= self.min_samples else (max(cvs) if cvs else 0.1)
        need = math.ceil((self.z * cv / PRECISION) ** 2)
        return min(cap, max(MIN_SETTLE_TOKENS, need))

    def measured_steps(self, batch: int) -> int:
        """Steps measured at ``batch`` (0 until it counts as measured)."""
        st = self.stats.get(batch)
        return st.n if st is not None and st.n >= self.min_samples else 0

    def settle_tokens(self, batch: int, cap: int, have: int = 0) -> int:
        """Steps a settle window at ``batch`` waits for: what ``need_steps`` asks beyond the ``have``
        steps measured there before the admit (a batch coming back to a size it had, after sessions
        ended, is known already: MIN_SETTLE_TOKENS, to see that it still costs what it did)."""
        return min(cap, max(MIN_SETTLE_TOKENS, self.need_steps(batch, cap) - have))

    def as_dict(self) -> dict:
        return {"calibration": self.calibration, "stall_s_per_step": self.stall_s, "ctx_s_per_token": self.ctx.slope,
                "per_batch": {b: {"n": s.n, "mean_s": s.mean, "cv": s.cv} for b, s in sorted(self.stats.items())}}
