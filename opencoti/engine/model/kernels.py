"""Linear-projection kernels per weight format and device: ``y = x @ W.T + b``.

Each kernel takes activations ``x [T, K]`` in the model's activation dtype and returns ``[T, N]``
in that dtype. Which kernel serves a format on a device is decided by measurement
(``autotune.py``); :func:`candidates` lists what exists here:

=======  ====================================================  ==========================================
format   CPU                                                   CUDA
=======  ====================================================  ==========================================
fp32     oneDNN pre-packed fp32 (``mkldnn_fp32``), matmul       matmul
bf16     oneDNN bf16 (CPUs with bf16 GEMM), FBGEMM fp16          matmul (bf16)
         weights (``fbgemm_fp16``: 16-bit weights, fp32 math)
int8     ``native_q8`` (fp32 activations), ``_weight_int8pack_mm``  ``_weight_int8pack_mm``
         (bf16 activations)
int4     ``native_q4`` (fp32 activations),                     ``_weight_int4pack_mm`` (tinygemm layout)
         ``_weight_int4pack_mm_for_cpu`` (bf16 activations)
=======  ====================================================  ==========================================

``native_kquant`` serves a GGUF's Q4_K / Q6_K rows as the file stores them (``qformats.KQuantRows``):
it is not timed against the others, because it is the only kernel that reads those bytes without a
conversion that adds bytes (int4 blocks take 5 bits a Q4_K weight, int8 8 a Q6_K one).

``native_q4`` / ``native_q8`` / ``native_kquant`` are this package's own AVX2/FMA kernels (``engine/native``), built for
the machine on first use: torch's int4/int8 CPU kernels round the activations to bf16 and, on CPUs
without native bf16 arithmetic, convert in software (measured on a 2-core AVX2 EPYC: a decode step's
projections took several times the weight-streaming time).

Weight-only kernels only: FBGEMM's dynamic int8 (``quantized.linear_dynamic``) was measured and
left out, because it also quantizes the activations (one 7-bit scale per call) and fails the
accuracy gate on SmolLM2 (perplexity x2.67, greedy top-1 agreement 49 % vs fp32).
"""

from __future__ import annotations

import torch

from .qformats import Int4Weight, Int8Weight, KQuantRows, Q4Blocks, quantize_int4, quantize_int8

FORMATS = ("fp32", "bf16", "int8", "int4")


def _onednn_linear_available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class Kernel:
    """Base: ``out_features``, ``nbytes`` (weight bytes read per call), ``bias``, ``name``."""

    name = "?"
    fmt = "?"

    def _init(self, n: int, k: int, nbytes: int, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features, self.nbytes, self.bias = n, k, int(nbytes), bias
        if bias is not None:
            self.nbytes += bias.numel() * bias.element_size()

    def _b(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # each kernel's own
        raise NotImplementedError


class DenseMkldnn(Kernel):
    """oneDNN pre-packed weight (fp32 or bf16): the GEMM streams it without re-packing per call."""


    def __init__(self, weight: torch.Tensor, bias, act_dtype: torch.dtype):
        if not _onednn_linear_available():
            raise RuntimeError("oneDNN linear is not available")
        self.dtype = weight.dtype
        self.fmt = "bf16" if weight.dtype == torch.bfloat16 else "fp32"
        self.name = f"mkldnn_{self.fmt}"
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 8)
        b = None if bias is None else bias.to(weight.dtype)
        n, k = weight.shape
        self._init(n, k, weight.numel() * weight.element_size(), b)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xin = x if x.dtype == self.dtype else x.to(self.dtype)
        y = torch.ops.mkldnn._linear_pointwise(xin.contiguous(), self.packed, self.bias, "none", [None], "")
        return y if y.dtype == x.dtype else y.to(x.dtype)


class DenseMatmul(Kernel):
    """Plain ``x @ W.T`` with the weight stored transposed (CUDA; the CPU fallback)."""


    def __init__(self, weight: torch.Tensor, bias, act_dtype: torch.dtype):
        self.fmt = "bf16" if weight.dtype == torch.bfloat16 else "fp32"
        self.name = f"matmul_{self.fmt}"
        self.weight_t = weight.t().contiguous()
        n, k = weight.shape
        self._init(n, k, weight.numel() * weight.element_size(), None if bias is None else bias.to(act_dtype))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = x.to(self.weight_t.dtype) @ self.weight_t
        return self._b(y.to(x.dtype))


class FbgemmFp16(Kernel):
    """FBGEMM: fp16 weights, fp32 activations and accumulation (half the bytes of fp32)."""

    name, fmt = "fbgemm_fp16", "bf16"

    def __init__(self, weight: torch.Tensor, bias, act_dtype: torch.dtype):
        if act_dtype != torch.float32:
            raise RuntimeError("fbgemm_fp16 takes fp32 activations")
        w = weight.float()
        if not bool(torch.isfinite(w.half()).all()):
            raise RuntimeError("weights out of fp16 range")
        self.packed = torch.ops.quantized.linear_prepack_fp16(w.contiguous(), None)
        n, k = w.shape
        self._init(n, k, w.numel() * 2, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._b(torch.ops.quantized.linear_dynamic_fp16(x.contiguous(), self.packed))


class Int8PackMM(Kernel):
    """``torch._weight_int8pack_mm``: int8 weights, per-channel scales, bf16 (CPU) / act-dtype (CUDA) math."""

    name, fmt = "int8pack", "int8"

    def __init__(self, w8: Int8Weight, bias, act_dtype: torch.dtype, device: torch.device):
        self.dtype = torch.bfloat16 if act_dtype == torch.float32 else act_dtype
        self.q = w8.q.to(device).contiguous()
        self.scale = w8.scale.to(device=device, dtype=self.dtype)
        n, k = w8.shape
        self._init(n, k, n * k + n * self.scale.element_size(), None if bias is None else bias.to(act_dtype))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.to(self.dtype).contiguous(), self.q, self.scale)
        return self._b(y.to(x.dtype))


def _scales_and_zeros(w4: Int4Weight, dtype: torch.dtype, device) -> torch.Tensor:
    # [K / group, N, 2] as the tinygemm-style kernels want it
    return torch.stack([w4.scale, w4.zero], -1).transpose(0, 1).contiguous().to(device=device, dtype=dtype)


class Int4PackCPU(Kernel):
    """``torch._weight_int4pack_mm_for_cpu``: int4 groups with scale + zero, bf16 activations."""

    name, fmt = "int4pack_cpu", "int4"

    def __init__(self, w4: Int4Weight, bias, act_dtype: torch.dtype):
        n, k = w4.shape
        self.group = w4.group
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w4.q.to(torch.int32).contiguous(), 1)
        self.sz = _scales_and_zeros(w4, torch.bfloat16, "cpu")
        self._init(n, k, n * k // 2 + self.sz.numel() * 2, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), self.packed, self.group,
                                                       self.sz)
        return self._b(y.to(x.dtype))


class _NativeKernel(Kernel):
    """What the native kernels share: the typed operators (``torch.ops.opencoti``), fp32 activations."""

    def _attach(self, act_dtype: torch.dtype) -> None:
        from .. import native

        self.ops = native.lib()
        if self.ops is None:
            raise RuntimeError(f"native kernels {native.status()['reason']}")
        if act_dtype != torch.float32:
            raise RuntimeError(f"{self.name} takes fp32 activations")


class NativeQ4(_NativeKernel):
    """Native int4 (``engine/native``): 20 bytes per 32 weights (nibbles, fp16 d, fp16 m), fp32 accumulation."""

    name, fmt = "native_q4", "int4"

    def __init__(self, w4: "Int4Weight | Q4Blocks", bias, act_dtype: torch.dtype):
        self._attach(act_dtype)
        n, k = w4.shape
        if isinstance(w4, Q4Blocks):  # already in this kernel's layout (a GGUF's 4-bit rows)
            self.blocks = w4.blocks.contiguous()
        else:
            if w4.group != 32 or k % 32:
                raise RuntimeError(f"native_q4 needs groups of 32 inputs, got {w4.group} (K={k})")
            self.blocks = pack_q4_blocks(w4)
        self._init(n, k, self.blocks.numel(), None if bias is None else bias.float().contiguous())
        self._op = self.ops.q4_matmul.default

    def proj(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The weights as the fused decode layer takes them: (weights, scale, bias)."""
        return self.blocks, None, self.bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x.contiguous(), self.blocks, self.bias)


def pack_q4_blocks(w4: Int4Weight) -> torch.Tensor:
    """``Int4Weight`` (group 32) -> uint8 [N, K/32 * 20]: per row, K/32 x 16 bytes of nibbles (byte j of
    a block holds value j low, j + 16 high, as GGUF Q4_0/Q4_1 do), then K/32 fp16 scales d, then K/32
    fp16 offsets m: ``W = d * q + m`` (``m = zero - 8 d``). Raises when a scale or offset does not fit
    fp16."""
    n, k = w4.shape
    nb = k // 32
    d = w4.scale.float()
    m = w4.zero.float() - 8.0 * d
    dm = torch.stack([d, m], 0).half()  # [2, N, nb]
    if not bool(torch.isfinite(dm).all()):
        raise RuntimeError("int4 scales out of fp16 range")
    q = w4.q.view(n, nb, 32).to(torch.uint8)
    nib = (q[..., :16] | (q[..., 16:] << 4)).reshape(n, nb * 16)
    return torch.cat([nib, dm[0].view(torch.uint8), dm[1].view(torch.uint8)], -1).contiguous()


class NativeQ8(_NativeKernel):
    """Native int8 (``engine/native``): int8 [N, K] with per-row fp32 scales, fp32 math."""

    name, fmt = "native_q8", "int8"

    def __init__(self, w8: Int8Weight, bias, act_dtype: torch.dtype):
        self._attach(act_dtype)
        self.q = w8.q.contiguous()
        self.scale = w8.scale.float().contiguous()
        n, k = w8.shape
        self._init(n, k, n * k + n * 4, None if bias is None else bias.float().contiguous())
        self._op = self.ops.q8_matmul.default

    def proj(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The weights as the fused decode layer takes them: (weights, scale, bias)."""
        return self.q, self.scale, self.bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x.contiguous(), self.q, self.scale, self.bias)


class NativeKQuant(_NativeKernel):
    """Native k-quant rows (``engine/native``): a GGUF's Q4_K / Q6_K super-blocks as stored, in segments of
    one type (``KQuantRows``): int8 activations per super-block of 256 (llama.cpp's Q8_K) with integer sub-block
    scales, fp32 per super-block (``native.kquant_i8_rows(0)``: int16 per block of 32)."""

    name, fmt = "native_kquant", "int4"

    def __init__(self, w: KQuantRows, bias, act_dtype: torch.dtype):
        self._attach(act_dtype)
        self.data = w.data.contiguous()
        self.segments = list(w.segments)
        self.table = w.table()
        self.table_t = torch.tensor(self.table, dtype=torch.int64).reshape(-1, 3)  # the fused layer's form
        n, k = w.shape
        self._init(n, k, self.data.numel(), None if bias is None else bias.float().contiguous())
        self._op = self.ops.ggml_matmul.default

    def proj(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The weights as the fused decode layer takes them: (bytes, segment table, bias)."""
        return self.data, self.table_t, self.bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x.contiguous(), self.data, self.table, self.bias)


def _inner_k_tiles(k: int) -> int:
    for t in (8, 4, 2):
        if k % (t * 16) == 0:
            return t
    raise RuntimeError(f"int4 (CUDA) needs the input size to be a multiple of 32, got {k}")


class Int4PackCUDA(Kernel):
    """``torch._weight_int4pack_mm`` (tinygemm): int4 groups, bf16 activations, on CUDA."""

    name, fmt = "int4pack_cuda", "int4"

    def __init__(self, w4: Int4Weight, bias, act_dtype: torch.dtype, device: torch.device):
        n, k = w4.shape
        if w4.group not in (32, 64, 128, 256):
            raise RuntimeError(f"int4 (CUDA) group size must be 32|64|128|256, got {w4.group}")
        q = w4.q.to(device)
        nib = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8).contiguous()  # [N, K/2]
        self.packed = torch.ops.aten._convert_weight_to_int4pack(nib, _inner_k_tiles(k))
        self.group = w4.group
        self.sz = _scales_and_zeros(w4, torch.bfloat16, device)
        self._init(n, k, n * k // 2 + self.sz.numel() * 2, None if bias is None else bias.to(act_dtype))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm(x.to(torch.bfloat16).contiguous(), self.packed, self.group, self.sz)
        return self._b(y.to(x.dtype))


# ------------------------------------------------------------------------------------ construction
def candidates(fmt: str, device: torch.device) -> tuple[str, ...]:
    """Kernel names that may serve ``fmt`` on ``device``, in order of preference when untimed."""
    cpu = torch.device(device).type == "cpu"
    table = {
        "fp32": ("mkldnn_fp32" if _onednn_linear_available() else "matmul_fp32",) if cpu else ("matmul_fp32",),
        "bf16": ("mkldnn_bf16", "fbgemm_fp16", "matmul_bf16") if cpu else ("matmul_bf16",),
        "int8": (*_native(cpu, "native_q8"), "int8pack"),
        "int4": (*_native(cpu, "native_q4"), "int4pack_cpu") if cpu else ("int4pack_cuda",),
    }
    if fmt not in table:
        raise ValueError(f"unknown weight format {fmt!r} (choose from {', '.join(FORMATS)})")
    return table[fmt]


def _native(cpu: bool, name: str) -> tuple[str, ...]:
    from .. import native

    return (name,) if cpu and native.lib() is not None else ()


def to_format(weight, fmt: str):
    """A float or quantized weight in the container ``fmt``'s kernels take (exact when it already is)."""
    if fmt == "int8":
        return weight if isinstance(weight, Int8Weight) else quantize_int8(_float(weight))
    if fmt == "int4":
        if isinstance(weight, Q4Blocks):
            return weight.to_int4()
        return weight if isinstance(weight, Int4Weight) else quantize_int4(_float(weight))
    w = _float(weight)
    return w.to(torch.bfloat16) if fmt == "bf16" else w


def _float(weight) -> torch.Tensor:
    return weight.float() if isinstance(weight, torch.Tensor) else weight.dequantize()


def build(name: str, weight, bias: torch.Tensor | None, *, act_dtype: torch.dtype, device) -> Kernel:
    """Kernel ``name`` for ``weight`` (float tensor or a container of the kernel's format).

    Raises RuntimeError/ValueError when the kernel can't serve this shape or machine."""
    device = torch.device(device)
    if bias is not None:
        bias = bias.to(device=device, dtype=act_dtype)
    if name in ("mkldnn_fp32", "mkldnn_bf16", "matmul_fp32", "matmul_bf16"):
        dt = torch.bfloat16 if name.endswith("bf16") else torch.float32
        w = _float(weight).to(device=device, dtype=dt).contiguous()
        return (DenseMkldnn if name.startswith("mkldnn") else DenseMatmul)(w, bias, act_dtype)
    if name == "fbgemm_fp16":
        return FbgemmFp16(_float(weight), bias, act_dtype)
    if name == "int8pack":
        return Int8PackMM(to_format(weight, "int8"), bias, act_dtype, device)
    if name == "native_q4":
        if device.type != "cpu":
            raise RuntimeError("native_q4 runs on CPU")
        return NativeQ4(weight if isinstance(weight, Q4Blocks) else to_format(weight, "int4"), bias, act_dtype)
    if name == "native_kquant":
        if device.type != "cpu":
            raise RuntimeError("native_kquant runs on CPU")
        if not isinstance(weight, KQuantRows):
            raise RuntimeError("native_kquant reads a GGUF's Q4_K / Q6_K rows as stored (KQuantRows)")
        return NativeKQuant(weight, bias, act_dtype)
    if name == "native_q8":
        if device.type != "cpu":
            raise RuntimeError("native_q8 runs on CPU")
        return NativeQ8(to_format(weight, "int8"), bias, act_dtype)
    if name == "int4pack_cpu":
        return Int4PackCPU(to_format(weight, "int4"), bias, act_dtype)
    if name == "int4pack_cuda":
        return Int4PackCUDA(to_format(weight, "int4"), bias, act_dtype, device)
    raise ValueError(f"unknown kernel {name!r}")
