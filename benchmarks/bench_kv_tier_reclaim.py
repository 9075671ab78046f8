"""Reclaims while a session decodes: what does taking idle agents' KV out of RAM cost the decoding steps?

When a request needs pages and none are free, a reclaim takes an idle session's KV (an agent waiting on a
tool) and the disk tier keeps it. A page the tier does not hold yet is copied on the step thread before it
is freed (~0.06 ms a page: ~22 ms for a 6,000-token context), so the step that needs the room pays for it.
Writing idle sessions' KV ahead (``persist/write_ahead.py``, ``--kv-disk-write-ahead``, on by default)
copies it earlier, in the share of the steps' time the tier's writes have, so the reclaim frees pages the
tier holds already. This measures both sides with one session decoding throughout, the concurrent-decoder
case, where the engine is never idle (its idle write-ahead cannot help; the share between steps must):

* ``ahead``: the engine's default; only the steps' share writes ahead here (the idle path is switched off
  for this run: the engine never idles while the decoder runs);
* ``copy``: ``kv_disk_write_ahead=False``: each reclaim copies what it takes.

Each side runs in its own process, the sides in rotated order (``--rounds`` each). In each: ``--sessions``
named sessions of ``--context`` tokens each are created and go idle (a RAM budget that leaves under a
quarter of the pages free: a reclaim is near); then one session decodes ``--answer`` tokens (one a step, no
speculation); after ``--warm-s`` (the ``ahead`` side writes the idle sessions' KV meanwhile, in its share),
the idle sessions are reclaimed one at a time, ``--gap-s`` apart, each on the step thread between two steps
(``PolyKV.reclaim``, as an allocation that finds no page free does), timed there; then, once the tier's
files are written, ``--tail-s`` of quiet decoding (the baseline of the writing's last steps).

Reported per side: the reclaims' time on the step thread (and per page), pages copied by them, the gap
between two tokens that holds a reclaim over the median of the quiet steps around it, and the steps that
began with the writer's work (a window of a file, or KV written ahead) against the quiet ones (the share
over 1.1x, the median, the worst percentile). Results: ``benchmarks/results/<machine-id>/kv_tier_reclaim.json``.
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from bench_kv_tier_steps import QUANTILES, _quantile, classify, consume_in_background  # noqa: E402

SIDES = ("ahead", "copy")
WORK_S = 1e-4  # a step whose start ran the writer's work for longer than this is a "work" step (a window of a
# file is ~0.15 ms, a run of pages written ahead more; a filler's check that finds nothing to write is ~0.01 ms)


def child(args) -> dict:
    """One side's run, in this process."""
    common.set_threads(args.threads)
    from opencoti.engine import SamplingParams

    work = tempfile.mkdtemp(prefix="opencoti-tier-reclaim-")
    budget = args.sessions * (args.context + 16) + args.decoder_context + args.answer + 64
    eng = common.make_engine(args, state_dir=work, kv_budget_tokens=budget, session_kv_budget_mib=0,
                             kv_disk_write_ahead=args.side == "ahead", speculative="off")
    tier, pacer = eng.kv_tier, eng.step_pacer
    assert tier is not None, "the tier is on where a state directory exists"
    if eng.write_ahead is not None:
        eng.write_ahead.idle = lambda: None  # the decoder never lets the engine idle: only the share writes ahead
    rng = random.Random(0)
    fill, pacer.filler = pacer.filler, None  # (set-up: nothing written ahead before the decoder starts)
    for i in range(args.sessions):
        eng.generate([rng.randint(100, 20000) for _ in range(args.context)],
                     params=SamplingParams.greedy(1, ignore_eos=True), session_id=f"idle-{i}")
    pacer.filler = fill
    free_share = eng.kv.num_free / eng.kv.num_pages
    from opencoti.engine.persist.write_ahead import PRESSURE

    if free_share >= PRESSURE:  # (no reclaim would be near: nothing is written ahead, the run would say nothing)
        raise SystemExit(f"{free_share:.0%} of the KV pages are free after the set-up: more --sessions or "
                         "--context, or a shorter --answer")
    work_spans: list[tuple[float, float]] = []
    begin = pacer.step_begin

    def timed_begin() -> None:  # (the writer's work runs at a step's start: a window of a file, or a fill)
        t0 = time.perf_counter()
        begin()
        t1 = time.perf_counter()
        if t1 - t0 > WORK_S:
            work_spans.append((t0, t1))

    pacer.step_begin = timed_begin  # type: ignore[method-assign]
    prompt = [rng.randint(100, 20000) for _ in range(args.decoder_context)]
    stream = eng.stream(prompt, params=SamplingParams.greedy(args.answer, ignore_eos=True, speculative_max=0),
                        session_id="decoder")
    times, done = consume_in_background(stream)
    time.sleep(args.warm_s)
    ahead_at_reclaims = tier.stats["written_ahead_pages"]
    reclaims = []
    polykv = eng.core.polykv
    for i in range(args.sessions):
        if done.is_set():
            break

        def take(i=i) -> dict:
            s = polykv.sessions[f"idle-{i}"]
            n = len(s.seq.page_table)
            before = dict(tier.stats)
            t0 = time.perf_counter()
            freed = polykv.reclaim(n)
            t1 = time.perf_counter()
            copied = ((tier.stats["spilled_pages"] - before["spilled_pages"])
                      - (tier.stats["written_ahead_pages"] - before["written_ahead_pages"]))
            return {"t0": t0, "t1": t1, "ms": 1e3 * (t1 - t0), "pages": freed, "session_pages": n,
                    "copied_pages": copied, "held_pages": tier.stats["reclaimed_held_pages"] - before["reclaimed_held_pages"]}

        reclaims.append(eng.run_on_step_thread(take))
        time.sleep(args.gap_s)
    tier.flush()  # (blocks until every file is written: a quiet stretch after the writing, the baseline of its
    # last steps; the context grows over the run, and a baseline only before the writing would count that growth)
    time.sleep(args.tail_s)
    decoding = not done.is_set()  # (the answer is long enough to outlast the reclaims: then it is stopped here)
    stream.close()
    done.wait()
    eng.shutdown()
    shutil.rmtree(work, ignore_errors=True)
    st = tier.status()
    return {"times": times, "work_spans": work_spans, "reclaims": reclaims, "free_share_before": free_share,
            "decoder_outlasted_reclaims": decoding,
            "written_ahead_before_reclaims": ahead_at_reclaims, "pacer": dict(pacer.stats),
            "tier": {k: st[k] for k in ("spilled_pages", "written_ahead_pages", "reclaimed_held_pages",
                                        "write_seconds", "write_errors", "dropped_pages_queue_full")},
            "page_bytes": eng.kv.page_bytes, "kv_pages": eng.kv.num_pages}


def side_rows(run: dict) -> dict:
    """A run's steps classed: a reclaim's, the writer's work, quiet (each over the quiet steps around it)."""
    windows = sorted([("copy", r["t0"], r["t1"], 1) for r in run["reclaims"]]
                     + [("write", a, b, 1) for a, b in run["work_spans"]], key=lambda w: w[1])
    t = run["times"]
    return classify(list(zip(t[1:], t[2:])), windows)  # (from the 2nd gap: the 1st follows the prefill)


def summarize_side(runs: list[dict]) -> dict:
    classes: dict[str, list[float]] = {}
    for run in runs:
        for (kind, _), vals in side_rows(run).items():
            classes.setdefault({"copy": "reclaim", "write": "work"}.get(kind, kind), []).extend(vals)
    quiet = classes.get("quiet", [])
    rec = [r for run in runs for r in run["reclaims"]]
    out = {"reclaims": len(rec), "reclaim_ms": common.summarize([r["ms"] for r in rec]),
           "reclaim_ms_per_page": statistics.median(r["ms"] / max(1, r["pages"]) for r in rec) if rec else None,
           "reclaim_pages": sum(r["pages"] for r in rec), "reclaim_copied_pages": sum(r["copied_pages"] for r in rec),
           "written_ahead_before_reclaims": [run["written_ahead_before_reclaims"] for run in runs],
           "free_share_before": [round(run["free_share_before"], 3) for run in runs],
           "fills": sum(run["pacer"]["fills"] for run in runs), "fill_s": sum(run["pacer"]["fill_s"] for run in runs),
           "step_turns": sum(run["pacer"]["step_turns"] for run in runs),
           "step_turn_s": sum(run["pacer"]["step_turn_s"] for run in runs),
           "decoder_outlasted_reclaims": all(run.get("decoder_outlasted_reclaims", True) for run in runs), "classes": {}}
    # the tier's whole time on the step thread: its reclaims' copies, KV written ahead, the files' windows
    out["step_thread_s"] = sum(r["ms"] for r in rec) / 1e3 + out["fill_s"] + out["step_turn_s"]
    for kind, vals in classes.items():
        out["classes"][kind] = {
            "steps": len(vals), "median_vs_quiet": statistics.median(vals), "p99_vs_quiet": _quantile(vals, 0.99),
            "max_vs_quiet": max(vals), "share_over_1_1x_quiet": sum(v > 1.1 for v in vals) / len(vals),
            "worst_percentile_vs_quiet": max(_quantile(vals, q) / _quantile(quiet, q) for q in QUANTILES)
            if quiet and kind != "quiet" else None}
    return out


def main() -> int:
    p = common.base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=4, help="idle sessions reclaimed one at a time")
    p.add_argument("--context", type=int, default=6000, help="tokens of each idle session's context")
    p.add_argument("--decoder-context", type=int, default=512, help="the decoding session's prompt tokens")
    p.add_argument("--answer", type=int, default=6000,
                   help="tokens it may decode (stopped after the last reclaim: long enough to outlast them)")
    p.add_argument("--warm-s", type=float, default=20.0, help="seconds of decoding before the first reclaim")
    p.add_argument("--gap-s", type=float, default=2.0, help="seconds between two reclaims")
    p.add_argument("--tail-s", type=float, default=2.0, help="seconds of quiet decoding after the files are written")
    p.add_argument("--rounds", type=int, default=2, help="runs per side (the sides' order rotated)")
    p.add_argument("--side", choices=SIDES, default=None, help=argparse_hidden())
    p.add_argument("--child-out", default=None, help=argparse_hidden())
    args = p.parse_args()
    if args.quick:
        args.sessions, args.context, args.decoder_context, args.answer = 3, 2000, 256, 1200
        args.warm_s, args.gap_s, args.tail_s, args.rounds = 4.0, 1.0, 1.0, 1
    if args.side is not None:
        Path(args.child_out).write_text(json.dumps(child(args)))
        return 0
    before = common.load_snapshot()
    runs: dict[str, list[dict]] = {s: [] for s in SIDES}
    order = []
    tmp = Path(tempfile.mkdtemp(prefix="bench-kv-tier-reclaim-"))
    passed = _without(sys.argv[1:], "--out")
    for rnd in range(args.rounds):
        for side in common.rotated(SIDES, rnd):
            out = tmp / f"{side}-{rnd}.json"
            common.log(f"round {rnd}: {side}")
            proc = common.track(subprocess.Popen([sys.executable, __file__, *passed, "--side", side,
                                                  "--child-out", str(out)]))
            if proc.wait() != 0:
                raise SystemExit(f"the {side} side failed (exit {proc.returncode})")
            runs[side].append(json.loads(out.read_text()))
            order.append(side)
    shutil.rmtree(tmp, ignore_errors=True)
    summary = {s: summarize_side(r) for s, r in runs.items()}
    page_bytes = runs["ahead"][0]["page_bytes"]
    rows = []
    for s, v in summary.items():
        for kind in ("reclaim", "work", "quiet"):
            c = v["classes"].get(kind)
            if c is None:
                continue
            rows.append([s, kind, c["steps"], round(c["median_vs_quiet"], 2), round(c["p99_vs_quiet"], 2),
                         f"{100 * c['share_over_1_1x_quiet']:.0f} %",
                         "–" if c["worst_percentile_vs_quiet"] is None else round(c["worst_percentile_vs_quiet"], 2)])
    headers = ["side", "steps holding", "steps", "median / quiet around", "p99 / quiet around",
               "steps > 1.1x quiet around", "worst percentile (p10-p99) / quiet's"]
    common.print_table(headers, rows, title="decode steps beside reclaims")
    for s, v in summary.items():
        if not v["reclaims"] or not v["decoder_outlasted_reclaims"]:
            raise SystemExit(f"{s}: {v['reclaims']} reclaims; the decoder outlasted them: "
                             f"{v['decoder_outlasted_reclaims']} (a longer --answer, or fewer --sessions)")
        common.log(f"{s}: {v['reclaims']} reclaims, {v['reclaim_ms']['median']:.2f} ms median on the step thread "
                   f"({v['reclaim_ms_per_page']:.4f} ms a page), {v['reclaim_copied_pages']} of "
                   f"{v['reclaim_pages']} pages copied; written ahead before them {v['written_ahead_before_reclaims']}; "
                   f"the tier's time on the step thread {v['step_thread_s']:.3f} s")
    a, c = summary["ahead"], summary["copy"]
    ratio = c["reclaim_ms"]["median"] / a["reclaim_ms"]["median"]
    report = {
        "headers": headers, "rows": rows,
        "notes": [f"One session decodes {args.answer} tokens (one a step) after a {args.decoder_context}-token prompt; "
                  f"{args.sessions} idle sessions of {args.context} tokens each "
                  f"({args.context * page_bytes // 16 / 2**20:.0f} MiB of KV each) are reclaimed one at a time, "
                  f"{args.gap_s:g} s apart, after {args.warm_s:g} s of decoding, "
                  f"each between two steps on the step thread. Each side in its own process, {args.rounds} run(s) "
                  f"each, in the order {', '.join(order)}.",
                  f"A reclaim took {a['reclaim_ms']['median']:.2f} ms on the step thread with write-ahead "
                  f"({a['reclaim_copied_pages']} of {a['reclaim_pages']} pages copied) and "
                  f"{c['reclaim_ms']['median']:.2f} ms without ({c['reclaim_copied_pages']} of {c['reclaim_pages']} "
                  f"copied): {ratio:.1f}x.",
                  f"The tier's whole time on the step thread (its reclaims' copies, KV written ahead, the windows "
                  f"of its files): {a['step_thread_s']:.2f} s with write-ahead, {c['step_thread_s']:.2f} s without.",
                  f"With write-ahead, {a['fills']} steps began by writing KV ahead "
                  f"({1e3 * a['fill_s'] / max(1, a['fills']):.2f} ms each) and {a['step_turns']} by a window of a "
                  f"file; without, {c['step_turns']} by a window."]}
    path = common.write_json("kv_tier_reclaim", {
        "report": report,
        "config": {k: getattr(args, k) for k in ("sessions", "context", "decoder_context", "answer", "warm_s", "gap_s",
                                                 "tail_s", "rounds", "threads", "quick")}
        | {"order": order, "speculative": "off"},
        "summary": summary, "reclaim_ms_copy_over_ahead": ratio,
        "raw": {s: [{k: v for k, v in r.items() if k not in ("times", "work_spans")} for r in rr] for s, rr in runs.items()},
        "machine": common.machine_info(), "load_before": before, "load_after": common.load_snapshot()}, args.out)
    print(f"wrote {path}")
    return 0


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


def _without(argv: list[str], flag: str) -> list[str]:
    """``argv`` without ``flag`` and its value."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == flag:
            skip = True
            continue
        if not a.startswith(flag + "="):
            out.append(a)
    return out


if __name__ == "__main__":
    sys.exit(main())
