"""Replay of the speculative drafter on bench_speculative's prompts: its drafting policy under a fixed step-cost line.

What it measures. (1) Capture: in one process, the engine on the bundled GGUF (weights as the
benchmark's servers get them: ``auto`` unless ``--weights`` says otherwise; ``--threads`` as
theirs) answers each round of ``benchmarks/bench_speculative.py``'s single-session requests greedily
with speculation off: the warm-up, then each workload :data:`bench_speculative.REPEATS` times, with
the benchmark's nonces, prompts rendered as its server renders them, one cache salt per round (as
one fresh server per round). (2) Replay: each answer goes token by token through a drafter module's
``DraftState.propose``, ``StepCosts.plan`` and ``RecentOutputs``, called as the engine's core calls
them (the answers of the round's earlier requests, warm-up included, are looked up as the engine's
recent outputs); greedy, so a draft token is accepted iff it equals the answer's next token. A step
costs ``a + b * rows`` (``--line``, default 6.2 ms + 1.1 ms a row, the line the drafter was tuned
under); the plan sees that line instead of fitted step times. Two drafters: the current
``opencoti/engine/core/speculative.py`` and the one as of ``--baseline`` (default ``f30f4c5``, the
drafter before per-position confidence and per-length rates), read with ``git show`` into a
temporary file (with the commit's ``opencoti/engine/speculation.py``, the n-gram matcher and
``RecentOutputs`` it imports, where the commit has one). (3) Check (``--no-engine-check`` skips it): the same requests again with
speculation on and the engine's cost line pinned to the same line (each round in a fresh engine,
as the benchmark's servers are: draft rows take free KV pages only, which a long run's prefix
cache would use up); the engine's ``draft_n`` /
``draft_n_accepted`` must equal the current drafter's replay, request by request, and its
outputs the answers of (1).

Reported per workload, for a round's first request (no earlier answer of its own workload to
draft from) and its later ones, separately for the rounds the drafter's constants were chosen on
(:data:`TUNING_ROUNDS`: rounds 0-2) and the held-out rounds (3 and up): decode tokens per step
(the first token comes from the prefill and is not counted), rows per step, acceptance
(``draft_n_accepted / draft_n``) and the speed the line gives against speculation off:
``tokens * (a + b) / sum over steps of (a + b * rows)``.

What it does not measure: time. No step is timed; the ratio is the drafting policy judged by a
fixed line, on one machine's greedy answers. Real speed (fitted step costs, the server, the
machine's noise) is ``benchmarks/bench_speculative.py``'s.

Results: ``benchmarks/results/<machine-id>/speculative_replay.json``.

Run: .venv/bin/python benchmarks/replay_speculative.py [--rounds 7] [--line 6.2,1.1] [--baseline f30f4c5]
"""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

TUNING_ROUNDS = 3  # rounds 0..2: the nonces the drafter's constants were chosen on; later rounds are held out
DRAFTER_PATH = "opencoti/engine/core/speculative.py"
# what the drafter imports of the engine (its n-gram matcher, RecentOutputs), at commits that have it
SHARED_PATH, SHARED_MODULE = "opencoti/engine/speculation.py", "opencoti.engine.speculation"
WARMUP_TOKENS = 8  # bench_speculative's warm-up request (PROMPTS["novel"], 8 tokens)
ROOT = b"round"  # the replay's one salt root (each round is replayed with its own RecentOutputs)


# ============================================================================ drafters
def load_drafter(commit: str) -> tuple[ModuleType, str]:
    """The drafter module as of ``commit`` (``git show`` into a temporary file, imported under a
    name of its own in the drafter's package) and the commit's full hash. Where the commit has the
    module the drafter imports its shared parts from (:data:`SHARED_PATH`), the drafter imports the
    commit's, not the working tree's."""
    def git(*args: str) -> str:
        proc = subprocess.run(["git", *args], cwd=common.REPO_ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"git {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc.stdout

    full = git("rev-parse", "--verify", f"{commit}^{{commit}}").strip()
    source = git("show", f"{full}:{DRAFTER_PATH}")
    has_shared = SHARED_PATH in git("ls-tree", "-r", "--name-only", full, "--", SHARED_PATH).split()
    import opencoti.engine.core  # noqa: F401 - the package the drafter's relative imports resolve in

    package = "opencoti.engine.core"
    saved = sys.modules.get(SHARED_MODULE)
    try:
        if has_shared:
            sys.modules[SHARED_MODULE] = exec_source(f"opencoti.engine.speculation_{full[:10]}",
                                                     git("show", f"{full}:{SHARED_PATH}"))
        module = exec_source(f"{package}.speculative_{full[:10]}", source)
    finally:
        if saved is not None:
            sys.modules[SHARED_MODULE] = saved
        else:
            sys.modules.pop(SHARED_MODULE, None)
    return module, full


def exec_source(name: str, source: str) -> ModuleType:
    """``source`` imported as the module ``name`` (from a temporary file; kept in ``sys.modules``)."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", prefix=name.rpartition(".")[2] + "_", delete=False) as f:
        f.write(source)
        path = f.name
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look the module up by name
        spec.loader.exec_module(module)
    finally:
        Path(path).unlink()
    return module


def current_drafter() -> dict:
    """The commit the current drafter is read at, and whether the file differs from it."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=common.REPO_ROOT, capture_output=True, text=True)

    head = git("rev-parse", "HEAD").stdout.strip() or "?"
    return {"commit": head,
            "modified": git("diff", "--quiet", "HEAD", "--", DRAFTER_PATH, SHARED_PATH).returncode != 0}


def replay_request(mod: Any, costs: Any, recent: Any, prompt: list[int], answer: list[int], max_tokens: int,
                   k_max: int, budget: int, max_context: int | None = None) -> dict:
    """One request's decode steps as the engine's core takes them (``Drafter.add_drafts``):
    each step the job's ``DraftState`` proposes up to ``min(k_max, budget)`` tokens (bounded like
    ``draft_limit``), ``costs.plan`` picks how many to verify, the verified ones are accepted while
    they equal the answer, and the step emits the accepted ones plus one. ``recent``: a
    ``RecentOutputs`` whose answers (salt root :data:`ROOT`) the job may draft from, or None.
    (Where an answer ended with EOS inside a verified draft, the engine also counts the draft
    tokens after it that its argmax repeats; the replay has no answer past EOS and counts none:
    the engine check shows such a request.)"""
    st = mod.DraftState(k_max)
    ctx = list(prompt) + list(answer[:1])  # the first token comes from the prefill
    emitted = min(1, len(answer))
    steps = rows = 0
    lookup = functools.partial(recent.lookup, ROOT) if recent is not None else None
    while emitted < len(answer):
        st.idle += 1
        k = min(k_max, budget, max_tokens - emitted - 1)
        if max_context is not None:
            k = min(k, max_context - len(ctx) - 1)
        k = max(0, k)
        draft = st.propose(ctx, k, lookup) if k > 0 else []
        verify = draft[:min(costs.plan([st], 1, [len(draft)])[0], budget)]
        accepted = 0
        while (accepted < len(verify) and emitted + accepted < len(answer)
               and verify[accepted] == answer[emitted + accepted]):
            accepted += 1
        if verify:
            st.update(len(verify), accepted)
        n = min(accepted + 1, len(answer) - emitted)
        ctx.extend(answer[emitted:emitted + n])
        emitted += n
        steps += 1
        rows += 1 + len(verify)
    return {"tokens": max(0, len(answer) - 1), "steps": steps, "rows": rows, "draft_n": st.drafted,
            "draft_n_accepted": st.accepted}


def fixed_costs(mod: Any, line_s: tuple[float, float]) -> Any:
    """A ``StepCosts`` of ``mod`` whose line is ``line_s`` (seconds fixed, seconds per row)."""
    costs = mod.StepCosts()
    costs.line = lambda: line_s
    return costs


def replay_round(mod: Any, requests: list[dict], line_s: tuple[float, float], k_max: int, budget: int,
                 max_context: int | None = None) -> list[dict]:
    """A round's requests, in order, through ``mod``: one ``StepCosts`` at the fixed line and one
    ``RecentOutputs`` that gets every answer once its request ended (as the engine's does for a salt)."""
    costs = fixed_costs(mod, line_s)
    recent = mod.RecentOutputs()
    out = []
    for req in requests:
        out.append(replay_request(mod, costs, recent, req["prompt"], req["answer"], req["max_tokens"], k_max,
                                  budget, max_context))
        recent.add(ROOT, req["answer"])
    return out


def estimated_ratio(tokens: int, steps: int, rows: int, line_s: tuple[float, float]) -> float | None:
    """Decode tokens per second by the line, over speculation off's (one token per one-row step)."""
    a, b = line_s
    time = a * steps + b * rows
    return tokens * (a + b) / time if time > 0 else None


def summarize_group(res: list[dict], line_s: tuple[float, float]) -> dict:
    tokens, steps, rows = (sum(r[k] for r in res) for k in ("tokens", "steps", "rows"))
    drafted, accepted = sum(r["draft_n"] for r in res), sum(r["draft_n_accepted"] for r in res)
    return {"requests": len(res), "tokens": tokens, "steps": steps, "rows": rows, "draft_n": drafted,
            "draft_n_accepted": accepted, "tokens_per_step": tokens / steps if steps else None,
            "rows_per_step": rows / steps if steps else None,
            "acceptance": accepted / drafted if drafted else None,
            "est_ratio_vs_off": estimated_ratio(tokens, steps, rows, line_s)}


# ============================================================================ capture
def with_nonce(messages: list[dict], nonce: str) -> list[dict]:
    """The benchmark's request messages: the nonce leads the first message (``bench_speculative.chat``)."""
    return [{**messages[0], "content": f"[{nonce}] {messages[0]['content']}"}] + messages[1:]


def round_plan(rnd: int, tokens: int) -> list[tuple[str, int, list[dict], int, str]]:
    """(workload, index, messages, max tokens, nonce) of a round's requests in the benchmark's order
    (``bench_speculative.run_round``: the warm-up, then each single-session workload REPEATS times)."""
    from bench_speculative import PROMPTS, REPEATS, SINGLE

    nonce = f"r{rnd}"
    plan = [("warmup", 0, PROMPTS["novel"], WARMUP_TOKENS, nonce + "-warmup")]
    plan += [(w, i, PROMPTS[w], tokens, f"{nonce}-{w}-{i}") for w in SINGLE for i in range(REPEATS)]
    return plan


def capture(eng: Any, rnd: int, tokens: int, speculative: bool) -> list[dict]:
    """Round ``rnd``'s requests, answered greedily (speculation off, or on at the engine's setting)."""
    from opencoti.engine import SamplingParams
    from opencoti.ops.chat_continue import chat_prompt

    out = []
    salt = f"replay-{'on' if speculative else 'off'}-round-{rnd}"  # the two passes share nothing
    for w, i, messages, n, nonce in round_plan(rnd, tokens):
        prompt = eng.tokenize(chat_prompt(eng.tokenizer, with_nonce(messages, nonce)).full_text)  # as served
        params = SamplingParams.greedy(n, **({} if speculative else {"speculative_max": 0}))
        res = eng.generate(prompt, params=params, cache_salt=salt)
        out.append({"round": rnd, "workload": w, "index": i, "max_tokens": n, "prompt": prompt,
                    "answer": list(res.token_ids), "stop_reason": res.stop_reason,
                    "draft_n": res.timings.get("draft_n", 0),
                    "draft_n_accepted": res.timings.get("draft_n_accepted", 0)})
    common.log(f"{'on' if speculative else 'off'}: round {rnd} captured")
    return out


# ============================================================================ report
def groups(requests: list[dict], rounds: int) -> list[tuple[str, str, str, list[int]]]:
    """(round set, workload, position, indices into ``requests``) of every reported group."""
    sets = [("tuning", range(min(rounds, TUNING_ROUNDS))), ("held-out", range(TUNING_ROUNDS, rounds))]
    workloads = list(dict.fromkeys(r["workload"] for r in requests if r["workload"] != "warmup"))
    out = []
    for label, rs in sets:
        if not len(rs):
            continue
        name = f"{label} (rounds {rs[0]}-{rs[-1]})" if len(rs) > 1 else f"{label} (round {rs[0]})"
        for w in workloads:
            for pos, keep in (("first", lambda r: r["index"] == 0), ("later", lambda r: r["index"] > 0),
                              ("all", lambda r: True)):
                idx = [j for j, r in enumerate(requests) if r["workload"] == w and r["round"] in rs and keep(r)]
                if idx:
                    out.append((name, w, pos, idx))
    return out


def parse_line(text: str) -> tuple[float, float]:
    try:
        a, b = (float(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"--line takes two numbers, 'fixed_ms,per_row_ms' (e.g. 6.2,1.1); got {text!r}")
    if not (a > 0 and b >= 0):
        raise SystemExit(f"--line: the fixed cost must be > 0 ms and the per-row cost >= 0 ms; got {text!r}")
    return a, b


def main() -> int:
    p = common.base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7, help=f"nonce rounds (0-{TUNING_ROUNDS - 1}: tuning, then held out)")
    p.add_argument("--tokens", type=int, default=160, help="tokens per request at most (bench_speculative's)")
    p.add_argument("--line", default="6.2,1.1", help="the fixed step-cost line: fixed ms, ms per row")
    p.add_argument("--baseline", default="f30f4c5", help="the commit whose drafter is compared with the current one")
    p.add_argument("--traces", default=None, help="also write the captured prompts and answers (token ids) here")
    p.add_argument("--no-engine-check", action="store_true",
                   help="skip the engine run with speculation on (draft counts and outputs against the replay)")
    args = p.parse_args()
    if args.quick:
        args.rounds = 1
    if args.rounds < 1 or args.tokens < 2:
        raise SystemExit("--rounds must be >= 1 and --tokens >= 2")
    line_ms = parse_line(args.line)
    line_s = (line_ms[0] / 1e3, line_ms[1] / 1e3)

    from opencoti.engine.core import speculative as current
    from opencoti.engine.model.loader import bundled_gguf_path
    from opencoti.engine.model.threads import usable_cpus

    baseline, baseline_commit = load_drafter(args.baseline)
    drafters = {"current": current, "baseline": baseline}
    args.threads = args.threads or usable_cpus()  # as bench_speculative's servers: --threads or the usable cores
    gguf = str(bundled_gguf_path())
    before = common.load_snapshot()
    reqs: list[dict] = []
    on: list[dict] | None = None if args.no_engine_check else []
    for rnd in range(args.rounds):
        # a fresh engine per round, as bench_speculative starts fresh servers: draft rows take free KV pages
        # only, and the pages a long run's prefix cache keeps would leave the engine's drafts short of them
        eng = common.make_engine(args, model=gguf, speculative="ngram")
        try:
            if rnd == 0:
                weights = eng.weights_info()
                cfg = eng.config
                k_max = cfg.speculative_max
                budget = min(current.MAX_DRAFT_ROWS, current.MAX_STEP_ROWS - 1, cfg.max_batch_tokens - 1)  # one job
                max_context = eng.max_context
                common.log(f"weights {weights.get('format')}; {args.rounds} round(s)")
            elif eng.weights_info().get("format") != weights.get("format"):
                raise SystemExit(f"round {rnd}: auto chose {eng.weights_info().get('format')}, round 0 "
                                 f"{weights.get('format')}; pass --weights")
            if on is not None:  # first, while the KV pages are all free
                eng.core.drafter.costs.line = lambda: line_s  # the engine plans by the replay's line
                on += capture(eng, rnd, args.tokens, speculative=True)
            reqs += capture(eng, rnd, args.tokens, speculative=False)
        finally:
            eng.shutdown()

    if args.traces:
        Path(args.traces).write_text(json.dumps([{k: r[k] for k in ("round", "workload", "index", "max_tokens",
                                                                        "prompt", "answer")} for r in reqs]))
    replays: dict[str, list[dict]] = {name: [] for name in drafters}
    for name, mod in drafters.items():
        for rnd in range(args.rounds):
            replays[name] += replay_round(mod, [r for r in reqs if r["round"] == rnd], line_s, k_max, budget,
                                          max_context)
    check = None
    if on is not None:  # the engine's own drafts, request by request, against the current drafter's replay
        for r, e, mine in zip(reqs, on, replays["current"]):
            same = (e["draft_n"], e["draft_n_accepted"]) == (mine["draft_n"], mine["draft_n_accepted"])
            # an answer ended by EOS inside a verified draft: the engine also counts the draft tokens after
            # EOS that its argmax repeats (never emitted); the replay has nothing past EOS to count
            past_eos = (not same and r["stop_reason"] == "eos" and e["draft_n"] == mine["draft_n"]
                        and e["draft_n_accepted"] > mine["draft_n_accepted"])
            r["engine"] = {"draft_n": e["draft_n"], "draft_n_accepted": e["draft_n_accepted"],
                           "same_output": e["answer"] == r["answer"], "same_draft_counts": same,
                           "accepted_past_eos": e["draft_n_accepted"] - mine["draft_n_accepted"] if past_eos else 0}
        check = {"same_outputs": all(r["engine"]["same_output"] for r in reqs),
                 "same_draft_counts": all(r["engine"]["same_draft_counts"] or r["engine"]["accepted_past_eos"]
                                          for r in reqs),
                 "requests_accepted_past_eos": sum(1 for r in reqs if r["engine"]["accepted_past_eos"]),
                 "mismatches": [f"round {r['round']} {r['workload']} #{r['index']}" for r in reqs
                                if not (r["engine"]["same_output"] and (r["engine"]["same_draft_counts"]
                                                                        or r["engine"]["accepted_past_eos"]))]}

    summary, rows = [], []
    for rset, w, pos, idx in groups(reqs, args.rounds):
        entry = {"rounds": rset, "workload": w, "requests": pos,
                 **{name: summarize_group([replays[name][j] for j in idx], line_s) for name in drafters}}
        summary.append(entry)
        b, c = entry["baseline"], entry["current"]
        pct = [None if x["acceptance"] is None else round(100 * x["acceptance"], 1) for x in (b, c)]
        rows.append([rset, w, pos, b["tokens_per_step"], c["tokens_per_step"], b["rows_per_step"],
                     c["rows_per_step"], *pct, b["est_ratio_vs_off"], c["est_ratio_vs_off"]])
    headers = ["rounds", "workload", "requests", "tok/step base", "tok/step now", "rows/step base",
               "rows/step now", "% accepted base", "% accepted now", "est. x off base", "est. x off now"]
    now = current_drafter()
    title = (f"speculative drafting replayed under the line {line_ms[0]} ms + {line_ms[1]} ms/row: drafter as of "
             f"{baseline_commit[:7]} (base) vs {now['commit'][:7]}{' + uncommitted changes' if now['modified'] else ''}"
             f" (now); {args.rounds} round(s), weights {weights.get('format')}")
    common.print_table(headers, rows, title=title)
    if check is not None:
        print(f"engine check (speculation on, same line): outputs identical {check['same_outputs']}, "
              f"draft counts equal the replay's {check['same_draft_counts']} (requests whose engine count also "
              f"has accepted draft tokens past EOS: {check['requests_accepted_past_eos']})"
              + (f"; differing: {check['mismatches']}" if check["mismatches"] else ""))
    machine = common.machine_info()
    print(common.describe_machine(machine))
    notes = [f"No step is timed: est. x off = decode tokens x (a + b) / sum of (a + b x rows) over the steps, "
             f"a = {line_ms[0]} ms, b = {line_ms[1]} ms a row; real speed is bench_speculative's.",
             f"Rounds 0-{TUNING_ROUNDS - 1} are the nonces the drafter's constants were chosen on; later rounds are "
             "held out. 'first': each round's first request of the workload (no earlier answer of its own "
             "workload to draft from)."]
    if check is not None:
        notes.append(f"Engine with speculation on at the same line: outputs identical to off: {check['same_outputs']}; "
                     f"its draft counts equal the replay's: {check['same_draft_counts']} (in "
                     f"{check['requests_accepted_past_eos']} requests ended by EOS inside a draft the engine also "
                     "counted the draft tokens after EOS that it would have sampled; the replay has none to count).")
    path = common.write_json("speculative_replay", {
        "config": {"rounds": args.rounds, "tuning_rounds": TUNING_ROUNDS, "tokens": args.tokens,
                   "threads": args.threads, "gguf": Path(gguf).name, "weights_requested": args.weights,
                   "weights": weights.get("format"),
                   "kernels": weights.get("kernels"), "weights_reason": (weights.get("choice") or {}).get("reason"),
                   "cost_line_ms": {"fixed": line_ms[0], "per_row": line_ms[1]}, "k_max": k_max,
                   "dtype": args.dtype, "device": args.device, "draft_budget": budget,
                   "drafters": {"path": DRAFTER_PATH, "current": now, "baseline": {"commit": baseline_commit}},
                   "engine_check": check is not None, "quick": args.quick},
        "summary": summary, "engine_check": check,
        "requests": [{k: r[k] for k in ("round", "workload", "index", "max_tokens", "stop_reason")}
                     | {"prompt_n": len(r["prompt"]), "answer_n": len(r["answer"]), "engine": r.get("engine"),
                        **{name: replays[name][j] for name in drafters}}
                     for j, r in enumerate(reqs)],
        "report": {"headers": headers, "rows": rows, "notes": notes},
        "machine": machine, "load_before": before}, args.out)
    print(f"wrote {path}")
    if check is not None and not (check["same_outputs"] and check["same_draft_counts"]):
        print("the engine's drafts or outputs differ from the replay (see engine_check in the result)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
