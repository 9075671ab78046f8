#!/usr/bin/env python3
"""llama.cpp's next-token references for synthetic GGUF models of every architecture we serve.

For each case (llama tied / mistral-shaped / llama3 rope scaling / linear rope scaling, qwen2,
qwen3; tensor mixes Q4_0, Q4_1, Q8_0, Q4_K_M, Q5_K_M generated directly, and one Q4_K_M made by
the real ``llama-quantize`` from a generated F16 file) this writes a small random-weight GGUF with
``opencoti.engine.model.synthetic.write_gguf``, starts ``llama-server -m FILE -t 2 -c 512``, and
for every prefix ``ids[:i+1]`` (i = 0..63) of a fixed 65-token text asks ``/completion`` for one
token with ``n_probs: 2``: llama.cpp's raw (pre-sampling) top-1 next token and its top-2 margin.
The rope-scaling cases are also run without their scaling, to record how many top-1 tokens the
scaling changes (the check is only meaningful when that number is large).

Everything goes to ``tests/data/arch_reference.json`` (generator arguments, each file's sha256,
the ids, the top-1 ids, log-probabilities and margins, llama.cpp's version and the CPU);
``tests/offline/test_arch_agreement.py`` regenerates each file from its arguments, checks the
sha256 and compares opencoti's teacher-forced top-1 with llama.cpp's. The GGUF files themselves
are not kept (``--work`` holds them while the script runs).

    .venv/bin/python scripts/arch_reference.py [--bin DIR] [--opencoti]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from opencoti.engine.model import synthetic as syn  # noqa: E402

OUT = ROOT / "tests" / "data" / "arch_reference.json"
POSITIONS = 64
TOP_K = 5  # llama.cpp's top-5 (ids and log-probabilities) per position, for diagnosing misses
TEXT = ("The quick brown fox jumps over the lazy dog while the river runs quietly past the old mill. "
        "Scientists measured the temperature of the water every morning for three weeks, and the "
        "results surprised everyone who had expected a steady decline. In the evening, the village "
        "gathered in the square to hear the mayor read a letter from the capital about the new bridge, "
        "the school, and the long winter that was coming.")

# small shapes: hidden 256-512, 2-4 layers, every k-quant row a multiple of 256
CASES: list[dict] = [
    {"name": "llama_tied_q4km", "what": "llama, tied head, plain rope, Q4_K_M (Q6_K head/attn_v/ffn_down)",
     "gen": dict(arch="llama", hidden=256, layers=2, ffn=768, heads=4, kv_heads=2, tied=True,
                 mix="Q4_K_M", seed=11)},
    {"name": "mistral_shaped_q4_0", "what": "llama mistral-shaped: untied, GQA 4:1, rope theta 1e6, Q4_0",
     "gen": dict(arch="llama", hidden=512, layers=4, ffn=1536, heads=8, kv_heads=2, tied=False,
                 rope_theta=1000000.0, mix="Q4_0", seed=12)},
    {"name": "llama3_rope_q5km", "what": "llama with llama3 rope scaling (rope_freqs.weight), Q5_K_M",
     "gen": dict(arch="llama", hidden=256, layers=2, ffn=768, heads=4, kv_heads=1, tied=True,
                 rope_theta=500000.0, rope_scaling=("llama3", 8.0, 1.0, 4.0, 64), mix="Q5_K_M", seed=13),
     "control": {"rope_scaling": None}},
    {"name": "linear_rope_q8_0", "what": "llama with linear rope scaling (factor 4), untied, Q8_0",
     "gen": dict(arch="llama", hidden=256, layers=2, ffn=768, heads=4, kv_heads=2, tied=False,
                 rope_scaling=("linear", 4.0), mix="Q8_0", seed=14),
     "control": {"rope_scaling": None}},
    {"name": "qwen2_q4_1", "what": "qwen2: q/k/v biases, untied, Q4_1",
     "gen": dict(arch="qwen2", hidden=256, layers=2, ffn=768, heads=4, kv_heads=2, tied=False,
                 rope_theta=1000000.0, mix="Q4_1", seed=15)},
    {"name": "qwen3_q4km", "what": "qwen3: per-head q/k RMSNorm, head_dim 128 != hidden/heads 64, tied, Q4_K_M",
     "gen": dict(arch="qwen3", hidden=512, layers=2, ffn=1024, heads=8, kv_heads=4, head_dim=128, tied=True,
                 rope_theta=1000000.0, mix="Q4_K_M", seed=16)},
    {"name": "qwen3_hd96_q8_0", "what": "qwen3: head_dim 96 (neither hidden/heads nor the HF default 128), untied, Q8_0",
     "gen": dict(arch="qwen3", hidden=256, layers=2, ffn=768, heads=4, kv_heads=2, head_dim=96, tied=False,
                 rope_theta=1000000.0, mix="Q8_0", seed=18)},
    # F16 weights: llama.cpp multiplies in F16 without quantizing the activations to 8 bits, so its
    # logits are within ~0.01 of an exact forward and the top-1 can be compared strictly
    {"name": "llama3_rope_f16", "what": "llama, llama3 rope scaling, untied, GQA 4:1, F16 (strict: no 8-bit activations)",
     "gen": dict(arch="llama", hidden=256, layers=2, ffn=768, heads=4, kv_heads=1, tied=False,
                 rope_theta=500000.0, rope_scaling=("llama3", 8.0, 1.0, 4.0, 64), mix="F16", seed=19),
     "control": {"rope_scaling": None}},
    {"name": "qwen3_hd96_f16", "what": "qwen3, head_dim 96, tied, F16 (strict: no 8-bit activations)",
     "gen": dict(arch="qwen3", hidden=256, layers=2, ffn=768, heads=4, kv_heads=2, head_dim=96, tied=True,
                 rope_theta=1000000.0, mix="F16", seed=20)},
    {"name": "qwen2_f16", "what": "qwen2 (biases), tied, F16 (strict: no 8-bit activations)",
     "gen": dict(arch="qwen2", hidden=256, layers=2, ffn=768, heads=4, kv_heads=2, tied=True,
                 rope_theta=1000000.0, mix="F16", seed=21)},
    {"name": "llama_quantize_q4km", "what": "llama, tied, F16 quantized by the real llama-quantize to Q4_K_M",
     "gen": dict(arch="llama", hidden=256, layers=4, ffn=768, heads=4, kv_heads=2, tied=True,
                 mix="F16", seed=17),
     "quantize": "Q4_K_M"},
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class Server:
    """``llama-server -m FILE -t 2 -c 512`` on a free port, for one file."""

    def __init__(self, binary: Path, model: Path, log: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [str(binary), "-m", str(model), "-t", "2", "-c", "512", "-np", "1", "--port", str(self.port)]
        self.log = open(log, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 180
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}); see {log}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                self.close()
                raise RuntimeError(f"llama-server did not become healthy; see {log}")
            time.sleep(0.3)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def tokenize(self, text: str) -> list[int]:
        return _post(self.url + "/tokenize", {"content": text, "add_special": False})["tokens"]

    def next_token(self, prefix: list[int]) -> dict:
        """llama.cpp's raw (pre-sampling) top-2 for the token after ``prefix``.

        llama-server holds back a token that ends in an incomplete UTF-8 character (a byte token)
        and then returns no probabilities for it; ``return_tokens`` still names the sampled token
        (greedy: the raw top-1), and asking again with that token banned by ``logit_bias`` (a
        sampler: the raw probabilities are unchanged) samples another one and returns the raw top-2.
        """
        body = {"prompt": prefix, "n_predict": 1, "n_probs": TOP_K, "temperature": 0, "cache_prompt": False,
                "post_sampling_probs": False, "samplers": ["top_k"], "top_k": 1, "seed": 0, "return_tokens": True}
        r = _post(self.url + "/completion", body)
        sampled = r["tokens"][0]
        banned: list[int] = []
        while not r.get("completion_probabilities"):
            banned.append(r["tokens"][0])
            if len(banned) > 8:
                raise RuntimeError(f"no probabilities for prefix of {len(prefix)} tokens")
            r = _post(self.url + "/completion", {**body, "logit_bias": [[t, False] for t in banned]})
        top = r["completion_probabilities"][0]["top_logprobs"]
        return {"sampled": sampled, "top": [t["id"] for t in top], "logprobs": [t["logprob"] for t in top],
                "held_back": len(banned)}


def run_server_checks(binary: Path, model: Path, ids: list[int] | None, log: Path) -> dict:
    server = Server(binary, model, log)
    try:
        if ids is None:
            ids = server.tokenize(TEXT)[:POSITIONS + 1]
            if len(ids) < POSITIONS + 1:
                raise RuntimeError(f"the text gives only {len(ids)} tokens")
        rows = [server.next_token(ids[:i + 1]) for i in range(POSITIONS)]
    finally:
        server.close()
    top1 = [r["top"][0] for r in rows]
    lp = [r["logprobs"] for r in rows]
    margins = [math.exp(x[0]) - math.exp(x[1]) for x in lp]
    p1 = sorted(math.exp(x[0]) for x in lp)
    return {
        "ids": ids,
        "top1": top1,
        "margins": [round(m, 6) for m in margins],
        "gaps": [round(x[0] - x[1], 6) for x in lp],
        "top5": [r["top"] for r in rows],
        "top5_logprobs": [[round(v, 6) for v in x] for x in lp],
        "sampled_equals_top1": all(r["sampled"] == r["top"][0] for r in rows),
        "utf8_held_back_at": [i for i, r in enumerate(rows) if r["held_back"]],
        "peakedness": {"top1_prob_median": round(p1[len(p1) // 2], 4), "top1_prob_p10": round(p1[len(p1) // 10], 4),
                       "top1_prob_p90": round(p1[(9 * len(p1)) // 10], 4),
                       "margin_median": round(sorted(margins)[len(margins) // 2], 4),
                       "gap_median_nats": round(sorted(x[0] - x[1] for x in lp)[len(lp) // 2], 4),
                       "margins_below_1e-3": sum(m < 1e-3 for m in margins)},
    }


def llama_cpp_version(binary: Path) -> str:
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    lines = [x for x in (out.stdout + out.stderr).splitlines() if x.startswith(("version", "built with"))]
    return "; ".join(lines) or (out.stdout + out.stderr).strip()[:200]


def _machine_cpu() -> str:
    """The CPU as the benchmarks record it (benchmarks/common.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import common

    return common.machine_info()["cpu"]


def jsonable_gen(gen: dict) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in gen.items()}


def opencoti_top1(path: Path, ids: list[int], weights: str) -> list[int]:
    import torch

    from opencoti.engine.model.loader import load_model
    from opencoti.engine.model.weights import build_forward

    loaded = load_model(str(path))
    model = build_forward(loaded, weights=weights, dtype=torch.float32, device="cpu", max_positions=512)
    logits = model.dense_logits(torch.tensor(ids))
    return logits[:POSITIONS].argmax(-1).tolist()


def dump(doc: dict) -> str:
    """JSON with lists of scalars on one line each."""
    text = json.dumps(doc, indent=1)
    return re.sub(r"\[[^\[\]{}]*\]", lambda m: "[" + ", ".join(x.strip() for x in m.group(0)[1:-1].split(",")
                                                                  if x.strip()) + "]", text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", type=Path, default=None,
                    help="a folder with llama-server and llama-quantize (default: built once from the registry's "
                         "llama-cpp-python sources and cached, as benchmarks/peer_llamacpp.py does)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/arch_reference"), help="GGUF files and server logs")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--only", nargs="*", help="case names (default: all)")
    ap.add_argument("--opencoti", action="store_true", help="also print opencoti's agreement (fp32 and int4)")
    args = ap.parse_args(argv)
    if args.bin is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
        from peer_llamacpp import build_llama_server

        args.bin = build_llama_server().parent
    server_bin, quantize_bin = args.bin / "llama-server", args.bin / "llama-quantize"
    args.work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OPENCOTI_CACHE", str(args.work / "cache"))

    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    done = {c["name"]: c for c in previous.get("cases", [])} if args.only else {}
    ids: list[int] | None = previous.get("ids") if args.only else None
    results = []
    for case in CASES:
        if args.only and case["name"] not in args.only:
            if case["name"] in done:
                results.append(done[case["name"]])
            continue
        started = time.perf_counter()
        gen = dict(case["gen"])
        path = args.work / f"{case['name']}.gguf"
        info = syn.write_gguf(path, **gen)
        entry: dict = {"name": case["name"], "what": case["what"], "gen": jsonable_gen(gen), "sha256": info["sha256"],
                       "bytes": info["bytes"], "types": info["types"]}
        model = path
        if case.get("quantize"):
            qpath = args.work / f"{case['name']}.{case['quantize']}.gguf"
            cmd = [str(quantize_bin), str(path), str(qpath), case["quantize"], "2"]
            q = subprocess.run(cmd, capture_output=True, text=True)
            if q.returncode:
                raise RuntimeError(f"llama-quantize failed: {q.stderr[-2000:]}")
            header_kv, tinfos = syn.read_gguf_header(qpath)
            qtypes = {t.name: syn.TYPE_NAMES.get(t.qtype, str(t.qtype)) for t in tinfos}
            ours = {p.name: syn.TYPE_NAMES[p.qtype] for p in syn.plan_tensors(
                arch=gen["arch"], hidden=gen["hidden"], layers=gen["layers"], ffn=gen["ffn"], heads=gen["heads"],
                kv_heads=gen["kv_heads"], head_dim=gen["hidden"] // gen["heads"], tied=gen["tied"],
                mix=case["quantize"], qkv_bias=False, rope_freqs=False, head_scale=1.0)}
            entry["quantize"] = {
                "command": "llama-quantize F16.gguf OUT.gguf " + case["quantize"] + " 2",
                "argv": shlex.join(cmd), "sha256": syn.sha256_file(qpath), "bytes": qpath.stat().st_size,
                "tensor_types": qtypes,
                "generator_types_differ": {n: [t, ours.get(n)] for n, t in qtypes.items() if ours.get(n) != t},
                "in_tests": False, "why_not_in_tests": f"{qpath.stat().st_size / 2**20:.1f} MiB (over ~3 MiB)",
            }
            model = qpath
        ref = run_server_checks(server_bin, model, ids, args.work / f"{case['name']}.log")
        ids = ref.pop("ids")
        entry.update(ref)
        if case.get("control"):
            cgen = {**gen, **case["control"]}
            cpath = args.work / f"{case['name']}.control.gguf"
            syn.write_gguf(cpath, **cgen)
            cref = run_server_checks(server_bin, cpath, ids, args.work / f"{case['name']}.control.log")
            entry["control"] = {"gen": jsonable_gen(cgen),
                                "top1_differs_at": sum(a != b for a, b in zip(cref["top1"], ref["top1"]))}
        entry["seconds"] = round(time.perf_counter() - started, 1)
        if args.opencoti:
            for weights in ("fp32", "int4"):
                ours_top1 = opencoti_top1(model, ids, weights)
                agree = sum(a == b for a, b in zip(ours_top1, entry["top1"]))
                low = sum(a != b and m < 1e-3 for a, b, m in zip(ours_top1, entry["top1"], entry["margins"]))
                print(f"  opencoti {weights}: {agree}/{POSITIONS} agree ({low} of the misses at margin < 1e-3)",
                      flush=True)
        print(f"{case['name']}: {entry['peakedness']} control={entry.get('control', {}).get('top1_differs_at')} "
              f"{entry['seconds']} s", flush=True)
        results.append(entry)

    doc = {
        "about": "llama.cpp's raw top-1 next token for each prefix ids[:i+1], i < 64, of synthetic GGUF models "
                 "(scripts/arch_reference.py; checked by tests/offline/test_arch_agreement.py). margins: p(top1) - "
                 "p(top2), gaps: logp(top1) - logp(top2), top5/top5_logprobs: llama-server's n_probs 5 "
                 "(post_sampling_probs false: log-softmax of the raw logits).",
        "text": TEXT,
        "ids": ids,
        "positions": POSITIONS,
        "llama_cpp": llama_cpp_version(server_bin),
        "server_command": "llama-server -m FILE -t 2 -c 512 -np 1 --port P",
        "cpu": _machine_cpu(),
        "generator": "opencoti.engine.model.synthetic.write_gguf",
        "cases": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(dump(doc) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
