"""Our forward pass for Llama-family decoders over the paged KV cache.

Covers Llama (incl. SmolLM2 and llama3 rope scaling), Mistral, Qwen2 (qkv bias) and Qwen3
(per-head q/k RMSNorm); GQA; tied embeddings. Weights come from a HF state dict; q/k/v and
gate/up projections are fused into one matmul each (fewer, larger GEMMs: on CPU the op count
per step matters as much as the FLOPs). transformers is used only to compute RoPE frequencies
with the exact scaling rules of each architecture.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..attention.base import AttentionMetadata

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
    """cos/sin tables [max_positions, head_dim] (fp32) using the architecture's own RoPE rules."""
    arch = cfg.model_type
    mod = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
    cls_name = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[arch] + "RotaryEmbedding"
    rotary = getattr(mod, cls_name)(cfg)
    pos = torch.arange(max_positions, dtype=torch.int64)[None, :]
    dummy = torch.zeros(1, dtype=torch.float32)
    with torch.no_grad():
        cos, sin = rotary(dummy, pos)
    return cos[0].to(device), sin[0].to(device)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, heads, D]; cos/sin [T, 1, D] (HF convention: halves, rotate_half)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rot = torch.cat((-x2, x1), dim=-1)
    return x * cos + rot * sin


def _onednn_linear_available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class Proj:
    """``y = x @ W.T + b`` with the fastest kernel for the device.

    On CPU the weight is pre-packed once into oneDNN's blocked layout: the GEMM then streams the
    weights without re-packing them every call. Measured on the 2-core target machine (fp32,
    SmolLM2 shapes, per decode step): F.linear 32 ms, x @ W.T (pre-transposed) 23 ms, pre-packed
    oneDNN 10 ms at batch 1, and 55 / 48 / 14.5 ms at batch 8 (docs/benchmarks.md). Elsewhere
    (CUDA) it is a plain matmul with the weight stored transposed.
    """

    __slots__ = ("weight_t", "packed", "bias", "out_features", "nbytes")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.out_features = weight.shape[0]
        self.bias = bias
        self.nbytes = weight.numel() * weight.element_size()
        self.packed = self.weight_t = None
        if weight.device.type == "cpu" and _onednn_linear_available():
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 8)
                return
            except RuntimeError:  # an unsupported dtype for this CPU: fall back
                self.packed = None
        self.weight_t = weight.t().contiguous()  # [in, out]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [None], "")
        y = x @ self.weight_t
        return y if self.bias is None else y + self.bias


class _Layer:
    __slots__ = ("in_norm", "qkv", "o", "post_norm", "gate_up", "down", "q_norm", "k_norm")


class LlamaForward:
    """Holds the weights and runs one step over the paged cache."""

    def __init__(self, hf_config, state_dict: dict[str, torch.Tensor], *, dtype: torch.dtype,
                 device: torch.device | str, max_positions: int):
        self.config = hf_config
        self.dims = d = ModelDims.from_hf_config(hf_config)
        self.dtype = dtype
        self.device = torch.device(device)

        def w(name: str) -> torch.Tensor:
            if name not in state_dict:
                raise KeyError(f"weight {name!r} missing from the checkpoint")
            return state_dict[name].to(device=self.device, dtype=dtype).contiguous()

        def proj(*names: str, bias: bool = False) -> Proj:
            weight = torch.cat([w(n + ".weight") for n in names], 0)
            b = torch.cat([w(n + ".bias") for n in names], 0).contiguous() if bias else None
            return Proj(weight, b)

        self.embed = w("model.embed_tokens.weight")  # [V, hidden]
        self.final_norm = w("model.norm.weight")
        if "lm_head.weight" in state_dict and not d.tie_word_embeddings:
            self.lm_head = proj("lm_head")  # hidden -> V
        else:
            self.lm_head = Proj(self.embed, None)
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
        self.sin = sin.to(dtype)
        self.max_positions = max_positions
        self.scale = 1.0 / math.sqrt(d.head_dim)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights read per decode step (embedding rows excluded, lm_head included)."""
        elem = self.final_norm.element_size()
        n = self.lm_head.nbytes + self.final_norm.numel() * elem
        for L in self.layers:
            n += sum(p.nbytes for p in (L.qkv, L.o, L.gate_up, L.down))
            for t in (L.in_norm, L.post_norm, L.qkv.bias, L.q_norm, L.k_norm):
                if t is not None:
                    n += t.numel() * elem
        return n

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor,
                v_cache: torch.Tensor, backend, logits_rows: torch.Tensor | None) -> torch.Tensor | None:
        """Compute the step's new tokens and return logits [len(logits_rows), V] (fp32).

        input_ids [T] int64; k_cache/v_cache [L, P, S, Hkv, D]; logits_rows: which of the T rows
        need logits (None = none, e.g. a prefill-only chunk).
        """
        d = self.dims
        T = input_ids.shape[0]
        h, hkv, hd = d.num_heads, d.num_kv_heads, d.head_dim
        q_size, kv_size = h * hd, hkv * hd
        backend.plan(meta, num_heads=h, num_kv_heads=hkv, head_dim=hd)
        cos = self.cos.index_select(0, meta.positions)[:, None, :]  # [T, 1, D]
        sin = self.sin.index_select(0, meta.positions)[:, None, :]
        x = self.embed.index_select(0, input_ids)  # [T, hidden]
        eps = d.rms_norm_eps
        for i, L in enumerate(self.layers):
            hs = _rms_norm(x, L.in_norm, eps)
            qkv = L.qkv(hs)  # [T, q + 2kv]
            q = qkv[:, :q_size].view(T, h, hd)
            k = qkv[:, q_size:q_size + kv_size].view(T, hkv, hd)
            v = qkv[:, q_size + kv_size:].view(T, hkv, hd)
            if L.q_norm is not None:
                q = _rms_norm(q, L.q_norm, eps)
                k = _rms_norm(k, L.k_norm, eps)
            q = _rotate(q, cos, sin)
            k = _rotate(k, cos, sin)
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
