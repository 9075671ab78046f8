"""opencoti serve vs llama.cpp's llama-server, side by side in one run, same GGUF, same threads.

``llama-server`` is built once from the ``llama-cpp-python`` sdist on the package registry (its
vendored llama.cpp: CMake Release, native CPU, no curl, no prebuilt web UI, only the
``llama-server`` and ``llama-quantize`` targets; ~20 min on 2 cores the first time) and cached under
``<opencoti cache>/peer/llama-cpp-python-<version>/``. ``--llama-server PATH`` uses another binary.

Both servers load the bundled SmolLM2-135M-Instruct Q4_1 GGUF with ``--threads`` threads (default:
the usable cores; opencoti's ``auto`` re-quantizes its weights to the format it measures fastest,
recorded as ``servers.opencoti.weights``); llama-server with ``--parallel 8 --kv-unified -c 16384`` (8 slots sharing one
KV buffer, as an agent team needs), opencoti with its defaults (no flags but the model, port and
threads: what a user gets; and ``--state-dir none``: nothing restored from an earlier run). Each
round starts each server fresh (cold caches), the two in alternating order, and runs the workloads
below on it; ``--rounds`` (3) rounds, medians reported.

Workloads (client side, over HTTP, identical requests to both servers):

* ``decode_1``: one session streams ``--tokens`` tokens (``ignore_eos``) after a short prompt;
  decode tok/s = (tokens - 1) / (time of the last token - time of the first), from the client.
* ``decode_1_long``: the same after a ~3,000-token prompt (a chronicle of 160 lines, then a request
  for an essay): decode at the context a long agent session reaches.
* ``decode_1_busy``: the same while a neighbour process burns one core (``while 1: pass``).
* ``sessions_8``: 8 sessions with different short prompts start together and stream ``--tokens``
  tokens each; aggregate tok/s = all tokens / (last token - first request sent).
* ``fanout_cold`` / ``fanout_warm``: 8 agents share a ~600-word system prompt (tools and a brief),
  each with its own question, 32 tokens each, all sent together: seconds until the last one
  finishes. Cold: the prompt is new to the server (a per-round nonce); warm: the same team again
  with new questions. OpenAI chat requests, no pool.
* ``fanout_pool_cold`` / ``fanout_pool_warm`` (opencoti only; compared with llama.cpp's plain
  fan-out): the system prompt becomes a pool first (its creation counted in the cold time), and
  each agent attaches with ``pool_id``.

Ratios are ours / theirs for tok/s and theirs / ours for seconds (> 1: we are faster).
Results: ``benchmarks/results/<machine-id>/peer_llamacpp.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

SDIST = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
LLAMA_FLAGS = ["--parallel", "8", "--kv-unified", "-c", "16384"]
WORKLOADS = ("decode_1", "decode_1_long", "decode_1_busy", "sessions_8", "fanout_cold", "fanout_warm",
             "fanout_pool_cold", "fanout_pool_warm")
HIGHER_IS_BETTER = {"decode_1": True, "decode_1_long": True, "decode_1_busy": True, "sessions_8": True,
                    "fanout_cold": False,
                    "fanout_warm": False, "fanout_pool_cold": False, "fanout_pool_warm": False}
PEER_OF = {"fanout_pool_cold": "fanout_cold", "fanout_pool_warm": "fanout_warm"}  # llama.cpp has no pools


# ============================================================================ building llama-server
def peer_dir() -> Path:
    from opencoti.engine.model.loader import cache_root

    return cache_root() / "peer" / f"{SDIST.replace('-', '_')}-{SDIST_VERSION}"


def build_llama_server() -> Path:
    """The cached llama-server binary, built from the registry's sdist the first time."""
    out = peer_dir() / "bin" / "llama-server"
    if out.exists() and (out.parent / "llama-quantize").exists():
        return out
    legacy = peer_dir().parent / f"{SDIST}-{SDIST_VERSION}" / "build" / "bin"
    if (legacy / "llama-server").exists():  # a build made by hand with the same commands
        return _install(legacy, out)
    if not shutil.which("cmake"):
        raise SystemExit("building llama-server needs cmake (apt-get install cmake)")
    work = Path(tempfile.mkdtemp(prefix="llama-build-"))
    common.log(f"downloading the {SDIST}=={SDIST_VERSION} sdist (llama.cpp's sources) ...")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    f"{SDIST}=={SDIST_VERSION}", "-d", str(work)], check=True)
    archive = next(work.glob("*.tar.gz"))
    with tarfile.open(archive) as tf:
        tf.extractall(work, filter="data")
    src = next(work.glob("llama_cpp_python-*")) / "vendor" / "llama.cpp"
    build = work / "build"
    common.log("building llama-server (CMake Release, native; ~20 min on 2 cores) ...")
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                    "-DLLAMA_CURL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON"], check=True)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "llama-quantize", "-j",
                    str(os.cpu_count() or 2)], check=True)
    _install(build / "bin", out)
    shutil.rmtree(work, ignore_errors=True)
    return out


def _install(bin_dir: Path, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    for lib in bin_dir.glob("*.so*"):  # shared ggml/llama libraries, when built shared
        shutil.copy2(lib, out.parent / lib.name)
    for tool in ("llama-server", "llama-quantize"):  # llama-quantize makes k-quant test models (scripts/)
        if (bin_dir / tool).exists():
            shutil.copy2(bin_dir / tool, out.parent / tool)
    return out


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
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

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

    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{path} -> {r.status_code}: {r.read()[:500]!r}")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def stream(url: str, path: str, body: dict) -> dict:
    """Send one streaming request; times of the first and last content chunk and the token count."""
    t_send = time.perf_counter()
    first = last = None
    n_chunks = 0
    final = None
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
    tokens = None
    if final and final.get("timings"):
        tokens = final["timings"].get("predicted_n")
    return {"sent": t_send, "first": first, "last": last, "chunks": n_chunks, "tokens": tokens or n_chunks,
            "final": final}


def decode_rate(res: dict) -> float:
    return (res["tokens"] - 1) / (res["last"] - res["first"])


def w_decode_1(url: str, tokens: int, nonce: str) -> float:
    res = stream(url, "/completion", {"prompt": f"[{nonce}] Write a long essay about the history of computing.",
                                      "n_predict": tokens, "ignore_eos": True, "temperature": 0})
    return decode_rate(res)


LONG_SUBJECTS = ["the harbour", "a glass kiln", "the night train", "an orchard", "the archive", "a salt marsh",
                 "the observatory", "a paper mill", "the ferry", "a bell foundry", "the library", "a vineyard"]
LONG_EVENTS = ["was rebuilt after the flood of", "changed owners in", "first appeared on a map in",
               "doubled its workforce in", "closed for repairs in", "was painted by a travelling artist in",
               "lost its roof in a storm in", "hosted a market fair in"]


def long_context(nonce: str) -> str:
    """~3,000 tokens of a town's chronicle (every line another subject, event and year), then a request
    for an essay: the context a long agent session reaches."""
    lines = [f"{i + 1}. {LONG_SUBJECTS[(7 * i) % len(LONG_SUBJECTS)].capitalize()} "
             f"{LONG_EVENTS[(5 * i + i // 12) % len(LONG_EVENTS)]} {1650 + (37 * i) % 370}."
             for i in range(160)]
    return f"[{nonce}] A chronicle of our town:\n" + "\n".join(lines) + "\n\nWrite a long essay about the town's history."


def w_decode_1_long(url: str, tokens: int, nonce: str) -> float:
    res = stream(url, "/completion", {"prompt": long_context(nonce), "n_predict": tokens, "ignore_eos": True,
                                      "temperature": 0})
    return decode_rate(res)


def burn() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while 1: pass"])


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


def w_sessions_8(url: str, tokens: int, nonce: str) -> float:
    topics = ["rivers", "volcanoes", "bridges", "bees", "glass", "maps", "tea", "clocks"]
    res = parallel(8, lambda i: stream(url, "/completion", {
        "prompt": f"[{nonce}] Tell me everything you know about {topics[i]}.", "n_predict": tokens,
        "ignore_eos": True, "temperature": 0}))
    t0 = min(r["sent"] for r in res)
    return sum(r["tokens"] for r in res) / (max(r["last"] for r in res) - t0)


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


def fanout(url: str, nonce: str, questions: list[str], pool_id: int | None, team: str = "a") -> float:
    sys_msg = {"role": "system", "content": system_prompt(nonce)}

    def agent(i: int):
        body = {"messages": [sys_msg, {"role": "user", "content": questions[i]}], "max_tokens": 32,
                "temperature": 0, "ignore_eos": True}
        if pool_id is not None:  # each team its own sessions (a named session continues its history)
            body.update(pool_id=pool_id, session_id=f"{nonce}-{team}-agent-{i}")
        return stream(url, "/v1/chat/completions", body)

    t0 = time.perf_counter()
    parallel(8, agent)
    return time.perf_counter() - t0


def create_pool(url: str, nonce: str) -> int:
    import httpx

    r = httpx.post(url + "/polykv/pools", json={"messages": [{"role": "system", "content": system_prompt(nonce)}]},
                   timeout=600)
    r.raise_for_status()
    return r.json()["pool_id"]


def run_round(srv: Server, name: str, args, rnd: int) -> dict:
    url, out = srv.url, {}
    nonce = f"r{rnd}-{int(time.time() * 1000) % 100000}"
    w_decode_1(url, 8, nonce + "-warmup")  # first request: lazily built buffers, page faults
    out["decode_1"] = w_decode_1(url, args.tokens, nonce)
    out["decode_1_long"] = w_decode_1_long(url, args.tokens, nonce)
    neighbour = burn()
    try:
        time.sleep(0.5)
        out["decode_1_busy"] = w_decode_1(url, args.tokens, nonce + "-busy")
    finally:
        neighbour.kill()
        neighbour.wait()
    out["sessions_8"] = w_sessions_8(url, args.tokens, nonce)
    out["fanout_cold"] = fanout(url, nonce + "-team", QUESTIONS[:8], None)
    out["fanout_warm"] = fanout(url, nonce + "-team", QUESTIONS[8:], None)
    if name == "opencoti":
        t0 = time.perf_counter()
        pool = create_pool(url, nonce + "-pool")
        cold = fanout(url, nonce + "-pool", QUESTIONS[:8], pool)
        out["fanout_pool_cold"] = time.perf_counter() - t0 if cold else None
        out["fanout_pool_warm"] = fanout(url, nonce + "-pool", QUESTIONS[8:], pool, team="b")
    return out


def props(url: str) -> dict:
    import httpx

    try:
        p = httpx.get(url + "/props", timeout=10).json()
    except Exception:  # noqa: BLE001 - informational
        return {}
    w = (p.get("opencoti") or {}).get("weights") or {}
    return {"weights": w.get("format"), "weights_reason": (w.get("choice") or {}).get("reason"),
            "build_info": p.get("build_info")}


def main() -> int:
    p = common.base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128, help="tokens per decode request")
    p.add_argument("--llama-server", default=None, help="a llama-server binary (default: build and cache one)")
    p.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2-135M Q4_1)")
    p.add_argument("--only", default=None, choices=["opencoti", "llama.cpp"], help="one server only")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.tokens = 1, 64
    from opencoti.engine.model.loader import bundled_gguf_path
    from opencoti.engine.model.threads import usable_cpus

    gguf = args.model or str(bundled_gguf_path())
    threads = args.threads or usable_cpus()
    llama_bin = Path(args.llama_server) if args.llama_server else build_llama_server()
    names = ["opencoti", "llama.cpp"] if args.only is None else [args.only]
    before = common.load_snapshot()
    raw: dict[str, list[dict]] = {n: [] for n in names}
    info: dict[str, dict] = {}
    for rnd in range(args.rounds):
        order = names if rnd % 2 == 0 else names[::-1]
        for name in order:
            srv = start(name, gguf, threads, llama_bin)
            try:
                ready = srv.wait_ready()
                common.log(f"round {rnd + 1}: {name} ready in {ready:.1f} s")
                res = run_round(srv, name, args, rnd)
                res["ready_s"] = ready
                raw[name].append(res)
                info.setdefault(name, props(srv.url))
                common.log(f"round {rnd + 1}: {name}: " + ", ".join(f"{k}={v:.2f}" for k, v in res.items() if v))
            finally:
                srv.stop()
    med = {n: {w: statistics.median([r[w] for r in raw[n] if r.get(w) is not None])
               for w in WORKLOADS if any(r.get(w) is not None for r in raw[n])} for n in names}
    rows, ratios = [], {}
    for w in WORKLOADS:
        ours = med.get("opencoti", {}).get(w)
        theirs = med.get("llama.cpp", {}).get(PEER_OF.get(w, w))
        r = None
        if ours and theirs:
            r = ours / theirs if HIGHER_IS_BETTER[w] else theirs / ours
        ratios[w] = r
        unit = "tok/s" if HIGHER_IS_BETTER[w] else "s"
        rows.append([w, unit, ours, theirs, r, "-" if r is None else ("win" if r >= 1 else "LOSE")])
    common.print_table(["workload", "unit", "opencoti", "llama.cpp", "ratio (x, >1 = opencoti faster)", ""],
                       rows, title=f"opencoti vs llama.cpp, {args.rounds} round(s), {threads} threads, medians")
    machine = common.machine_info()
    print(common.describe_machine(machine))
    path = common.write_json("peer_llamacpp", {
        "config": {"rounds": args.rounds, "tokens": args.tokens, "threads": threads, "gguf": Path(gguf).name,
                   "llama_server_flags": LLAMA_FLAGS, "llama_cpp_source": f"{SDIST}=={SDIST_VERSION} (vendored)",
                   "quick": args.quick},
        "servers": info, "raw": raw, "median": med, "ratio": ratios, "machine": machine,
        "load_before": before}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
