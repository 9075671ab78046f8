#!/usr/bin/env python
"""KV pages in fp32 vs 16 and 8 bits on the bundled model: decode speed at long contexts and accuracy.

Speed: one engine per KV dtype in ONE process (same weights format, same threads), each with the
same prompt of about ``--contexts`` tokens (the gate text repeated) prefilled once; then
``--repeats`` rounds, the engines taking turns in a rotated order, each generating ``--tokens``
greedy tokens from that prompt (its full pages come from the prefix cache, so the time is decode).
Per run: the request's decode tok/s (``timings.predicted_per_second``). The load average is
recorded before and after each round: the machine is shared.

Accuracy: ``engine/kv/gate.py`` (teacher forcing over the gate text through the paged cache: half
the tokens in one prefill step, the rest one decode step each) per 16-bit / 8-bit (q8) dtype
against fp32 pages, with the weights' gate bounds (``passed``).

Results: ``benchmarks/results/<machine-id>/bench_kv_dtype.json``.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repository root on sys.path)


def _block_quantize(x):
    """llama.cpp q8_0's rule: an fp16 scale per block of 32 values (D + 4 bytes for D = 64, as q8)."""
    import torch

    x = x.float()
    xb = x.reshape(*x.shape[:-1], -1, 32)
    s = (xb.abs().amax(-1, keepdim=True) / 127).half().float()
    q = (xb / torch.where(s > 0, s, torch.ones_like(s))).round().clamp(-127, 127).to(torch.int8).reshape(x.shape)
    return torch.cat([q, s.half().reshape(*x.shape[:-1], -1).view(torch.int8)], -1)


def _block_dequantize(t, dtype=None):
    import torch

    d = t.shape[-1] - 4
    s = t[..., d:].contiguous().view(torch.float16).float()
    x = (t[..., :d].float().reshape(*t.shape[:-1], -1, 32) * s[..., None]).reshape(*t.shape[:-1], d)
    return x.to(dtype or torch.float32)


def q8_layouts(model, ids) -> dict:
    """q8 as kv_dtype q8 holds it (one fp32 scale per vector) vs q8_0's layout (an fp16 scale per
    block of 32 values, the same bytes for 64 dimensions), both through the torch attention path
    (the native kernels read only the first), against fp32 pages: the choice of the layout."""
    from unittest import mock

    import torch

    from opencoti.engine.attention.torch_backend import TorchAttentionBackend
    from opencoti.engine.attention import q8
    from opencoti.engine.kv.gate import paged_logits
    from opencoti.engine.model.weights import gate_metrics

    fused, model.fused_layers = model.fused_layers, None
    try:
        be = TorchAttentionBackend(cascade="off", native=False)
        t = torch.tensor(ids)
        ref = paged_logits(model, ids, torch.float32, backend=be)
        out = {"per_vector_fp32_scale": gate_metrics(ref, paged_logits(model, ids, torch.int8, backend=be), t, len(ids))}
        with mock.patch.object(q8, "quantize", _block_quantize), mock.patch.object(q8, "dequantize", _block_dequantize):
            got = paged_logits(model, ids, torch.int8, backend=be)
        out["per_32_block_fp16_scales"] = gate_metrics(ref, got, t, len(ids))
    finally:
        model.fused_layers = fused
    return out


def main() -> None:
    p = common.base_parser(__doc__.splitlines()[1])
    p.add_argument("--kv-dtypes", default="fp32,fp16,bf16,q8", help="KV dtypes compared (the first is the reference)")
    p.add_argument("--contexts", default="512,3500", help="prompt lengths in tokens")
    p.add_argument("--tokens", type=int, default=48, help="tokens generated per run")
    p.add_argument("--repeats", type=int, default=5, help="rounds per context")
    p.add_argument("--gate-tokens", type=int, default=512, help="tokens of the gate text in the accuracy check")
    p.set_defaults(weights="int4", threads=2)
    args = p.parse_args()
    if args.quick:
        args.contexts, args.tokens, args.repeats, args.gate_tokens = "512", 16, 2, 128
    common.set_threads(args.threads)
    import torch

    from opencoti.engine import SamplingParams
    from opencoti.engine.kv.gate import kv_gate
    from opencoti.engine.model.gate_text import GATE_TEXT

    names = args.kv_dtypes.split(",")
    contexts = [int(c) for c in args.contexts.split(",")]
    budget = 2 * max(contexts) + 4096
    engines = {n: common.make_engine(args, kv_dtype=n, kv_budget_tokens=budget) for n in names}
    ref = engines[names[0]]
    text_ids = ref.tokenizer.encode(GATE_TEXT)
    load = {"start": common.load_snapshot()}

    accuracy = {}
    gate_ids = text_ids[:args.gate_tokens]
    for n in names[1:]:
        m = kv_gate(engines[n].model, gate_ids, engines[n].kv.dtype)
        accuracy[n] = {k: m[k] for k in ("ppl_fp32", "ppl", "ppl_ratio", "top1_agreement", "tokens",
                                         "max_abs_logit_diff", "passed")}
        common.log(f"accuracy {n}: ppl {m['ppl']:.4f} vs {m['ppl_fp32']:.4f} (x{m['ppl_ratio']:.5f}), "
                   f"top-1 {m['top1_agreement']:.4f} over {m['tokens']} tokens")
    if "q8" in names and ref.model.dims.head_dim % 32 == 0:
        accuracy["q8_layouts_torch_path"] = layouts = q8_layouts(ref.model, gate_ids)
        common.log("q8 layouts: " + ", ".join(f"{k} ppl x{v['ppl_ratio']:.5f} top-1 {v['top1_agreement']:.4f}"
                                               for k, v in layouts.items()))

    params = SamplingParams.greedy(args.tokens, ignore_eos=True)
    speed: dict = {}
    for ctx in contexts:
        prompt = (text_ids * (ctx // len(text_ids) + 1))[:ctx]
        for n in names:  # prefill once: the runs read the prompt's full pages from the prefix cache
            engines[n].generate(prompt, params=SamplingParams.greedy(1))
        runs: dict = {n: [] for n in names}
        loads = []
        outputs: dict = {}
        for r in range(args.repeats):
            before = os.getloadavg()
            for n in common.rotated(names, r):
                res = engines[n].generate(prompt, params=params)
                assert res.info.cached_prefix_tokens >= ctx - 16, res.info
                runs[n].append(res.timings["predicted_per_second"])
                outputs.setdefault(n, res.token_ids)
            loads.append({"before": before, "after": os.getloadavg()})
        row = {n: {"decode_tps_median": statistics.median(v), "decode_tps": v} for n, v in runs.items()}
        for n in names[1:]:
            row[n]["vs_" + names[0]] = row[n]["decode_tps_median"] / row[names[0]]["decode_tps_median"]
            row[n]["same_tokens_as_" + names[0]] = outputs[n] == outputs[names[0]]
        speed[str(ctx)] = {"runs": row, "load": loads}
        common.log(f"context {ctx}: " + ", ".join(f"{n} {row[n]['decode_tps_median']:.1f} tok/s" for n in names))
    load["end"] = common.load_snapshot()

    kv = {n: {"dtype": e.kv.dtype_name, "bytes_per_token": e.kv.page_bytes // e.kv.page_size}
          for n, e in engines.items()}
    weights = {n: e.weights_info()["format"] for n, e in engines.items()}
    for e in engines.values():
        e.shutdown()
    out = common.write_json("bench_kv_dtype", {
        "machine": common.machine_info(), "threads": args.threads, "torch_threads": torch.get_num_threads(),
        "weights": weights, "kv": kv, "tokens_per_run": args.tokens, "repeats": args.repeats,
        "accuracy": accuracy, "speed": speed, "load": load}, args.out)
    common.log(f"wrote {out}")


if __name__ == "__main__":
    main()
