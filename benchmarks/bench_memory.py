#!/usr/bin/env python
"""Resident memory: opencoti serve vs llama.cpp's llama-server on the same GGUF, one after the other.

Each server starts fresh with ``--threads`` (2) threads: ``opencoti serve`` with its defaults (and
once per ``--weights-variants`` entry with ``--weights <format>``), ``llama-server`` with
``--parallel 8 --kv-unified -c 16384`` (the binary of ``peer_llamacpp.py``: built once, cached).
For each: RSS (``/proc/<pid>/smaps_rollup``: anonymous vs file-backed) and the largest mappings
(``/proc/<pid>/smaps``) once ready and idle ("after load"), then again after three prompts of
about 1,600 tokens each, all different (no shared prefix), were prefilled together (``/completion``,
one token generated). KV bytes per token: ours from ``/props`` (``kv_bytes_per_token``, the page
geometry in the KV dtype), llama.cpp's f16 default from the GGUF (2 bytes x K and V x layers x KV
heads x head dim). The KV budget of each (ours: ``kv_budget_tokens``; theirs: ``-c``) is recorded
too: opencoti's KV pages lie in an anonymous memory map and become resident as they are first
written, llama.cpp clears its whole KV buffer at start.

Results: ``benchmarks/results/<machine-id>/bench_memory.json``.
"""

from __future__ import annotations

import re
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repository root on sys.path)
import peer_llamacpp as peer  # noqa: E402

PROMPTS = 3
SENTENCES = 46  # about 35 tokens each: ~1,640 tokens per prompt
SETTLE_S = 3.0
TOP_MAPPINGS = 8


# ============================================================================ process memory
def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        for c in task.read_text().split():
            out += [int(c), *_children(int(c))]
    return out


def _rollup(pid: int) -> dict[str, int]:
    kb = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, val, *_ = line.split()
        kb[key.rstrip(":")] = int(val)
    return kb


def _mappings(pid: int) -> dict[str, dict]:
    """RSS by mapping: files by name (shortened to the part after site-packages/ or lib/), anonymous
    mappings of 64 MiB or more one by one (KV caches, large buffers), the rest of them together."""
    maps: dict[str, dict] = {}
    for m in common.smaps(pid):
        size, path = m["size"], m["path"]
        if path.startswith("/"):
            name = re.sub(r".*/(site-packages|lib)/", r"\1/", path)
        elif path:
            name = path
        else:
            name = f"[anon {size >> 20} MiB map @{m['start']}]" if size >= 64 << 20 else "[anon, small maps]"
        entry = maps.setdefault(name, {"size_mib": 0.0, "rss_mib": 0.0})
        entry["size_mib"] += size / 2**20
        entry["rss_mib"] += m["rss"] / 2**20
    return maps


def memory(pid: int) -> dict:
    """RSS of ``pid`` and its children (MiB), split anonymous / file-backed, and the largest mappings."""
    pids = [pid, *_children(pid)]
    tot: dict[str, int] = {}
    for p in pids:
        for k, v in _rollup(p).items():
            tot[k] = tot.get(k, 0) + v
    maps = _mappings(pid)
    top = sorted(maps.items(), key=lambda kv: -kv[1]["rss_mib"])[:TOP_MAPPINGS]
    return {"rss_mib": round(tot["Rss"] / 1024, 1), "anon_mib": round(tot["Anonymous"] / 1024, 1),
            "file_mib": round((tot["Rss"] - tot["Anonymous"]) / 1024, 1),  # file-backed (and shared) pages
            "processes": len(pids),
            "top_mappings": {k: {kk: round(vv, 1) for kk, vv in v.items()} for k, v in top}}


# ============================================================================ workload
def prompt(i: int, nonce: str) -> str:
    lines = [f"Record {j} of log {i}-{nonce}: the crossing near station {(j * 37 + i) % 100} was inspected "
             f"on day {(j * 13 + i) % 365} and found {'clear' if (i + j) % 3 else 'blocked'}." for j in range(SENTENCES)]
    return " ".join(lines) + " Summarize the log."


def prefill(url: str, nonce: str) -> list[int]:
    """The three prompts prefilled together (one token each); their prompt token counts."""
    import httpx

    def one(i: int) -> int:
        r = httpx.post(url + "/completion", json={"prompt": prompt(i, nonce), "n_predict": 1, "temperature": 0,
                                                  "cache_prompt": True}, timeout=900)
        r.raise_for_status()
        return int(r.json()["timings"]["prompt_n"])

    return peer.parallel(PROMPTS, one)


def llama_kv_bytes_per_token(gguf: str) -> dict:
    """llama.cpp's KV bytes per token at its f16 default, from the GGUF header."""
    from opencoti.engine.model.gguf_index import GGUFIndex

    idx = GGUFIndex(gguf)
    md, arch = idx.metadata, idx.architecture
    layers, kv_heads = int(md[f"{arch}.block_count"]), int(md[f"{arch}.attention.head_count_kv"])
    k_dim = int(md.get(f"{arch}.attention.key_length") or int(md[f"{arch}.embedding_length"]) //
                int(md[f"{arch}.attention.head_count"]))
    v_dim = int(md.get(f"{arch}.attention.value_length") or k_dim)
    return {"kv_dtype": "f16", "kv_bytes_per_token": 2 * layers * kv_heads * (k_dim + v_dim),
            "layers": layers, "kv_heads": kv_heads, "head_dim": k_dim}


def measure(name: str, gguf: str, threads: int, llama_bin: Path, extra: list[str]) -> dict:
    import httpx

    srv = peer.start(name, gguf, threads, llama_bin, extra)
    try:
        ready = srv.wait_ready()
        time.sleep(SETTLE_S)
        after_load = memory(srv.proc.pid)
        common.log(f"{name} {' '.join(extra)}: ready in {ready:.1f} s, RSS {after_load['rss_mib']} MiB")
        t0 = time.perf_counter()
        tokens = prefill(srv.url, uuid.uuid4().hex[:8])
        seconds = time.perf_counter() - t0
        time.sleep(SETTLE_S)
        after_prefill = memory(srv.proc.pid)
        common.log(f"{name}: prefilled {tokens} tokens in {seconds:.1f} s, RSS {after_prefill['rss_mib']} MiB")
        props = httpx.get(srv.url + "/props", timeout=30).json()
        log_text = Path(srv.log.name).read_text(errors="replace")
    finally:
        srv.stop()
    out = {"flags": extra, "ready_s": round(ready, 1), "after_load": after_load, "after_prefill": after_prefill,
           "prefill_tokens": tokens, "prefill_s": round(seconds, 2)}
    if name == "opencoti":
        poly = props["opencoti"]["polykv"]
        w = props["opencoti"].get("weights") or {}
        out.update(weights=w.get("format"), kv_dtype=poly.get("kv_dtype"),
                   kv_bytes_per_token=poly.get("kv_bytes_per_token"), kv_budget_tokens=poly["kv_budget_tokens"])
    else:
        out.update(llama_kv_bytes_per_token(gguf), kv_budget_tokens=int(peer.LLAMA_FLAGS[-1]))
        m = re.search(r"KV buffer size\s*=\s*([0-9.]+) MiB", log_text)
        out["kv_buffer_mib_logged"] = float(m.group(1)) if m else None
    if out.get("kv_bytes_per_token"):
        out["kv_budget_mib"] = round(out["kv_budget_tokens"] * out["kv_bytes_per_token"] / 2**20, 1)
    return out


def main() -> int:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--weights-variants", default="int8,int4",
                   help="opencoti also started with --weights <format> for each (comma-separated; '' for none)")
    p.add_argument("--llama-server", default=None, help="a llama-server binary (default: peer_llamacpp's cached build)")
    p.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2-135M Q4_1)")
    args = p.parse_args()
    from opencoti.engine.model.loader import bundled_gguf_path

    gguf = args.model or str(bundled_gguf_path())
    threads = args.threads or 2
    llama_bin = Path(args.llama_server) if args.llama_server else peer.build_llama_server()
    before = common.load_snapshot()
    runs = [("opencoti", [])] + [("opencoti", ["--weights", f]) for f in args.weights_variants.split(",") if f]
    runs.append(("llama.cpp", []))
    results = {}
    for name, extra in runs:
        results[" ".join([name, *extra])] = measure(name, gguf, threads, llama_bin, extra)
    ours, theirs = results["opencoti"], results["llama.cpp"]
    ratios = {"rss_after_load": common.ratio(ours["after_load"]["rss_mib"], theirs["after_load"]["rss_mib"]),
              "rss_after_prefill": common.ratio(ours["after_prefill"]["rss_mib"], theirs["after_prefill"]["rss_mib"]),
              "kv_bytes_per_token": common.ratio(ours["kv_bytes_per_token"], theirs["kv_bytes_per_token"])}
    rows = [[k, r.get("weights") or "-", r["after_load"]["rss_mib"], r["after_load"]["anon_mib"],
             r["after_load"]["file_mib"], r["after_prefill"]["rss_mib"], sum(r["prefill_tokens"]),
             r.get("kv_dtype"), r.get("kv_bytes_per_token"), r.get("kv_budget_mib")] for k, r in results.items()]
    common.print_table(["server", "weights", "RSS load", "anon", "file", "RSS prefill", "prefill tok", "KV dtype",
                        "KV B/token", "KV budget MiB"], rows, title=f"resident memory (MiB), {threads} threads")
    print("ours / llama.cpp: " + ", ".join(f"{k} {common.fmt(v)}x" for k, v in ratios.items()))
    machine = common.machine_info()
    print(common.describe_machine(machine))
    path = common.write_json("bench_memory", {
        "config": {"threads": threads, "gguf": Path(gguf).name, "llama_server_flags": peer.LLAMA_FLAGS,
                   "prompts": PROMPTS, "llama_cpp_source": f"{peer.SDIST}=={peer.SDIST_VERSION} (vendored)"},
        "servers": results, "ratio_ours_to_llamacpp": ratios, "machine": machine, "load_before": before}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
