"""How fast any policy can finish a ramp while running at most ``k`` sessions at once.

The wall-time target (ours <= 1.15x naive) and the overshoot target (at most ``fit + 1`` sessions
in flight) pull against each other on a machine whose aggregate throughput keeps growing past
``fit``: the naive rule finishes early *by* running more sessions, under the floor. This module
gives a lower bound on the expected wall time of ANY schedule of the ramp's tasks that never has
more than ``k`` sessions in flight (floor or no floor, clairvoyant or not), from the profile alone:

* every engine step gives each of its ``b`` sessions one token, so the steps ``n_b`` with ``b``
  sessions satisfy ``sum b * n_b = tasks * tokens``;
* a session decodes one token per step from its admission to its end, so with at most ``k`` in
  flight the tasks fall into ``k`` lanes, one of which runs ``ceil(tasks / k)`` tasks back to
  back: ``sum n_b >= ceil(tasks / k) * tokens``;
* the expected cost of a step is ``mean_factor * m * g(b) + stall_prob * stall_mean`` (``g``: the
  profile's batch term, ``m``: the noisy neighbour's long-run time multiplier); its context and
  prompt terms are linear, and their sum over a whole run does not depend on the schedule.

The minimum of ``sum n_b * cost(b)`` under these two constraints is a linear programme in the
``n_b`` (an optimum uses at most two batch sizes, so every pair is tried); the bound is that
minimum plus the schedule-independent terms. It ignores the spawn tick, the ramp and the floor,
so a real policy needs more; comparing it with naive's measured wall time says whether the wall
target is reachable at all under the overshoot target, and by how much it is not.
"""

from __future__ import annotations

import math

from .profile import StepProfile

__all__ = ["burst_multiplier", "wall_lower_bound"]


def burst_multiplier(p: StepProfile) -> float:
    """Long-run factor on the decode time of a noisy neighbour's calm/burst periods: with a
    share ``s`` of the *time* in bursts that cost ``f`` times more, work done in ``W`` seconds
    is ``W * (1 - s + s / f)`` calm-seconds."""
    if p.burst_factor <= 1 or p.burst_on_mean_s <= 0:
        return 1.0
    s = p.burst_on_mean_s / (p.burst_on_mean_s + p.burst_off_mean_s)
    return 1.0 / (1.0 - s + s / p.burst_factor)


def _batch_term(p: StepProfile, b: int) -> float:
    """decode_s(b, C) - ctx_s * C: the part of a step that depends on the batch size only."""
    t = p.table.get(b)
    if t is not None:
        return t - p.ctx_s * b * p.ctx_ref
    return p.base_s + p.seq_s * max(0, b - p.knee)


def wall_lower_bound(p: StepProfile, *, tasks: int, tokens: int, k: int, prompt_tokens: int,
                     cached_tokens: int) -> dict:
    """A lower bound on the expected wall time of ``tasks`` sessions of ``tokens`` tokens each,
    never more than ``k`` in flight (see the module docstring). Returns ``{"wall_s", "steps",
    "batches": {b: n_b}, "fixed_s"}``."""
    if tasks < 1 or tokens < 1 or k < 1:
        raise ValueError("tasks, tokens and k must be positive")
    m, mf = burst_multiplier(p), p.mean_factor()
    stall = p.stall_prob * p.stall_mean_s
    cost = {b: max(0.0, mf * m * _batch_term(p, b)) + stall for b in range(1, k + 1)}
    work = tasks * tokens  # sum of b * n_b
    lanes = math.ceil(tasks / k) * tokens  # sum of n_b is at least this
    best = (math.inf, {})
    for b in cost:  # one batch size (the steps constraint slack)
        n = work / b
        if n >= lanes - 1e-9 and n * cost[b] < best[0]:
            best = (n * cost[b], {b: n})
    for b1 in cost:  # two batch sizes, the steps constraint tight
        for b2 in cost:
            if b2 <= b1:
                continue
            n2 = (work - lanes * b1) / (b2 - b1)
            n1 = lanes - n2
            if n1 < -1e-9 or n2 < -1e-9:
                continue
            c = n1 * cost[b1] + n2 * cost[b2]
            if c < best[0]:
                best = (c, {b1: n1, b2: n2})
    # context (the sum over every token of the context it attends over) and prompts, fixed
    ctx_tokens = tasks * (tokens * prompt_tokens + tokens * (tokens - 1) / 2)
    fixed = mf * m * (p.ctx_s * ctx_tokens + p.prefill_s * tasks * max(prompt_tokens - cached_tokens, 1))
    return {"wall_s": best[0] + fixed, "steps": sum(best[1].values()), "batches": best[1], "fixed_s": fixed}
