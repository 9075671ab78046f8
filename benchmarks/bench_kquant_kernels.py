#!/usr/bin/env python
"""k-quant projections: Q4_K / Q6_K read as stored (int8 or int16 activations) vs int4 blocks, per weight.

One projection of ``--n`` x ``--k`` random GGUF blocks (``tests/offline/gguf_blocks.random_blocks``),
timed at each row count of ``--rows`` through each path, interleaved (every path once per repeat, in
rotated order; best of ``--repeats``), in ns per weight and row:

* ``q4k_i8`` / ``q6k_i8``: the default, int8 activations per super-block of 256 (llama.cpp's Q8_K),
  integer sub-block scales (``native.kquant_i8_rows``);
* ``q4k_i16`` / ``q6k_i16``: int16 activations per block of 32 up to 31 rows, fp32 panels from 32;
* ``int4_blocks``: the same Q4_K rows turned into the native int4 layout (5 bits a weight), the
  kernels OPENCOTI_KQUANT=0 uses; ``int8_rows``: the Q6_K rows as per-row int8.

A matrix larger than the last-level cache (the default, 75 MB of Q4_K) is read from memory at every call,
as a decode step reads a model's layers. It also measures (``--no-gate``: not) what the activation rounding costs:
the accuracy gate's KL divergence and clear-margin top-1 agreement of a generated Q4_K_M model (or
``--model FILE``) against an fp32 forward of the file's own values, for both activation paths.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repository root on sys.path)
from common import log, now, print_table  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "offline"))


def _time(fn, reps: int) -> float:
    fn()
    t0 = now()
    for _ in range(reps):
        fn()
    return (now() - t0) / reps


def kernel_times(args) -> list[dict]:
    import torch
    from gguf_blocks import random_blocks

    from opencoti.engine import native

    ops = native._ops()
    n, k = args.n, args.k
    raw = {t: torch.from_numpy(random_blocks(t, n, k, 1).reshape(n, -1).copy()) for t in ("Q4_K", "Q6_K")}
    q4 = ops.gguf_q4_blocks(raw["Q4_K"], 12, k)
    q8, q8s = ops.gguf_to_q8_rows(raw["Q6_K"], 14, k)
    default = native.kquant_i8_rows()

    def kq(t: str, tid: int, i8: bool, x):
        flat = raw[t].reshape(-1)

        def run():
            native.kquant_i8_rows(default if i8 else 0)
            ops.ggml_matmul(x, flat, [tid, n, k], None)
        return run

    rows_out = []
    try:
        for rows in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            paths = {"q4k_i8": kq("Q4_K", 12, True, x), "q4k_i16": kq("Q4_K", 12, False, x),
                     "int4_blocks": lambda x=x: ops.q4_matmul(x, q4, None),
                     "q6k_i8": kq("Q6_K", 14, True, x), "q6k_i16": kq("Q6_K", 14, False, x),
                     "int8_rows": lambda x=x: ops.q8_matmul(x, q8, q8s, None)}
            reps = max(2, args.calls // rows)
            best = {p: float("inf") for p in paths}
            for rep in range(args.repeats):
                for p in common.rotated(list(paths), rep):
                    best[p] = min(best[p], _time(paths[p], reps))
            row = {"rows": rows, **{p: best[p] * 1e9 / (n * k * rows) for p in paths}}
            log(f"rows {rows}: " + ", ".join(f"{p} {v:.4f}" for p, v in row.items() if p != "rows"))
            rows_out.append(row)
    finally:
        native.kquant_i8_rows(default)
    return rows_out


def gate(args) -> dict:
    import tempfile

    import torch

    from opencoti.engine import native
    from opencoti.engine.model import weights
    from opencoti.engine.model.gate_text import GATE_TEXT
    from opencoti.engine.model.loader import load_model
    from opencoti.engine.model.synthetic import write_gguf

    tmp = tempfile.mkdtemp(prefix="opencoti-kquant-gate-")
    path = args.model
    if path is None:
        path = str(Path(tmp) / "gate-q4km.gguf")
        write_gguf(path, arch="llama", hidden=512, layers=8, ffn=1536, heads=8, kv_heads=2, tied=False,
                   mix="Q4_K_M", seed=3)
    loaded = load_model(path, cache_dir=tmp)

    def build(fmt: str):
        return weights.build_forward(loaded, weights=fmt, dtype=torch.float32, device="cpu",
                                     max_positions=512, adapt_threads=False)

    ref = build("fp32")
    ids = torch.tensor(loaded.tokenizer.encode(GATE_TEXT)[:weights.GATE_TOKENS], dtype=torch.long)
    ref_logits = ref.dense_logits(ids)
    del ref
    model = build("int4")
    out = {"model": Path(path).name, "tokens": int(ids.shape[0]), "kernels": sorted(set(model.kernel_names.values()))}
    default = native.kquant_i8_rows()
    try:
        for name, rows in (("int8_per_256", default), ("int16_per_32", 0)):
            native.kquant_i8_rows(rows)
            for how, per_call in (("prefill", None), ("decode_rows", 1)):
                m = weights.gate_metrics(ref_logits, model.dense_logits(ids, rows_per_call=per_call), ids,
                                         weights.GATE_TOKENS)
                out[f"{name}_{how}"] = {k: m[k] for k in ("kl", "top1_agreement_clear", "clear_positions", "passed")}
                log(f"gate {name} {how}: KL {m['kl']:.5f}, top-1 {m['top1_agreement_clear']:.3f}")
    finally:
        native.kquant_i8_rows(default)
    return out


def main() -> int:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=65536, help="weight rows (output features)")
    p.add_argument("--k", type=int, default=2048, help="input features (a multiple of 256)")
    p.add_argument("--rows", default="1,2,4,8,16,64,256")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--calls", type=int, default=16, help="calls per timing at one row (fewer at more rows)")
    p.add_argument("--no-gate", dest="gate", action="store_false",
                   help="skip the accuracy gate's numbers of both activation paths")
    p.add_argument("--model", default=None, help="GGUF file for --gate (default: a generated Q4_K_M model)")
    args = p.parse_args()
    if args.quick:
        args.n, args.rows, args.repeats, args.gate = 8192, "1,8,64", 2, False
    common.set_threads(args.threads)
    import torch

    info = common.machine_info()
    table = kernel_times(args)
    paths = [c for c in table[0] if c != "rows"]
    print_table(["rows", *paths], [[r["rows"], *(f"{r[p]:.4f}" for p in paths)] for r in table],
                title=f"ns per weight and row, {args.n} x {args.k}, {torch.get_num_threads()} threads")
    payload = {"machine": info, "config": {"n": args.n, "k": args.k, "threads": torch.get_num_threads(),
                                           "repeats": args.repeats, "quick": args.quick},
               "ns_per_weight_row": table}
    if args.gate:
        payload["gate"] = gate(args)
    path = common.write_json("kquant_kernels" + ("_quick" if args.quick else ""), payload, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
