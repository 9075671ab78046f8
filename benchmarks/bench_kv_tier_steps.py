"""Decode steps while the disk tier writes: does writing reclaimed KV to disk slow anyone decoding?

Issue 48 asks that no decode step be slower than 1.1x the median while the tier writes. The team
benchmark (``bench_kv_tier.py``) cannot tell the tier's writes from the machine's jitter: its
all-in-RAM server, which writes nothing, has as many slow steps. This one isolates them. One session
decodes a long answer in-process; beside it, in alternating windows, bursts of its KV pages are
handed to the tier as if they had been reclaimed (``DiskTier.spill``: the step thread copies them, the
tier's I/O thread writes and checksums them) and then nothing is written. Each inter-token gap the
client sees is classed by what overlapped it: the step thread's copy, the I/O thread's writing, or
neither (quiet). Reported: each class's median and p99 against the quiet median and the share of its
steps slower than 1.1x the quiet median (the quiet share is the machine's own jitter), and the copy's
cost per page. The writes are measured paced (the engine's default: a chunk at a time between steps,
``persist/pacer.py``) and unpaced (the I/O thread writing beside the steps), alternating burst by burst;
``--pacing on|off`` measures one.
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


class _Page:
    """What ``DiskTier.spill`` reads of an evicted prefix-index entry."""

    def __init__(self, key: bytes, page: int, tokens: tuple, parent, depth: int):
        self.key, self.page, self.tokens, self.parent, self.depth = key, page, tokens, parent, depth


def _quantile(vals: list[float], q: float) -> float | None:
    if not vals:
        return None
    s = sorted(vals)
    return s[min(len(s) - 1, int(q * len(s)))]


def classify(times: list[float], windows: list[tuple[str, float, float, int]]) -> dict[tuple[str, int], list[float]]:
    """Inter-token gaps by what overlapped them: ("copy" | "write" | "quiet", the mode: 1 paced, 0 not)."""
    out: dict[tuple[str, int], list[float]] = {}
    for a, b in zip(times, times[1:]):
        kind, mode = "quiet", -1
        for w, lo, hi, n in windows:
            if lo < b and hi > a:
                if w == "copy" or kind == "quiet":
                    kind, mode = w, n
        out.setdefault((kind, mode if kind != "quiet" else -1), []).append(b - a)
    return out


def main() -> int:
    p = common.base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=1024, help="the decoding session's prompt tokens")
    p.add_argument("--answer", type=int, default=1500, help="tokens it decodes (the steps measured)")
    p.add_argument("--burst-pages", type=int, default=256, help="pages handed to the tier per burst (64 per file)")
    p.add_argument("--quiet-s", type=float, default=0.6, help="seconds between bursts (after a burst is written)")
    p.add_argument("--pacing", choices=["both", "on", "off"], default="both",
                   help="the writes paced between steps (on), beside them (off), or alternating burst by burst")
    args = p.parse_args()
    common.set_threads(args.threads)
    if args.quick:
        args.context, args.answer, args.burst_pages = 256, 300, 64
    from opencoti.engine import SamplingParams

    work = tempfile.mkdtemp(prefix="opencoti-tier-steps-")
    eng = common.make_engine(args, state_dir=work, kv_budget_tokens=args.context + args.answer + 64)
    tier = eng.kv_tier
    assert tier is not None, "the tier is on where a state directory exists"
    share = tier.pacer.share
    assert share is not None, "the engine paces the tier's writes by default"
    modes = {"both": [1, 0], "on": [1], "off": [0]}[args.pacing]  # 1: paced, 0: unpaced
    rng = random.Random(0)
    prompt = [rng.randint(100, 20000) for _ in range(args.context)]
    stream = eng.stream(prompt, params=SamplingParams.greedy(args.answer, ignore_eos=True, speculative_max=0),
                        session_id="decoder")  # one token a step: each gap is one step
    times: list[float] = []
    windows: list[tuple[str, float, float, int]] = []
    copy_ms_per_page: list[float] = []
    first = threading.Event()
    done = threading.Event()

    def consume() -> None:
        for _ in stream:
            times.append(time.perf_counter())
            first.set()
        done.set()
        first.set()

    threading.Thread(target=consume, daemon=True).start()
    first.wait()
    time.sleep(args.quiet_s)
    ps, burst = eng.kv.page_size, 0
    while not done.is_set():
        mode = modes[burst % len(modes)]  # (the window's mode: 1 paced, 0 not)
        tier.pacer.share = share if mode else None  # read at each chunk's turn and each step

        def spill(burst=burst) -> tuple[float, float, int]:
            seq = eng.core.sessions["decoder"].seq
            pages = list(seq.page_table[:max(1, seq.num_cached // ps)])
            root = _Page(f"root-{burst}".encode().ljust(16, b"\0"), -1, (), None, 0)
            chain, parent = [], root
            for i in range(args.burst_pages):
                e = _Page(rng.randbytes(16), pages[i % len(pages)], tuple(range(i * ps, (i + 1) * ps)), parent, i + 1)
                chain.append(e)
                parent = e
            t0 = time.perf_counter()
            tier.spill(eng.kv, [chain])
            return t0, time.perf_counter(), len(chain)

        t0, t1, n = eng.run_on_step_thread(spill)
        windows.append(("copy", t0, t1, mode))
        copy_ms_per_page.append((t1 - t0) * 1e3 / n)
        while tier.pending_bytes and not done.is_set():
            time.sleep(0.001)
        windows.append(("write", t1, time.perf_counter(), mode))
        burst += 1
        time.sleep(args.quiet_s)
    eng.shutdown()
    gaps = classify(times[1:], windows)  # (the first gap is the first decode step after the prefill)
    quiet = gaps.get(("quiet", -1), [])
    q_med = statistics.median(quiet) if quiet else None
    rows = []
    for (kind, mode), vals in sorted(gaps.items()):
        rows.append({
            "class": kind, "paced": None if mode < 0 else bool(mode), "steps": len(vals),
            "median_ms": statistics.median(vals) * 1e3, "p99_ms": _quantile(vals, 0.99) * 1e3,
            "max_ms": max(vals) * 1e3,
            "median_vs_quiet": common.ratio(statistics.median(vals), q_med),
            "p99_vs_quiet": common.ratio(_quantile(vals, 0.99), q_med),
            "share_over_1_1x_quiet": sum(v > 1.1 * q_med for v in vals) / len(vals) if q_med else None,
        })
    for r in rows:
        common.log(f"{r['class']:5s} paced {r['paced']}: {r['steps']:4d} steps, median {r['median_ms']:.1f} ms "
                   f"({r['median_vs_quiet']:.2f}x quiet), p99 {r['p99_vs_quiet']:.2f}x, "
                   f"{100 * r['share_over_1_1x_quiet']:.0f}% over 1.1x")
    st = tier.status()
    common.log(f"{burst} bursts of {args.burst_pages} pages; copy {statistics.median(copy_ms_per_page):.3f} ms/page; "
               f"write {st['write_seconds']:.2f} s for {st['spilled_pages']} pages")
    copy_ms = statistics.median(copy_ms_per_page)
    report = {
        "headers": ["decode steps overlapping", "writes paced", "steps", "median ms", "median / quiet",
                    "p99 / quiet", "steps > 1.1x quiet median"],
        "rows": [[{"copy": "the step thread's copy of a burst", "write": "the tier writing (I/O thread)",
                   "quiet": "nothing (quiet)"}[r["class"]],
                  "–" if r["paced"] is None else ("yes (default)" if r["paced"] else "no"), r["steps"],
                  round(r["median_ms"], 1), round(r["median_vs_quiet"], 2), round(r["p99_vs_quiet"], 2),
                  f"{100 * r['share_over_1_1x_quiet']:.0f} %"] for r in rows],
        "notes": [f"One session decodes {args.answer} tokens (one a step, no speculation) after a {args.context}-token "
                  f"prompt; every {args.quiet_s} s a burst of {args.burst_pages} of its pages "
                  f"({args.burst_pages * eng.kv.page_bytes / 2**20:.0f} MiB) is handed to the tier as if reclaimed: "
                  f"{burst} bursts. Each gap between two tokens is classed by what overlapped it."]
        + [f"While the tier wrote {'paced' if r['paced'] else 'unpaced'}, {100 * r['share_over_1_1x_quiet']:.0f} % of steps took "
           f"longer than 1.1x the quiet median (median {r['median_vs_quiet']:.2f}x, p99 {r['p99_vs_quiet']:.2f}x); "
           f"quiet steps: {100 * next((q['share_over_1_1x_quiet'] for q in rows if q['class'] == 'quiet'), 0):.0f} % "
           "(the machine's own jitter)." for r in rows if r["class"] == "write"]
        + [f"The copy that reclaiming does on the step thread costs {copy_ms:.3f} ms a page "
           f"({copy_ms * 375:.0f} ms for a 6,000-token context reclaimed at once): the step that reclaims is slower "
           "by that much, whatever the disk does."],
    }
    common.write_json(Path(args.out).stem if args.out else "kv_tier_steps", {
        "report": report,
        "config": {"context": args.context, "answer": args.answer, "burst_pages": args.burst_pages,
                   "quiet_s": args.quiet_s, "pacing": args.pacing, "share": share, "threads": args.threads,
                   "quick": args.quick, "chunk_bytes": tier.pacer.chunk_bytes,
                   "page_bytes": eng.kv.page_bytes},
        "classes": rows, "bursts": burst,
        "copy_ms_per_page": common.summarize(copy_ms_per_page),
        "pacer": dict(tier.pacer.stats),
        "tier": {k: st[k] for k in ("spilled_pages", "spilled_segments", "write_seconds", "write_errors",
                                    "dropped_pages_queue_full")},
        "machine": common.machine_info(),
    }, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
