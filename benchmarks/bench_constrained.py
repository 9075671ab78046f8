#!/usr/bin/env python
"""Decode step time with a JSON-Schema constraint vs unconstrained, 8 concurrent sessions, one run.

The bundled model decodes C sessions at once (C threads released together, each streaming its
own request, ``ignore_eos`` so every session decodes the same number of tokens). Each round runs
two modes on the same prompts, interleaved so drift in the machine's load hits them alike:

* ``plain``: no constraint (the baseline);
* ``json``: every session constrained to a JSON Schema (masks computed inside the step, only for
  the constrained rows). Runs made before recorded a third mode, ``json-prefetch`` (masks computed
  on a helper thread during the forward pass): measured slower on 2 cores, it was removed.

Decode step time = (T1 - T0) / (tokens received in (T0, T1] / C), where T0 = the moment every
session has received its first token (all prefills done) and T1 = the moment the last token
arrives. CPU time per step is the process's CPU time over the same window / steps (all threads:
the step thread and its OpenMP team): on a machine shared with other work it moves
far less than wall time, so it is reported beside it. The schema's array has ``minItems`` larger than the tokens generated, so the constraint
is live (never finished) for every measured step. Every constrained output is checked to be a
prefix of a document the schema accepts (llguidance would have refused any other token).

Target (issue 17): constrained step time <= 1.10x the unconstrained one.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repository root on sys.path)
from common import fmt, log, now, print_table, summarize  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "orders": {
            "type": "array", "minItems": 200,
            "items": {"type": "object", "properties": {
                "customer": {"type": "string", "maxLength": 40},
                "quantity": {"type": "integer", "minimum": 1, "maximum": 1000},
                "express": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4}},
                "required": ["customer", "quantity", "express", "tags"], "additionalProperties": False},
        },
    },
    "required": ["orders"], "additionalProperties": False,
}

PROMPTS = [
    "List the orders of a small bakery as JSON.", "Give me this week's bookshop orders in JSON.",
    "Write the orders of a bicycle shop as a JSON document.", "JSON please: orders of a flower shop.",
    "Produce the coffee roaster's order list in JSON.", "Return the hardware store orders as JSON.",
    "Orders of a tea house, as JSON.", "Make a JSON list of orders for a toy shop.",
    "Output the orders of a record store in JSON.", "Show the orders of a cheese shop in JSON.",
]


def cpu_flags() -> list[str]:
    """The SIMD-related CPU flags (what the kernels can use)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                return sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c", "sse4")))
    except OSError:
        pass
    return []


def run_round(engine, prompts: list[list[int]], params_list) -> dict:
    barrier = threading.Barrier(len(prompts) + 1)
    first: list[float | None] = [None] * len(prompts)
    times: list[list[float]] = [[] for _ in prompts]
    cpu: list[list[float]] = [[] for _ in prompts]
    texts = [""] * len(prompts)
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            barrier.wait()
            for delta in engine.stream(prompts[i], params=params_list[i]):
                t = now()
                times[i].append(t)
                cpu[i].append(time.process_time())
                texts[i] += delta.text
            first[i] = times[i][0]
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    barrier.wait()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    i0 = max(range(len(prompts)), key=lambda i: first[i])
    i1 = max(range(len(prompts)), key=lambda i: times[i][-1])
    t0, t1 = first[i0], times[i1][-1]
    in_window = sum(1 for ts in times for t in ts if t > t0)
    steps = in_window / len(prompts)
    step_s = (t1 - t0) / steps if in_window else None
    cpu_s = (cpu[i1][-1] - cpu[i0][0]) / steps if in_window else None
    return {"step_ms": step_s * 1e3 if step_s else None, "cpu_ms": cpu_s * 1e3 if cpu_s else None,
            "texts": texts, "tokens": [len(ts) for ts in times]}


def check_prefix(lt, grammar: str, text: str) -> bool:
    import llguidance

    m = llguidance.LLMatcher(lt, grammar, log_level=0)
    return m.consume_tokens(lt.tokenize_str(text)) and not m.is_error()


def main() -> int:
    p = common.base_parser(__doc__.splitlines()[1])
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--tokens", type=int, default=96, help="tokens generated per session")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if args.quick:
        args.tokens, args.repeats = 32, 1
    common.set_threads(args.threads)
    from opencoti.engine import SamplingParams
    from opencoti.engine.constraints import ConstraintSpec, llg_tokenizer

    engine = common.make_engine(args)
    info = common.machine_info()
    info["cpu_flags"] = cpu_flags()
    log(common.describe_machine(info))
    spec = ConstraintSpec.json_schema(SCHEMA)
    prompts = [engine.tokenize(engine.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]))
               for i in range(args.sessions)]

    def params(constrained: bool, seed: int):
        return SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed, max_tokens=args.tokens,
                              ignore_eos=True, constraint=spec if constrained else None)

    modes = {"plain": False, "json": True}
    results: dict[str, list[float]] = {m: [] for m in modes}
    cpu_results: dict[str, list[float]] = {m: [] for m in modes}
    valid = True
    run_round(engine, prompts, [params(True, 1000 + i) for i in range(args.sessions)])  # warm-up (+ tokenizer build)
    lt = llg_tokenizer(engine_tokenizer(engine))
    for r in range(args.repeats):
        for mode, constrained in modes.items():
            out = run_round(engine, prompts, [params(constrained, 100 * r + i) for i in range(args.sessions)])
            results[mode].append(out["step_ms"])
            cpu_results[mode].append(out["cpu_ms"])
            log(f"round {r} {mode}: step {fmt(out['step_ms'])} ms (cpu {fmt(out['cpu_ms'])} ms), tokens {out['tokens']}")
            if constrained:
                ok = all(check_prefix(lt, spec.grammar, t) for t in out["texts"])
                valid &= ok
                if not ok:
                    log(f"constrained output not accepted by the schema: {out['texts']!r}")
    micro = sampler_cost(engine_tokenizer(engine), engine_tokenizer(engine).vocab_size, spec, rows=args.sessions)
    engine.shutdown()

    base = statistics.median(results["plain"])
    cpu_base = statistics.median(cpu_results["plain"])
    rows = []
    summary = {}
    for mode in modes:
        med = statistics.median(results[mode])
        cpu_med = statistics.median(cpu_results[mode])
        summary[mode] = {**summarize(results[mode]), "ratio_vs_plain": med / base,
                         "cpu_ms": summarize(cpu_results[mode]), "cpu_ratio_vs_plain": cpu_med / cpu_base}
        rows.append((mode, med, min(results[mode]), max(results[mode]), med / base, cpu_med, cpu_med / cpu_base))
    print_table(["mode", "median step ms", "min", "max", "x plain", "cpu ms/step", "cpu x plain"], rows,
                title=f"decode step time, {args.sessions} concurrent sessions, {args.tokens} tokens each "
                      f"({info['cpu']}, load avg {'/'.join(f'{x:.2f}' for x in info['loadavg'])})")
    overhead = summary["json"]["ratio_vs_plain"] - 1
    cpu_overhead = summary["json"]["cpu_ratio_vs_plain"] - 1
    print(f"\nJSON-schema constraint overhead: step time {overhead * 100:+.1f}%, CPU time per step "
          f"{cpu_overhead * 100:+.1f}% (target <= +10%): {'PASS' if overhead <= 0.10 else 'FAIL'}; "
          f"every constrained output valid: {valid}")
    print(f"sampler alone ({micro['rows']} rows, min of 60): plain {micro['plain_sample_ms']:.2f} ms, "
          f"JSON-constrained with inline masks {micro['constrained_sample_ms']:.2f} ms: "
          f"+{micro['added_ms']:.2f} ms per step = {100 * micro['added_ms'] / min(results['plain']):.1f}% of the "
          f"fastest plain step measured here")
    path = common.write_json("constrained", {"sampler_alone": micro, 
        "machine": info, "sessions": args.sessions, "tokens": args.tokens, "repeats": args.repeats,
        "schema": SCHEMA, "step_ms": summary, "overhead": overhead, "cpu_overhead": cpu_overhead,
        "target_overhead": 0.10,
        "outputs_valid": valid}, args.out)
    log(f"wrote {path}")
    return 0 if valid else 1


def sampler_cost(tokenizer, vocab: int, spec, rows: int = 8, reps: int = 60) -> dict:
    """The sampler alone (no model): min-of-``reps`` time of one ``Sampler.sample`` call for ``rows``
    rows, plain vs JSON-constrained (masks computed inside the call, the worst case), with the rows'
    matchers walked along a real document so every mask is a live one. Load-robust (minimum)."""
    import json as _json

    import torch

    from opencoti.engine import SamplingParams
    from opencoti.engine.sampling import Sampler, make_generator
    from opencoti.engine.sampling.state import SamplerState, process_logits

    doc = _json.dumps({"orders": [{"customer": "Ada", "quantity": 3, "express": True, "tags": ["a", "b"]}] * 6})
    ids = tokenizer.encode(doc)
    plain = [SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=i) for i in range(rows)]
    cons = [SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=i, constraint=spec) for i in range(rows)]
    logits = torch.randn(rows, vocab)
    sampler = Sampler()
    gens = [make_generator(i, 0) for i in range(rows)]

    def best(fn) -> float:
        out = []
        for _ in range(reps):
            t = now()
            fn()
            out.append(now() - t)
        return min(out) * 1e3

    plain_ms = best(lambda: sampler.sample(logits, plain, gens))
    states = [SamplerState.for_request(p, [1], tokenizer, vocab) for p in cons]
    pos = [0]

    def constrained():
        # walk the matchers along the document: each call masks a new position
        for st in states:
            st.constraint.mask_ready = False
        lg = logits.clone()
        process_logits(lg, cons, states)
        sampler.sample(lg, plain, gens)
        for st in states:
            st.constraint.matcher.consume_token(ids[pos[0] % len(ids)])
        pos[0] += 1
        if pos[0] % len(ids) == 0:
            for st in states:
                st.constraint.matcher.reset()

    cons_ms = best(constrained)
    return {"rows": rows, "plain_sample_ms": plain_ms, "constrained_sample_ms": cons_ms,
            "added_ms": cons_ms - plain_ms}


def engine_tokenizer(engine):
    core = getattr(engine, "core", None) or getattr(engine, "_core", None)
    return getattr(core, "tokenizer", None) or engine.tokenizer


if __name__ == "__main__":
    sys.exit(main())
