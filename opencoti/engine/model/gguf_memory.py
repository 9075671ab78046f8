"""A GGUF model's weights against its file: the format that holds its projections at their own
precision (``own_format``), the bytes each format would hold (``resident_mb``), the candidates of
``weights=auto`` (the formats within ``GGUF_MEMORY_FACTOR`` x the file's bytes), and the record (and
warning) of what the built model holds against the file. Used by ``weights.py``.
"""

from __future__ import annotations

import logging
from pathlib import Path

from . import kernels
from .gguf_weights import gguf_format, read_form
from .llama import LlamaForward

log = logging.getLogger("opencoti.engine")

# auto on a GGUF file considers the formats whose weights take at most this x the file's bytes
GGUF_MEMORY_FACTOR = 1.25
_BYTES_PER_VALUE = {"int4": 20 / 32, "fp32": 4.0, "bf16": 2.0}  # native_q4 blocks: 16 B nibbles + fp16 d, m


def format_bytes(weight, fmt: str) -> float:
    """Bytes ``weight`` (a ``GGUFWeight`` projection) takes in ``fmt`` as ``gguf_format`` builds it."""
    n, k = weight.shape
    fmt = gguf_format([weight], fmt)
    if fmt == "int4" and read_form([weight]) == "kquant":
        return float(weight.nbytes)  # Q4_K / Q6_K rows as stored
    return n * k * (1.0 + 4.0 / k) if fmt == "int8" else n * k * _BYTES_PER_VALUE[fmt]


def projection_sources(loaded) -> list:
    state, hf = loaded.state_dict, loaded.hf_config
    names = [n for n in state if n.endswith("_proj.weight")]
    head = "lm_head.weight" if "lm_head.weight" in state and not getattr(hf, "tie_word_embeddings", False) \
        else "model.embed_tokens.weight"
    return [state[n] for n in names] + [state[head]]


def resident_mb(loaded, fmt: str) -> float:
    """MB of weights a GGUF model holds in ``fmt``: its projections and head in the format, its
    embedding in the file's own blocks."""
    sources = projection_sources(loaded)
    embed = loaded.state_dict["model.embed_tokens.weight"]
    return (sum(format_bytes(w, fmt) for w in sources) + embed.nbytes) / 1e6


def head_16bit_fits(loaded, fmt: str) -> bool:
    """Whether a GGUF model in ``fmt`` stays within :data:`GGUF_MEMORY_FACTOR` x the file with a 16-bit
    output head instead of an 8-bit one."""
    head = projection_sources(loaded)[-1]
    extra = head.numel() * (2.0 - 1.0) / 1e6
    return resident_mb(loaded, fmt) + extra <= GGUF_MEMORY_FACTOR * Path(loaded.source_gguf).stat().st_size / 1e6


def available_mb() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024 * 1.048576
    except (OSError, ValueError, IndexError):
        pass
    return float("inf")


def own_format(loaded) -> str:
    """The format that holds a GGUF file's layer projections at their own precision: int4 when the 4-bit
    types carry most of their weights (Q4_0/Q4_1/Q4_K, the rest in int8), int8 for 5- to 8-bit files,
    bf16 for 16-bit, fp32 for 32-bit."""
    sources = projection_sources(loaded)[:-1]  # the layers' projections (the head has its own rule)
    total = sum(w.numel() for w in sources)
    by_bits: dict[int, int] = {}
    for w in sources:
        by_bits[w.bits] = by_bits.get(w.bits, 0) + w.numel()
    if sum(v for b, v in by_bits.items() if b <= 4) * 2 >= total:
        return "int4"
    top = max(by_bits, key=lambda b: by_bits[b])
    return "int8" if top <= 8 else ("bf16" if top <= 16 else "fp32")


def gguf_candidates(loaded, device, choice: dict, say) -> tuple[str, tuple[str, ...]]:
    """``auto`` on a GGUF file: the file's own format and the others whose weights fit in
    :data:`GGUF_MEMORY_FACTOR` x the file's bytes (a format that would multiply memory is never chosen
    silently: it is not a candidate at all)."""
    file_mb = Path(loaded.source_gguf).stat().st_size / 1e6
    own = own_format(loaded)
    sizes = {f: round(resident_mb(loaded, f), 1) for f in kernels.FORMATS}
    served = [f for f in kernels.FORMATS if kernels.candidates(f, device)]
    fits = tuple(f for f in served if sizes[f] <= GGUF_MEMORY_FACTOR * file_mb or f == own)
    if own not in fits:  # no kernel for the file's own format here: the smallest that has one
        own = min(served, key=lambda f: sizes[f])
        fits = (own,)
    types: dict[str, int] = {}
    for w in projection_sources(loaded):
        types[w.type_name] = types.get(w.type_name, 0) + 1
    choice.update(own_format=own, file_mb=round(file_mb, 1), weights_mb=sizes,
                  file_tensor_types=dict(sorted(types.items())), candidates=list(fits))
    say(f"auto weights: {own} holds the file's own precision; candidates within "
        f"{GGUF_MEMORY_FACTOR}x the file ({file_mb:.0f} MB): {', '.join(fits)}")
    return own, fits


def memory_against_file(model: LlamaForward, loaded, choice: dict, say) -> None:
    """Record the bytes the model's tensors hold against the GGUF file's (``choice["memory"]``, in
    ``/props``). A format other than the file's own precision that holds more than
    :data:`GGUF_MEMORY_FACTOR` x the file (``auto`` never chooses one) says so loudly (log warning,
    progress line, ``choice["memory_warning"]``), with what the file's own would hold."""
    held = model.tensor_bytes()
    total = sum(held.values())
    file_bytes = Path(loaded.source_gguf).stat().st_size
    own = choice.get("own_format") or own_format(loaded)
    choice["memory"] = {"tensors_mb": round(total / 1e6, 1), "file_mb": round(file_bytes / 1e6, 1),
                        "ratio": round(total / file_bytes, 3), "own_format": own,
                        "by_item_mb": {k: round(v / 1e6, 1) for k, v in held.items()}}
    if model.weights != own and total > GGUF_MEMORY_FACTOR * file_bytes:
        msg = (f"weights: {model.weights} holds {total / 1e6:.0f} MB of tensors for a {file_bytes / 1e6:.0f} MB GGUF "
               f"file ({total / file_bytes:.1f}x); the file's own precision ({own}, --weights {own}) would hold about "
               f"{resident_mb(loaded, own):.0f} MB")
        choice["memory_warning"] = msg
        log.warning(msg)
        say("WARNING: " + msg)


def own_summary(choice: dict) -> str:
    types = ", ".join(f"{n} x {t}" for t, n in choice.get("file_tensor_types", {}).items())
    return f"projections {types}; {choice['weights_mb'][choice['own_format']]:.0f} MB of weights for a " \
           f"{choice['file_mb']:.0f} MB file"
