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

Where the memory goes (``profile``): a fresh process with ``tracemalloc`` on builds the engine as
``opencoti serve`` does by default (``EngineConfig()``: the bundled model, ``weights=auto``, no state
directory) and imports the HTTP server's modules, then records its RSS and largest mappings, the
bytes of the model's tensors by item (``LlamaForward.tensor_bytes``), the KV pages (reserved and
resident), every torch tensor still referenced from Python by size (any state dict, gate reference
or candidate format kept alive would show up there) and the Python heap tracemalloc saw, by module.

Results: ``benchmarks/results/<machine-id>/bench_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
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


# ============================================================================ where it goes
def _resident_mib(t) -> float:
    """Resident MiB of a tensor's storage (``mincore`` on its pages; KV pages are resident once written)."""
    import ctypes
    import mmap

    size, addr = t.untyped_storage().nbytes(), t.untyped_storage().data_ptr()
    page = mmap.PAGESIZE
    start = addr - addr % page
    n = (addr + size - start + page - 1) // page
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(n * page), vec) != 0:
        return float("nan")
    return sum(b & 1 for b in vec) * page / 2**20


def _profile_child(gguf: str, threads: int, weights: str = "auto") -> dict:
    """Runs in a fresh process (``--profile-child``): see the module docstring."""
    import gc
    import tracemalloc

    tracemalloc.start()
    import torch

    import opencoti.server.app  # noqa: F401 - the HTTP server's modules are part of a served process
    from opencoti.engine import Engine, EngineConfig

    eng = Engine(EngineConfig(model=gguf, num_threads=threads, weights=weights))  # as serve --model <gguf>
    try:
        time.sleep(SETTLE_S)
        gc.collect()
        mem = memory(__import__("os").getpid())
        model = eng.model
        items = {k: round(v / 2**20, 1) for k, v in model.tensor_bytes().items()}
        kv = {"reserved_mib": round((eng.kv.k_cache.untyped_storage().nbytes() +
                                     eng.kv.v_cache.untyped_storage().nbytes()) / 2**20, 1),
              "resident_mib": round(_resident_mib(eng.kv.k_cache) + _resident_mib(eng.kv.v_cache), 1),
              "dtype": str(eng.kv.k_cache.dtype).replace("torch.", "")}
        seen, tensors = set(), []
        for o in gc.get_objects():
            if isinstance(o, torch.Tensor) and o.layout == torch.strided and not o.is_mkldnn:
                st = o.untyped_storage()
                if st.data_ptr() not in seen:
                    seen.add(st.data_ptr())
                    tensors.append((st.nbytes(), o.dtype, tuple(o.shape)))
        tensors.sort(key=lambda x: -x[0])
        snap = tracemalloc.take_snapshot()
        by_file: dict[str, int] = {}
        for stat in snap.statistics("filename"):
            name = re.sub(r".*/(site-packages|lib/python3[.0-9]*)/", "", stat.traceback[0].filename).split("/")[0]
            by_file[name] = by_file.get(name, 0) + stat.size
        top_py = sorted(by_file.items(), key=lambda kv: -kv[1])[:8]
        return {"rss_mib": mem["rss_mib"], "anon_mib": mem["anon_mib"], "file_mib": mem["file_mib"],
                "top_mappings": mem["top_mappings"], "weights": model.weights, "model_tensors_mib": items,
                "model_tensors_total_mib": round(sum(items.values()), 1), "kv_pages": kv,
                "torch_tensors_from_python": {"count": len(tensors),
                                              "total_mib": round(sum(t[0] for t in tensors) / 2**20, 1),
                                              "largest": [f"{t[0] / 2**20:.1f} MiB {str(t[1]).replace('torch.', '')} "
                                                          f"{list(t[2])}" for t in tensors[:8]]},
                "python_heap_mib": round(sum(by_file.values()) / 2**20, 1),
                "tracemalloc_own_mib": round(tracemalloc.get_tracemalloc_memory() / 2**20, 1),
                "python_heap_by_package_mib": {k: round(v / 2**20, 1) for k, v in top_py}}
    finally:
        eng.close()


def profile(gguf: str, threads: int, weights: str = "auto") -> dict:
    out = subprocess.run([sys.executable, __file__, "--profile-child", "--model", gguf, "--threads", str(threads),
                          "--weights", weights],
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"the profile process failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


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
    p.add_argument("--profile-only", action="store_true",
                   help="only the profile (of an engine with --weights), written to bench_memory_profile.json")
    p.add_argument("--profile-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    from opencoti.engine.model.loader import bundled_gguf_path

    gguf = args.model or str(bundled_gguf_path())
    threads = args.threads or 2
    if args.profile_child:
        print(json.dumps(_profile_child(gguf, threads, args.weights)))
        return 0
    if args.profile_only:
        before = common.load_snapshot()
        where = profile(gguf, threads, args.weights)
        print(json.dumps({k: v for k, v in where.items() if k != "top_mappings"}, indent=1))
        path = common.write_json("bench_memory_profile", {
            "config": {"threads": threads, "gguf": Path(gguf).name, "weights": args.weights}, "profile": where,
            "machine": common.machine_info(), "load_before": before}, args.out)
        print(f"wrote {path}")
        return 0
    llama_bin = Path(args.llama_server) if args.llama_server else peer.build_llama_server()
    before = common.load_snapshot()
    runs = [("opencoti", [])] + [("opencoti", ["--weights", f]) for f in args.weights_variants.split(",") if f]
    runs.append(("llama.cpp", []))
    results = {}
    for name, extra in runs:
        results[" ".join([name, *extra])] = measure(name, gguf, threads, llama_bin, extra)
    where = profile(gguf, threads)
    common.log(f"profile: RSS {where['rss_mib']} MiB; model tensors {where['model_tensors_mib']}; "
               f"KV {where['kv_pages']}; python heap {where['python_heap_mib']} MiB")
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
        "servers": results, "profile": where, "ratio_ours_to_llamacpp": ratios, "machine": machine,
        "load_before": before}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
