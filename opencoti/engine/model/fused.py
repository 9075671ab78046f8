"""Decode steps in one native call (``torch.ops.opencoti.decode_layers`` / ``decode_layers_cascade``:
``oc_decode_layer_cascade`` of ``engine/native/kernels.cpp`` for each layer in turn).

A decode-only step (every row one new token: a sequence's decode row, or the rows of its
speculative draft) of a model whose projections all run native kernels (``native_q4`` /
``native_q8``), with fp32 activations on CPU, an fp32, fp16, bf16 or q8 KV cache (read and written
in its dtype, attention computed in fp32) and the torch attention backend's plan (plain, or
shared-prefix: its groups' shared page runs are read once per group in the same call), runs all its
decoder layers in one call, each layer's norms, projections, RoPE, the K/V cache write, paged
attention, SiLU and residuals, without returning to
Python in between. Any other step takes the layer-by-layer path in ``llama.py``; both compute the
same function (tests compare them). Profiled on the bundled model (2-core AVX2 EPYC, one session),
the per-op cost of the layer-by-layer path (~20 torch calls per layer) was most of a decode step
once the projections were quantized.
"""

from __future__ import annotations

import torch


class FusedLayers:
    """A model's layers as the fused operators take them: per layer its four projections (qkv, o,
    gate_up, down) as (weights, scales, biases) lists (``per_layer``, for ``decode_layer``), and the
    same for every layer at once, flattened, with the layers' norms (``decode_layers``)."""

    def __init__(self, model, projs: list[list[tuple]]):
        self.per_layer = [tuple([p[i] for p in layer] for i in range(3)) for layer in projs]
        self.weights, self.scales, self.biases = ([p[i] for layer in projs for p in layer] for i in range(3))
        self.in_norms = [L.in_norm for L in model.layers]
        self.post_norms = [L.post_norm for L in model.layers]


def prepare(model) -> FusedLayers | None:
    """The model's layers for the fused operators; None when the fused path does not apply to it."""
    from .. import native

    if native.lib() is None or model.device.type != "cpu" or model.dtype != torch.float32 or model.dims.qk_norm:
        return None
    projs = []
    for L in model.layers:
        kerns = (L.qkv, L.o, L.gate_up, L.down)
        if not all(hasattr(k, "proj") for k in kerns):
            return None
        projs.append([k.proj() for k in kerns])
    return FusedLayers(model, projs)


def decode_step(model, layers: FusedLayers, x: torch.Tensor, meta, k_cache: torch.Tensor, v_cache: torch.Tensor,
                backend, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Run every layer on ``x`` [T, hidden] in place (one operator call for the step); False (nothing
    done) when this step does not qualify (a prefill row, another backend, a cache the kernels cannot
    read). A cascade plan runs in the same call (``decode_layers_cascade``): each row's private pages
    through the paged decode kernel, the shared page runs once per group, merged by log-sum-exp."""
    from .. import native

    plan = meta.backend_state.get("torch")
    if (plan is None or not getattr(backend, "native", False) or plan["prefill"]
            or plan["decode"] is None or native.kv_type(k_cache.dtype) is None or v_cache.dtype != k_cache.dtype
            or not k_cache.is_contiguous() or not v_cache.is_contiguous()):
        return False
    rows, page_idx, _span, _mask, lens = plan["decode"]
    d = model.dims
    T = x.shape[0]
    if rows.shape[0] != T:
        return False
    cos, sin = cos.reshape(T, -1).contiguous(), sin.reshape(T, -1).contiguous()
    args = (x, layers.in_norms, layers.post_norms, d.rms_norm_eps, layers.weights, layers.scales, layers.biases, cos,
            sin, meta.slot_mapping.contiguous(), k_cache, v_cache, rows, page_idx, lens, d.num_heads, model.scale)
    if plan["cascade"] is None:
        native.lib().decode_layers.default(*args)
    else:
        native.lib().decode_layers_cascade.default(*args, *plan["cascade_flat"])
    return True
