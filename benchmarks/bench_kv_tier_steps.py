"""Decode steps while the disk tier writes: does writing reclaimed KV to disk slow anyone decoding?

Issue 48 asks that no decode step be slower than 1.1x the median while the tier writes. The team
benchmark (``bench_kv_tier.py``) cannot tell the tier's writes from the machine's jitter: its
all-in-RAM server, which writes nothing, has as many slow steps. This one isolates them. One session
decodes a long answer in-process; beside it, bursts of its KV pages are handed to the tier as if they
had been reclaimed (``DiskTier.spill``: the step thread copies them, the tier writes and checksums
them). A paced burst (the engine's default, ``persist/pacer.py``) is written in turns: the steps lend
the writer its share for ``--window-s``, then nothing for as long (held: its backlog waits; nothing runs
before or beside a step), so every window of writing has quiet steps of the same context and moment
just before and after it. An unpaced burst (the I/O thread writing beside the steps) is written at
once, then quiet. Each inter-token gap the client sees is classed by what overlapped it: the step
thread's copy, the writing, or neither (quiet), and divided by the median of the quiet steps around it.
Reported: each class's median and p99 against the quiet median, the share of its steps slower than 1.1x
the quiet median (the quiet share is the machine's own jitter), the worst percentile (p10 ... p99)
against the quiet steps' same percentile, and the copy's cost per page. By default two unpaced bursts
come first, then a 3 s pause, then paced ones to the end (an unpaced write disturbs the steps for a while
after it); ``--pacing on|off`` measures one.

The harness itself must not run beside the steps: until 2026-12-07 it polled the tier every 1 ms while a
burst was written, a thread that took the GIL from the step thread and made the writing steps 4-20 %
slower (``results/intel-xeon-2c-fc7df03f/tier48_step/``); it now blocks (``tier.flush()``) or sleeps.
"""

from __future__ import annotations

import random
import shutil
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


def _quantile(vals: list[float], q: float) -> float:
    s = sorted(vals)
    return s[min(len(s) - 1, int(q * len(s)))]


QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99)
UNPACED_FIRST = 2  # --pacing both: unpaced bursts first, then paced ones
COOL_DOWN_S = 3.0  # between them (the quiet steps of this pause are a baseline like any other)


def classify(spans: list[tuple[float, float]], windows: list[tuple[str, float, float, int]]
             ) -> dict[tuple[str, int], list[float]]:
    """Each span's duration over the median of the quiet steps *around it* (so the context's growth and
    the machine's drift over the run cancel), by what overlapped it: ("copy" | "write" | "quiet", the mode:
    1 paced, 0 not). ``windows`` are in time order and do not overlap; the quiet steps between two of
    them are a stretch, and a window's steps are divided by the mean of the medians of the nearest
    non-empty stretch before it and after it. A quiet step's baseline is its own stretch (its spread is
    the machine's jitter)."""
    ends = [hi for _, _, hi, _ in windows]
    tagged = []
    for a, b in spans:
        kind, mode, idx = "quiet", -1, sum(hi <= a for hi in ends)  # (quiet: the stretch after that many)
        for i, (w, lo, hi, n) in enumerate(windows):
            if lo < b and hi > a:
                if w == "copy" or kind == "quiet":
                    kind, mode, idx = w, n, i
        tagged.append((kind, mode, idx, b - a))
    stretch: dict[int, list[float]] = {}
    for kind, _, idx, d in tagged:
        if kind == "quiet":
            stretch.setdefault(idx, []).append(d)
    base = {k: statistics.median(v) for k, v in stretch.items()}
    out: dict[tuple[str, int], list[float]] = {}
    for kind, mode, idx, d in tagged:
        if kind == "quiet":
            around = [base[idx]]
        else:  # the stretch before window idx is idx, the one after it idx + 1
            before = next((base[j] for j in range(idx, -1, -1) if j in base), None)
            after = next((base[j] for j in range(idx + 1, len(windows) + 1) if j in base), None)
            around = [x for x in (before, after) if x is not None]
        if around:
            out.setdefault((kind, mode), []).append(d / statistics.mean(around))
    return out


def consume_in_background(stream) -> tuple[list[float], threading.Event]:
    """Read ``stream`` on a thread of its own, each token's arrival time into the list returned; returns
    once the first token came. The event is set when the stream ends."""
    times: list[float] = []
    first, done = threading.Event(), threading.Event()

    def consume() -> None:
        for _ in stream:
            times.append(time.perf_counter())
            first.set()
        done.set()
        first.set()

    threading.Thread(target=consume, daemon=True).start()
    first.wait()
    return times, done


def main() -> int:
    p = common.base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=1024, help="the decoding session's prompt tokens")
    p.add_argument("--answer", type=int, default=1500, help="tokens it decodes (the steps measured)")
    p.add_argument("--burst-pages", type=int, default=256, help="pages handed to the tier per burst (64 per file)")
    p.add_argument("--quiet-s", type=float, default=0.6, help="seconds between unpaced bursts (after one is written)")
    p.add_argument("--window-s", type=float, default=0.4,
                   help="paced: the writer's work is lent time and held in turn, this long each")
    p.add_argument("--pacing", choices=["both", "on", "off"], default="both",
                   help="the writes paced between steps (on), beside them (off), or both (unpaced bursts, then paced)")
    p.add_argument("--share", type=float, default=None,
                   help="the writer's share of the steps' time when paced (default: the engine's, pacer.DEFAULT_SHARE)")
    p.add_argument("--chunk-kib", type=int, default=None,
                   help="the writer's window in KiB (a multiple of 4; default: the engine's, pacer.CHUNK_BYTES)")
    args = p.parse_args()
    if args.chunk_kib is not None and (args.chunk_kib <= 0 or args.chunk_kib % 4):
        p.error("--chunk-kib must be a positive multiple of 4")
    if args.share is not None and not 0 < args.share <= 1:
        p.error("--share must be in (0, 1]")
    common.set_threads(args.threads)
    if args.quick:
        args.context, args.answer, args.burst_pages = 256, 900, 64  # (room for the paced bursts after the unpaced)
    from opencoti.engine import SamplingParams

    work = tempfile.mkdtemp(prefix="opencoti-tier-steps-")
    eng = common.make_engine(args, state_dir=work, kv_budget_tokens=args.context + args.answer + 64)
    tier = eng.kv_tier
    assert tier is not None, "the tier is on where a state directory exists"
    share = tier.pacer.share if args.share is None else args.share
    assert share is not None, "the engine paces the tier's writes by default"
    if args.chunk_kib is not None:
        tier.pacer.chunk_bytes = args.chunk_kib * 1024
    rng = random.Random(0)
    prompt = [rng.randint(100, 20000) for _ in range(args.context)]
    stream = eng.stream(prompt, params=SamplingParams.greedy(args.answer, ignore_eos=True, speculative_max=0),
                        session_id="decoder")  # one token a step: each gap is one step
    windows: list[tuple[str, float, float, int]] = []
    copy_ms_per_page: list[float] = []
    times, done = consume_in_background(stream)
    # each step's own compute time, beside the gaps the client sees (a step waiting for a chunk, or slowed
    # by work beside it, shows in one or the other)
    step_spans: list[tuple[float, float]] = []
    step_end = tier.pacer.step_end
    lending = [True]  # paced: False while the writer's work is held (the steps lend it no time)
    lend_lock = threading.Lock()  # (a step's end and a hold do not interleave: no credit after a hold)

    def timed_step_end(seconds: float) -> None:
        now = time.perf_counter()
        step_spans.append((now - seconds, now))
        with lend_lock:
            step_end(seconds if lending[0] else 0.0)  # (timed either way; lent or not)

    tier.pacer.step_end = timed_step_end  # type: ignore[method-assign]

    def hold() -> None:  # (the credit left from the last on-window lapses: nothing more runs on a step;
        # the pacer's own fields, under its lock: a benchmark's baseline, not an engine feature)
        with lend_lock:
            lending[0] = False
            with tier.pacer._cv:
                tier.pacer._credit = min(tier.pacer._credit, 0.0)

    time.sleep(args.quiet_s)
    ps, burst = eng.kv.page_size, 0
    while not done.is_set():
        # (the window's mode: 1 paced, 0 not; both: two unpaced bursts, a pause, then paced ones to the end -
        # an unpaced burst's full-speed write disturbs the steps for a while after it, which alternating
        # bursts put on the next paced one: 1.20x at p99 against 1.03x in paced-only runs)
        mode = {"on": 1, "off": 0}.get(args.pacing, int(burst >= UNPACED_FIRST))
        if args.pacing == "both" and burst == UNPACED_FIRST:
            time.sleep(COOL_DOWN_S)
        tier.pacer.share = share if mode else None  # (switched with no write pending)

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

        if mode:
            hold()  # the burst waits, held, until its first on-window
        t0, t1, n = eng.run_on_step_thread(spill)
        windows.append(("copy", t0, t1, mode))
        copy_ms_per_page.append((t1 - t0) * 1e3 / n)
        if mode:  # paced: on-windows (the steps lend the writer its share) between held ones (they lend
            # nothing: the writer waits, its backlog pending), each held one the baseline of its neighbours
            time.sleep(args.window_s)
            while tier.pending_bytes and not done.is_set():
                lo = time.perf_counter()
                lending[0] = True
                time.sleep(args.window_s)
                hold()
                # (a window begun before the hold may still be written: the next 20 ms count as writing)
                windows.append(("write", lo, time.perf_counter() + 0.02, mode))
                time.sleep(args.window_s)
            lending[0] = True
        else:
            tier.flush()  # (blocks until the burst is written: a thread polling here would take the GIL
            # from the step thread every few ms and slow the very steps measured; it did, before 2026-12-07)
            windows.append(("write", t1, time.perf_counter(), mode))
            time.sleep(args.quiet_s)
        burst += 1
    eng.shutdown()
    shutil.rmtree(work, ignore_errors=True)  # the tier's files (GBs over a run)
    gaps = classify(list(zip(times[1:], times[2:])), windows)  # (from the 2nd gap: the 1st follows the prefill)
    computes = classify(step_spans[2:], windows)
    rows = []
    quiet_gaps = gaps.get(("quiet", -1), [])
    for (kind, mode), vals in sorted(gaps.items()):
        comp = computes.get((kind, mode))
        rows.append({
            # percentile by percentile (p10 ... p99) against the quiet steps': the worst ratio (the machine's own
            # jitter puts some quiet steps over 1.1x their median too; this asks how much slower the same
            # share of steps is while the tier writes)
            "worst_percentile_vs_quiet": max(_quantile(vals, q) / _quantile(quiet_gaps, q) for q in QUANTILES)
            if quiet_gaps and kind != "quiet" else None,
            "class": kind, "paced": None if mode < 0 else bool(mode), "steps": len(vals),
            "median_vs_quiet": statistics.median(vals), "p99_vs_quiet": _quantile(vals, 0.99),
            "max_vs_quiet": max(vals), "share_over_1_1x_quiet": sum(v > 1.1 for v in vals) / len(vals),
            # the step's own compute (core.step), without the loop's wait for a chunk and its other work
            "compute_median_vs_quiet": statistics.median(comp) if comp else None,
        })
    for r in rows:
        common.log(f"{r['class']:5s} paced {r['paced']}: {r['steps']:4d} steps, median {r['median_vs_quiet']:.2f}x "
                   f"the quiet steps around, p99 {r['p99_vs_quiet']:.2f}x, "
                   f"{100 * r['share_over_1_1x_quiet']:.0f}% over 1.1x; compute {r['compute_median_vs_quiet']}x; "
                   f"worst percentile vs quiet {r['worst_percentile_vs_quiet']}")
    st = tier.status()
    common.log(f"{burst} bursts of {args.burst_pages} pages; copy {statistics.median(copy_ms_per_page):.3f} ms/page; "
               f"write {st['write_seconds']:.2f} s for {st['spilled_pages']} pages")
    copy_ms = statistics.median(copy_ms_per_page)
    pst = tier.pacer.stats
    direct = tier.stats.get("direct_writes", 0) > 0
    order = (f" (the {UNPACED_FIRST} unpaced bursts first, then {COOL_DOWN_S:.0f} s of quiet before the paced ones)"
             if args.pacing == "both" else "")
    report = {
        "headers": ["decode steps overlapping", "writes paced", "steps", "median / quiet around",
                    "p99 / quiet around", "steps > 1.1x quiet around", "step compute median / quiet around",
                    "worst percentile (p10-p99) / quiet's"],
        "rows": [[{"copy": "the step thread's copy of a burst", "write": "the tier writing (I/O thread)",
                   "quiet": "nothing (quiet)"}[r["class"]],
                  "–" if r["paced"] is None else ("yes (default)" if r["paced"] else "no"), r["steps"],
                  round(r["median_vs_quiet"], 2), round(r["p99_vs_quiet"], 2),
                  f"{100 * r['share_over_1_1x_quiet']:.0f} %",
                  "–" if r["compute_median_vs_quiet"] is None else round(r["compute_median_vs_quiet"], 2),
                  "–" if r["worst_percentile_vs_quiet"] is None else round(r["worst_percentile_vs_quiet"], 2)]
                 for r in rows],
        "notes": [f"One session decodes {args.answer} tokens (one a step, no speculation) after a {args.context}-token "
                  f"prompt; beside it, bursts of {args.burst_pages} of its pages "
                  f"({args.burst_pages * eng.kv.page_bytes / 2**20:.0f} MiB) are handed to the tier as if reclaimed: "
                  f"{burst} bursts. A paced burst is written in turns: for {args.window_s} s the steps lend the writer "
                  f"its share, for {args.window_s} s they lend it nothing (held: the backlog waits, nothing runs beside "
                  f"or before a step), until it is written; an unpaced one at once, then {args.quiet_s} s of quiet{order}. Each "
                  "gap between two tokens is classed by what overlapped it and divided by the median of the quiet "
                  "(held) steps just before and after its window, so the context's growth over the answer and the "
                  "machine's drift cancel."]
        + [f"While the tier wrote {'paced' if r['paced'] else 'unpaced'}, {100 * r['share_over_1_1x_quiet']:.0f} % of steps took "
           f"longer than 1.1x the quiet steps around them (median {r['median_vs_quiet']:.2f}x, p99 {r['p99_vs_quiet']:.2f}x); "
           f"quiet steps: {100 * next((q['share_over_1_1x_quiet'] for q in rows if q['class'] == 'quiet'), 0):.0f} % "
           "(the machine's own jitter)." for r in rows if r["class"] == "write"]
        + [f"Paced, {pst['step_turns']} steps each ran one window of the writer's work before they began "
           f"({tier.pacer.chunk_bytes // 1024} KiB: checksum and copy, "
           f"{1e3 * pst['step_turn_s'] / max(1, pst['step_turns']):.2f} ms each; the writer's share {share}; "
           f"files written {'O_DIRECT' if direct else 'buffered'}); {pst['step_waits']} steps waited for a window "
           f"begun while idle, {1e3 * pst['step_wait_s'] / max(1, pst['step_waits']):.2f} ms on average."]
        + [f"The copy that reclaiming does on the step thread costs {copy_ms:.3f} ms a page "
           f"({copy_ms * 375:.0f} ms for a 6,000-token context reclaimed at once): the step that reclaims is slower "
           "by that much, whatever the disk does."],
    }
    common.write_json(Path(args.out).stem if args.out else "kv_tier_steps", {
        "report": report,
        "config": {"context": args.context, "answer": args.answer, "burst_pages": args.burst_pages,
                   "quiet_s": args.quiet_s, "window_s": args.window_s, "pacing": args.pacing, "share": share,
                   "threads": args.threads,
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
