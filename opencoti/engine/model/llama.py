"""Our forward pass for Llama-family decoders over the paged KV cache.

Covers Llama (incl. SmolLM2 and llama3 rope scaling), Mistral, Qwen2 (qkv bias) and Qwen3
(per-head q/k RMSNorm); GQA; tied embeddings. Weights come from a HF state dict (plus, for
GGUF sources, quantized tensors taken straight from the file); q/k/v and gate/up projections
are fused into one matmul each (fewer, larger GEMMs: on CPU the op count per step matters as
much as the FLOPs). Each projection runs a kernel for the weight format (``kernels.py``),
chosen per shape by measurement (``autotune.py``). transformers is used only to compute RoPE
frequencies with the exact scaling rules of each architecture.

On CPU, the pre-packed oneDNN fp32 kernel replaced ``F.linear`` / ``x @ W.T``: measured on the
2-core target machine (SmolLM2 shapes, per decode step) F.linear 32 ms, x @ W.T 23 ms, pre-packed
oneDNN 10 ms at batch 1, and 55 / 48 / 14.5 ms at batch 8.
"""

from __future__ import annotations

import importlib
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..attention.base import AttentionMetadata
from . import fused as _fused
from . import kernels as _kernels
from .gguf_weights import GGUFWeight, gguf_format, read_parts
from .qformats import KQuantRows, cat_rows

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelDims:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool

    @classmethod
    def from_hf_config(cls, cfg) -> "ModelDims":
        arch = cfg.model_type
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(
            architecture=arch,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
            qk_norm=arch == "qwen3",
        )


def _rotary_cos_sin(cfg, max_positions: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_positions, head_dim] (fp32) by the architecture's own RoPE rules: plain
    RoPE computed here as transformers' ``<Arch>RotaryEmbedding`` computes it (equal, bit for bit,
    for every supported architecture: tests/offline/test_rope_tables.py), other RoPE types by that
    class itself. Importing the modeling module pulls in ``torch._dynamo``: 1.8-3.4 s of every
    engine start, for a table."""
    table = _plain_rope_table(cfg, max_positions)
    if table is None:
        table = _transformers_rope_table(cfg, max_positions)
    cos, sin = table
    return cos.to(device), sin.to(device)


def _plain_rope_table(cfg, max_positions: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    params = getattr(cfg, "rope_parameters", None)
    if (not isinstance(params, dict) or params.get("rope_type", "default") != "default" or "rope_theta" not in params
            or params.get("partial_rotary_factor", 1.0) != 1.0 or getattr(cfg, "partial_rotary_factor", 1.0) != 1.0):
        return None
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    factors = getattr(cfg, "rope_freq_factors", None)
    if factors is not None:  # a GGUF's rope_freqs (llama3-style scaling): llama.cpp divides the frequencies by them
        if len(factors) != dim // 2:
            raise ValueError(f"rope_freq_factors has {len(factors)} values; the head dimension {dim} needs {dim // 2}")
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32)
    freqs = torch.arange(max_positions, dtype=torch.int64)[:, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _transformers_rope_table(cfg, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    arch = cfg.model_type
    mod = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
    cls_name = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[arch] + "RotaryEmbedding"
    rotary = getattr(mod, cls_name)(cfg)
    pos = torch.arange(max_positions, dtype=torch.int64)[None, :]
    dummy = torch.zeros(1, dtype=torch.float32)
    with torch.no_grad():
        cos, sin = rotary(dummy, pos)
    return cos[0], sin[0]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 and weight.dtype == torch.float32:  # one fused op instead of six
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE, HF convention (halves, ``rotate_half``): ``x * cos + rotate_half(x) * sin`` where
    ``rotate_half(x) = cat(-x2, x1) = roll(x) * (-1 | +1)``; the sign is folded into
    ``sin_signed = cat(-sin1, sin2)``: 3 ops instead of 7 (the per-step glue costs as much as
    the small GEMMs on CPU). x [T, heads, D]; cos/sin_signed [T, 1, D]."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)


class _Layer:
    __slots__ = ("in_norm", "qkv", "o", "post_norm", "gate_up", "down", "q_norm", "k_norm")
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: _kernels.Kernel  # hidden -> q + 2kv
    o: _kernels.Kernel  # q -> hidden
    gate_up: _kernels.Kernel  # hidden -> 2I
    down: _kernels.Kernel  # I -> hidden
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


def default_head_format(weights: str) -> str:
    """The output projection's format when nothing faster was measured: int4 keeps it in int8 (as
    llama.cpp's Q4 files keep it in Q6_K/Q8_0): measured on SmolLM2, greedy top-1 agreement with
    fp32 97 % with an int8 head, 84 % with int4."""
    return "int8" if weights == "int4" else weights


class LlamaForward:
    """Holds the weights and runs one step over the paged cache."""

    weights_choice: dict[str, Any]  # how the format was chosen (set by weights.build_forward)

    def __init__(self, hf_config, state_dict: dict[str, torch.Tensor], *, dtype: torch.dtype,
                 device: torch.device | str, max_positions: int, weights: str = "fp32",
                 quantized: dict | None = None, choose_kernel=None, threads=None, head_format: str | None = None,
                 embedding=None):
        """``weights``: fp32 | bf16 | int8 | int4 (the projections; embeddings and norms stay in
        ``dtype``). ``quantized``: HF weight name -> an ``Int4Weight``/``Int8Weight``/float tensor
        used instead of the state dict entry for projections (e.g. GGUF blocks). ``choose_kernel``:
        ``(fmt, n, k) -> kernel name`` (default: the first kernel that builds). ``threads``: a
        ``ThreadAdapter`` run around each forward (None = leave torch's thread count alone).
        ``head_format``: the output projection's format (default: :func:`default_head_format`).
        ``embedding``: the input embedding table to look tokens up in instead of a ``dtype`` copy of
        the state dict's (e.g. a GGUF's Q8_0 rows, ``embedding.Q8Embedding``: the same rows)."""
        self.config = hf_config
        self.dims = d = ModelDims.from_hf_config(hf_config)
        self.dtype = dtype
        self.device = torch.device(device)
        self.weights = weights
        self.threads = threads
        self.kernel_names: dict[str, str] = {}
        quantized = quantized or {}
        candidates = _kernels.candidates(weights, self.device)
        fallbacks = candidates + (_kernels.candidates("int8", self.device) if weights == "int4" else ()) \
            + _kernels.candidates("fp32", self.device)

        def w(name: str) -> torch.Tensor:
            if name not in state_dict:
                raise KeyError(f"weight {name!r} missing from the checkpoint")
            src = state_dict[name]
            if not isinstance(src, torch.Tensor):  # a GGUF tensor: read and decoded into a tensor of its own
                return src.to(device=self.device, dtype=dtype).contiguous()
            t = src.to(device=self.device, dtype=dtype).contiguous()
            # a copy of its own: a view would keep the checkpoint's memory map (all of it) resident
            return t.clone() if t.untyped_storage().data_ptr() == src.untyped_storage().data_ptr() else t

        def source(name: str):
            if name in quantized:
                return quantized[name]
            if name not in state_dict:
                raise KeyError(f"weight {name!r} missing from the checkpoint")
            return state_dict[name]

        def proj(*names: str, bias: bool = False, fmt: str = weights):
            parts = [source(n + ".weight") for n in names]
            if any(isinstance(p, GGUFWeight) for p in parts):  # read from the file now, one tensor at a time
                fmt = gguf_format(parts, fmt, self.device)
                parts = read_parts(parts, fmt, self.device)
            weight = cat_rows(parts)
            del parts
            b = torch.cat([w(n + ".bias") for n in names], 0).contiguous() if bias else None
            n, k = weight.shape
            if isinstance(weight, KQuantRows):  # the file's own k-quant blocks: the kernel that reads them as stored
                name = "native_kquant"
            else:
                name = choose_kernel(fmt, n, k) if choose_kernel is not None else \
                    _kernels.candidates(fmt, self.device)[0]
            kern = None
            others = (name, *(_kernels.candidates(fmt, self.device) if fmt != weights else ()), *fallbacks)
            for other in others:  # a kernel may not serve this shape (e.g. int4 group size)
                try:
                    kern = _kernels.build(other, weight, b, act_dtype=dtype, device=self.device)
                    break
                except (RuntimeError, ValueError):
                    continue
            if kern is None:
                raise RuntimeError(f"no kernel serves {weights} weights of shape {n}x{k} on {self.device}")
            used, shape = f"{fmt}:{kern.name}", f"{n}x{k}"
            before = self.kernel_names.get(shape)
            self.kernel_names[shape] = used if before in (None, used) or used in before.split("+") else f"{before}+{used}"
            return kern

        self.embed = embedding if embedding is not None else w("model.embed_tokens.weight")  # [V, hidden]
        self.final_norm = w("model.norm.weight")
        head_fmt = head_format or default_head_format(weights)
        head = "lm_head" if "lm_head.weight" in state_dict and not d.tie_word_embeddings else "model.embed_tokens"
        head_src = source(head + ".weight")
        if weights == "int4" and isinstance(head_src, GGUFWeight) and \
                gguf_format([head_src], "int4", self.device) == "int4":
            head_fmt = "int4"  # the file's own head (4-bit, or Q6_K as stored): its blocks (llama.cpp reads the same)
        self.lm_head = proj(head, fmt=head_fmt)  # hidden -> V
        self.layers: list[_Layer] = []
        for i in range(d.num_layers):
            p = f"model.layers.{i}."
            layer = _Layer()
            layer.in_norm = w(p + "input_layernorm.weight")
            layer.post_norm = w(p + "post_attention_layernorm.weight")
            layer.qkv = proj(p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj",
                             bias=d.qkv_bias)  # hidden -> q + 2kv
            layer.o = proj(p + "self_attn.o_proj")  # q -> hidden
            layer.gate_up = proj(p + "mlp.gate_proj", p + "mlp.up_proj")  # hidden -> 2I
            layer.down = proj(p + "mlp.down_proj")  # I -> hidden
            if d.qk_norm:
                layer.q_norm = w(p + "self_attn.q_norm.weight")
                layer.k_norm = w(p + "self_attn.k_norm.weight")
            else:
                layer.q_norm = layer.k_norm = None
            self.layers.append(layer)
        cos, sin = _rotary_cos_sin(hf_config, max_positions, self.device)
        self.cos = cos.to(dtype)  # [max_pos, D]
        sin = sin.to(dtype)
        half = d.head_dim // 2
        self.sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1).contiguous()  # the only sin table kept
        self.max_positions = max_positions
        self.scale = 1.0 / math.sqrt(d.head_dim)
        self.fused_layers = _fused.prepare(self)  # None: every step takes the layer-by-layer path

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights read per decode step (embedding rows excluded, lm_head included)."""
        elem = self.final_norm.element_size()
        n = self.lm_head.nbytes + self.final_norm.numel() * elem
        for L in self.layers:
            n += sum(p.nbytes for p in (L.qkv, L.o, L.gate_up, L.down))
            for t in (L.in_norm, L.post_norm, L.q_norm, L.k_norm):
                if t is not None:
                    n += t.numel() * elem
        return n

    def tensor_bytes(self) -> dict[str, int]:
        """Bytes the model's tensors hold, by item (each storage counted once): the input embedding,
        the output head, the layers' projections, the norms, the RoPE tables."""
        seen: set[int] = set()

        def held(*objs) -> int:
            n = 0
            for obj in objs:
                if obj is None:
                    continue
                ts = [obj] if isinstance(obj, torch.Tensor) else \
                    [v for v in vars(obj).values() if isinstance(v, torch.Tensor)]
                if not ts:  # a kernel holding an opaque packed weight (FBGEMM fp16): what it reads
                    n += getattr(obj, "nbytes", 0)
                for t in ts:
                    key = t.data_ptr() if t.layout == torch.strided else id(t)
                    if key not in seen:
                        seen.add(key)
                        n += (t.untyped_storage().nbytes() if t.layout == torch.strided and not t.is_mkldnn
                              else t.numel() * t.element_size())
            return n

        return {"embedding": held(self.embed), "output head": held(self.lm_head),
                "projections": held(*(k for L in self.layers for k in (L.qkv, L.o, L.gate_up, L.down))),
                "norms": held(self.final_norm, *(t for L in self.layers
                                                 for t in (L.in_norm, L.post_norm, L.q_norm, L.k_norm))),
                "rope tables": held(self.cos, self.sin_signed)}

    @property
    def weights_info(self) -> dict:
        """What serves the projections: format, kernel per shape, bytes per step, thread state."""
        from .. import native

        info = {"format": self.weights, "kernels": dict(self.kernel_names), "weight_bytes": self.weight_bytes,
                "fused_decode_layers": self.fused_layers is not None,
                "native": {k: v for k, v in native.status().items() if k != "path"}}
        if self.threads is not None:
            info["threads"] = self.threads.state()
        return info

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor,
                v_cache: torch.Tensor, backend, logits_rows: torch.Tensor | None) -> torch.Tensor | None:
        """Compute the step's new tokens and return logits [len(logits_rows), V] (fp32).

        input_ids [T] int64; k_cache/v_cache [L, P, S, Hkv, D]; logits_rows: which of the T rows
        need logits (None = none, e.g. a prefill-only chunk).
        """
        if self.threads is None:
            return self._forward(input_ids, meta, k_cache, v_cache, backend, logits_rows)
        T = int(input_ids.shape[0])
        self.threads.before(T)
        t0 = time.perf_counter()
        out = self._forward(input_ids, meta, k_cache, v_cache, backend, logits_rows)
        self.threads.after(T, time.perf_counter() - t0)
        return out

    @torch.inference_mode()
    def _forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, backend, logits_rows: torch.Tensor | None) -> torch.Tensor | None:
        d = self.dims
        T = input_ids.shape[0]
        h, hkv, hd = d.num_heads, d.num_kv_heads, d.head_dim
        q_size, kv_size = h * hd, hkv * hd
        backend.plan(meta, num_heads=h, num_kv_heads=hkv, head_dim=hd)
        cos = self.cos.index_select(0, meta.positions)[:, None, :]  # [T, 1, D]
        sin = self.sin_signed.index_select(0, meta.positions)[:, None, :]
        x = self.embed.index_select(0, input_ids)  # [T, hidden]
        eps = d.rms_norm_eps
        fused = self.fused_layers is not None and _fused.decode_step(self, self.fused_layers, x, meta, k_cache,
                                                                      v_cache, backend, cos, sin)
        for i, L in enumerate(() if fused else self.layers):
            hs = _rms_norm(x, L.in_norm, eps)
            qkv = L.qkv(hs)  # [T, q + 2kv]
            v = qkv[:, q_size + kv_size:].view(T, hkv, hd)
            qn, kn = L.q_norm, L.k_norm
            if qn is None or kn is None:  # q and k rotated together (a model has both norms or neither)
                qk = _rotate(qkv[:, :q_size + kv_size].view(T, h + hkv, hd), cos, sin)
                q, k = qk[:, :h].contiguous(), qk[:, h:].contiguous()  # backends take dense q/k
            else:
                q = _rotate(_rms_norm(qkv[:, :q_size].view(T, h, hd), qn, eps), cos, sin)
                k = _rotate(_rms_norm(qkv[:, q_size:q_size + kv_size].view(T, hkv, hd), kn, eps), cos, sin)
            attn = backend.forward(i, q, k, v.contiguous(), k_cache[i], v_cache[i], meta, self.scale)  # [T, H, D]
            x = x + L.o(attn.view(T, q_size))
            hs = _rms_norm(x, L.post_norm, eps)
            gate_up = L.gate_up(hs)  # [T, 2I]
            gate, up = gate_up.chunk(2, dim=-1)
            x = x + L.down(F.silu(gate) * up)
        if logits_rows is None or logits_rows.numel() == 0:
            return None
        x = _rms_norm(x.index_select(0, logits_rows), self.final_norm, eps)
        return self.lm_head(x).float()  # [B_out, V]

    @torch.inference_mode()
    def dense_logits(self, input_ids: torch.Tensor, rows_per_call: int | None = None) -> torch.Tensor:
        """Logits [T, V] (fp32) of one sequence from position 0, causal, without the paged cache
        (accuracy checks of weight formats; not a serving path). ``rows_per_call``: each projection
        runs on that many rows at a time (1: the kernels and numerics of decode steps, whose
        projections see one row per sequence; None: all T rows, as a prefill chunk)."""
        d = self.dims

        def run(kern, h: torch.Tensor) -> torch.Tensor:
            if rows_per_call is None or h.shape[0] <= rows_per_call:
                return kern(h)
            return torch.cat([kern(h[i:i + rows_per_call]) for i in range(0, h.shape[0], rows_per_call)])

        T = input_ids.shape[0]
        h, hkv, hd = d.num_heads, d.num_kv_heads, d.head_dim
        q_size, kv_size = h * hd, hkv * hd
        if T > self.max_positions:
            raise ValueError(f"{T} tokens exceed max_positions {self.max_positions}")
        pos = torch.arange(T, device=self.device)
        cos, sin = self.cos[pos][:, None, :], self.sin_signed[pos][:, None, :]
        x = self.embed.index_select(0, input_ids.to(self.device))
        eps = d.rms_norm_eps
        for L in self.layers:
            qkv = run(L.qkv, _rms_norm(x, L.in_norm, eps))
            q = qkv[:, :q_size].view(T, h, hd)
            k = qkv[:, q_size:q_size + kv_size].view(T, hkv, hd)
            v = qkv[:, q_size + kv_size:].view(T, hkv, hd)
            if L.q_norm is not None and L.k_norm is not None:
                q, k = _rms_norm(q, L.q_norm, eps), _rms_norm(k, L.k_norm, eps)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            rep = h // hkv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            attn = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                  is_causal=True, scale=self.scale)  # [H, T, D]
            x = x + run(L.o, attn.transpose(0, 1).reshape(T, q_size))
            gate, up = run(L.gate_up, _rms_norm(x, L.post_norm, eps)).chunk(2, dim=-1)
            x = x + run(L.down, F.silu(gate) * up)
        return run(self.lm_head, _rms_norm(x, self.final_norm, eps)).float()
