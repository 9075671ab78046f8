#!/usr/bin/env python
"""Pools: attach time-to-first-token and KV memory, vs the same prompts without pools (issue 3).

(a) TTFT. A shared prefix of exactly ``--prefix`` (1024) tokens, real text (an agent system prompt
    with tool definitions, rendered with the model's chat template, tokenized, truncated) plus a
    ``--suffix`` (32) token user turn; ``max_tokens=1``. Full prefill = a fresh session, no pool.
    Attach = a fresh session with ``pool_id`` of a pool created from the prefix tokens (auto-P
    shares all of it). TTFT = wall time of the 1-token ``generate`` call; median of ``--repeats``
    (5), the two kinds interleaved. Target: >= 10x faster.
(b) KV memory. ``--sessions`` (16) prompts = prefix + each its own suffix, ``--gen`` (64) greedy
    tokens each (ignore_eos), all running concurrently; once without pools (fresh sessions), once
    attached to one pool. KV bytes in use = ``engine.pools()["kv_bytes_used"]`` (physical pages x
    page bytes): polled for the peak while running, and measured again after all finished while
    the sessions are still cached. Ideal ratio = S(P+Q+G) / (P + S(Q+G)) = 7.0 for the defaults.
    Target: >= 6.5x less.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repository root on sys.path)
from common import check_mark, fmt, log, now, print_table, ratio, summarize  # noqa: E402

SYSTEM_POLICY = """\
You are Orchestrator, the lead agent of a team of software engineering agents working on a large \
code base. You receive tasks from users, break them into steps, delegate the steps to sub-agents, \
review their results and report back. Follow these rules at all times.

1. Understand the task before acting. Restate the goal in one sentence, list the constraints the \
user gave (deadlines, files that must not change, style rules), and ask a clarifying question only \
when the task cannot be done without the answer.
2. Plan in small, verifiable steps. Each step names the files it touches, the tool it uses and how \
its result will be checked. Prefer steps that can be undone.
3. Use the tools below instead of guessing. Read a file before editing it. Run the tests after every \
change that could affect them, and read the failures carefully before trying a fix.
4. Never invent file contents, command output, test results or API behaviour. If a tool call fails, \
report the error message verbatim and decide whether to retry with different arguments.
5. Keep the user informed: after each step, write one short line saying what was done and what \
comes next. At the end, summarize the changes, the tests that were run and anything left open.
6. Respect security boundaries: do not read credentials, do not send data to external services, do \
not run commands that delete data outside the working directory.
7. When several sub-agents work in parallel, give each a self-contained brief with the context it \
needs, the files it owns and the exact output expected, and merge their results carefully.
"""

TOOLS = [
    ("read_file", "Read a text file from the repository and return its contents with line numbers.",
     {"path": ("string", "Path relative to the repository root."),
      "start_line": ("integer", "First line to return (1-based)."),
      "end_line": ("integer", "Last line to return (inclusive).")}, ["path"]),
    ("write_file", "Create or overwrite a text file in the repository with the given contents.",
     {"path": ("string", "Path relative to the repository root."),
      "contents": ("string", "The complete new contents of the file.")}, ["path", "contents"]),
    ("search_code", "Search the repository for a regular expression and return matching lines.",
     {"pattern": ("string", "A regular expression in Python syntax."),
      "glob": ("string", "Only search files whose path matches this glob, e.g. '**/*.py'."),
      "max_results": ("integer", "Maximum number of matches to return.")}, ["pattern"]),
    ("run_tests", "Run the project's test suite, or a subset of it, and return the summary and failures.",
     {"selector": ("string", "A pytest node id or keyword expression; empty for all tests."),
      "timeout_s": ("integer", "Seconds before the run is stopped.")}, []),
    ("run_command", "Run a shell command in the repository root and return its exit code and output.",
     {"command": ("string", "The command line to run."),
      "timeout_s": ("integer", "Seconds before the command is stopped.")}, ["command"]),
    ("delegate", "Start a sub-agent on a self-contained task and return its final report.",
     {"agent": ("string", "Which specialist to start: coder, reviewer, tester or researcher."),
      "brief": ("string", "The complete task description, including context and expected output."),
      "files": ("array", "Files the sub-agent owns and may edit.")}, ["agent", "brief"]),
    ("web_search", "Search the documentation index and return the titles and snippets of the best pages.",
     {"query": ("string", "A few keywords describing what you are looking for."),
      "site": ("string", "Restrict results to this documentation site.")}, ["query"]),
    ("create_issue", "File an issue in the tracker with a title, a description and labels.",
     {"title": ("string", "A one-line summary of the problem."),
      "body": ("string", "What happens, what was expected, how to reproduce."),
      "labels": ("array", "Labels such as bug, performance or documentation.")}, ["title", "body"]),
]

QUESTIONS = [
    "Find where the page allocator frees pages and check it handles refcounts.",
    "Add a unit test for the tokenizer's handling of empty strings.",
    "Why does the scheduler stall when many long prompts arrive at once?",
    "Summarize the public API of the engine module for the docs.",
    "Rename the config option max_running to max_sessions everywhere.",
    "Review the last change to the attention backend for correctness.",
    "Profile one decode step and tell me where the time goes.",
    "Write a short README section on how pools share the KV cache.",
    "Check that every HTTP error uses the llama.cpp error shape.",
    "List the tests that touch the pool tree and run only those.",
    "Make the sampler reproducible when a seed is given per request.",
    "Explain how chunked prefill decides the chunk size per step.",
    "Find dead code in the loader and propose what to delete.",
    "Add type hints to the session module and fix what mypy reports.",
    "Draft release notes for the pools feature from the commit log.",
    "Investigate a flaky test in the concurrency suite and fix it.",
]


def tool_schema(name: str, desc: str, params: dict, required: list[str]) -> dict:
    props = {}
    for key, (typ, pdesc) in params.items():
        props[key] = {"type": typ, "description": pdesc}
        if typ == "array":
            props[key]["items"] = {"type": "string"}
    return {"type": "function", "function": {"name": name, "description": desc,
                                             "parameters": {"type": "object", "properties": props,
                                                            "required": required}}}


def build_prefix(engine, n_tokens: int) -> tuple[list[int], int]:
    """Exactly ``n_tokens`` tokens of a realistic agent system prompt with tool definitions,
    rendered with the chat template. Returns (tokens, tokens before truncation)."""
    tools = [tool_schema(*t) for t in TOOLS]
    tool_text = "\n".join(json.dumps(t, indent=1) for t in tools)
    system = (f"{SYSTEM_POLICY}\n# Tools\n\nYou may call one or more functions to assist with the user query. "
              f"The function signatures are given below, one JSON object per function:\n<tools>\n{tool_text}\n"
              f"</tools>\n\nFor each function call, return a JSON object with the function name and arguments "
              f"within <tool_call></tool_call> tags.")
    messages = [{"role": "system", "content": system}]
    tokens = engine.tokenize(engine.apply_chat_template(messages, add_generation_prompt=False))
    rounds = 1
    while len(tokens) < n_tokens:  # a larger --prefix: add worked examples until long enough
        rounds += 1
        messages += [{"role": "user", "content": QUESTIONS[rounds % len(QUESTIONS)]},
                     {"role": "assistant", "content": f"Step {rounds}: I will first read the relevant files, "
                      "then make the smallest change that solves it, then run the tests and report back."}]
        tokens = engine.tokenize(engine.apply_chat_template(messages, add_generation_prompt=False))
    return tokens[:n_tokens], len(tokens)


def build_suffix(engine, question: str, n_tokens: int) -> list[int]:
    """A user turn of exactly ``n_tokens`` tokens: header + question (cut or padded) + assistant header."""
    head = engine.tokenize("\n<|im_start|>user\n")
    tail = engine.tokenize("<|im_end|>\n<|im_start|>assistant\n")
    room = n_tokens - len(head) - len(tail)
    if room < 1:  # tiny suffix: plain question tokens
        return (engine.tokenize(" " + question) * n_tokens)[:n_tokens]
    body = engine.tokenize(question)
    pad = engine.tokenize(" Please be thorough and explain every step you take along the way.")
    while len(body) < room:
        body += pad
    return head + body[:room] + tail


# ============================================================================ (a) TTFT
def ttft_once(engine, prompt: list[int], session_id: str, pool_id: int | None) -> dict:
    """One 1-token request on a fresh session, under a salt of its own: it finds nothing in the
    automatic prefix cache, so a full prefill computes every token and an attach exactly the suffix."""
    from opencoti.engine import SamplingParams

    t0 = now()
    r = engine.generate(prompt, params=SamplingParams.greedy(1, ignore_eos=True), session_id=session_id,
                        pool_id=pool_id, cache_salt=common.fresh_salt(session_id))
    wall = now() - t0
    engine.release_session(session_id)
    return {"ttft_s": wall, "engine_prompt_ms": r.timings["prompt_ms"], "prompt_n": r.timings["prompt_n"],
            "cache_n": r.timings["cache_n"], "token": r.token_ids[0]}


# ============================================================================ (b) KV memory
class PeakPoller:
    """Polls ``engine.pools()["kv_bytes_used"]`` every ``interval`` seconds in a thread."""

    def __init__(self, engine, interval: float = 0.02):
        self.engine, self.interval = engine, interval
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.engine.pools()["kv_bytes_used"])
            self.samples += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> "PeakPoller":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.engine.pools()["kv_bytes_used"])


def run_sessions(engine, prompts: list[list[int]], gen: int, tag: str, pool_id: int | None, baseline: int) -> dict:
    """All prompts at once (one thread each), each under a salt of its own (sessions share KV only
    through ``pool_id``, never through the automatic prefix cache); sessions stay cached afterwards.
    ``baseline`` is kv_bytes_used before the phase began (before its pool was created, so the pool counts)."""
    from opencoti.engine import SamplingParams

    results: list = [None] * len(prompts)
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(prompts))

    def worker(i: int) -> None:
        try:
            barrier.wait()
            results[i] = engine.generate(prompts[i], params=SamplingParams.greedy(gen, ignore_eos=True),
                                         session_id=f"{tag}-{i}", pool_id=pool_id,
                                         cache_salt=common.fresh_salt(f"{tag}-{i}"))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(len(prompts))]
    t0 = now()
    with PeakPoller(engine) as poller:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    wall = now() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed: {errors[0]!r}") from errors[0]
    st = engine.pools()
    engine.check_integrity()
    return {
        "baseline_kv_bytes": baseline,
        "peak_kv_bytes": poller.peak,
        "after_kv_bytes": st["kv_bytes_used"],
        "after_kv_pages": st["kv_pages_used"],
        "poll_samples": poller.samples,
        "wall_s": wall,
        "generated": [len(r.token_ids) for r in results],
        "cache_n": [r.timings["cache_n"] for r in results],
        "stats": engine.stats(),
        "token_ids": [r.token_ids for r in results],
    }


def release_all(engine, tag: str, n: int) -> None:
    for i in range(n):
        try:
            engine.release_session(f"{tag}-{i}")
        except Exception:  # noqa: BLE001 - never created
            pass


# ============================================================================ main
def main(argv: list[str] | None = None) -> int:
    p = common.base_parser(__doc__.split("\n")[0])
    p.add_argument("--prefix", type=int, default=1024, help="shared prefix tokens (the pool)")
    p.add_argument("--suffix", type=int, default=32, help="per-session suffix tokens")
    p.add_argument("--sessions", type=int, default=16, help="sessions in the memory test")
    p.add_argument("--gen", type=int, default=64, help="generated tokens per session in the memory test")
    p.add_argument("--repeats", type=int, default=5, help="TTFT repeats (median reported)")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats = min(args.repeats, 2)
    if min(args.prefix, args.suffix, args.sessions, args.gen, args.repeats) < 1:
        p.error("--prefix, --suffix, --sessions, --gen and --repeats must be >= 1")
    if args.sessions > len(QUESTIONS):
        p.error(f"--sessions must be <= {len(QUESTIONS)}")
    common.set_threads(args.threads)

    t_start = now()
    load_before = common.load_snapshot()
    machine = common.machine_info()
    log(f"machine: {common.describe_machine(machine)}")
    P, Q, G, S = args.prefix, args.suffix, args.gen, args.sessions
    kv_tokens = S * (P + Q + G) + P + 4096  # both phases fit without eviction, with room to spare
    engine = common.make_engine(args, kv_budget_tokens=kv_tokens, max_pools=16,
                                max_running=max(64, S), pool_grace_ttl_s=0.0)
    page_size, page_bytes = engine.kv.page_size, engine.kv.page_bytes
    log(f"engine loaded in {engine.load_seconds:.1f}s ({engine.model_name}, {engine.dtype}, {engine.device}); "
        f"KV {engine.kv.num_pages} pages x {page_size} tokens, {page_bytes} B/page")

    prefix, untruncated = build_prefix(engine, P)
    suffixes = [build_suffix(engine, q, Q) for q in QUESTIONS[:S]]
    assert len(prefix) == P and all(len(s) == Q for s in suffixes)
    log(f"prefix: {P} tokens (cut from {untruncated}); suffix: {Q} tokens; context {P + Q}")

    # ---------------------------------------------------------------- (a) TTFT
    t_a = now()
    pool = engine.create_pool(tokens=prefix, label="bench-prefix")
    log(f"pool {pool.pool_id}: {pool.prefix_len} tokens, {pool.own_kv_bytes} B KV; warm-up")
    prompt = prefix + suffixes[0]
    ttft_once(engine, prompt, "warm-full", None)
    ttft_once(engine, prompt, "warm-attach", pool.pool_id)
    full_runs, attach_runs = [], []
    for r in range(args.repeats):
        log(f"TTFT round {r + 1}/{args.repeats}")
        full_runs.append(ttft_once(engine, prompt, f"full-{r}", None))
        attach_runs.append(ttft_once(engine, prompt, f"attach-{r}", pool.pool_id))
    engine.release_pool(pool.pool_id)
    engine.check_integrity()
    common.assert_cache_n([x["cache_n"] for x in full_runs], 0, "full prefill")
    common.assert_cache_n([x["cache_n"] for x in attach_runs], P, "attach")
    same_token = all(x["token"] == full_runs[0]["token"] for x in full_runs + attach_runs)
    full = summarize([x["ttft_s"] for x in full_runs])
    attach = summarize([x["ttft_s"] for x in attach_runs])
    ttft_ratio = ratio(full["median"], attach["median"])
    secs_a = now() - t_a

    # ---------------------------------------------------------------- (b) KV memory
    t_b = now()
    prompts = [prefix + s for s in suffixes]
    left = engine.pools()["kv_pages_used"]
    if left:
        log(f"WARNING: {left} KV pages still in use before the memory test")
    log(f"memory: {S} sessions without pools")
    nopool = run_sessions(engine, prompts, G, "nopool", None, engine.pools()["kv_bytes_used"])
    common.assert_cache_n(nopool["cache_n"], 0, "memory, no pools")
    release_all(engine, "nopool", S)
    log(f"memory: {S} sessions on one pool")
    baseline = engine.pools()["kv_bytes_used"]
    pool = engine.create_pool(tokens=prefix, label="bench-memory")
    pool_bytes = pool.own_kv_bytes
    withpool = run_sessions(engine, prompts, G, "pool", pool.pool_id, baseline)
    common.assert_cache_n(withpool["cache_n"], P, "memory, one pool")
    tree = engine.pools()
    release_all(engine, "pool", S)
    engine.release_pool(pool.pool_id)
    engine.check_integrity()
    pages_end = engine.pools()["kv_pages_used"]
    secs_b = now() - t_b

    def used(run: dict, key: str) -> int:
        return run[key] - run["baseline_kv_bytes"]

    # (the pool is created before its sessions run, so its bytes are inside the with-pool numbers)
    mem_peak_ratio = ratio(used(nopool, "peak_kv_bytes"), used(withpool, "peak_kv_bytes"))
    mem_after_ratio = ratio(used(nopool, "after_kv_bytes"), used(withpool, "after_kv_bytes"))
    ideal = S * (P + Q + G) / (P + S * (Q + G))
    same_out = sum(a == b for a, b in zip(nopool["token_ids"], withpool["token_ids"]))
    gen_ok = all(g == G for g in nopool["generated"] + withpool["generated"])
    attach_cache_ok = all(c == P for c in withpool["cache_n"])

    print(f"\nopencoti pools benchmark: {engine.model_name}, dtype {args.dtype}, device {engine.device}, "
          f"page size {page_size}")
    print(f"machine: {common.describe_machine(machine)}")
    print_table(
        ["(a) time to first token", "median ms", "min ms", "max ms", "engine prompt_ms", "prompt_n", "cache_n"],
        [["full prefill (fresh session, no pool)", full["median"] * 1e3, full["min"] * 1e3, full["max"] * 1e3,
          summarize([x["engine_prompt_ms"] for x in full_runs])["median"], full_runs[0]["prompt_n"],
          full_runs[0]["cache_n"]],
         ["attach (fresh session, pool_id)", attach["median"] * 1e3, attach["min"] * 1e3, attach["max"] * 1e3,
          summarize([x["engine_prompt_ms"] for x in attach_runs])["median"], attach_runs[0]["prompt_n"],
          attach_runs[0]["cache_n"]]],
        title=f"prefix {P} tokens + suffix {Q} tokens, max_tokens=1, TTFT = wall time of the request, "
              f"median of {args.repeats}")
    print(f"  attach speed-up: {fmt(ttft_ratio, 1)}x   target >= 10x: {check_mark(ttft_ratio, 10.0)}"
          f"   (first token identical in all runs: {fmt(same_token)})")

    mib = 2**20
    print_table(
        ["(b) KV bytes in use", "peak MiB", "after MiB", "after pages", "wall s"],
        [["no pools (fresh sessions)", used(nopool, "peak_kv_bytes") / mib, used(nopool, "after_kv_bytes") / mib,
          used(nopool, "after_kv_bytes") // page_bytes, nopool["wall_s"]],
         ["one pool + attached sessions", used(withpool, "peak_kv_bytes") / mib,
          used(withpool, "after_kv_bytes") / mib, used(withpool, "after_kv_bytes") // page_bytes,
          withpool["wall_s"]]],
        title=f"{S} sessions x ({P} prefix + {Q} suffix + {G} generated tokens), all running together; "
              f"peak = max of polled kv_bytes_used, after = all finished, sessions still cached")
    print(f"  memory reduction: peak {fmt(mem_peak_ratio)}x, after {fmt(mem_after_ratio)}x; ideal "
          f"{S}x({P}+{Q + G}) / ({P} + {S}x{Q + G}) = {ideal:.2f}x   target >= 6.5x: "
          f"{check_mark(mem_peak_ratio, 6.5)}" + ("" if (P, Q, G, S) == (1024, 32, 64, 16)
                                                    else "  (target is defined for 1024/32/64/16)"))
    print(f"  pool own KV {pool_bytes / mib:.2f} MiB; sessions attached with cache_n={P}: {fmt(attach_cache_ok)}; "
          f"all generated {G} tokens: {fmt(gen_ok)}; greedy outputs identical with/without pool: {same_out}/{S}; "
          f"KV pages in use at the end: {pages_end}")
    print(f"  time: (a) {secs_a:.0f}s, (b) {secs_b:.0f}s")

    def strip(run: dict) -> dict:
        return {k: v for k, v in run.items() if k != "token_ids"}

    payload = {
        "config": {"model": engine.model_name, "dtype": args.dtype, "device": str(engine.device),
                   "page_size": page_size, "page_bytes": page_bytes, "prefix_tokens": P, "suffix_tokens": Q,
                   "sessions": S, "generated_tokens": G, "repeats": args.repeats, "quick": args.quick,
                   "prefix_untruncated_tokens": untruncated},
        "machine": machine,
        "definitions": {
            "ttft": "wall time of a generate() call with max_tokens=1 on a fresh session",
            "full_prefill": "fresh session, no pool, a cache_salt of its own: computes all prefix+suffix tokens "
                            "(asserted: cache_n == 0)",
            "attach": "fresh session with pool_id of a resident pool holding the prefix (auto-P), a cache_salt "
                      "of its own (asserted: cache_n == prefix tokens, nothing from the automatic prefix cache)",
            "memory_no_pool": "each session under its own cache_salt (asserted: cache_n == 0)",
            "kv_bytes": "engine.pools()['kv_bytes_used'] (physical pages in use x page bytes) minus the "
                        "value before the phase; peak polled every 20 ms, after = all requests finished",
            "ideal_ratio": "S*(P+Q+G) / (P + S*(Q+G))",
        },
        "ttft": {"full_s": full, "attach_s": attach, "speedup": ttft_ratio,
                 "target_10x": ttft_ratio is not None and ttft_ratio >= 10.0,
                 "full_runs": full_runs, "attach_runs": attach_runs, "first_token_identical": same_token},
        "memory": {"no_pool": strip(nopool), "pool": strip(withpool), "pool_own_kv_bytes": pool_bytes,
                   "ratio_peak": mem_peak_ratio, "ratio_after": mem_after_ratio, "ideal_ratio": ideal,
                   "target_6_5x": mem_peak_ratio is not None and mem_peak_ratio >= 6.5,
                   "outputs_identical": same_out, "attach_cache_n_ok": attach_cache_ok, "generated_ok": gen_ok,
                   "pool_tree_after": tree, "kv_pages_in_use_at_end": pages_end},
        "total_seconds": now() - t_start,
        "loadavg_end": common.machine_info()["loadavg"],
        "machine_end": common.machine_info(),
        "load_before": load_before,
    }
    path = common.write_json("pools", payload, args.out)
    print(f"\nwrote {path} ({now() - t_start:.0f}s total)")
    engine.shutdown()
    return 0


if __name__ == "__main__":
    _rc = main()
    if _rc:  # no SystemExit on success: `opencoti bench all` runs the next benchmark in this process
        sys.exit(_rc)
