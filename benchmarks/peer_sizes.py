"""The model sizes users run: opencoti serve vs llama.cpp's llama-server on the same GGUF file, threads
and KV size, speculation off on both sides.

For each ``--model`` file (default: the bundled SmolLM2-135M Q4_1; ``--preset 1b|3b|8b``: a file of
that model's shapes in the Q4_K_M mix, written once by ``scripts/make_gguf.py``), each round starts each server fresh, the two
in alternating order (``--rounds``, default 2), and measures from outside:

* ``ready_first_s`` (round 1 only, opencoti with an empty cache directory of its own: it reads the
  file's config and tokenizer once and times its kernels for the model's shapes; llama.cpp keeps no
  cache, so its first start is any start) and ``ready_s`` (later rounds: the same cache directory,
  now holding what the first start wrote): seconds from the process start to ``/health`` 200. The
  GGUF file is in the OS page cache for both (it was just written or read).
* ``rss_ready_mib`` / ``rss_peak_ready_mib``: the server's resident set (VmRSS) and its peak (VmHWM)
  when it is ready; ``rss_after_mib`` / ``rss_peak_mib`` after the workloads.
* ``decode_1``: one session streams ``--tokens`` tokens (``ignore_eos``) after a short prompt: decode
  tok/s from the client ((tokens - 1) / (last token - first token)).
* ``sessions_8``: 8 sessions with different short prompts at once, ``--tokens`` each: aggregate tok/s.
* ``prefill_1000``: a new prompt of about 1,000 tokens, one token generated: prompt tokens (as the
  server counts them) / seconds to the first token.

Both servers: ``--threads`` threads (default: the usable cores), a KV cache of 16,384 tokens in fp16
(llama-server ``-c 16384 --parallel 8 --kv-unified``; opencoti ``--kv-budget-tokens 16384
--kv-dtype fp16``), no speculative decoding (opencoti ``--speculative off``; llama-server has none
without a draft model or ``--spec-type``), opencoti ``--state-dir none`` (nothing restored). opencoti
chooses its weight format itself (``auto``; recorded). Ratios: ours / theirs for tok/s, theirs / ours
for seconds and MiB (> 1: opencoti better). Results:
``benchmarks/results/<machine-id>/peer_sizes_<model stem>.json``.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import peer_llamacpp as peer  # noqa: E402

KV_TOKENS = 16384
LLAMA_FLAGS = ["--parallel", "8", "--kv-unified", "-c", str(KV_TOKENS)]
OPENCOTI_FLAGS = ["--kv-budget-tokens", str(KV_TOKENS), "--kv-dtype", "fp16", "--speculative", "off"]
WORKLOADS = ("decode_1", "sessions_8", "prefill_1000", "ready_s", "ready_first_s", "rss_ready_mib",
             "rss_peak_ready_mib", "rss_after_mib", "rss_peak_mib")
HIGHER_IS_BETTER = {"decode_1": True, "sessions_8": True, "prefill_1000": True}


def status_mib(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM of ``pid`` in MiB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) / 1024
    return out


def server_pid(srv: peer.Server) -> int:
    """The serving process (``opencoti serve`` runs in the process started; so does llama-server)."""
    return srv.proc.pid


def w_prefill(url: str, nonce: str) -> float:
    """Prompt tokens per second of a new ~1,000-token prompt (one token generated)."""
    text = " ".join(f"Note {i}: the {w} in section {i % 17} was checked on day {i * 7 % 31}."
                    for i, w in zip(range(70), ["valve", "pump", "sensor", "relay", "cable"] * 14))
    res = peer.stream(url, "/completion", {"prompt": f"[{nonce}] {text}\nSummarize the notes.", "n_predict": 1,
                                            "temperature": 0, "cache_prompt": False})
    final = res.get("final") or {}
    n = (final.get("timings") or {}).get("prompt_n")
    return (n or 0) / ((res["first"] or time.perf_counter()) - res["sent"])


def run_round(srv: peer.Server, args, rnd: int) -> dict:
    url, out = srv.url, {}
    nonce = f"r{rnd}-{int(time.time() * 1000) % 100000}"
    peer.w_decode_1(url, 4, nonce + "-warmup")  # first request: lazily built buffers, page faults
    out["decode_1"] = peer.w_decode_1(url, args.tokens, nonce)
    out["sessions_8"] = peer.w_sessions_8(url, args.tokens, nonce)
    out["prefill_1000"] = w_prefill(url, nonce)
    return out


def main() -> int:
    p = common.base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64, help="tokens per decode request")
    p.add_argument("--llama-server", default=None, help="a llama-server binary (default: build and cache one)")
    p.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2-135M Q4_1)")
    p.add_argument("--preset", default=None, choices=["1b", "3b", "8b"],
                   help="a generated Q4_K_M file of that model's shapes (scripts/make_gguf.py; written once into "
                        "<cache>/bench-models/llama<preset>-q4km.gguf), instead of --model")
    p.add_argument("--table-only", action="store_true", help="only rebuild peer_sizes.json from the per-file results")
    args = p.parse_args()
    if args.table_only:
        print(f"wrote {size_table()}")
        return 0
    if args.quick:
        args.rounds, args.tokens = 1, 16
    from opencoti.engine.model.loader import bundled_gguf_path
    from opencoti.engine.model.threads import usable_cpus

    if args.preset and args.model:
        p.error("give --model or --preset, not both")
    if args.model or args.preset:
        targets = [args.model or str(generated(args.preset))]
    else:  # the size table: the bundled file, then 1B and 8B shapes (a --quick run: the bundled file only)
        targets = [str(bundled_gguf_path())] + ([] if args.quick else [str(generated(x)) for x in ("1b", "8b")])
    if args.out and len(targets) > 1:
        p.error("--out takes one model's result")
    threads = args.threads or usable_cpus()
    llama_bin = Path(args.llama_server) if args.llama_server else peer.build_llama_server()
    for gguf in targets:
        measure(gguf, args, threads, llama_bin)
    if args.out is None:
        print(f"wrote {size_table()}")
    return 0


def measure(gguf: str, args, threads: int, llama_bin: Path) -> Path:
    """Both servers on ``gguf``, ``args.rounds`` rounds; writes ``peer_sizes_<stem>.json`` (or ``args.out``)."""
    names = ["opencoti", "llama.cpp"]
    before = common.load_snapshot()
    raw: dict[str, list[dict]] = {n: [] for n in names}
    info: dict[str, dict] = {}
    peer.LLAMA_FLAGS[:] = LLAMA_FLAGS
    # a first start of a new model: an empty cache but for the native kernels' build (made once per
    # machine at set-up, not per model)
    from opencoti.engine.paths import cache_root

    first_cache = tempfile.mkdtemp(prefix="opencoti-first-start-")
    if (cache_root() / "native").is_dir():
        (Path(first_cache) / "native").symlink_to(cache_root() / "native")
    for rnd in range(args.rounds):
        for name in (names if rnd % 2 == 0 else names[::-1]):
            first = rnd == 0 and name == "opencoti"
            srv = _start(name, gguf, threads, llama_bin, first_cache)
            try:
                ready = srv.wait_ready(timeout=1800)
                mem = status_mib(server_pid(srv))
                common.log(f"round {rnd + 1}: {name} ready in {ready:.1f} s, RSS {mem['VmRSS']:.0f} MiB "
                           f"(peak {mem['VmHWM']:.0f})")
                res = run_round(srv, args, rnd)
                after = status_mib(server_pid(srv))
                res.update({"ready_first_s" if first else "ready_s": ready,
                            "rss_ready_mib": mem["VmRSS"], "rss_peak_ready_mib": mem["VmHWM"],
                            "rss_after_mib": after["VmRSS"], "rss_peak_mib": after["VmHWM"]})

                raw[name].append(res)
                info.setdefault(name, peer.props(srv.url))
                common.log(f"round {rnd + 1}: {name}: " + ", ".join(f"{k}={v:.2f}" for k, v in res.items() if v))
            finally:
                srv.stop()
    for r in raw["llama.cpp"]:  # llama.cpp keeps no cache: every start is a first start
        r["ready_first_s"] = r["ready_s"]
    med = {n: {w: statistics.median([r[w] for r in raw[n] if r.get(w) is not None])
               for w in WORKLOADS if any(r.get(w) is not None for r in raw[n])} for n in names}
    rows, ratios = [], {}
    for w in WORKLOADS:
        ours, theirs = med["opencoti"].get(w), med["llama.cpp"].get(w)
        r = None
        if ours and theirs:
            r = ours / theirs if HIGHER_IS_BETTER.get(w) else theirs / ours
        ratios[w] = r
        unit = "tok/s" if w in HIGHER_IS_BETTER else ("s" if w.endswith("_s") else "MiB")
        rows.append([w, unit, ours, theirs, r, "-" if r is None else ("win" if r >= 1 else "LOSE")])
    size_mib = Path(gguf).stat().st_size / 2**20
    common.print_table(["measure", "unit", "opencoti", "llama.cpp", "ratio (x, >1 = opencoti better)", ""], rows,
                       title=f"{Path(gguf).name} ({size_mib:.0f} MiB), {args.rounds} round(s), {threads} threads, "
                             "medians, speculation off on both")
    machine = common.machine_info()
    print(common.describe_machine(machine))
    payload = {
        "config": {"rounds": args.rounds, "tokens": args.tokens, "threads": threads, "gguf": Path(gguf).name,
                   "gguf_mib": round(size_mib, 1), "llama_server_flags": LLAMA_FLAGS,
                   "opencoti_flags": OPENCOTI_FLAGS,
                   "llama_cpp_source": f"{peer.SDIST}=={peer.SDIST_VERSION} (vendored)", "quick": args.quick,
                   "llama_build": peer.build_info(llama_bin)},
        "servers": info, "raw": raw, "median": med, "ratio": ratios, "machine": machine,
        "load_before": before}
    row, notes = table_row({**payload, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    payload["report"] = {"headers": HEADERS, "rows": [row], "notes": notes}  # this file's row alone (a --quick run)
    path = common.write_json(f"peer_sizes_{Path(gguf).stem}", payload, args.out)
    print(f"wrote {path}")
    return path


def generated(preset: str) -> Path:
    """The Q4_K_M file of ``preset``'s shapes, written by ``scripts/make_gguf.py`` once (the same arguments
    give the same bytes) into the cache directory."""
    import subprocess

    from opencoti.engine.paths import cache_root

    path = cache_root() / "bench-models" / f"llama{preset}-q4km.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        common.log(f"writing {path} (scripts/make_gguf.py --preset {preset} --mix Q4_K_M)")
        tmp = path.with_suffix(".partial")
        subprocess.run([sys.executable, str(common.REPO_ROOT / "scripts" / "make_gguf.py"), "--preset", preset,
                        "--mix", "Q4_K_M", "-o", str(tmp)], check=True, stdout=subprocess.DEVNULL)
        tmp.rename(path)
    return path


HEADERS = ["GGUF file", "MiB", "opencoti weights", "decode 1 tok/s (ours / llama.cpp)", "8 sessions tok/s",
           "prefill 1,000 tok/s", "RSS after work MiB", "peak RSS MiB", "ready, first start s", "ready, later s",
           "rounds"]


def table_row(d: dict) -> tuple[list, list[str]]:
    """One model file's row of the size table (from its ``peer_sizes_<stem>.json`` payload ``d``) and its notes."""
    r, m = d["ratio"], d["median"]
    o, ll = m["opencoti"], m["llama.cpp"]
    weights = (d.get("servers", {}).get("opencoti") or {}).get("weights")

    def cell(w: str, digits: int = 2) -> str:
        if o.get(w) is None or ll.get(w) is None:
            return "-"
        x = r.get(w)
        return f"{o[w]:.{digits}f} / {ll[w]:.{digits}f} = {x:.2f}x" + ("" if x is None or x >= 1 else " LOSE")

    row = [d["config"]["gguf"], f"{d['config']['gguf_mib']:.0f}", weights or "?", cell("decode_1"),
           cell("sessions_8"), cell("prefill_1000", 1), cell("rss_after_mib", 0), cell("rss_peak_mib", 0),
           cell("ready_first_s", 1), cell("ready_s", 1), str(d["config"]["rounds"])]
    git = (d.get("machine") or {}).get("git") or {}
    notes = [f"{d['config']['gguf']}: commit `{(git.get('commit') or '?')[:10]}`"
             f"{' + uncommitted changes' if git.get('dirty') else ''}, {d.get('time')}, load average "
             f"{(d.get('load_before') or {}).get('loadavg', ['?'])[0]:.2f} before the run."]
    reason = (d.get("servers", {}).get("opencoti") or {}).get("weights_reason")
    if reason:
        notes.append(f"{d['config']['gguf']}: opencoti's weights: {reason}.")
    lost = [w for w, x in r.items() if x is not None and x < 1]
    if lost:
        notes.append(f"{d['config']['gguf']}: opencoti loses on {', '.join(lost)} (ratios below 1).")
    return row, notes


def size_table() -> Path:
    """``peer_sizes.json``: one row per model file measured on this machine (its newest
    ``peer_sizes_<stem>.json``), the ratios of each, for the docs' size table."""
    import json

    rows, notes, runs = [], [], []
    found = []
    for f in sorted(common.results_dir().glob("peer_sizes_*.json")):
        if f.stem.endswith("_quick"):  # a reduced run never stands in the table
            continue
        d = json.loads(f.read_text())
        found.append((d["config"]["gguf_mib"], f.name, d))
    for _, name, d in sorted(found, key=lambda x: x[0]):
        row, row_notes = table_row(d)
        rows.append(row)
        notes += row_notes
        runs.append({"file": name, "time": d.get("time"), "load_before": d.get("load_before"),
                     "load_at_end": d.get("load_at_end"), "commit": (d.get("machine") or {}).get("git")})
    for f in sorted(common.results_dir().glob("earlier_peer_sizes_*.json")):  # runs a newer one replaced
        d = json.loads(f.read_text())
        r = d["ratio"]
        git = (d.get("machine") or {}).get("git") or {}
        notes.append(f"An earlier run of {d['config']['gguf']} (`{f.name}`, commit `{(git.get('commit') or '?')[:10]}`, "
                     f"{d.get('time')}): decode 1 {r.get('decode_1') or 0:.2f}x, 8 sessions {r.get('sessions_8') or 0:.2f}x, "
                     f"prefill {r.get('prefill_1000') or 0:.2f}x, peak RSS {r.get('rss_peak_mib') or 0:.2f}x.")
    payload = {"config": {"threads": found[0][2]["config"]["threads"] if found else None,
                          "llama_server_flags": LLAMA_FLAGS, "opencoti_flags": OPENCOTI_FLAGS},
               "runs": runs, "machine": common.machine_info(),
               "report": {"headers": HEADERS,
                          "rows": rows,
                          "notes": ["Ratios > 1: opencoti better (tok/s ours / theirs; MiB and seconds theirs / ours). "
                                    "Speculation off on both sides, 16,384 fp16 KV tokens on both, medians of the "
                                    "rounds; each file's raw rounds are in peer_sizes_<file>.json."] + notes}}
    return common.write_json("peer_sizes", payload)


def _start(name: str, gguf: str, threads: int, llama_bin: Path, cache: str | None) -> peer.Server:
    import os

    if name == "llama.cpp":
        return peer.start(name, gguf, threads, llama_bin)
    srv_env = dict(os.environ)
    if cache is not None:
        srv_env["OPENCOTI_CACHE"] = cache
    port = peer.free_port()
    cmd = [sys.executable, "-m", "opencoti", "serve", "--model", gguf, "--port", str(port), "--threads",
           str(threads), "--state-dir", "none", *OPENCOTI_FLAGS]
    return peer.Server(name, cmd, port, srv_env)


if __name__ == "__main__":
    sys.exit(main())
