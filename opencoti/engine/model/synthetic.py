"""Synthetic GGUF files: test models of any size, no downloads.

:func:`write_gguf` writes a random-weight Llama / Qwen2 / Qwen3 model as a GGUF
file that llama.cpp and opencoti both load, with the bundled SmolLM2 tokenizer
(every ``tokenizer.*`` key copied from the bundled GGUF, so the vocabulary has
49152 entries = the rows of ``token_embd``). Quantized tensors are generated
directly as ggml blocks (random quants, random fp16 scales, valid 6-bit k-quant
sub-block scales), never by quantizing floats, so an 8B Q4_K_M file takes
seconds plus the disk write, and the data is streamed tensor by tensor (peak
memory: one chunk of one tensor).

Scales are chosen so every weight has mean 0 and std ~ 1/sqrt(fan_in), so
activations stay sane through the layers; RMSNorm weights are F32 around 1.0,
biases F32 small. ``head_scale`` is (about) the std of the output logits: the
output weight is scaled by it (untied), or, for a tied head (the head IS the
embedding), ``output_norm``'s weight is — so the next-token distribution is
peaked like a real model's instead of flat.

Same arguments -> byte-identical file (each tensor has its own random stream
seeded from ``seed`` and the tensor's name).

Note for readers comparing against HF checkpoints: llama-architecture GGUF
files store the rows of ``attn_q`` / ``attn_k`` in llama.cpp's rotary order (the
HF converter permutes them). For random weights that is just a fixed
permutation, so nothing here applies it; a loader that un-permutes gets a
different (equally random) model that is still the same function as llama.cpp's.

The random blocks are made in ``ggml_blocks.py`` (the GGML type ids, block geometry and a tensor's
plan too), the bundled tokenizer's metadata is read by ``gguf_header.py``; this module plans the
tensors of a model and writes the file. Only numpy, gguf and the standard library are used.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from .gguf_header import TensorInfo, read_gguf_header, read_gguf_kv, tokenizer_kv
from .ggml_blocks import (F16, F32, FALLBACK, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, Q8_0, TYPE_NAMES, TensorPlan,
                               chunk_rows, make_chunk)

ARCHITECTURES = ("llama", "qwen2", "qwen3")
MIXES = ("F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K_S", "Q4_K_M", "Q5_K_M")
VOCAB_SIZE = 49152  # the bundled SmolLM2 tokenizer
RMS_EPS = 1e-5
DEFAULT_HEAD_SCALE = 8.0  # top-1 probability: median ~0.65-0.7, 10th percentile ~0.3 (measured, see tests)
# general.file_type (llama_ftype) per mix
FILE_TYPES = {"F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_M": 17}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(arch="llama", hidden=256, layers=2, ffn=512, heads=4, kv_heads=2, tied=True),
    "135m": dict(arch="llama", hidden=576, layers=30, ffn=1536, heads=9, kv_heads=3, tied=True,
                 context=8192, rope_theta=100000.0),
    "1b": dict(arch="llama", hidden=2048, layers=16, ffn=8192, heads=32, kv_heads=8, tied=True,
               context=131072, rope_theta=500000.0, rope_scaling=("llama3", 32.0, 1.0, 4.0, 8192)),
    "3b": dict(arch="llama", hidden=3072, layers=28, ffn=8192, heads=24, kv_heads=8, tied=True,
               context=131072, rope_theta=500000.0, rope_scaling=("llama3", 32.0, 1.0, 4.0, 8192)),
    "8b": dict(arch="llama", hidden=4096, layers=32, ffn=14336, heads=32, kv_heads=8, tied=False,
               context=131072, rope_theta=500000.0, rope_scaling=("llama3", 8.0, 1.0, 4.0, 8192)),
}


# ---------------------------------------------------------------------------
# the model plan
# ---------------------------------------------------------------------------


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama-quantize's choice of layers that get more bits in the *_M mixes."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def _weight_type(mix: str, role: str, i_layer: int, n_layers: int, cols: int, tied: bool) -> int:
    """The ggml type llama-quantize would pick for a 2-D weight (plain mixes are pure: one type)."""
    if mix == "F16":
        return F16
    if mix in ("Q8_0", "Q4_0", "Q4_1"):
        qtype = {"Q8_0": Q8_0, "Q4_0": Q4_0, "Q4_1": Q4_1}[mix]
        return qtype if cols % 32 == 0 else F16
    base = Q5_K if mix == "Q5_K_M" else Q4_K
    if role == "output" or (role == "token_embd" and tied):
        # llama-quantize: the output (and a tied embedding) gets Q6_K, or Q8_0 for odd row sizes
        return Q6_K if cols % 256 == 0 else Q8_0
    qtype = base
    if role == "attn_v":
        if mix in ("Q4_K_M", "Q5_K_M") and use_more_bits(i_layer, n_layers):
            qtype = Q6_K
        elif mix == "Q4_K_S" and i_layer < 4:
            qtype = Q5_K
    elif role == "ffn_down":
        if mix in ("Q4_K_M", "Q5_K_M") and use_more_bits(i_layer, n_layers):
            qtype = Q6_K
        elif mix == "Q4_K_S" and i_layer < n_layers // 8:
            qtype = Q5_K
    if cols % 256 != 0:  # tensor_type_fallback
        qtype = FALLBACK[qtype]
        if cols % 32 != 0:
            qtype = F16
    return qtype


def llama3_rope_factors(head_dim: int, theta: float, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_context: int) -> np.ndarray:
    """``rope_freqs.weight`` as llama.cpp's convert_hf_to_gguf.py computes it (head_dim/2 F32 factors)."""
    # float64 with math.pow (not numpy's SIMD float32 pow, which can differ by an ulp between CPUs):
    # the same bytes everywhere, within float32 rounding of the converter's torch.float32 values
    freqs = [1.0 / math.pow(theta, i / head_dim) for i in range(0, head_dim, 2)]
    low_wavelen = original_context / low_freq_factor
    high_wavelen = original_context / high_freq_factor
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _check(cond: object, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _positive_int(name: str, value: Any) -> int:
    _check(isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value > 0,
           f"{name} must be a positive integer, got {value!r}")
    return int(value)


def normalize_rope_scaling(rope_scaling: Any) -> tuple | None:
    """Validate ``rope_scaling``: None, ("linear", factor) or ("llama3", factor, low, high, original_context)."""
    if rope_scaling is None:
        return None
    _check(isinstance(rope_scaling, (tuple, list)) and len(rope_scaling) >= 1,
           f"rope_scaling must be None, ('linear', factor) or ('llama3', factor, low_freq_factor, "
           f"high_freq_factor, original_context), got {rope_scaling!r}")
    kind = rope_scaling[0]
    if kind == "linear":
        _check(len(rope_scaling) == 2, f"linear rope_scaling is ('linear', factor), got {rope_scaling!r}")
        factor = float(rope_scaling[1])
        _check(factor > 0, f"rope scaling factor must be > 0, got {factor}")
        return ("linear", factor)
    if kind == "llama3":
        _check(len(rope_scaling) == 5, "llama3 rope_scaling is ('llama3', factor, low_freq_factor, "
               f"high_freq_factor, original_context), got {rope_scaling!r}")
        factor, low, high = (float(x) for x in rope_scaling[1:4])
        original = _positive_int("original_context", rope_scaling[4])
        _check(factor > 0 and low > 0 and high > low,
               f"llama3 rope scaling needs factor > 0 and 0 < low_freq_factor < high_freq_factor, got {rope_scaling!r}")
        return ("llama3", factor, low, high, original)
    raise ValueError(f"unknown rope_scaling type {kind!r} (expected 'linear' or 'llama3')")


def plan_tensors(*, arch: str, hidden: int, layers: int, ffn: int, heads: int, kv_heads: int, head_dim: int,
                 tied: bool, mix: str, qkv_bias: bool, rope_freqs: bool, head_scale: float,
                 vocab: int = VOCAB_SIZE) -> list[TensorPlan]:
    """The file's tensors in order, with types and scales (names as llama.cpp expects them)."""
    plans: list[TensorPlan] = []
    q_out, kv_out = heads * head_dim, kv_heads * head_dim

    def weight(name: str, role: str, i: int, rows: int, cols: int, sigma: float | None = None) -> None:
        qtype = _weight_type(mix, role, i, layers, cols, tied)
        plans.append(TensorPlan(name, (rows, cols), qtype, "weight",
                                sigma=(1.0 / math.sqrt(cols)) if sigma is None else sigma))

    weight("token_embd.weight", "token_embd", -1, vocab, hidden)
    if rope_freqs:
        plans.append(TensorPlan("rope_freqs.weight", (head_dim // 2,), F32, "rope_freqs"))
    for i in range(layers):
        p = f"blk.{i}."
        plans.append(TensorPlan(p + "attn_norm.weight", (hidden,), F32, "norm"))
        weight(p + "attn_q.weight", "attn_q", i, q_out, hidden)
        weight(p + "attn_k.weight", "attn_k", i, kv_out, hidden)
        weight(p + "attn_v.weight", "attn_v", i, kv_out, hidden)
        if qkv_bias:
            for nm, n in (("attn_q", q_out), ("attn_k", kv_out), ("attn_v", kv_out)):
                plans.append(TensorPlan(p + nm + ".bias", (n,), F32, "bias", sigma=0.1))
        if arch == "qwen3":
            plans.append(TensorPlan(p + "attn_q_norm.weight", (head_dim,), F32, "norm"))
            plans.append(TensorPlan(p + "attn_k_norm.weight", (head_dim,), F32, "norm"))
        weight(p + "attn_output.weight", "attn_output", i, hidden, q_out)
        plans.append(TensorPlan(p + "ffn_norm.weight", (hidden,), F32, "norm"))
        weight(p + "ffn_gate.weight", "ffn_gate", i, ffn, hidden)
        weight(p + "ffn_up.weight", "ffn_up", i, ffn, hidden)
        weight(p + "ffn_down.weight", "ffn_down", i, hidden, ffn)
    plans.append(TensorPlan("output_norm.weight", (hidden,), F32, "norm", scale=head_scale if tied else 1.0))
    if not tied:
        weight("output.weight", "output", -1, vocab, hidden, sigma=head_scale / math.sqrt(hidden))
    return plans


# ---------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------


def _add_kv(writer: Any, key: str, vtype: int, value: Any, sub: int | None) -> None:
    import gguf

    vt = gguf.GGUFValueType(vtype)
    if vt == gguf.GGUFValueType.ARRAY:
        assert sub is not None, "an array has a sub type"
        try:
            writer.add_key_value(key, value, vt, sub_type=gguf.GGUFValueType(sub))
        except TypeError:  # older gguf: no sub_type; the type comes from the first element
            writer.add_key_value(key, value, vt)
    else:
        writer.add_key_value(key, value, vt)


def write_gguf(
    path: str | os.PathLike,
    *,
    arch: str = "llama",
    hidden: int = 256,
    layers: int = 2,
    ffn: int = 512,
    heads: int = 4,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    context: int = 4096,
    rope_theta: float = 10000.0,
    rope_scaling: tuple | None = None,
    qkv_bias: bool = False,
    tied: bool = True,
    mix: str = "Q4_K_M",
    seed: int = 0,
    head_scale: float = DEFAULT_HEAD_SCALE,
    name: str | None = None,
    tokenizer_from: str | os.PathLike | None = None,
    progress: Callable[[str], None] | None = None,
    threads: int | None = None,
) -> dict[str, Any]:
    """Write a random-weight model as a GGUF file at ``path``; returns a summary (sha256, bytes, types).

    ``arch``: "llama" | "qwen2" (always q/k/v biases) | "qwen3" (per-head q/k RMSNorm;
    ``head_dim`` may differ from hidden/heads). ``rope_scaling``: None,
    ``("linear", factor)`` or ``("llama3", factor, low_freq_factor, high_freq_factor,
    original_context)`` (llama only; written as ``rope_freqs.weight``). ``mix``: one of
    :data:`MIXES`; the k-quant mixes imitate llama-quantize's per-tensor choices (and its
    fallbacks for rows that are not a multiple of 256); F16/Q8_0/Q4_0/Q4_1 are pure.
    ``head_scale``: about the std of the output logits. ``threads``: chunks made in parallel
    (default: the CPU count, at most 4; the bytes do not depend on it). Raises ValueError on bad arguments.
    """
    import gguf

    _check(arch in ARCHITECTURES, f"arch must be one of {', '.join(ARCHITECTURES)}, got {arch!r}")
    _check(mix in MIXES, f"mix must be one of {', '.join(MIXES)}, got {mix!r}")
    hidden = _positive_int("hidden", hidden)
    layers = _positive_int("layers", layers)
    ffn = _positive_int("ffn", ffn)
    heads = _positive_int("heads", heads)
    kv_heads = heads if kv_heads is None else _positive_int("kv_heads", kv_heads)
    context = _positive_int("context", context)
    seed = int(seed)
    _check(0 <= seed < 2 ** 63, f"seed must be a non-negative integer, got {seed}")
    _check(heads % kv_heads == 0, f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if head_dim is None:
        _check(hidden % heads == 0, f"hidden ({hidden}) must be a multiple of heads ({heads}), or give head_dim")
        head_dim = hidden // heads
    head_dim = _positive_int("head_dim", head_dim)
    _check(head_dim % 2 == 0, f"head_dim must be even (rotary pairs), got {head_dim}")
    _check(math.isfinite(rope_theta) and rope_theta > 0, f"rope_theta must be > 0, got {rope_theta}")
    _check(math.isfinite(head_scale) and head_scale > 0, f"head_scale must be > 0, got {head_scale}")
    rope_scaling = normalize_rope_scaling(rope_scaling)
    if arch == "qwen2":
        qkv_bias = True
    _check(not (arch == "qwen3" and qkv_bias), "qwen3 has no q/k/v biases (qkv_bias=True is only for llama / qwen2)")
    _check(not (rope_scaling and rope_scaling[0] == "llama3" and arch != "llama"),
           "llama3 rope scaling (rope_freqs.weight) is only read by llama.cpp's llama architecture")
    _check(hidden % 32 == 0 and ffn % 32 == 0 and (heads * head_dim) % 32 == 0,
           f"hidden, ffn and heads*head_dim must be multiples of 32 (got {hidden}, {ffn}, {heads * head_dim}); "
           "k-quant rows that are not multiples of 256 fall back to Q5_0/Q5_1/Q8_0 like llama-quantize")

    tok_kv = tokenizer_kv(tokenizer_from)
    vocab = len(next(v for k, _, v, _ in tok_kv if k == "tokenizer.ggml.tokens"))
    rope_factors = None
    if rope_scaling and rope_scaling[0] == "llama3":
        rope_factors = llama3_rope_factors(head_dim, rope_theta, *rope_scaling[1:])
    plans = plan_tensors(arch=arch, hidden=hidden, layers=layers, ffn=ffn, heads=heads, kv_heads=kv_heads,
                         head_dim=head_dim, tied=tied, mix=mix, qkv_bias=qkv_bias,
                         rope_freqs=rope_factors is not None, head_scale=float(head_scale), vocab=vocab)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(str(tmp), arch)
    if gguf.Keys.General.ARCHITECTURE not in writer.kv_data[0]:
        writer.add_architecture()
    writer.add_type("model") if hasattr(writer, "add_type") else None
    writer.add_name(name or f"synthetic-{arch}-{hidden}x{layers}-{mix}-seed{seed}")
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(rope_theta))
    writer.add_layer_norm_rms_eps(RMS_EPS)
    if arch == "qwen3" or head_dim != hidden // heads or hidden % heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_vocab_size(vocab)
        writer.add_rope_dimension_count(head_dim)
    if rope_scaling and rope_scaling[0] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope_scaling[1])
    writer.add_file_type(FILE_TYPES[mix])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, vtype, value, sub in tok_kv:
        _add_kv(writer, key, vtype, value, sub)

    for plan in plans:
        writer.add_tensor_info(plan.name, plan.shape, np.dtype(np.float32), plan.nbytes,
                               raw_dtype=gguf.GGMLQuantizationType(plan.qtype))
    digest = hashlib.sha256()
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        fout = writer.fout[0] if isinstance(writer.fout, list) else writer.fout
        assert fout is not None  # open since write_header_to_file
        fout.flush()
        align = writer.data_alignment
        # everything so far, hashed from the file (the writer produced it), then the data as we write it
        with open(tmp, "rb") as f:
            head = f.read()
        digest.update(head)
        pos = len(head)

        def emit(data: bytes | memoryview) -> None:
            nonlocal pos
            fout.write(data)
            digest.update(data)
            pos += len(data)

        def write(job: tuple) -> None:  # in file order, on this thread
            k, plan, i, last, future = job
            if i == 0:
                emit(b"\0" * (-pos % align))
            emit(memoryview(np.ascontiguousarray(future.result())).cast("B"))  # type: ignore[arg-type]  # numpy stubs: ndarray.__buffer__ only for Python >= 3.12
            if last and progress and (k % 16 == 0 or k == len(plans) - 1):
                progress(f"{k + 1}/{len(plans)} tensors, {pos / 2**20:.0f} MiB")

        workers = max(1, min(4, threads if threads is not None else (os.cpu_count() or 1)))
        with ThreadPoolExecutor(max_workers=workers) as pool:  # numpy, hashing and writes release the GIL
            ahead: deque = deque()  # at most workers + 1 chunks in memory
            for k, plan in enumerate(plans):
                chunks = chunk_rows(plan)
                for i, (_, rows) in enumerate(chunks):
                    future = pool.submit(make_chunk, plan, seed, i, rows, rope_factors)
                    ahead.append((k, plan, i, i == len(chunks) - 1, future))
                    while len(ahead) > workers + 1 or (ahead and ahead[0][-1].done()):
                        write(ahead.popleft())
            while ahead:
                write(ahead.popleft())
        emit(b"\0" * (-pos % align))
        planned = -(-len(head) // align) * align + sum(-(-p.nbytes // align) * align for p in plans)
        if pos != planned:
            raise AssertionError(f"wrote {pos} bytes, planned {planned}")
        fout.flush()
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    types: dict[str, int] = {}
    for plan in plans:
        types[TYPE_NAMES[plan.qtype]] = types.get(TYPE_NAMES[plan.qtype], 0) + 1
    return {
        "path": str(path),
        "sha256": digest.hexdigest(),
        "bytes": pos,
        "tensors": len(plans),
        "types": types,
        "vocab": vocab,
        "head_dim": head_dim,
    }


def preset_args(preset: str) -> dict[str, Any]:
    """The generator arguments of a named preset (a copy)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (one of {', '.join(PRESETS)})")
    return dict(PRESETS[preset])


def sha256_file(path: str | os.PathLike, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


__all__: Sequence[str] = (
    "ARCHITECTURES", "MIXES", "PRESETS", "DEFAULT_HEAD_SCALE", "write_gguf", "preset_args", "plan_tensors",
    "tokenizer_kv", "read_gguf_kv", "read_gguf_header", "TensorInfo", "llama3_rope_factors", "use_more_bits", "sha256_file",
)
