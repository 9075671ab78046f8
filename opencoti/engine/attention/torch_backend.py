"""Reference attention over the paged KV cache in plain torch (CPU or GPU).

Decode rows (one new token each) are attended in one batched SDPA call per layer over their
page-gathered KV (padded to the longest, masked). Prefill rows attend one sequence at a time
with a causal mask offset by the cached prefix. GQA is handled without repeating K/V: the
``G = H / Hkv`` query heads of a KV head are folded into the query-length axis.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import AttentionMetadata


class TorchAttentionBackend:
    name = "torch"

    def plan(self, meta: AttentionMetadata, *, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        device = meta.positions.device
        ps = meta.page_size
        group = num_heads // num_kv_heads
        decode_idx = [i for i, q in enumerate(meta.qo_lens) if q == 1]
        prefill_idx = [i for i, q in enumerate(meta.qo_lens) if q > 1]
        qo_start = meta.qo_indptr.tolist()
        plan: dict = {"group": group}
        if decode_idx:
            max_pages = max(len(meta.page_tables[i]) for i in decode_idx)
            page_idx = torch.zeros((len(decode_idx), max_pages), dtype=torch.int64)
            for row, i in enumerate(decode_idx):
                t = meta.page_tables[i]
                page_idx[row, : len(t)] = torch.tensor(t, dtype=torch.int64)
            kv_lens = torch.tensor([meta.kv_lens[i] for i in decode_idx])
            span = max_pages * ps
            if bool((kv_lens == span).all()):
                mask = None
            else:
                mask = (torch.arange(span)[None, :] < kv_lens[:, None])[:, None, None, :]  # [Bd, 1, 1, S]
                mask = mask.to(device)
            plan["decode"] = (
                torch.tensor([qo_start[i] for i in decode_idx], dtype=torch.int64, device=device),
                page_idx.to(device),
                span,
                mask,
            )
        prefill = []
        for i in prefill_idx:
            q_len, kv_len = meta.qo_lens[i], meta.kv_lens[i]
            pages = torch.tensor(meta.page_tables[i], dtype=torch.int64, device=device)
            q_pos = torch.arange(kv_len - q_len, kv_len, device=device)
            mask = torch.arange(kv_len, device=device)[None, :] <= q_pos[:, None]  # [q, kv] causal, offset
            mask = mask.repeat(group, 1)  # rows ordered (g, i) to match the folded queries
            prefill.append((qo_start[i], q_len, kv_len, pages, mask))
        plan["prefill"] = prefill
        meta.backend_state["torch"] = plan

    def forward(self, layer, q, k, v, k_cache, v_cache, meta, scale):
        plan = meta.backend_state["torch"]
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        flat_k = k_cache.view(-1, num_kv_heads, head_dim)
        flat_v = v_cache.view(-1, num_kv_heads, head_dim)
        flat_k.index_copy_(0, meta.slot_mapping, k)
        flat_v.index_copy_(0, meta.slot_mapping, v)
        group = plan["group"]
        out = torch.empty_like(q)  # [T, H, D]
        dec = plan.get("decode")
        if dec is not None:
            rows, page_idx, span, mask = dec
            bd = rows.shape[0]
            qd = q.index_select(0, rows).view(bd, num_kv_heads, group, head_dim)  # [Bd, Hkv, G, D]
            kd = k_cache[page_idx].view(bd, span, num_kv_heads, head_dim).transpose(1, 2)  # [Bd, Hkv, S, D]
            vd = v_cache[page_idx].view(bd, span, num_kv_heads, head_dim).transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)  # [Bd, Hkv, G, D]
            out.index_copy_(0, rows, od.reshape(bd, -1, head_dim))
        for start, q_len, kv_len, pages, mask in plan["prefill"]:
            qp = q[start:start + q_len].view(q_len, num_kv_heads, group, head_dim)
            qp = qp.permute(1, 2, 0, 3).reshape(num_kv_heads, group * q_len, head_dim)  # [Hkv, G*q, D]
            kp = k_cache[pages].view(-1, num_kv_heads, head_dim)[:kv_len].transpose(0, 1)  # [Hkv, kv, D]
            vp = v_cache[pages].view(-1, num_kv_heads, head_dim)[:kv_len].transpose(0, 1)
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale)
            op = op.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)  # [q, Hkv, G, D]
            out[start:start + q_len] = op.reshape(q_len, -1, head_dim)
        return out
