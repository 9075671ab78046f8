"""Step-cost profiles: how long one engine step takes, as a function of the batch composition.

A profile gives the noise-free cost of a step with ``B`` sequences producing a token, ``P`` prompt
tokens computed and ``C`` context tokens attended over (summed over the batch)::

    decode(B, C) = table[B] + ctx_s * (C - B * ctx_ref)          B measured (``table``)
                 = base_s + seq_s * max(0, B - knee) + ctx_s * C  otherwise (the fitted line)
    cost         = decode(B, C) + prefill_s * P

and the random part of every step: a multiplicative log-normal noise of median 1 (``noise_sigma``),
a stall with probability ``stall_prob`` (exponential, mean ``stall_mean_s``), and optionally a
noisy neighbour: alternating calm and burst periods (exponential lengths) during which every step
costs ``burst_factor`` times more. ``measured_mean_s`` (fitted profiles only) keeps the mean step
time the real engine measured per batch size, so a test can check the simulator against it.

Profiles are JSON files in ``opencoti/sim/profiles/``; ``fit_profile`` builds one from the step
records of a real engine (``benchmarks/sim_measure.py``).
"""

from __future__ import annotations

import json
import math
import random
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


@dataclass
class StepProfile:
    name: str
    description: str = ""
    source: str = "synthetic"  # measured | synthetic | derived
    base_s: float = 0.03
    seq_s: float = 0.005
    knee: int = 0  # sequences that cost nothing extra (a GPU's flat region)
    ctx_s: float = 0.0  # per context token attended (summed over the batch)
    ctx_ref: float = 0.0  # mean context per sequence when ``table`` was measured
    prefill_s: float = 0.0005  # per prompt token computed
    table: dict[int, float] = field(default_factory=dict)  # measured median decode step per B
    noise_sigma: float = 0.05
    stall_prob: float = 0.0
    stall_mean_s: float = 0.0
    burst_factor: float = 1.0
    burst_on_mean_s: float = 0.0
    burst_off_mean_s: float = 0.0
    measured_mean_s: dict[int, float] = field(default_factory=dict)
    ramp: dict = field(default_factory=dict)  # the spawn-ramp scenario for this profile (fit, tasks, tokens)
    machine: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.table = {int(k): float(v) for k, v in self.table.items()}
        self.measured_mean_s = {int(k): float(v) for k, v in self.measured_mean_s.items()}

    # ---------------------------------------------------------------- deterministic part
    def decode_s(self, b: int, ctx_sum: float) -> float:
        if b <= 0:
            return self.base_s
        t = self.table.get(b)
        if t is not None:
            return max(1e-6, t + self.ctx_s * (ctx_sum - b * self.ctx_ref))
        return self.base_s + self.seq_s * max(0, b - self.knee) + self.ctx_s * ctx_sum

    def cost_s(self, b: int, prefill_tokens: int = 0, ctx_sum: float = 0.0) -> float:
        return self.decode_s(b, ctx_sum) + self.prefill_s * prefill_tokens

    def mean_factor(self) -> float:
        """E[noise] of the log-normal of median 1."""
        return math.exp(self.noise_sigma ** 2 / 2)

    def expected_step_s(self, b: int, ctx_sum: float, burst_share: float = 0.0) -> float:
        """The mean of a pure-decode step (noise, stalls, the share of time in bursts)."""
        base = self.decode_s(b, ctx_sum) * self.mean_factor()
        return base * (1 + burst_share * (self.burst_factor - 1)) + self.stall_prob * self.stall_mean_s

    # ---------------------------------------------------------------- I/O
    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=False) + "\n"

    @classmethod
    def load(cls, name_or_path: str | Path) -> "StepProfile":
        p = Path(name_or_path)
        if not p.suffix:
            p = PROFILE_DIR / f"{name_or_path}.json"
        return cls(**json.loads(p.read_text()))


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


class StepClock:
    """Draws the cost of successive steps of one profile (deterministic under its seed)."""

    def __init__(self, profile: StepProfile, seed: int):
        self.p = profile
        self.rng = random.Random(seed)
        self.burst = False
        self.next_switch = self._period(False) if profile.burst_factor > 1 else math.inf

    def _period(self, burst: bool) -> float:
        m = self.p.burst_on_mean_s if burst else self.p.burst_off_mean_s
        return self.rng.expovariate(1.0 / m) if m > 0 else math.inf

    def step(self, t: float, b: int, prefill_tokens: int, ctx_sum: float) -> float:
        """The duration of a step that starts at time ``t``."""
        while t >= self.next_switch:
            self.burst = not self.burst
            self.next_switch += self._period(self.burst)
        p = self.p
        cost = p.cost_s(b, prefill_tokens, ctx_sum)
        if p.noise_sigma > 0:
            cost *= math.exp(self.rng.gauss(0.0, p.noise_sigma))
        if self.burst:
            cost *= p.burst_factor
        if p.stall_prob > 0 and self.rng.random() < p.stall_prob:
            cost += self.rng.expovariate(1.0 / p.stall_mean_s)
        return cost


# ============================================================================ fitting
def _lstsq(xs: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares with a few columns (normal equations, Gaussian elimination)."""
    k = len(xs[0])
    a = [[sum(r[i] * r[j] for r in xs) for j in range(k)] for i in range(k)]
    v = [sum(r[i] * y for r, y in zip(xs, ys)) for i in range(k)]
    for i in range(k):
        piv = max(range(i, k), key=lambda r: abs(a[r][i]))
        a[i], a[piv], v[i], v[piv] = a[piv], a[i], v[piv], v[i]
        if abs(a[i][i]) < 1e-18:
            return [0.0] * k
        for r in range(k):
            if r != i:
                f = a[r][i] / a[i][i]
                a[r] = [x - f * y for x, y in zip(a[r], a[i])]
                v[r] -= f * v[i]
    return [v[i] / a[i][i] for i in range(k)]


def fit_profile(records: list[dict], name: str, *, description: str = "", min_steps: int = 20,
                stall_threshold: float = 2.0) -> StepProfile:
    """Fit a profile from real step records ``{b, prefill, ctx_sum, total_s}``.

    Pure-decode steps (no prompt tokens) give, per batch size, the median, the context slope
    (least squares of the residuals on the context, pooled over B), the log-normal sigma (from the
    median absolute deviation of log(step / median), robust to stalls) and the stalls (steps
    longer than ``stall_threshold`` x the median: their rate and mean excess). ``table`` is then set
    so that the simulated mean step at each batch size equals the measured mean there (the noise
    and stall model pooled over batch sizes, the level per batch size). Mixed steps give the
    per-prompt-token cost.
    """
    dec: dict[int, list[dict]] = {}
    for r in records:
        if r["prefill"] == 0 and r["b"] > 0:
            dec.setdefault(r["b"], []).append(r)
    dec = {b: rs for b, rs in dec.items() if len(rs) >= min_steps}
    if not dec:
        raise ValueError("no batch size with enough pure-decode steps to fit")
    med = {b: statistics.median(r["total_s"] for r in rs) for b, rs in dec.items()}
    ctx_ref_b = {b: statistics.mean(r["ctx_sum"] for r in rs) / b for b, rs in dec.items()}
    # context slope: residual (step - median_B) against (ctx - mean ctx_B), stalls excluded
    xs, ys = [], []
    for b, rs in dec.items():
        mc = statistics.mean(r["ctx_sum"] for r in rs)
        for r in rs:
            if r["total_s"] < stall_threshold * med[b]:
                xs.append([r["ctx_sum"] - mc])
                ys.append(r["total_s"] - med[b])
    ctx_s = max(0.0, _lstsq(xs, ys)[0]) if xs else 0.0
    ctx_ref = statistics.mean(ctx_ref_b.values())
    # table values at the common ctx_ref
    table = {b: med[b] - ctx_s * b * (ctx_ref_b[b] - ctx_ref) for b in med}
    # line through the table: base + seq * B (for batch sizes not measured)
    bs = sorted(table)
    if len(bs) >= 2:
        base_s, seq_s = _lstsq([[1.0, float(b)] for b in bs], [table[b] for b in bs])
        seq_s = max(seq_s, 0.0)
    else:
        base_s, seq_s = table[bs[0]], 0.0
    logres, stalls, n = [], [], 0
    for b, rs in dec.items():
        for r in rs:
            n += 1
            ratio = r["total_s"] / med[b]
            if ratio >= stall_threshold:
                stalls.append(r["total_s"] - med[b])
            else:
                logres.append(math.log(ratio))
    mad = statistics.median(abs(x) for x in logres) if logres else 0.0
    sigma = 1.4826 * mad
    mixed = [r for r in records if r["prefill"] > 0 and r["b"] > 0]
    prefill_s = 0.0
    if mixed:
        per = [(r["total_s"] - (table.get(r["b"]) or base_s + seq_s * r["b"])) / r["prefill"] for r in mixed]
        prefill_s = max(0.0, statistics.median(per))
    mean_s = {b: statistics.mean(r["total_s"] for r in rs) for b, rs in dec.items()}
    stall_prob = len(stalls) / n if n else 0.0
    stall_mean = statistics.mean(stalls) if stalls else 0.0
    factor = math.exp(sigma ** 2 / 2)
    for b in table:  # the level at each batch size reproduces its measured mean (at its own context)
        level = max(1e-6, (mean_s[b] - stall_prob * stall_mean) / factor)
        table[b] = level - ctx_s * b * (ctx_ref_b[b] - ctx_ref)
    if len(bs) >= 2:
        base_s, seq_s = _lstsq([[1.0, float(b)] for b in bs], [table[b] for b in bs])
        seq_s = max(seq_s, 0.0)
    return StepProfile(name=name, description=description, source="measured", base_s=base_s, seq_s=seq_s,
                       ctx_s=ctx_s, ctx_ref=ctx_ref, prefill_s=prefill_s, table=table, noise_sigma=sigma,
                       stall_prob=stall_prob, stall_mean_s=stall_mean, measured_mean_s=mean_s)
