#!/usr/bin/env python
"""Prefill projections: the native row kernels vs fp32 panels, by the number of rows in a step.

The native int4 / int8 projections (``opencoti/engine/native``) run small steps on row kernels
(the quantized weights read directly, 8 rows at a time) and, from a number of rows on, fill fp32
panels first (every weight of the matrix dequantized and transposed once per call, then a 6 x 16
register-blocked GEMM). This measures, on the bundled model's own projections (q/k/v, o, gate/up,
down of one layer, x the model's layers: one step's projection time), both paths at each row count
``--rows``, interleaved (rows, panels, rows, ... ``--repeats`` times, median), and prints their
ratio and where the library's thresholds (``native.gemm_min_rows``) put each row count. A step with
a newcomer's prompt and the sessions decoding has prompt + decoding rows.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repository root on sys.path)
from common import fmt, log, now, print_table  # noqa: E402


def main() -> int:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--formats", default="int8,int4")
    p.add_argument("--rows", default="8,16,24,32,40,48,56,64,80,96,128")
    p.add_argument("--repeats", type=int, default=21)
    args = p.parse_args()
    common.set_threads(args.threads)
    import torch

    from opencoti.engine import native

    info = common.machine_info()
    rows = [int(x) for x in args.rows.split(",")]
    out: dict = {}
    defaults = native.gemm_min_rows()
    for f in args.formats.split(","):
        args.weights = f
        eng = common.make_engine(args)
        layer = eng.model.layers[0]
        projs = [layer.qkv, layer.o, layer.gate_up, layer.down]
        n_layers = len(eng.model.layers)
        thr = defaults[0] if f == "int4" else defaults[1]
        table = []
        for t in rows:
            xs = [torch.randn(t, pr.in_features) for pr in projs]
            times: dict[str, list[float]] = {"rows": [], "panels": []}
            try:
                for _ in range(args.repeats):
                    for path, forced in (("rows", 10 ** 9), ("panels", 1)):
                        native.gemm_min_rows(forced, forced)
                        t0 = now()
                        for pr, x in zip(projs, xs):
                            pr(x)
                        times[path].append((now() - t0) * n_layers * 1e3)
            finally:
                native.gemm_min_rows(*defaults)
            r, pa = statistics.median(times["rows"]), statistics.median(times["panels"])
            table.append({"rows": t, "row_kernels_ms": r, "panels_ms": pa, "panels_over_rows": pa / r,
                          "default": "panels" if t >= thr else "rows"})
        eng.shutdown()
        out[f] = {"threshold": thr, "steps": table}
        print_table(["rows", "row kernels ms", "panels ms", "panels / rows", "library default"],
                    [[x["rows"], x["row_kernels_ms"], x["panels_ms"], fmt(x["panels_over_rows"]), x["default"]]
                     for x in table],
                    title=f"{f}: one step's projections ({n_layers} layers), median of {args.repeats}, "
                          f"interleaved; panels from {thr} rows by default")
    info["loadavg_end"] = common.machine_info()["loadavg"]
    print(f"\nload average: {info['loadavg'][0]:.2f} at the start, {info['loadavg_end'][0]:.2f} at the end")
    path = common.write_json("prefill_kernels", {"config": vars(args), "machine": info, "formats": out}, args.out)
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
