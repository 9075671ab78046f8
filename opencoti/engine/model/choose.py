"""``weights="auto"``: the weight format chosen by timing real steps of the real model.

Each candidate format that passes the accuracy gate is built and runs real engine steps through
the forward pass the engine will use (the fused native decode layer included, the torch attention
backend over a paged cache): a decode step at batch 1 and at batch 8 (contexts of
:data:`CONTEXT` tokens) and one prefill chunk of :data:`PREFILL` tokens. The candidates take
turns within each round (a burst of load from elsewhere hits them alike), best of
:data:`ROUNDS` rounds.

The formats are ranked by the time they take for a reference agent turn (:data:`AGENT_TURN`):
generated tokens, half decoded alone and half in a batch of eight, and the prompt tokens that
still need computing after pools and the prefix cache have supplied the rest (an agent's prompt is
mostly a shared system prompt, tool list and brief, which are computed once). Per token:

    cost = 75 * t_decode(1) + 75 * t_decode(8) / 8 + 100 * t_prefill(128) / 128

Per-kernel timings of synthetic shapes (``autotune.py``) are not used for this: they leave out
everything the fused decode layer saves, and gave the prefill chunk most of the weight.

The choice is cached per machine (CPU model and flags, torch version, thread count, native build)
and model. A measurement taken under load -- other processes using more than :data:`MAX_OTHERS` of
the cores while it ran (from ``/proc/stat`` less this process's own CPU time), or the rounds of a
step spreading by more than :data:`MAX_SPREAD` -- is used for this start and measured
again at the next quiet one instead of being kept: a start that finds other processes busy
(:func:`busy_now`) uses the earlier choice at once (a restart after a crash does not spend a minute
measuring), and a start over a state directory with saved KV files keeps the format that computed
them unless a kept quiet measurement chose another (it does not switch formats under the KV files
of pinned pools and named sessions). After :data:`MAX_ATTEMPTS`
disturbed measurements in a row the last one is kept for :data:`RETRY_AFTER` starts, then measured
again.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from ..attention.base import SeqBatchEntry, build_metadata

CONTEXT = 256  # tokens of context of each decoding sequence
PREFILL = 128  # tokens of the prefill chunk
DECODE_BATCH = 8
ROUNDS = 5
MAX_SPREAD = 1.5  # median / best of a step's rounds above this: the measurement was disturbed
MAX_OTHERS = 0.25  # share of the cores other processes may use while it runs
MAX_ATTEMPTS = 3  # disturbed measurements in a row after which the last choice is kept anyway ...
RETRY_AFTER = 10  # ... for this many starts, then measured again
PAGE_SIZE = 16
# the reference agent turn: tokens decoded alone, tokens decoded in a batch of eight, prompt tokens computed
AGENT_TURN = {"decode_1": 75, "decode_8": 75, "prefill": 100}
WEIGHTING = ("75 tokens decoded alone + 75 decoded in a batch of 8 + 100 prompt tokens computed "
             "(the rest of an agent's prompt comes from pools and the prefix cache)")


@dataclass
class StepTimes:
    """Best-of-rounds seconds of one step: decode at batch 1, decode at batch 8, a prefill chunk."""

    decode_1: float
    decode_8: float
    prefill: float
    spread: float = 1.0  # the largest median / best ratio of the three

    def cost(self) -> float:
        """Seconds for the reference agent turn (:data:`AGENT_TURN`)."""
        return (AGENT_TURN["decode_1"] * self.decode_1 + AGENT_TURN["decode_8"] * self.decode_8 / DECODE_BATCH
                + AGENT_TURN["prefill"] * self.prefill / PREFILL)

    def as_dict(self) -> dict:
        return {"decode_1_ms": round(self.decode_1 * 1e3, 3), "decode_8_ms": round(self.decode_8 * 1e3, 3),
                f"prefill_{PREFILL}_ms": round(self.prefill * 1e3, 3),
                "decode_1_tok_s": round(1 / self.decode_1, 1) if self.decode_1 > 0 else None,
                "turn_cost_ms": round(self.cost() * 1e3, 2), "spread": round(self.spread, 3)}

    @classmethod
    def from_dict(cls, d: dict) -> "StepTimes":
        return cls(d["decode_1_ms"] / 1e3, d["decode_8_ms"] / 1e3, d[f"prefill_{PREFILL}_ms"] / 1e3,
                   d.get("spread", 1.0))


def decide(measured: dict[str, StepTimes], passed: dict[str, bool]) -> str:
    """The format with the cheapest reference turn among those that passed the accuracy gate
    (fp32 needs no gate); ties go to the first in ``measured``'s order."""
    eligible = [f for f in measured if f == "fp32" or passed.get(f, False)]
    if not eligible:
        raise ValueError("no measured format passed the accuracy gate")
    return min(eligible, key=lambda f: measured[f].cost())


def disturbed(times: dict[str, StepTimes], others: float, cpus: int) -> str | None:
    """Why this measurement is not to be kept (None: it is): other processes used more than
    :data:`MAX_OTHERS` of the machine's cores while it ran, or its rounds spread widely."""
    if others > MAX_OTHERS * cpus:
        return f"other processes used {others:.2f} of {cpus} cores while it ran"
    worst = max((t.spread for t in times.values()), default=1.0)
    if worst > MAX_SPREAD:
        return f"rounds spread by x{worst:.2f} (> x{MAX_SPREAD})"
    return None


def cpu_seconds() -> tuple[float, float] | None:
    """(busy seconds of the CPUs this process may run on, CPU seconds of this process) so far; None
    off Linux. Only the CPUs of the affinity set count: other cores of a large host are not ours."""
    try:
        allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        busy = 0
        with open("/proc/stat", encoding="ascii") as f:
            for line in f:
                name, *vals = line.split()
                if not name.startswith("cpu") or name == "cpu":
                    continue
                if not name[3:].isdigit():
                    break
                if allowed is not None and int(name[3:]) not in allowed:
                    continue
                fields = [int(v) for v in vals]
                busy += sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)  # minus idle, iowait
        return busy / os.sysconf("SC_CLK_TCK"), time.process_time()
    except (OSError, ValueError, IndexError):
        return None


def busy_now(cpus: int, window_s: float = 0.5) -> float | None:
    """Cores other processes use over the next ``window_s`` when that is more than :data:`MAX_OTHERS`
    of ``cpus`` (a measurement now would be disturbed), else None."""
    before, t0 = cpu_seconds(), time.perf_counter()
    time.sleep(window_s)
    others = others_load(before, cpu_seconds(), time.perf_counter() - t0)
    return others if others > MAX_OTHERS * cpus else None


def others_load(before, after, wall_s: float) -> float:
    """Cores used by other processes on average between two :func:`cpu_seconds` readings."""
    if before is None or after is None or wall_s <= 0:
        return 0.0
    return max(0.0, (after[0] - before[0]) - (after[1] - before[1])) / wall_s


class _Bench:
    """A paged cache and the step metadata for timing one model's real steps."""

    def __init__(self, model):
        from ..attention.torch_backend import TorchAttentionBackend

        d = model.dims
        self.model = model
        ctx = min(CONTEXT, model.max_positions - 1)  # a short context window (--ctx-size) bounds both
        prefill = min(PREFILL, model.max_positions)
        per_seq = -(-(ctx + 1) // PAGE_SIZE)
        pages = max(per_seq * DECODE_BATCH, -(-prefill // PAGE_SIZE)) + 1
        shape = (d.num_layers, pages, PAGE_SIZE, d.num_kv_heads, d.head_dim)
        self.k = torch.zeros(shape, dtype=model.dtype, device=model.device)
        self.v = torch.zeros(shape, dtype=model.dtype, device=model.device)
        self.backend = TorchAttentionBackend(cascade="off")
        tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(DECODE_BATCH)]
        self.entries = {
            "decode_1": [SeqBatchEntry(tables[0], ctx, 1)],
            "decode_8": [SeqBatchEntry(t, ctx, 1) for t in tables],
            "prefill": [SeqBatchEntry(list(range(1, 1 + -(-prefill // PAGE_SIZE))), 0, prefill)],
        }
        gen = torch.Generator().manual_seed(0)
        self.ids = {kind: torch.randint(0, d.vocab_size, (sum(e.num_new for e in es),), generator=gen)
                    for kind, es in self.entries.items()}
        self.rows = {"decode_1": torch.arange(1), "decode_8": torch.arange(DECODE_BATCH),
                     "prefill": torch.tensor([prefill - 1])}

    def run(self, kind: str) -> float:
        meta = build_metadata(self.entries[kind], PAGE_SIZE, self.model.device)
        sync = torch.cuda.synchronize if self.model.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        self.model._forward(self.ids[kind].to(self.model.device), meta, self.k, self.v, self.backend,
                            self.rows[kind].to(self.model.device))
        sync()
        return time.perf_counter() - t0


def time_steps(models: dict, rounds: int = ROUNDS) -> dict[str, StepTimes]:
    """Real step times of each model (``{format: LlamaForward}``), the formats taking turns."""
    benches = {f: _Bench(m) for f, m in models.items()}
    kinds = ("decode_1", "decode_8", "prefill")
    samples: dict[str, dict[str, list[float]]] = {f: {k: [] for k in kinds} for f in models}
    for b in benches.values():  # warm-up: first-call allocations, lazily built kernels
        for k in kinds:
            b.run(k)
    for r in range(rounds):
        order = list(benches)[r % len(benches):] + list(benches)[:r % len(benches)]
        for f in order:
            for k in kinds:
                samples[f][k].append(benches[f].run(k))
    out = {}
    for f, s in samples.items():
        best = {k: min(v) for k, v in s.items()}
        spread = max(sorted(v)[len(v) // 2] / max(min(v), 1e-9) for v in s.values())
        out[f] = StepTimes(best["decode_1"], best["decode_8"], best["prefill"], spread)
    return out
