"""Shared-prefix (cascade) attention on vs. off: decode step time and aggregate decode tok/s.

Bundled model; a pool of P tokens; N sessions attach with their own 16-token suffix and decode
D tokens together. Both modes run in the same process on the same engine (the backend's
cascade switch is flipped between runs, alternating, median of repeats). Only steps in which
all N sessions decode (one token each, no prefill) are counted:
    step time     = median model forward time of those steps
    aggregate tps = N / mean step wall time of those steps
Targets (issue 9): aggregate tps >= 2x with cascade at P=2048, N=16; no slowdown > 5% at P=512, N=4.

Run: .venv/bin/python benchmarks/bench_cascade.py [--quick]
"""

from __future__ import annotations

import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (base_parser, describe_machine, load_snapshot, log, machine_info, make_engine,  # noqa: E402
                    print_table, ratio, set_threads, summarize, write_json)


def prefix_tokens(eng, n: int) -> list[int]:
    text = ("You are one agent in a team. Tools: search(query), read(url), write(path, text), "
            "run(cmd). Always cite sources. ") * 400
    toks = eng.tokenize(text)
    assert len(toks) >= n
    return toks[:n]


def run_once(eng, pool_id: int, prefix: list[int], n: int, decode: int, mode: str, tag: str) -> dict:
    from opencoti.engine import SamplingParams

    eng.backend.cascade = mode
    steps = []

    def on_event(kind, data):
        if kind == "step":
            st = data["stats"]
            if st.num_seqs == n and st.num_tokens == n:
                steps.append((st.model_s, st.total_s, eng.backend.last_used_cascade))

    eng.core.listeners.append(on_event)
    try:
        def start(i):
            return eng.stream(prefix + [100 + i] * 16, pool_id=pool_id, session_id=f"{tag}-{i}",
                              params=SamplingParams.greedy(decode, ignore_eos=True, speculative_max=0))  # one token a step

        with ThreadPoolExecutor(n) as ex:  # all requests reach the engine before its next step
            streams = list(ex.map(start, range(n)))
        for s in streams:
            list(s)
    finally:
        eng.core.listeners.remove(on_event)
    for i in range(n):
        eng.release_session(f"{tag}-{i}")
    steps = steps[1:] or steps  # the first full step still overlaps with admission bookkeeping
    if not steps:
        raise RuntimeError(f"no step had all {n} sessions decoding; increase --decode")
    used = sum(1 for s in steps if s[2])
    return {
        "steps": len(steps),
        "cascade_steps": used,
        "model_ms": 1e3 * statistics.median(s[0] for s in steps),
        "agg_tps": n / statistics.mean(s[1] for s in steps),
    }


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--prefix", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--sessions", type=int, nargs="+", default=[4, 16])
    p.add_argument("--decode", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if args.quick:
        args.decode, args.repeats = 10, 1
    set_threads(args.threads)
    load_before = load_snapshot()
    # no speculative drafts: a step verifying drafts has more rows than sessions and is not counted (the
    # repeated prefix text makes prompt-lookup drafts hit, so with drafts on no step would qualify)
    eng = make_engine(args, kv_budget_tokens=4096 + 16 * 2200, max_batch_tokens=1024, cascade="on",
                      speculative="off")
    info = machine_info()
    log(describe_machine(info))
    rows, results = [], []
    for P in args.prefix:
        prefix = prefix_tokens(eng, P)
        pool = eng.create_pool(tokens=prefix)
        for N in args.sessions:
            runs = {"on": [], "off": []}
            for r in range(args.repeats):
                for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
                    runs[mode].append(run_once(eng, pool.pool_id, prefix, N, args.decode, mode, f"{mode}{r}"))
            on = summarize([x["agg_tps"] for x in runs["on"]])["median"]
            off = summarize([x["agg_tps"] for x in runs["off"]])["median"]
            ms_on = summarize([x["model_ms"] for x in runs["on"]])["median"]
            ms_off = summarize([x["model_ms"] for x in runs["off"]])["median"]
            assert all(x["cascade_steps"] == x["steps"] for x in runs["on"])
            assert all(x["cascade_steps"] == 0 for x in runs["off"])
            speedup = ratio(on, off)
            rows.append((f"P={P} N={N}", ms_off, ms_on, off, on, speedup))
            results.append({"prefix": P, "sessions": N, "step_ms_off": ms_off, "step_ms_on": ms_on,
                            "agg_tps_off": off, "agg_tps_on": on, "speedup": speedup, "runs": runs})
            log(f"P={P} N={N}: off {off:.1f} tok/s, on {on:.1f} tok/s, x{speedup:.2f}")
        eng.release_pool(pool.pool_id)
    print_table(["case", "step ms off", "step ms on", "agg tok/s off", "agg tok/s on", "on/off"], rows,
                title="Shared-prefix attention (cascade) vs plain paged attention, bundled model")
    print(f"\nmachine: {describe_machine(info)}")
    path = write_json("cascade", {"machine": info, "load_before": load_before, "decode_tokens": args.decode,
                                  "repeats": args.repeats, "results": results,
                                  "config": {"quick": args.quick, "prefix": args.prefix, "sessions": args.sessions,
                                             "decode": args.decode, "repeats": args.repeats, "speculative": "off"}},
                      args.out)
    print(f"results: {path}")
    eng.shutdown()


if __name__ == "__main__":
    main()
