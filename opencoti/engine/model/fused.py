"""Decode steps in one native call per layer (``torch.ops.opencoti.decode_layer``: ``oc_decode_layer`` in
``engine/native/kernels.cpp``).

A decode-only step (every sequence computes one new token) of a model whose projections all run
native kernels (``native_q4`` / ``native_q8``), with fp32 activations on CPU, an fp32, fp16, bf16 or q8
KV cache (read and written in its dtype, attention computed in fp32) and the torch attention
backend's plain (non-cascade) plan, runs each decoder layer as one call: norms,
projections, RoPE, the K/V cache write, paged attention, SiLU and residuals, without returning to
Python in between. Any other step takes the layer-by-layer path in ``llama.py``; both compute the
same function (tests compare them). Profiled on the bundled model (2-core AVX2 EPYC, one session),
the per-op cost of the layer-by-layer path (~20 torch calls per layer) was most of a decode step
once the projections were quantized.
"""

from __future__ import annotations

import torch


def prepare(model) -> list | None:
    """Per layer, its four projections (qkv, o, gate_up, down) as the fused operator takes them:
    (weights, scales, biases) lists; None when the fused path does not apply to this model."""
    from .. import native

    if native.lib() is None or model.device.type != "cpu" or model.dtype != torch.float32 or model.dims.qk_norm:
        return None
    layers = []
    for L in model.layers:
        kerns = (L.qkv, L.o, L.gate_up, L.down)
        if not all(hasattr(k, "proj") for k in kerns):
            return None
        projs = [k.proj() for k in kerns]
        layers.append(tuple([p[i] for p in projs] for i in range(3)))
    return layers


def decode_step(model, layers: list, x: torch.Tensor, meta, k_cache: torch.Tensor, v_cache: torch.Tensor,
                backend, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Run every layer on ``x`` [T, hidden] in place; False (nothing done) when this step does not
    qualify (a prefill row, a cascade plan, another backend, a cache the kernels cannot read)."""
    from .. import native

    plan = meta.backend_state.get("torch")
    if (plan is None or not getattr(backend, "native", False) or plan["cascade"] is not None or plan["prefill"]
            or plan["decode"] is None or native.kv_type(k_cache.dtype) is None or v_cache.dtype != k_cache.dtype
            or not k_cache.is_contiguous() or not v_cache.is_contiguous()):
        return False
    rows, page_idx, _span, _mask, lens = plan["decode"]
    d = model.dims
    T = x.shape[0]
    if rows.shape[0] != T:
        return False
    cos, sin = cos.reshape(T, -1).contiguous(), sin.reshape(T, -1).contiguous()
    slots = meta.slot_mapping.contiguous()
    layer = native.lib().decode_layer.default
    eps, heads, scale = d.rms_norm_eps, d.num_heads, model.scale
    for i, L in enumerate(model.layers):
        weights, scales, biases = layers[i]
        layer(x, L.in_norm, L.post_norm, eps, weights, scales, biases, cos, sin, slots, k_cache[i], v_cache[i], rows,
              page_idx, lens, heads, scale)
    return True
