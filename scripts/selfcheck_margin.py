"""The numbers behind the attention self-check's bf16 tolerance (opencoti/engine/attention/selfcheck.py).

Runs the self-check's steps on CPU in bf16 with no tolerance (every step measured), for

* ``flashinfer-api``: FlashInferBackend driving torch stand-in kernels (a correct backend that
  rounds differently from the torch backend), and
* ``scale-10pct``: the torch backend with a softmax scale 10 % off (a subtle wrong backend),

on the tiny test model and the bundled SmolLM2-135M, and writes the per-step relative errors with
the noise floor (the torch backend with its attention output rounded differently) and the
tolerance the check would apply.

    .venv/bin/python scripts/selfcheck_margin.py [--models tiny,bundled] [--out scripts/selfcheck_margin.json]

About 4 minutes on 2 cores (the bundled model in bf16 on CPU is slow; on a GPU the check is instant).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from opencoti.engine.attention import selfcheck
from opencoti.engine.attention.flashinfer_backend import FlashInferBackend
from opencoti.engine.attention.flashinfer_reference import ReferenceKernels
from opencoti.engine.attention.torch_backend import TorchAttentionBackend
from opencoti.engine.model.loader import load_model, tiny_model
from opencoti.engine.model.weights import build_forward


class ScaleOff(TorchAttentionBackend):
    name = "scale-10pct"

    def forward(self, layer, q, k, v, k_cache, v_cache, meta, scale):
        return super().forward(layer, q, k, v, k_cache, v_cache, meta, scale * 1.1)


def measure(model) -> dict:
    out = {}
    saved = dict(selfcheck.FLOOR)
    selfcheck.FLOOR[model.dtype] = float("inf")  # measure every step, fail none
    try:
        for name, cand in (("flashinfer-api", FlashInferBackend("cpu", cascade="auto", kernels=ReferenceKernels())),
                           ("scale-10pct", ScaleOff(cascade="off", native=False))):
            v = selfcheck.check_backend(cand, TorchAttentionBackend(cascade="off"), model)
            assert v["error"] is None, v["error"]
            noise = [s["noise"] for s in v["steps"]]  # the rounded reference's error, running max
            tol = max(saved[model.dtype], selfcheck.NOISE_FACTOR * noise[-1])
            out[name] = {"max_rel_err": v["max_rel_err"], "noise": noise[-1], "tolerance": tol,
                         "passes": v["max_rel_err"] <= tol, "steps": v["steps"]}
            print(f"  {name:<15} max {v['max_rel_err']:.4f} (noise {noise[-1]:.4f}, tolerance {tol:.4f}) "
                  f"per step {[s['max_rel_err'] for s in v['steps']]}", flush=True)
    finally:
        selfcheck.FLOOR.clear()
        selfcheck.FLOOR.update(saved)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,bundled")
    p.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = p.parse_args()
    dtype = torch.bfloat16
    results = {"dtype": "bfloat16", "floor": selfcheck.FLOOR[dtype], "noise_factor": selfcheck.NOISE_FACTOR,
               "torch": torch.__version__, "metric": selfcheck.METRIC, "models": {}}
    for which in args.models.split(","):
        t0 = time.perf_counter()
        loaded = tiny_model("llama", dtype=dtype) if which == "tiny" else load_model(None, dtype=dtype)
        model = build_forward(loaded, weights="fp32", dtype=dtype, device="cpu", max_positions=1024,
                              adapt_threads=False)
        print(f"{which} ({loaded.name}):", flush=True)
        results["models"][which] = {"name": loaded.name, **measure(model),
                                    "seconds": round(time.perf_counter() - t0, 1)}
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
