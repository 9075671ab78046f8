#!/usr/bin/env python3
"""Write a random-weight GGUF test model of any size (no downloads).

Examples::

    .venv/bin/python scripts/make_gguf.py --preset 8b --mix Q4_K_M -o /tmp/llama8b-q4km.gguf
    .venv/bin/python scripts/make_gguf.py --preset tiny --arch qwen3 --head-dim 128 -o /tmp/q3.gguf
    .venv/bin/python scripts/make_gguf.py --hidden 512 --layers 4 --ffn 1536 --heads 8 --kv-heads 2 \\
        --no-tied --rope-theta 1e6 --mix Q4_0 -o /tmp/mistral-shaped.gguf

Presets (shapes of real models): tiny, 135m (SmolLM2-135M), 1b (Llama-3.2-1B),
3b (Llama-3.2-3B), 8b (Llama-3.1-8B); explicit flags override a preset's values.
The tokenizer is the bundled SmolLM2 one (vocabulary 49152). Prints a JSON summary
(path, sha256, bytes, tensor types, seconds, peak RSS).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opencoti.engine.model.synthetic import (  # noqa: E402
    ARCHITECTURES,
    DEFAULT_HEAD_SCALE,
    MIXES,
    PRESETS,
    preset_args,
    write_gguf,
)


def parse_rope_scaling(text: str | None):
    """'linear:4' | 'llama3:8,1,4,8192' | 'none' -> the write_gguf tuple."""
    if text is None or text == "none":
        return None
    kind, _, rest = text.partition(":")
    values = [v for v in rest.split(",") if v]
    if kind == "linear" and len(values) == 1:
        return ("linear", float(values[0]))
    if kind == "llama3" and len(values) == 4:
        return ("llama3", float(values[0]), float(values[1]), float(values[2]), int(values[3]))
    raise argparse.ArgumentTypeError(
        f"bad --rope-scaling {text!r}: use none, linear:FACTOR or llama3:FACTOR,LOW,HIGH,ORIGINAL_CONTEXT")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("-o", "--output", required=True, help="the .gguf path to write")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--arch", choices=ARCHITECTURES)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--ffn", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--kv-heads", type=int)
    ap.add_argument("--head-dim", type=int, help="default hidden/heads")
    ap.add_argument("--context", type=int)
    ap.add_argument("--rope-theta", type=float)
    ap.add_argument("--rope-scaling", type=parse_rope_scaling,
                    help="none | linear:FACTOR | llama3:FACTOR,LOW,HIGH,ORIGINAL_CONTEXT")
    ap.add_argument("--qkv-bias", action="store_true", default=None, help="q/k/v biases (always for qwen2)")
    tie = ap.add_mutually_exclusive_group()
    tie.add_argument("--tied", dest="tied", action="store_true", default=None, help="output head = token_embd")
    tie.add_argument("--no-tied", dest="tied", action="store_false", help="a separate output.weight")
    ap.add_argument("--mix", choices=MIXES, default="Q4_K_M")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--head-scale", type=float, help=f"about the std of the logits (default {DEFAULT_HEAD_SCALE})")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)

    kw = preset_args(args.preset)
    for flag, key in (("arch", "arch"), ("hidden", "hidden"), ("layers", "layers"), ("ffn", "ffn"),
                      ("heads", "heads"), ("kv_heads", "kv_heads"), ("head_dim", "head_dim"),
                      ("context", "context"), ("rope_theta", "rope_theta"), ("qkv_bias", "qkv_bias"),
                      ("tied", "tied"), ("head_scale", "head_scale")):
        value = getattr(args, flag)
        if value is not None:
            kw[key] = value
    if args.rope_scaling is not None or "--rope-scaling" in (argv if argv is not None else sys.argv):
        kw["rope_scaling"] = args.rope_scaling
    if kw.get("arch") != "llama" and kw.get("rope_scaling") and kw["rope_scaling"][0] == "llama3":
        kw["rope_scaling"] = None  # a llama preset's llama3 scaling does not carry over to qwen
    kw["mix"], kw["seed"] = args.mix, args.seed
    say = None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    started = time.perf_counter()
    try:
        summary = write_gguf(args.output, progress=say, **kw)
    except ValueError as exc:
        print(f"make_gguf: {exc}", file=sys.stderr)
        return 2
    summary["seconds"] = round(time.perf_counter() - started, 2)
    summary["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    summary["args"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in kw.items()}
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
