"""The KV dtype accuracy check: a model's logits over a text with its KV pages in fp16 / bf16 against
the same model with fp32 pages (greedy top-1 agreement and perplexity, the metrics of the weights'
accuracy gate).

The text runs through the paged cache as serving runs it: the first ``prefill`` tokens in one
prefill step, then one decode step per token (teacher forcing), so both the prefill attention and
the decode attention (the native kernels and the fused decode layers where they apply) read the
pages in the dtype under test.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..attention.base import SeqBatchEntry, build_metadata
from ..attention import q8
from .pages import PagePool


@torch.inference_mode()
def paged_logits(model, ids: Sequence[int], kv_dtype: torch.dtype, *, page_size: int = 16,
                 prefill: int | None = None, backend=None) -> torch.Tensor:
    """Logits [len(ids), V] (fp32) of ``ids`` from position 0 with the KV pages in ``kv_dtype``:
    the first ``prefill`` tokens (default: half) in one step, then one token per step."""
    from ..attention.torch_backend import TorchAttentionBackend

    d = model.dims
    n = len(ids)
    if n < 2:
        raise ValueError("the check needs at least 2 tokens")
    prefill = max(1, min(n, n // 2 if prefill is None else prefill))
    kv = PagePool(num_layers=d.num_layers, num_pages=-(-n // page_size), page_size=page_size,
                  num_kv_heads=d.num_kv_heads, head_dim=d.head_dim, dtype=kv_dtype, device=model.device)
    table = list(range(kv.num_pages))  # a private cache: every page is this text's
    backend = backend or TorchAttentionBackend(cascade="off")
    dev = model.device
    out = []
    steps = [(0, prefill)] + [(p, 1) for p in range(prefill, n)]
    for start, count in steps:
        meta = build_metadata([SeqBatchEntry(table, start, count)], page_size, device=dev)
        x = torch.tensor(list(ids[start:start + count]), dtype=torch.int64, device=dev)
        rows = torch.arange(count, device=dev)
        out.append(model.forward(x, meta, kv.k_cache, kv.v_cache, backend, rows).float().cpu())
    return torch.cat(out)


def kv_gate(model, ids: Sequence[int], kv_dtype: torch.dtype, **kw) -> dict:
    """Perplexity of ``ids`` and greedy top-1 agreement at every position with ``kv_dtype`` pages
    against fp32 pages (``gate_metrics`` of the weights' gate; ``passed`` by that gate's bounds)."""
    from ..model.weights import gate_metrics

    t = torch.tensor(list(ids), dtype=torch.int64)
    ref = paged_logits(model, ids, torch.float32, **kw)
    got = paged_logits(model, ids, kv_dtype, **kw)
    m = gate_metrics(ref, got, t, len(ids))
    m["kv_dtype"] = q8.name(kv_dtype)
    m["max_abs_logit_diff"] = float((ref - got).abs().max())
    return m
