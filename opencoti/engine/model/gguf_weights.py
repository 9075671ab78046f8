"""The tensors of a GGUF file as the forward pass takes them: read on demand, one tensor at a time.

A GGUF file is read, not converted (DESIGN.md, decision 19). :func:`gguf_state` maps each HF
parameter name to a :class:`GGUFWeight`: the tensor's type, shape and place in the file, nothing
else. Its bytes are read with ``pread`` when a kernel is built from it (not through a memory map:
the pages of a map stay in the process's resident set until it is unmapped, so mapping an 8B file
and converting it tensor by tensor would hold the file *and* its conversion at the peak) and turned
into the serving format right away:

* Q4_0 / Q4_1 / Q4_K -> the native int4 layout by moving bytes (``qformats.gguf_to_q4_blocks``; Q4_K's
  sub-block scales rounded to fp16),
* on CPU with the native library (``OPENCOTI_KQUANT=0`` turns it off): Q4_K / Q6_K kept as the file
  stores them (``qformats.KQuantRows``), read by the native k-quant kernel,
* every type -> int8 by rows (dequantized a chunk of rows at a time, per-row scales),
* every type -> fp32 / bf16 by chunks of rows (a float copy of one tensor, never of the model).

llama-architecture files keep attn_q / attn_k rows in llama.cpp's rotary order; the rows are put
back in HF order on the raw bytes (each row's blocks stand alone), before decoding.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .qformats import EXACT_INT4_TYPES, KQUANT_TYPES, Int8Weight, KQuantRows, Q4Blocks, gguf_to_q4_blocks

CHUNK_BYTES = 32 << 20  # fp32 bytes of one dequantized chunk of rows

_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# bits a value of each type holds (what a format must keep): 4-bit types become int4 exactly
SOURCE_BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6, "Q8_0": 8,
               "Q8_K": 8, "F16": 16, "BF16": 16, "F32": 32, "Q2_K": 2, "Q3_K": 3, "IQ4_NL": 4, "IQ4_XS": 4}


def hf_name(gguf_name: str) -> str | None:
    """The HF parameter name of a GGUF tensor name (None: a tensor the forward does not read)."""
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES and parts[1].isdigit():
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


@dataclass
class GGUFWeight:
    """One tensor of a GGUF file: ``shape`` is torch's ``[N rows, K]`` (a 1-D tensor: ``[K]``)."""

    path: Path
    name: str
    type_name: str
    shape: tuple[int, ...]
    offset: int          # of its first byte in the file
    nbytes: int
    row_perm: torch.Tensor | None = field(default=None, repr=False)  # HF row i = file row row_perm[i]

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.rows

    @property
    def rows(self) -> int:
        return self.shape[0] if len(self.shape) == 2 else 1

    @property
    def bits(self) -> int:
        return SOURCE_BITS.get(self.type_name, 8)

    @property
    def is_exact_int4(self) -> bool:
        return self.type_name in EXACT_INT4_TYPES and len(self.shape) == 2

    @property
    def is_kquant(self) -> bool:
        """Whether the native k-quant kernel can read this tensor's blocks as stored (Q4_K / Q6_K rows)."""
        return self.type_name in KQUANT_TYPES and len(self.shape) == 2 and self.shape[1] % 256 == 0

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    # ------------------------------------------------------------------ reading
    def raw(self, r0: int = 0, r1: int | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """The bytes of rows ``[r0, r1)`` in HF row order: uint8 ``[r1 - r0, row_bytes]`` (a copy), read into
        ``out`` (uint8, ``(r1 - r0) * row_bytes`` contiguous bytes) when given: a fused projection's parts go
        straight into their place in one buffer, with no concatenation after."""
        r1 = self.rows if r1 is None else r1
        rb = self.row_bytes
        if out is not None and (out.dtype != np.uint8 or out.size != (r1 - r0) * rb or not out.flags.c_contiguous):
            raise ValueError(f"{self.name}: rows {r0}:{r1} take {(r1 - r0) * rb} contiguous bytes, got {out.size}")
        with open(self.path, "rb", buffering=0) as f:
            if self.row_perm is None:
                return self._read_into(f.fileno(), self.offset + r0 * rb, (r1 - r0) * rb, out).reshape(r1 - r0, rb)
            rows = self._read_into(f.fileno(), self.offset, self.nbytes).reshape(self.rows, rb)
        if out is None:
            return rows[self.row_perm[r0:r1].numpy()]
        np.take(rows, self.row_perm[r0:r1].numpy(), axis=0, out=out.reshape(r1 - r0, rb))
        return out.reshape(r1 - r0, rb)

    def _read_into(self, fd: int, offset: int, nbytes: int, out: np.ndarray | None = None) -> np.ndarray:
        """``nbytes`` at ``offset`` read straight into a new array (or ``out``: one copy out of the page
        cache, none through an intermediate bytes object)."""
        out = np.empty(nbytes, dtype=np.uint8) if out is None else out.reshape(-1)
        view, done = memoryview(out), 0  # type: ignore[arg-type]  # numpy's stubs give ndarray __buffer__ only for Python >= 3.12
        while done < nbytes:
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise ValueError(f"{self.path}: tensor {self.name!r} is cut short (truncated file?)")
            done += n
        return out

    def _chunk_rows(self) -> int:
        k = self.shape[-1]
        return max(1, CHUNK_BYTES // (4 * k))

    def dequantize_rows(self, r0: int, r1: int) -> torch.Tensor:
        """Rows ``[r0, r1)`` as fp32 ``[r1 - r0, K]`` (gguf's own decoder: the values llama.cpp uses)."""
        return decode_rows(self.type_name, self.raw(r0, r1), self.shape[-1])

    def dequantize(self) -> torch.Tensor:
        """The whole tensor in fp32 (one tensor; filled a chunk of rows at a time)."""
        if len(self.shape) == 1:
            return decode_rows(self.type_name, self.raw(), self.shape[0])[0]
        out = torch.empty(self.shape, dtype=torch.float32)
        step = self._chunk_rows()
        for r0 in range(0, self.rows, step):
            r1 = min(self.rows, r0 + step)
            out[r0:r1] = self.dequantize_rows(r0, r1)
        return out

    def to(self, device=None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A dense tensor (norms, biases, small tables), like ``Tensor.to``."""
        t = self.dequantize()
        return t.to(device=device, dtype=dtype or t.dtype)

    def is_floating_point(self) -> bool:
        return True

    def to_int4(self) -> Q4Blocks:
        """Q4_0 / Q4_1 / Q4_K rows in the native int4 layout, by moving bytes (``gguf_to_q4_blocks``:
        exact for Q4_0 / Q4_1, Q4_K's sub-block scales rounded to fp16); ValueError for another type."""
        if not self.is_exact_int4:
            raise ValueError(f"{self.name}: {self.type_name} has no exact int4 form")
        n, k = self.shape
        return gguf_to_q4_blocks(self.type_name, self.raw(), n, k)

    def to_kquant(self) -> KQuantRows:
        """The tensor's Q4_K / Q6_K rows as stored (HF row order), for the native k-quant kernel."""
        if not self.is_kquant:
            raise ValueError(f"{self.name}: {self.type_name} {self.shape} is not read by the k-quant kernel")
        return KQuantRows(torch.from_numpy(self.raw().reshape(-1)), [(self.type_name, self.rows)], self.shape[1])

    def to_int8(self) -> Int8Weight:
        """Per-row int8 (symmetric), quantized from the decoded rows: by the native operator
        (``gguf_to_q8_rows``, from the raw rows, the same bits) for the types it decodes where the
        library is built, else a chunk of rows at a time with gguf's decoder and ``quantize_int8``."""
        from .qformats import quantize_int8

        n, k = self.shape
        ggml_type = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14,
                     "BF16": 30}.get(self.type_name)  # ggml's type ids
        if ggml_type is not None:
            from .. import native  # here, not at the top: engine/native imports model/loader

            ops = native.lib()
            if ops is not None:
                if self.row_perm is not None or self.nbytes <= CHUNK_BYTES:  # (permuted rows: read whole)
                    q, scale = ops.gguf_to_q8_rows(torch.from_numpy(self.raw()), ggml_type, k)
                    return Int8Weight(q, scale)
                q = torch.empty((n, k), dtype=torch.int8)
                scale = torch.empty(n, dtype=torch.float32)
                step = max(1, CHUNK_BYTES // self.row_bytes)  # the file's bytes a chunk, not the whole tensor's
                for r0 in range(0, n, step):
                    r1 = min(n, r0 + step)
                    q[r0:r1], scale[r0:r1] = ops.gguf_to_q8_rows(torch.from_numpy(self.raw(r0, r1)), ggml_type, k)
                return Int8Weight(q, scale)
        q = torch.empty((n, k), dtype=torch.int8)
        scale = torch.empty(n, dtype=torch.float32)
        step = self._chunk_rows()
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            part = quantize_int8(self.dequantize_rows(r0, r1))
            q[r0:r1], scale[r0:r1] = part.q, part.scale
        return Int8Weight(q, scale)

    def sample(self, count: int = 4096) -> bytes:
        """The first ``count`` bytes of the tensor as stored (model fingerprints)."""
        with open(self.path, "rb", buffering=0) as f:
            return os.pread(f.fileno(), min(count, self.nbytes), self.offset)


def decode_rows(type_name: str, raw: np.ndarray, k: int) -> torch.Tensor:
    """GGUF rows (uint8 ``[rows, row_bytes]``) of ``type_name`` -> fp32 ``[rows, k]``."""
    rows = raw.shape[0]
    if type_name == "F32":
        return torch.from_numpy(np.ascontiguousarray(raw).view(np.float32).reshape(rows, k).copy())
    if type_name == "F16":
        return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16).reshape(rows, k).astype(np.float32))
    if type_name == "BF16":
        bits = np.ascontiguousarray(raw).view(np.uint16).astype(np.uint32) << 16
        return torch.from_numpy(bits.view(np.float32).reshape(rows, k))
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    out = dequantize(np.ascontiguousarray(raw), GGMLQuantizationType[type_name])
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32).reshape(rows, k))


def gguf_state(path: str | Path, hf_config) -> dict[str, GGUFWeight]:
    """HF parameter name -> :class:`GGUFWeight` for every tensor the forward reads (nothing is read
    from the tensors themselves). Raises ValueError on a tensor whose shape does not fit the config."""
    from .gguf_index import GGUFIndex

    path = Path(path)
    index = GGUFIndex(path)
    arch = index.architecture
    num_heads = int(hf_config.num_attention_heads)
    num_kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or num_heads)
    state: dict[str, GGUFWeight] = {}
    for t in index.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        shape = tuple(int(s) for s in reversed(t.shape))  # GGUF lists the row length first
        if len(shape) == 2 and shape[1] == 1:
            shape = (shape[0],)
        perm = None
        kind = t.name.split(".")[-2] if t.name.startswith("blk.") else ""
        if arch == "llama" and kind in ("attn_q", "attn_k") and len(shape) == 2:
            heads = num_heads if kind == "attn_q" else num_kv_heads
            n = shape[0]
            if n % (2 * heads):
                raise ValueError(f"{t.name}: {n} rows do not split into {heads} rotary heads")
            perm = torch.arange(n).reshape(heads, n // heads // 2, 2).transpose(1, 2).reshape(-1)
        state[name] = GGUFWeight(path, t.name, t.type_name, shape, t.offset, int(t.data.nbytes), perm)
    if getattr(hf_config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state


KQUANT_ENV = "OPENCOTI_KQUANT"  # "0": Q4_K / Q6_K become int4 blocks / int8 rows instead of being read as stored


def _kquant_native(device="cpu") -> bool:
    """Whether Q4_K / Q6_K rows are served as stored: on CPU where the native library is built, unless
    ``OPENCOTI_KQUANT=0``. The default by measurement: on the 1B Q4_K_M file (2-core AVX2 EPYC,
    ``peer_sizes``) the k-quant kernels with int8 activations per super-block decoded one session at
    0.88-1.10x llama.cpp and ran 8 sessions at 1.70-2.26x (two runs), where int4 blocks + int8 rows gave
    0.86x and 1.54x, at the file's size (benchmarks/results/.../peer_sizes_llama1b-q4km.json and its
    history; docs/models.md)."""
    if torch.device(device).type != "cpu" or os.environ.get(KQUANT_ENV, "1").strip().lower() in ("0", "false", "no",
                                                                                                     "off"):
        return False
    from .. import native  # here, not at the top: engine/native imports model/loader

    return native.lib() is not None


def read_form(parts: list, device="cpu") -> str | None:
    """How a projection of ``parts`` keeps 4-bit weights on ``device``: "kquant" (every part Q4_K / Q6_K,
    read as stored by the native k-quant kernel, CPU only), "q4" (every part Q4_0 / Q4_1 / Q4_K: the int4
    layout), or None (a part the file keeps in more bits that the k-quant kernel does not read)."""
    srcs = [p for p in parts if isinstance(p, GGUFWeight)]
    if len(srcs) == len(parts) and all(p.is_kquant for p in srcs) and _kquant_native(device):
        return "kquant"
    if all(p.is_exact_int4 for p in srcs):
        return "q4"
    return None


def gguf_format(parts: list, fmt: str, device="cpu") -> str:
    """The format a projection made of ``parts`` (fused q/k/v or gate/up) takes when the model's
    projections are in ``fmt``: in int4, the file's own blocks where every part has a 4-bit form
    (Q4_0 / Q4_1 / Q4_K as int4 blocks; Q4_K and Q6_K as stored, in segments, with the native k-quant
    kernel: a q/k/v whose v is Q6_K, as Q4_K_M files have in some layers, stays one projection); a part
    the file keeps in more bits that no 4-bit form reads (Q8_0, Q5_K, F16 ..., or Q6_K without the
    native kernels) is never rounded down to 4 bits: the projection takes int8."""
    if fmt == "int4" and read_form(parts, device) is None:
        return "int8"
    return fmt


def read_parts(parts: list, fmt: str, device="cpu") -> list:
    """The GGUF ``parts`` of one projection read from the file into ``fmt`` (from :func:`gguf_format`),
    all in one container kind (so they fuse): k-quant rows, int4 blocks, int8 rows or fp32."""
    if fmt == "int4" and read_form(parts, device) == "kquant":
        if len(parts) == 1:
            return [parts[0].to_kquant()]
        # a fused projection's parts read into one buffer, each at its place: cat_rows then takes it as is
        buf = torch.empty(sum(p.nbytes for p in parts), dtype=torch.uint8)
        data = buf.numpy()  # the same memory
        at, rows = 0, []
        for p in parts:
            p.raw(out=data[at:at + p.nbytes])
            rows.append(KQuantRows(buf[at:at + p.nbytes], [(p.type_name, p.rows)], p.shape[1]))
            at += p.nbytes
        return rows
    return [from_gguf(p, fmt) if isinstance(p, GGUFWeight) else p for p in parts]


def from_gguf(weight: GGUFWeight, fmt: str):
    """``weight`` read from its file into the container ``fmt``'s kernels take: an ``Int4Weight``
    (its blocks, exactly), an ``Int8Weight`` (per-row, from the decoded rows) or an fp32 tensor."""
    if fmt == "int4" and weight.is_exact_int4:
        return weight.to_int4()
    if fmt == "int8":
        return weight.to_int8()
    return weight.dequantize()
