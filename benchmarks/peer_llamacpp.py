"""opencoti serve vs llama.cpp's llama-server, side by side in one run, same GGUF, same threads.

``llama-server`` is built once from the ``llama-cpp-python`` sdist on the package registry (its
vendored llama.cpp: CMake Release, native CPU, no curl, no prebuilt web UI, only the
``llama-server`` and ``llama-quantize`` targets; ~20 min on 2 cores the first time) and cached under
``<opencoti cache>/peer/llama-cpp-python-<version>/``. ``--llama-server PATH`` uses another binary.

Four servers load the bundled SmolLM2-135M-Instruct Q4_1 GGUF with ``--threads`` threads (default:
the usable cores): ``opencoti`` (its defaults: n-gram speculation on), ``opencoti-off``
(``--speculative off``), ``llama.cpp`` (its defaults: no speculation) and ``llama.cpp-ngram``
(``--spec-type ngram-simple``); llama-server with ``--parallel 8 --kv-unified -c 16384`` (8 slots
sharing one KV buffer, as an agent team needs), opencoti with ``--state-dir none`` (nothing restored
from an earlier run). opencoti's ``auto`` chooses its weight format at the first start of the run;
the other opencoti starts are pinned to that choice (``--weights``), so both opencoti servers run
the same weights (recorded as ``servers.<name>.weights``). Three comparisons, each a row group of
the report:

* ``default``: opencoti default (speculation on) vs llama.cpp default (none): what users get;
* ``spec_off``: opencoti ``--speculative off`` vs llama.cpp: the per-token claim;
* ``both_ngram``: both with n-gram speculation (opencoti default vs ``--spec-type ngram-simple``).

Each round starts all four fresh (cold caches) and keeps them up at once; every request is sent to
each server in turn, the order rotated per request (each server goes first once every four), so a
drift in the machine's speed (other work, the clock) hits them alike. A ratio is taken per pair (the
same request on both servers of a comparison, a few seconds apart) and the report gives the median of
the per-pair ratios and their spread (min–max); ``--rounds`` (2) rounds.

Workloads (client side, over HTTP, identical requests to every server; every prompt is new to the
server, and no two requests of a round share a prompt text, so no drafter can copy an earlier answer):

* ``decode_1``: one session streams ``--tokens`` tokens (``ignore_eos``) after a short prompt (an
  essay; each repeat another subject); decode tok/s = (tokens - 1) / (time of the last token - time
  of the first), from the client.
* ``decode_1_long``: the same after a ~3,000-token prompt (a chronicle of 160 lines, then a request
  for an essay): decode at the context a long agent session reaches.
* ``decode_1_busy``: the same, with a prompt no earlier request had, while a neighbour process burns
  one core (``while 1: pass``) for the four requests.
* ``sessions_8``: 8 sessions with different short prompts start together and stream ``--tokens``
  tokens each; aggregate tok/s = all tokens / (last token - first request sent).
* ``fanout_cold`` / ``fanout_warm``: 8 agents share a ~600-word system prompt (tools and a brief),
  each with its own question, 32 tokens each, all sent together: seconds until the last one
  finishes. Cold: the prompt is new to the server (a per-round nonce) — the eight requests arrive
  together, and opencoti computes their shared prefix once for all of them (its automatic prefix
  cache; llama.cpp computes it per slot); warm: the same team again with new questions. OpenAI chat
  requests, no explicit pool (both servers' automatic prefix caches are on).
* ``fanout_pool_cold`` / ``fanout_pool_warm`` (opencoti only; compared with llama.cpp's fan-out
  without a pool): the system prompt becomes an explicit pool first (its creation counted in the cold
  time), and each agent attaches with ``pool_id``.

Every opencoti measurement records ``draft_n`` / ``draft_n_accepted`` (the server's timings, summed
over the measurement's requests), as do llama.cpp's when it drafts.

Memory, like for like (``--no-memory`` skips it), one server at a time after the rounds: both with
the same KV budget in tokens (``--memory-kv-tokens``, 16,384; fp16 on both: opencoti
``--kv-budget-tokens N --kv-dtype fp16``, llama-server ``-c N`` at its f16 default), RSS (VmRSS,
anonymous / file-backed) when ready and after 8 sessions of new ~1,800-token prompts and ``--tokens``
generated filled the budget; and each with a 512-token KV after one short request ("without KV":
the process, weights and buffers). KV bytes per token: ours from ``/props``, llama.cpp's from the
GGUF header.

Ratios are ours / theirs for tok/s and theirs / ours for seconds and MiB (> 1: we are better).
Results: ``benchmarks/results/<machine-id>/peer_llamacpp.json`` (``--quick``:
``peer_llamacpp_quick.json``); an earlier result of the same name is moved to ``history/`` first, so
every run is kept.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from llama_build import SDIST, SDIST_VERSION, build_info, build_llama_server  # noqa: E402

LLAMA_FLAGS = ["--parallel", "8", "--kv-unified", "-c", "16384"]
SERVERS = {  # name -> (server, extra flags)
    "opencoti": ("opencoti", []),  # its defaults: n-gram speculation on
    "opencoti-off": ("opencoti", ["--speculative", "off"]),
    "llama.cpp": ("llama.cpp", []),  # its defaults: no speculation
    "llama.cpp-ngram": ("llama.cpp", ["--spec-type", "ngram-simple"]),
}
COMPARISONS = {  # name -> (ours, theirs, label)
    "default": ("opencoti", "llama.cpp", "each with its defaults: opencoti's n-gram speculation on, llama.cpp none"),
    "spec_off": ("opencoti-off", "llama.cpp", "speculation off on both (the per-token claim)"),
    "both_ngram": ("opencoti", "llama.cpp-ngram", "n-gram speculation on both (llama.cpp --spec-type ngram-simple)"),
}
WORKLOADS = ("decode_1", "decode_1_long", "decode_1_busy", "sessions_8", "fanout_cold", "fanout_warm",
             "fanout_pool_cold", "fanout_pool_warm")
HIGHER_IS_BETTER = {"decode_1": True, "decode_1_long": True, "decode_1_busy": True, "sessions_8": True,
                    "fanout_cold": False,
                    "fanout_warm": False, "fanout_pool_cold": False, "fanout_pool_warm": False}
PEER_OF = {"fanout_pool_cold": "fanout_cold", "fanout_pool_warm": "fanout_warm"}  # llama.cpp has no pools
REPEATS = {"decode_1": 2}  # requests per server and round (each its own prompt); the others: one
TARGETS = {"sessions_8": 1.5}  # ratio targets (8 sessions: >= 1.5x), judged per comparison and per run
MEMORY_SMALL_KV = 512  # tokens: the "without KV" start

# ============================================================================ servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name: str, cmd: list[str], port: int, env: dict | None = None):
        self.name, self.cmd, self.port = name, cmd, port
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix=f"peer-{name}-", suffix=".log", delete=False)
        self.proc = common.track(subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                                  start_new_session=True))

    def wait_ready(self, timeout: float = 900) -> float:
        import httpx

        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {Path(self.log.name).read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"{self.name} not ready after {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def start(name: str, gguf: str, threads: int, llama_bin: Path | None, extra: list[str] = ()) -> Server:
    """``name`` (opencoti | llama.cpp) on ``gguf`` and a free port; ``extra``: more command-line flags."""
    port = free_port()
    if name == "llama.cpp":
        cmd = [str(llama_bin), "-m", gguf, "-t", str(threads), "-tb", str(threads), "--port", str(port),
               "--host", "127.0.0.1", *LLAMA_FLAGS, *extra]
        env = {**os.environ, "LD_LIBRARY_PATH": str(llama_bin.parent)}
    else:
        # --state-dir none: a fresh server is cold, as llama-server is (the default state directory is
        # per port, and a port used before may hold pools of an earlier run, even of another model:
        # a round of bench_speculative failed to start on one)
        cmd = [sys.executable, "-m", "opencoti", "serve", "--model", gguf, "--port", str(port), "--threads",
               str(threads), "--state-dir", "none", *extra]
        env = dict(os.environ)
    return Server(name, cmd, port, env)


# ============================================================================ workloads
def sse_events(url: str, path: str, body: dict):
    """The JSON events of one streaming request (its SSE ``data:`` lines; ``[DONE]`` left out)."""
    import httpx

    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=900) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{path} -> {r.status_code}: {r.read()[:500]!r}")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def stream(url: str, path: str, body: dict) -> dict:
    """Send one streaming request; times of the first and last content chunk, the token count and the
    server's timings (``draft_n`` / ``draft_n_accepted`` among them)."""
    t_send = time.perf_counter()
    first = last = None
    n_chunks = 0
    final = None
    timings: dict = {}
    for ev in sse_events(url, path, body):
        text = ev.get("content")
        if text is None and ev.get("choices"):
            text = (ev["choices"][0].get("delta") or {}).get("content")
        if text:
            now = time.perf_counter()
            first = first or now
            last = now
            n_chunks += 1
        if ev.get("timings") or ev.get("stop"):
            final = ev
        timings = ev.get("timings") or timings
    tokens = timings.get("predicted_n")
    return {"sent": t_send, "first": first, "last": last, "chunks": n_chunks, "tokens": tokens or n_chunks,
            "final": final, "timings": timings}


def decode_rate(res: dict) -> float:
    return (res["tokens"] - 1) / (res["last"] - res["first"])


def drafts(results: list[dict]) -> dict:
    """``draft_n`` / ``draft_n_accepted`` summed over requests (None when the server reports neither)."""
    t = [r.get("timings") or {} for r in results]
    if not any("draft_n" in x for x in t):
        return {"draft_n": None, "draft_n_accepted": None}
    return {"draft_n": sum(x.get("draft_n") or 0 for x in t),
            "draft_n_accepted": sum(x.get("draft_n_accepted") or 0 for x in t)}


def measured(value: float, results: list[dict]) -> dict:
    return {"value": value, "tokens": sum(r["tokens"] or 0 for r in results), **drafts(results)}


ESSAYS = ["the history of computing", "the history of shipbuilding", "how bridges are designed",
          "the life of honeybees", "the invention of the printing press", "how glass is made"]
BUSY_PROMPT = "Describe, step by step, how a lighthouse keeper prepares the light for a winter storm."


def decode_one(url: str, tokens: int, nonce: str, prompt: str | None = None) -> dict:
    """One session decoding after a short prompt (an essay on ``ESSAYS[0]`` unless ``prompt``)."""
    res = stream(url, "/completion", {"prompt": f"[{nonce}] " + (prompt or f"Write a long essay about {ESSAYS[0]}."),
                                      "n_predict": tokens, "ignore_eos": True, "temperature": 0})
    return measured(decode_rate(res), [res])


def w_decode_1(url: str, tokens: int, nonce: str) -> float:
    """Decode tok/s of one session after a short prompt (``peer_sizes`` uses it too)."""
    return decode_one(url, tokens, nonce)["value"]


LONG_SUBJECTS = ["the harbour", "a glass kiln", "the night train", "an orchard", "the archive", "a salt marsh",
                 "the observatory", "a paper mill", "the ferry", "a bell foundry", "the library", "a vineyard"]
LONG_EVENTS = ["was rebuilt after the flood of", "changed owners in", "first appeared on a map in",
               "doubled its workforce in", "closed for repairs in", "was painted by a travelling artist in",
               "lost its roof in a storm in", "hosted a market fair in"]


def long_context(nonce: str, lines: int = 160) -> str:
    """~3,000 tokens (160 lines; ~19 tokens a line) of a town's chronicle (every line another subject,
    event and year), then a request for an essay: the context a long agent session reaches."""
    rows = [f"{i + 1}. {LONG_SUBJECTS[(7 * i) % len(LONG_SUBJECTS)].capitalize()} "
            f"{LONG_EVENTS[(5 * i + i // 12) % len(LONG_EVENTS)]} {1650 + (37 * i) % 370}."
            for i in range(lines)]
    return f"[{nonce}] A chronicle of our town:\n" + "\n".join(rows) + "\n\nWrite a long essay about the town's history."


def decode_long(url: str, tokens: int, nonce: str) -> dict:
    res = stream(url, "/completion", {"prompt": long_context(nonce), "n_predict": tokens, "ignore_eos": True,
                                      "temperature": 0})
    return measured(decode_rate(res), [res])


def w_decode_1_long(url: str, tokens: int, nonce: str) -> float:
    return decode_long(url, tokens, nonce)["value"]


def burn() -> subprocess.Popen:
    return common.track(subprocess.Popen([sys.executable, "-c", "while 1: pass"]))


def parallel(n: int, fn) -> list:
    out: list = [None] * n
    errs: list = []

    def run(i: int) -> None:
        try:
            out[i] = fn(i)
        except Exception as e:  # noqa: BLE001 - re-raised below
            errs.append(e)

    common.run_threads(n, run)
    if errs:
        raise errs[0]
    return out


TOPICS = ["rivers", "volcanoes", "bridges", "bees", "glass", "maps", "tea", "clocks"]


def sessions(url: str, tokens: int, nonce: str) -> dict:
    res = parallel(8, lambda i: stream(url, "/completion", {
        "prompt": f"[{nonce}] Tell me everything you know about {TOPICS[i]}.", "n_predict": tokens,
        "ignore_eos": True, "temperature": 0}))
    t0 = min(r["sent"] for r in res)
    return measured(sum(r["tokens"] for r in res) / (max(r["last"] for r in res) - t0), res)


def w_sessions_8(url: str, tokens: int, nonce: str) -> float:
    """Aggregate tok/s of 8 sessions started together (``peer_sizes`` uses it too)."""
    return sessions(url, tokens, nonce)["value"]


TOOLS = ["search_web(query)", "read_file(path)", "write_file(path, text)", "run_python(code)", "list_dir(path)",
         "ask_user(question)", "summarize(text)", "send_email(to, subject, body)"]


def system_prompt(nonce: str) -> str:
    """About 600 words: an agent team's shared system prompt (role, rules, tools, brief)."""
    rules = " ".join(f"Rule {i}: keep answers short, cite the files you read, never invent a tool result, "
                     f"and report what you could not finish." for i in range(1, 16))
    tools = " ".join(f"Tool {t}: use it when the task needs it and say why in one line." for t in TOOLS)
    brief = ("The team is preparing a migration plan for a payment service: inventory the endpoints, the "
             "database tables, the background jobs and the alerts, then propose an order of work. ") * 6
    return f"Session {nonce}. You are one member of a team of research agents. {rules} {tools} Brief: {brief}"


QUESTIONS = ["List the endpoints.", "List the tables.", "List the jobs.", "List the alerts.", "Who owns billing?",
             "What fails most?", "What to migrate first?", "What can wait?", "Any risks?", "Any blockers?",
             "Estimate the work.", "Name the tests.", "Which team reviews?", "What is the rollback?",
             "Which metrics?", "What to document?"]


def fanout_run(url: str, nonce: str, questions: list[str], pool_id: int | None, team: str = "a") -> dict:
    sys_msg = {"role": "system", "content": system_prompt(nonce)}

    def agent(i: int):
        body = {"messages": [sys_msg, {"role": "user", "content": questions[i]}], "max_tokens": 32,
                "temperature": 0, "ignore_eos": True}
        if pool_id is not None:  # each team its own sessions (a named session continues its history)
            body.update(pool_id=pool_id, session_id=f"{nonce}-{team}-agent-{i}")
        return stream(url, "/v1/chat/completions", body)

    t0 = time.perf_counter()
    res = parallel(8, agent)
    return measured(time.perf_counter() - t0, res)


def fanout(url: str, nonce: str, questions: list[str], pool_id: int | None, team: str = "a") -> float:
    return fanout_run(url, nonce, questions, pool_id, team)["value"]


def create_pool(url: str, nonce: str) -> int:
    import httpx

    r = httpx.post(url + "/polykv/pools", json={"messages": [{"role": "system", "content": system_prompt(nonce)}]},
                   timeout=600)
    r.raise_for_status()
    return r.json()["pool_id"]


def pool_fanout(url: str, nonce: str) -> dict[str, dict]:
    """The pooled fan-out: the pool's creation counted in the cold time, then a second team (warm)."""
    t0 = time.perf_counter()
    pool = create_pool(url, nonce)
    cold = fanout_run(url, nonce, QUESTIONS[:8], pool)
    cold["value"] = time.perf_counter() - t0
    return {"fanout_pool_cold": cold, "fanout_pool_warm": fanout_run(url, nonce, QUESTIONS[8:], pool, team="b")}


def run_round(urls: dict[str, str], args, rnd: int) -> dict[str, dict[str, list[dict]]]:
    """One round on every server at once: each request to every server in turn, the order rotated per
    request. ``{server: {workload: [measurement per repeat]}}``."""
    names = list(urls)
    out: dict[str, dict[str, list[dict]]] = {n: {} for n in names}
    nonce = f"r{rnd}-{int(time.time() * 1000) % 100000}"
    k = rnd  # the rotation: continues across rounds

    def each(workload: str, fn, servers=None) -> None:
        nonlocal k
        for n in common.rotated(list(servers or names), k):
            out[n].setdefault(workload, []).append(fn(urls[n]))
        k += 1

    for n in names:
        decode_one(urls[n], 8, nonce + "-warmup")  # first request: lazily built buffers, page faults
    for i in range(REPEATS.get("decode_1", 1)):
        each("decode_1", lambda u: decode_one(u, args.tokens, f"{nonce}-{i}",
                                              f"Write a long essay about {ESSAYS[i % len(ESSAYS)]}."))
    each("decode_1_long", lambda u: decode_long(u, args.tokens, nonce))
    neighbour = burn()
    try:
        time.sleep(0.5)
        each("decode_1_busy", lambda u: decode_one(u, args.tokens, nonce + "-busy", BUSY_PROMPT))
    finally:
        neighbour.kill()
        neighbour.wait()
    each("sessions_8", lambda u: sessions(u, args.tokens, nonce))
    each("fanout_cold", lambda u: fanout_run(u, nonce + "-team", QUESTIONS[:8], None))
    each("fanout_warm", lambda u: fanout_run(u, nonce + "-team", QUESTIONS[8:], None))
    ours = [n for n in names if SERVERS[n][0] == "opencoti"]
    for n in common.rotated(ours, k):
        for w, m in pool_fanout(urls[n], nonce + "-pool").items():
            out[n].setdefault(w, []).append(m)
    return out


# ============================================================================ per-pair ratios
def pair_ratios(raw: dict[str, list[dict]], ours: str, theirs: str, w: str) -> list[float]:
    """The ratio of every pair (same round, same repeat: the same request on both servers, seconds
    apart): ours / theirs for rates, theirs / ours for seconds (> 1: opencoti faster)."""
    out = []
    for ro, rt in zip(raw.get(ours, []), raw.get(theirs, [])):
        for a, b in zip(ro.get(w) or [], rt.get(PEER_OF.get(w, w)) or []):
            x, y = a["value"], b["value"]
            if x and y:
                out.append(x / y if HIGHER_IS_BETTER[w] else y / x)
    return out


def summarize(raw: dict[str, list[dict]]) -> tuple[dict, dict, dict]:
    """(medians per server and workload, draft totals per server and workload, comparisons)."""
    med: dict[str, dict] = {}
    drafted: dict[str, dict] = {}
    for n, rounds in raw.items():
        for w in WORKLOADS:
            vals = [m for r in rounds for m in r.get(w) or []]
            if not vals:
                continue
            med.setdefault(n, {})[w] = statistics.median(m["value"] for m in vals)
            if any(m.get("draft_n") is not None for m in vals):
                drafted.setdefault(n, {})[w] = {"draft_n": sum(m["draft_n"] or 0 for m in vals),
                                                "draft_n_accepted": sum(m["draft_n_accepted"] or 0 for m in vals)}
    comps: dict[str, dict] = {}
    for c, (ours, theirs, label) in COMPARISONS.items():
        if ours not in raw or theirs not in raw:
            continue
        rows = {}
        for w in WORKLOADS:
            rs = pair_ratios(raw, ours, theirs, w)
            if not rs:
                continue
            row = {"ratio_median": statistics.median(rs), "ratio_min": min(rs), "ratio_max": max(rs),
                   "ratios": rs, "pairs": len(rs), "ours_median": med.get(ours, {}).get(w),
                   "theirs_median": med.get(theirs, {}).get(PEER_OF.get(w, w))}
            if w in TARGETS:
                row["target"] = TARGETS[w]
                row["target_met"] = row["ratio_median"] >= TARGETS[w]
            rows[w] = row
        comps[c] = {"ours": ours, "theirs": theirs, "label": label, "workloads": rows}
    return med, drafted, comps


# ============================================================================ memory, like for like
def memory_fill(url: str, tokens: int, lines: int, nonce: str) -> dict:
    """8 sessions of new ~19-token-a-line chronicles of ``lines`` lines, ``tokens`` generated each, all at
    once: the tokens they hold (prompt + generated)."""
    res = parallel(8, lambda i: stream(url, "/completion", {
        "prompt": long_context(f"{nonce}-{i}", lines), "n_predict": tokens, "ignore_eos": True, "temperature": 0}))
    held = sum((r["timings"].get("prompt_n") or 0) + (r["timings"].get("cache_n") or 0) + (r["tokens"] or 0)
               for r in res)
    return {"tokens_held": held, "sessions": 8}


def memory_side(name: str, gguf: str, threads: int, llama_bin: Path | None, kv_tokens: int, gen: int,
                weights: str | None, stack: list) -> dict:
    """RSS of one server with a ``kv_tokens`` budget: ready, then after the fill workload; and with a
    512-token KV after one short request."""
    import httpx
    from bench_memory import llama_kv_bytes_per_token, memory

    kind = SERVERS[name][0]
    lines = max(8, int((kv_tokens / 8 - gen - 40) / 19))  # 8 sessions of (prompt + gen) just under the budget

    def flags(tokens: int) -> list[str]:
        if kind == "llama.cpp":
            return ["-c", str(tokens)]  # after LLAMA_FLAGS' -c: the last one counts
        return ["--kv-budget-tokens", str(tokens), "--kv-dtype", "fp16", "--speculative", "off",
                *(["--weights", weights] if weights else [])]

    out: dict = {"kv_budget_tokens": kv_tokens, "flags": flags(kv_tokens)}
    for label, tokens in (("small_kv", MEMORY_SMALL_KV), ("full_kv", kv_tokens)):
        srv = start(kind, gguf, threads, llama_bin, flags(tokens))
        stack.append(srv)
        try:
            srv.wait_ready()
            time.sleep(2)
            ready = memory(srv.proc.pid)
            if label == "small_kv":
                decode_one(srv.url, 16, "mem-small")
                time.sleep(2)
                out["small_kv"] = {"kv_budget_tokens": tokens, "ready": ready, "after_request": memory(srv.proc.pid)}
            else:
                t0 = time.perf_counter()
                fill = memory_fill(srv.url, gen, lines, "mem-full")
                fill["seconds"] = round(time.perf_counter() - t0, 1)
                time.sleep(2)
                out["full_kv"] = {"kv_budget_tokens": tokens, "ready": ready, "after_fill": memory(srv.proc.pid),
                                  **fill}
            if kind == "opencoti":
                poly = (httpx.get(srv.url + "/props", timeout=30).json().get("opencoti") or {}).get("polykv") or {}
                out.update(kv_bytes_per_token=poly.get("kv_bytes_per_token"), kv_dtype=poly.get("kv_dtype"))
            else:
                out.update(llama_kv_bytes_per_token(gguf))
                m = re.search(r"KV buffer size\s*=\s*([0-9.]+) MiB", Path(srv.log.name).read_text(errors="replace"))
                out[label]["kv_buffer_mib_logged"] = float(m.group(1)) if m else None
        finally:
            srv.stop()
            stack.remove(srv)
        common.log(f"memory {name} {label}: " + json.dumps({k: v.get("rss_mib") for k, v in out[label].items()
                                                             if isinstance(v, dict)}))
    kv_mib = kv_tokens * (out.get("kv_bytes_per_token") or 0) / 2**20
    out["kv_budget_mib"] = round(kv_mib, 1)
    full, small = out["full_kv"]["after_fill"]["rss_mib"], out["small_kv"]["after_request"]["rss_mib"]
    out["rss_full_mib"], out["rss_without_kv_mib"] = full, small
    out["rss_beyond_kv_mib"] = round(full - kv_mib, 1)  # everything but the KV the budget holds
    return out


def memory_compare(gguf: str, threads: int, llama_bin: Path, kv_tokens: int, gen: int, weights: str | None,
                   stack: list) -> dict:
    sides = {n: memory_side(n, gguf, threads, llama_bin, kv_tokens, gen, weights, stack)
             for n in ("opencoti-off", "llama.cpp")}
    o, t = sides["opencoti-off"], sides["llama.cpp"]
    return {"kv_tokens": kv_tokens, "generated_per_session": gen, "sides": sides,
            "ratio_full": t["rss_full_mib"] / o["rss_full_mib"],  # theirs / ours: > 1, we hold less
            "ratio_without_kv": t["rss_without_kv_mib"] / o["rss_without_kv_mib"],
            "extra_full_mib": round(o["rss_full_mib"] - t["rss_full_mib"], 1),
            "extra_without_kv_mib": round(o["rss_without_kv_mib"] - t["rss_without_kv_mib"], 1)}


# ============================================================================ the run
def props(url: str) -> dict:
    import httpx

    try:
        p = httpx.get(url + "/props", timeout=10).json()
    except Exception:  # noqa: BLE001 - informational
        return {}
    w = (p.get("opencoti") or {}).get("weights") or {}
    return {"weights": w.get("format"), "weights_reason": (w.get("choice") or {}).get("reason"),
            "build_info": p.get("build_info")}


def _stop_all(stack: list) -> None:
    for srv in list(stack):
        try:
            srv.stop()
        except Exception:  # noqa: BLE001 - stop the others too
            pass


def main() -> int:
    p = common.base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds (each: four fresh servers, every workload; decode_1 twice per round)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per decode request")
    p.add_argument("--llama-server", default=None, help="a llama-server binary (default: build and cache one)")
    p.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2-135M Q4_1)")
    p.add_argument("--only", default=None, choices=["opencoti", "llama.cpp"], help="one server kind only")
    p.add_argument("--no-memory", action="store_true", help="skip the like-for-like memory comparison")
    p.add_argument("--memory-kv-tokens", type=int, default=16384, help="the KV budget of both, in tokens")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.tokens, args.memory_kv_tokens = 1, 64, 4096
    from opencoti.engine.model.loader import bundled_gguf_path
    from opencoti.engine.model.threads import usable_cpus

    # (SIGTERM - timeout, kill - ends the run through its finally blocks and common.stop_children)
    gguf = args.model or str(bundled_gguf_path())
    threads = args.threads or usable_cpus()
    names = [n for n, (kind, _) in SERVERS.items() if args.only in (None, kind)]
    llama_bin = None
    if any(SERVERS[n][0] == "llama.cpp" for n in names):
        llama_bin = Path(args.llama_server) if args.llama_server else build_llama_server()
    before = common.load_snapshot()
    raw: dict[str, list[dict]] = {n: [] for n in names}
    info: dict[str, dict] = {}
    weights: list[str] = []
    loads: list = []
    stack: list[Server] = []
    memory = None
    try:
        for rnd in range(args.rounds):
            servers: dict[str, Server] = {}
            for name in common.rotated(names, rnd):  # every server of the round up at once, fresh
                kind, extra = SERVERS[name]
                if kind == "opencoti" and weights:
                    extra = extra + ["--weights", weights[0]]
                srv = servers[name] = start(kind, gguf, threads, llama_bin, extra)
                stack.append(srv)
                ready = srv.wait_ready()
                if kind == "opencoti" and not weights:
                    weights.append(props(srv.url).get("weights") or "auto")
                info.setdefault(name, {**props(srv.url), "flags": extra})
                servers[name].ready_s = ready  # type: ignore[attr-defined]
                common.log(f"round {rnd + 1}: {name} ready in {ready:.1f} s")
            load0 = os.getloadavg()[0]
            res = run_round({n: servers[n].url for n in names}, args, rnd)
            loads.append([load0, os.getloadavg()[0]])
            for name in names:
                res[name]["ready_s"] = servers[name].ready_s  # type: ignore[attr-defined]
                raw[name].append(res[name])
                common.log(f"round {rnd + 1}: {name}: " + ", ".join(
                    f"{w}={statistics.median(m['value'] for m in v):.2f}" for w, v in res[name].items()
                    if isinstance(v, list)))
            _stop_all(stack)
            stack.clear()
        if not args.no_memory and args.only is None:
            try:
                memory = memory_compare(gguf, threads, llama_bin, args.memory_kv_tokens, args.tokens,
                                        weights[0] if weights else None, stack)
            except Exception as e:  # noqa: BLE001 - the rounds' results are still written; the error with them
                common.log(f"memory comparison failed: {e!r}")
                memory = {"error": repr(e)}
    finally:
        _stop_all(stack)
    med, drafted, comps = summarize(raw)
    for c, comp in comps.items():
        rows = []
        for w, r in comp["workloads"].items():
            rows.append([w, r["ours_median"], r["theirs_median"], r["ratio_median"],
                         f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}", r["pairs"],
                         "win" if r["ratio_median"] >= 1 else "LOSE"])
        common.print_table(["workload", comp["ours"], comp["theirs"], "median pair ratio", "min-max", "pairs", ""],
                           rows, title=f"{c}: {comp['label']}")
    if memory:
        print(json.dumps({k: v for k, v in memory.items() if k != "sides"}, indent=1))
    if any(not comp["workloads"] for comp in comps.values()) or not comps:
        common.log("no comparison measured")
    machine = common.machine_info()
    print(common.describe_machine(machine))
    out = args.out or (str(common.results_dir() / "peer_llamacpp_quick.json") if args.quick else None)
    path = common.write_json("peer_llamacpp", {
        "config": {"rounds": args.rounds, "tokens": args.tokens, "threads": threads, "gguf": Path(gguf).name,
                   "llama_server_flags": LLAMA_FLAGS, "llama_cpp_source": f"{SDIST}=={SDIST_VERSION} (vendored)",
                   "llama_build": build_info(llama_bin),
                   "servers": {n: SERVERS[n] for n in names}, "opencoti_weights": weights, "repeats": REPEATS,
                   "interleaved": True, "targets": TARGETS, "memory_kv_tokens": args.memory_kv_tokens,
                   "quick": args.quick, "command": sys.argv[1:]},
        "servers": info, "raw": raw, "median": med, "drafts": drafted, "comparisons": comps, "memory": memory,
        "round_loads": loads, "machine": machine, "load_before": before}, out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
