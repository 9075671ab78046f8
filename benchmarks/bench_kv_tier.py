"""KV tiering: an agent team whose KV is 3x the RAM page budget, each turn after a tool wait, in rotation.

Five sides, each its own server process, all up at once, the team's turns interleaved between them:

* ``tier``: ``opencoti serve`` with a KV budget of a third of the team's KV and the disk tier on (a
  state directory of its own, ``--session-kv-budget-mib 0`` so that the named sessions' restart files
  do not add writes of their own: what is measured is the tier);
* ``tier_copy``: the same, with ``--kv-disk-write-ahead off``: idle sessions' KV is not written ahead,
  so each reclaim copies the pages it takes on the step thread (what the tier did before write-ahead);
* ``recompute``: the same engine and budget with no tier (``--state-dir none``): an agent whose KV
  was reclaimed recomputes its context (what opencoti did before the tier);
* ``all_in_ram``: the same engine with a KV budget that holds the whole team (the target: the tier
  should come close to it);
* ``llama.cpp``: ``llama-server --slot-save-path DIR -c <the same RAM budget> --parallel 1``, used as
  its docs suggest for more contexts than fit: before each turn the agent's slot file is restored
  (``POST /slots/0?action=restore``), after it saved (``?action=save``).

The team: ``--agents`` agents, each with a context of ``--context`` tokens (a shared ~300-token system
prompt then a long brief of its own: a chronicle), takes ``--rounds`` turns in rotation after a cold
first turn: each turn sends the agent's whole context plus a tool result (~40 tokens) and streams a
greedy answer of ``--answer`` tokens, which joins the context. Between two turns of one agent the others
take theirs (the tool wait). Prompts are token ids (tokenized once), so every side computes the same
tokens. Each agent's turn is taken on every side before the next agent's, the sides in an order rotated
turn by turn, so that the machine's drift in speed (10-30 % over minutes on a shared VM) falls on all
sides alike; only one side computes at a time (after a tier side's turn, its writes and the KV it writes
ahead are let finish before the next side's turn: ``settle``). Before each turn of ``tier`` and ``llama.cpp`` the files
of their disk directories are dropped from the OS page cache (``posix_fadvise(DONTNEED)``; ``--warm-disk``
keeps them), so that a read-back comes from the disk, not from RAM the kernel kept.

Reported per side over the warm turns: turn latency p50 / p95 (request sent to last token; llama.cpp's
includes the restore, its save is counted apart and in the total), the median of the per-turn ratios to
all-in-RAM's same turn, total time, prompt tokens computed, the gaps between streamed tokens relative to
the side's median gap (p99, max, and the share of steps slower than 1.1x the median: a step slowed by
the tier's writes shows there, against the same numbers of all-in-RAM, which writes nothing), and
whether the greedy answers equal all-in-RAM's.

Results: ``benchmarks/results/<machine-id>/kv_tier.json``.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import peer_llamacpp as peer  # noqa: E402

SIDES = ("tier", "tier_copy", "recompute", "all_in_ram", "llama.cpp")
FULL_AGENTS, FULL_CONTEXT = 12, 6000  # the team

SYSTEM = ("You are one agent of a research team. You read the brief below, call tools when you need facts, and "
          "answer in short, precise notes that the other agents will read. Tools: search(query) returns web "
          "results; read(url) returns a page; calc(expr) evaluates arithmetic; note(text) stores a note for the "
          "team. Rules: cite the line of the brief you rely on; never invent a year; when two lines disagree, "
          "say so; keep every answer under one hundred words; end with the next tool call you would make, if "
          "any. The team lead merges the notes every hour and asks follow-up questions. " * 2)


def brief(agent: int, n_lines: int) -> str:
    subj, ev = peer.LONG_SUBJECTS, peer.LONG_EVENTS
    lines = [f"{i + 1}. {subj[(7 * i + agent) % len(subj)].capitalize()} {ev[(5 * i + agent + i // 12) % len(ev)]} "
             f"{1650 + (37 * i + 11 * agent) % 370}." for i in range(n_lines)]
    return f"\n\nBrief of agent {agent}: a chronicle of the town.\n" + "\n".join(lines) + "\n\nYour first note:"


def tool_result(agent: int, turn: int) -> str:
    return (f"\n\nTool result (search, agent {agent}, call {turn}): three pages mention the harbour and the "
            f"archive; one says the flood was in {1700 + 13 * turn + agent}, another disagrees.\nYour next note:")


def tokenize(url: str, text: str) -> list[int]:
    import httpx

    r = httpx.post(url + "/tokenize", json={"content": text, "add_special": False}, timeout=120)
    r.raise_for_status()
    return [t if isinstance(t, int) else t["id"] for t in r.json()["tokens"]]


def build_team(url: str, agents: int, context: int, rounds: int) -> dict:
    """Token ids of the system prompt, each agent's brief (about ``context`` tokens with the system
    prompt) and its tool results."""
    system = tokenize(url, SYSTEM)
    probe = tokenize(url, brief(0, 40))
    per_line = max(1.0, len(probe) / 40)
    n_lines = max(4, int((context - len(system)) / per_line))
    briefs = [tokenize(url, brief(a, n_lines))[: max(1, context - len(system))] for a in range(agents)]
    tools = [[tokenize(url, tool_result(a, t)) for t in range(rounds + 1)] for a in range(agents)]
    return {"system": system, "briefs": briefs, "tools": tools}


def drop_cached(folder: Path) -> int:
    """Drop the files under ``folder`` from the OS page cache (written back first, so that none stay
    behind as dirty pages); returns their bytes."""
    import os

    n = 0
    for f in folder.rglob("*"):
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:  # a directory, or a file the tier removed meanwhile
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += os.fstat(fd).st_size
        except OSError:
            pass
        finally:
            os.close(fd)
    return n


def stream_turn(url: str, body: dict) -> dict:
    """One streamed completion: token ids, the gaps between its steps, final timings."""
    t0 = time.perf_counter()
    ids, times, final = [], [], None
    for ev in peer.sse_events(url, "/completion", body):
        got = ev.get("tokens") or []
        if got:
            now = time.perf_counter()
            ids.extend(got)
            times.extend([now] * len(got))
        if ev.get("timings") or ev.get("stop"):
            final = ev
    t1 = time.perf_counter()
    timings = (final or {}).get("timings") or {}
    # gaps between steps: tokens that arrive within 3 ms of each other came from one step (a verified draft, or
    # one read of the stream)
    events = [t for i, t in enumerate(times) if i == 0 or t - times[i - 1] > 0.003]
    gaps = [b - a for a, b in zip(events, events[1:])]
    return {"ids": ids, "seconds": t1 - t0, "ttft": (times[0] - t0) if times else None,
            "prompt_n": timings.get("prompt_n"), "cache_n": timings.get("cache_n"),
            "draft_n": timings.get("draft_n"), "draft_n_accepted": timings.get("draft_n_accepted"),
            "gaps": gaps, "gap_median": statistics.median(gaps) if gaps else None, "gap_max": max(gaps) if gaps else None}


def take_turn(side: str, url: str, prompt: list[int], agent: int, rnd: int, args, disk: Path | None) -> dict:
    """One turn of ``agent`` on ``side``; ``disk``: the side's disk directory, dropped from the page
    cache first (unless ``--warm-disk``)."""
    import httpx

    dropped = drop_cached(disk) if disk is not None and disk.exists() and not args.warm_disk else 0
    body = {"prompt": prompt, "n_predict": args.answer, "temperature": 0, "ignore_eos": True,
            "return_tokens": True, "cache_prompt": True}
    restore_s = save_s = 0.0
    if side == "llama.cpp":
        body["id_slot"] = 0
        if rnd > 0:
            t0 = time.perf_counter()
            r = httpx.post(url + "/slots/0?action=restore", json={"filename": f"agent{agent}.bin"}, timeout=600)
            r.raise_for_status()
            restore_s = time.perf_counter() - t0
    else:
        body["session_id"] = f"agent-{agent}"
    res = stream_turn(url, body)
    if side == "llama.cpp":
        t0 = time.perf_counter()
        r = httpx.post(url + "/slots/0?action=save", json={"filename": f"agent{agent}.bin"}, timeout=600)
        r.raise_for_status()
        save_s = time.perf_counter() - t0
    res.update(agent=agent, round=rnd, prompt_tokens=len(prompt), restore_s=restore_s, save_s=save_s,
               latency=res["seconds"] + restore_s, page_cache_dropped_bytes=dropped)
    common.log(f"{side}: round {rnd} agent {agent}: {res['latency']:.2f} s, prompt {len(prompt)}, "
               f"computed {res['prompt_n']}, cached {res['cache_n']}")
    return res


TIER_SIDES = ("tier", "tier_copy")


def settle(url: str, timeout: float = 60.0) -> float:
    """Wait until a tier side's background work after its turn is done (its writes queued for the disk
    and the KV it writes ahead), so that it does not run during the next side's turn: only one side
    computes at a time. Returns the seconds waited (not part of any turn)."""
    import httpx

    t0 = time.monotonic()
    last = None
    while time.monotonic() - t0 < timeout:
        d = (httpx.get(url + "/polykv/pools", timeout=60).json().get("kv_tiers") or {}).get("disk") or {}
        now = (d.get("pending_bytes"), d.get("spilled_pages"), d.get("written_ahead_pages"))
        if now[0] == 0 and now == last:
            break
        last = now
        time.sleep(0.1)
    return time.monotonic() - t0


def run_team(servers: dict, team: dict, args, disks: dict) -> dict:
    """The team's turns on every side, interleaved: each agent's turn on all sides (in an order rotated
    turn by turn) before the next agent's."""
    sides = list(servers)
    ctx = {s: [team["system"] + b for b in team["briefs"]] for s in sides}
    turns: dict[str, list] = {s: [] for s in sides}
    k = args.repeat
    for rnd in range(args.rounds + 1):  # round 0: the cold first turns
        for a in range(args.agents):
            for side in common.rotated(sides, k):
                prompt = ctx[side][a] + team["tools"][a][rnd]
                res = take_turn(side, servers[side].url, prompt, a, rnd, args, disks.get(side))
                if side in TIER_SIDES:
                    res["settle_s"] = settle(servers[side].url)
                ctx[side][a] = prompt + res["ids"]
                turns[side].append(res)
            k += 1
    return {s: {"turns": t, "total_s": sum(x["latency"] + x["save_s"] for x in t)} for s, t in turns.items()}


def _q(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def summarize(side: str, run: dict) -> dict:
    warm = [t for t in run["turns"] if t["round"] > 0]
    lat = sorted(t["latency"] for t in warm)
    # each step's gap over its own turn's median gap (turns differ in context length, so in step time)
    rel = [g / t["gap_median"] for t in warm if t["gap_median"] for g in t["gaps"]]
    return {"turn_p50_s": statistics.median(lat), "turn_p95_s": _q(lat, 95),
            "warm_total_s": sum(lat) + sum(t["save_s"] for t in warm),
            "total_s": run["total_s"], "cold_total_s": sum(t["latency"] + t["save_s"] for t in run["turns"] if t["round"] == 0),
            "warm_prompt_tokens_computed": sum(t["prompt_n"] or 0 for t in warm),
            "warm_prompt_tokens": sum(t["prompt_tokens"] for t in warm),
            "warm_ttft_p50_s": statistics.median(t["ttft"] for t in warm if t["ttft"] is not None),
            "save_s_total": sum(t["save_s"] for t in warm), "restore_s_total": sum(t["restore_s"] for t in warm),
            "draft_n": sum(t["draft_n"] or 0 for t in warm), "draft_n_accepted": sum(t["draft_n_accepted"] or 0 for t in warm),
            "steps": len(rel), "step_gap_p99_over_median": _q(rel, 99) if rel else None,
            "step_gap_max_over_median": max(rel) if rel else None,
            "steps_over_1.1x_median_share": (sum(r > 1.1 for r in rel) / len(rel)) if rel else None}


def paired(run: dict, ref: dict) -> dict:
    """The per-turn ratios of ``run``'s warm turns to ``ref``'s same turn: median, min, max."""
    r = sorted(a["latency"] / b["latency"] for a, b in zip(run["turns"], ref["turns"]) if a["round"] > 0)
    return {"median": statistics.median(r), "min": r[0], "max": r[-1], "n": len(r)}


def side_server(side: str, gguf: str, threads: int, llama_bin: Path, args, work: Path) -> peer.Server:
    import os

    ram = str(args.ram_tokens)
    port = peer.free_port()
    if side == "llama.cpp":
        slots = work / "slots"
        slots.mkdir(parents=True, exist_ok=True)
        cmd = [str(llama_bin), "-m", gguf, "-t", str(threads), "-tb", str(threads), "--port", str(port),
               "--host", "127.0.0.1", "--parallel", "1", "-c", ram, "--slot-save-path", str(slots) + "/"]
        return peer.Server(side, cmd, port, {**os.environ, "LD_LIBRARY_PATH": str(llama_bin.parent)})
    tier = ["--kv-budget-tokens", ram, "--state-dir", str(work / "state"), "--session-kv-budget-mib", "0"]
    extra = {"tier": tier, "tier_copy": [*tier, "--kv-disk-write-ahead", "off"],
             "recompute": ["--kv-budget-tokens", ram, "--state-dir", "none"],
             "all_in_ram": ["--kv-budget-tokens", str(4 * args.ram_tokens + 16384), "--state-dir", "none"]}[side]
    cmd = [sys.executable, "-m", "opencoti", "serve", "--model", gguf, "--port", str(port), "--threads", str(threads),
           "--speculative", args.speculative, *extra]
    return peer.Server(side, cmd, port, dict(os.environ))


def main() -> int:
    p = common.base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--agents", type=int, default=FULL_AGENTS)
    p.add_argument("--context", type=int, default=FULL_CONTEXT, help="tokens of each agent's context at its first turn")
    p.add_argument("--rounds", type=int, default=2, help="warm turns per agent after the cold one")
    p.add_argument("--answer", type=int, default=16, help="tokens of each answer")
    p.add_argument("--ram-tokens", type=int, default=None, help="the RAM KV budget (default: a third of the team's KV)")
    p.add_argument("--repeat", type=int, default=0, help="rotates the order of the sides")
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument("--warm-disk", action="store_true",
                   help="leave the disk files in the OS page cache (default: dropped before each turn)")
    p.add_argument("--llama-server", default=None)
    p.add_argument("--speculative", choices=["ngram", "off"], default="ngram",
                   help="our sides' speculation (the engine's default: ngram; llama.cpp's side has none); off compares "
                        "like for like step by step (the sides' drafters need not draft alike)")
    p.add_argument("--work-dir", default=None, help="where the sides' disk directories go (default: the temp dir)")
    args = p.parse_args()
    if args.quick:
        args.agents, args.context, args.rounds = 6, 2000, 1
    team_tokens = args.agents * (args.context + (args.rounds + 1) * (args.answer + 60))
    if args.ram_tokens is None:
        args.ram_tokens = team_tokens // 3 // 16 * 16
    from opencoti.engine.model.loader import bundled_gguf_path
    from opencoti.engine.model.threads import usable_cpus

    gguf = str(bundled_gguf_path())
    threads = args.threads or usable_cpus()
    sides = [s for s in common.rotated(SIDES, args.repeat) if s in args.sides.split(",")]
    llama_bin = Path(args.llama_server) if args.llama_server else peer.build_llama_server()
    before = common.load_snapshot()
    work = Path(tempfile.mkdtemp(prefix="bench-kv-tier-", dir=args.work_dir))
    servers: dict[str, peer.Server] = {}
    props: dict[str, dict] = {}
    ready: dict[str, float] = {}
    try:
        for side in sides:
            servers[side] = side_server(side, gguf, threads, llama_bin, args, work / side)
        for side, srv in servers.items():
            ready[side] = srv.wait_ready()
            common.log(f"{side}: ready in {ready[side]:.1f} s (all sides start together)")
        team = build_team(servers[sides[0]].url, args.agents, args.context, args.rounds)
        common.log(f"team: {args.agents} agents x {len(team['system']) + len(team['briefs'][0])} tokens; "
                   f"RAM budget {args.ram_tokens} tokens (~{team_tokens} tokens of KV in all)")
        disks = {s: work / s for s in ("tier", "tier_copy", "llama.cpp") if s in servers}
        runs = run_team(servers, team, args, disks)
        import httpx

        for side, srv in servers.items():
            runs[side]["ready_s"] = ready[side]
            if side != "llama.cpp":
                props[side] = httpx.get(srv.url + "/polykv/pools", timeout=60).json().get("kv_tiers")
    finally:
        for srv in servers.values():
            srv.stop()
        shutil.rmtree(work, ignore_errors=True)
    summary = {s: summarize(s, r) for s, r in runs.items()}
    ref = runs.get("all_in_ram")
    for s, r in runs.items():
        if ref is not None and s != "llama.cpp":
            same = [a["ids"] == b["ids"] for a, b in zip(r["turns"], ref["turns"])]
            summary[s]["greedy_equal_to_all_in_ram"] = all(same)
            summary[s]["greedy_equal_turns"] = f"{sum(same)}/{len(same)}"
            summary[s]["greedy_differing_turns"] = [[t["round"], t["agent"]] for t, ok in zip(r["turns"], same)
                                                    if not ok]
        elif ref is not None:
            same = [a["ids"] == b["ids"] for a, b in zip(r["turns"], ref["turns"])]
            summary[s]["greedy_equal_turns"] = f"{sum(same)}/{len(same)} (another weight format and kernels)"
        if ref is not None and s != "all_in_ram":
            summary[s]["turn_over_all_in_ram_paired"] = paired(r, ref)
    t = summary.get("tier")
    ratios = {}
    if t is not None:
        for s in ("tier_copy", "all_in_ram", "recompute", "llama.cpp"):
            if s in summary:
                ratios[s] = {"turn_p50": summary[s]["turn_p50_s"] / t["turn_p50_s"],
                             "turn_p95": summary[s]["turn_p95_s"] / t["turn_p95_s"],
                             "warm_total": summary[s]["warm_total_s"] / t["warm_total_s"]}
    rows = [[s, v["turn_p50_s"], v["turn_p95_s"], (v.get("turn_over_all_in_ram_paired") or {}).get("median", 1.0),
             v["warm_total_s"], v["warm_prompt_tokens_computed"], v["step_gap_p99_over_median"],
             v["step_gap_max_over_median"], v["steps_over_1.1x_median_share"], v.get("greedy_equal_turns", "-")]
            for s, v in summary.items()]
    common.print_table(["side", "turn p50 s", "turn p95 s", "/ RAM (paired)", "warm total s", "tokens computed",
                        "step p99/med", "step max/med", "steps >1.1x", "greedy = RAM"], rows,
                       title=f"{args.agents} agents x {args.context} tokens, RAM {args.ram_tokens} tokens, "
                             f"{args.rounds} warm rounds")
    for s, r in ratios.items():
        print(f"{s} / tier: turn p50 {r['turn_p50']:.2f}x, p95 {r['turn_p95']:.2f}x, warm total {r['warm_total']:.2f}x")
    machine = common.machine_info()
    print(common.describe_machine(machine))
    after = common.load_snapshot()
    for r in runs.values():
        for turn in r["turns"]:
            turn["ids"] = len(turn["ids"])  # the answers themselves are compared above; the file keeps counts
            turn["gaps"] = [round(g, 5) for g in turn["gaps"]]
    path = common.write_json("kv_tier", {
        "config": {"interleaved": True, "speculative": args.speculative,
                   "page_cache_dropped": not args.warm_disk, "agents": args.agents,
                   "context": args.context, "rounds": args.rounds, "answer": args.answer,
                   "ram_tokens": args.ram_tokens, "team_kv_tokens": team_tokens, "threads": threads,
                   "gguf": Path(gguf).name, "order": sides, "llama_build": peer.build_info(llama_bin),
                   # reduced: smaller than the team (12 agents x 6,000 tokens, the defaults)
                   "quick": args.quick or (args.agents, args.context) != (FULL_AGENTS, FULL_CONTEXT),
                   "llama_server_flags": ["--parallel", "1", "-c", str(args.ram_tokens), "--slot-save-path", "DIR"]},
        "summary": summary, "ratio_vs_tier": ratios, "kv_tiers": props, "raw": runs, "machine": machine,
        "load_before": before, "load_after": after}, args.out)
    print(f"wrote {path}")
    print(json.dumps({"summary": summary, "ratios": ratios}, indent=1, default=str)[:4000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
