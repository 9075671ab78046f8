"""Reference attention over the paged KV cache in plain torch (CPU or GPU).

Plain path: decode rows (one new token each) are attended in one batched SDPA call per layer
over their page-gathered KV (padded to the longest, masked); prefill rows one sequence at a
time with a causal mask offset by the cached prefix.

Cascade path (shared-prefix attention, see cascade.py): each shared page run is gathered once
and attended by all the query rows that share it in one call; every sequence then attends to
its private pages; partial outputs are merged exactly with their log-sum-exp. On CPU with the
native library, the shared runs of all groups go through one native call per layer
(``oc_cascade_groups``: each page read and converted once for its whole group, no gather, an online
softmax per query vector, merged into the private partials), else through torch as above.

GQA never repeats K/V: the ``G = H / Hkv`` query heads of a KV head are folded into the
query-length axis.

Decode rows on CPU use the native kernel (``engine/native``) when it is built: it reads K/V
straight from the pages (no gather) in one call per layer; profiled on the bundled model (2-core
AVX2 EPYC, one session, ~60-260 tokens of context), the gather + SDPA path took about 80 % of a
decode step's time outside the projections. A decode-only step of a model whose projections all
run native kernels does not come here at all: ``model/fused.py`` runs every layer in one native call
with this backend's plan (plain, or cascade with the flattened groups).

The cache may hold another dtype than the activations (``EngineConfig.kv_dtype``: fp16, bf16 or q8
pages under fp32 activations): new K/V are rounded to the cache dtype (q8: quantized, ``attention/q8.py``)
as they are written, and gathered pages are converted back to the activations' dtype before
attention, so scores, softmax and the weighted sum are computed in that dtype (the native kernel
converts as it loads).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import q8
from .base import AttentionMetadata
from .cascade import build_cascade_plan

_NEG_INF = float("-inf")


def _attend_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention that also returns the log-sum-exp of the scores.

    q [B, Hkv, M, D], k/v [B, Hkv, N, D], mask additive float [B or 1, 1, M, N] or None.
    Returns out [B, Hkv, M, D] and lse [B, Hkv, M] (fp32).
    """
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask,
                                                                              scale=scale)
        return out, lse.float()
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [B, Hkv, M, N]
    if mask is not None:
        s = s + mask
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)
    return out, lse


def _pages_ref(pages: list[int], device) -> torch.Tensor | slice:
    """A slice when the page ids are consecutive (a view, no copy), else an index tensor."""
    if pages and pages[-1] - pages[0] == len(pages) - 1 and pages == list(range(pages[0], pages[-1] + 1)):
        return slice(pages[0], pages[-1] + 1)
    return torch.tensor(pages, dtype=torch.int64, device=device)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered K/V in the activations' dtype (a copy when the cache holds another dtype; q8
    vectors ``[..., D + 4]`` become ``[..., D]``)."""
    if t.dtype == dtype:
        return t
    return q8.dequantize(t, dtype) if t.dtype == q8.DTYPE else t.to(dtype)


def _store(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Write new K or V ``x [T, Hkv, D]`` into the slots of a layer's cache, in the cache's dtype."""
    flat = cache.view(-1, x.shape[1], cache.shape[-1])
    flat.index_copy_(0, slots, q8.quantize(x) if cache.dtype == q8.DTYPE else _as(x, flat.dtype))


def _merge(o_acc, lse_acc, o, lse):
    """Exact merge of two partial attentions over disjoint KV sets. o [..., D], lse [...]."""
    new = torch.logaddexp(lse_acc, lse)
    o_acc = o_acc * torch.exp(lse_acc - new).unsqueeze(-1) + o.float() * torch.exp(lse - new).unsqueeze(-1)
    return o_acc, new


class TorchAttentionBackend:
    """``cascade``: "auto" (use shared-prefix attention when it saves enough KV reads), "on", "off"."""

    name = "torch"

    # "auto": shared-prefix attention only when it spares at least this many KV-token reads per step.
    # Both plans take the one-call fused decode on CPU; the shared part's kernel reads a page once for
    # its whole group, the plain kernel once per sequence. Measured end to end on the bundled model
    # (benchmarks/bench_cascade.py, 2-core AVX-512 EPYC, native int8 projections, after the plain
    # decode kernel came to read its rows in place; results in benchmarks/results/
    # amd-epyc-2c-fb86c92f/cascade_small.json (--prefix 512 1024 --sessions 2 4 8) and cascade.json),
    # cascade on/off agg tok/s by spared reads: 512 1.04x (its step time 0.97x), 1,024 0.87x, 1,536
    # 0.96x, 3,072 0.99x, 3,584 0.99x; then 6,144 (P=2048 N=4) 1.04x, 7,168 1.04x, 7,680 1.05x,
    # 30,720 (P=2048 N=16) 1.07x. Below ~6,000 the plain kernel is as fast or faster (it was 512
    # with the plain kernel before, which copied and transposed each block).
    AUTO_MIN_SAVED_TOKENS = 6144

    def __init__(self, cascade: str = "auto", min_saved_tokens: int = AUTO_MIN_SAVED_TOKENS, native: bool = True):
        self.cascade = cascade
        self.native = native  # use the native decode kernel where it applies (False: torch only)
        self.min_saved_tokens = min_saved_tokens
        self.last_used_cascade = False
        self.num_cascade_steps = 0  # steps that used shared-prefix attention (for tests and stats)

    # ---------------------------------------------------------------------------- planning
    def plan(self, meta: AttentionMetadata, *, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        group = num_heads // num_kv_heads
        cplan = None
        if self.cascade != "off" and meta.num_seqs >= 2:
            cplan = build_cascade_plan(meta.page_tables, meta.kv_lens, meta.qo_lens, meta.page_size,
                                       seq_of=meta.seq_of or None)
            if not cplan.groups or (self.cascade == "auto" and cplan.saved_tokens < self.min_saved_tokens):
                cplan = None
        self.last_used_cascade = cplan is not None
        self.num_cascade_steps += cplan is not None
        meta.cascade = cplan
        if cplan is None:
            starts = [0] * meta.num_seqs
            meta.backend_state["torch"] = {"group": group, "cascade": None, **self._plan_rows(meta, starts, group)}
            return
        device = meta.positions.device
        qo_start = meta.qo_indptr.tolist()
        groups = []
        page_ptr, row_ptr, all_pages, all_rows = [0], [0], [], []
        for g in cplan.groups:
            rows = [r for s in g.seqs for r in range(qo_start[s], qo_start[s] + meta.qo_lens[s])]
            groups.append((torch.tensor(rows, dtype=torch.int64, device=device), _pages_ref(g.pages, device)))
            all_pages += g.pages
            all_rows += rows
            page_ptr.append(len(all_pages))
            row_ptr.append(len(all_rows))
        # the same groups flattened for the native kernels (cascade_groups, decode_layers_cascade): per group
        # its pages and query rows
        flat = tuple(torch.tensor(x, dtype=torch.int64) for x in (page_ptr, all_pages, row_ptr, all_rows))
        meta.backend_state["torch"] = {"group": group, "cascade": groups, "cascade_flat": flat,
                                       **self._plan_rows(meta, cplan.private_start, group)}

    def _plan_rows(self, meta: AttentionMetadata, page_start: list[int], group: int) -> dict:
        """Each sequence attends to its pages from ``page_start[i]`` on (all of them when 0)."""
        device = meta.positions.device
        ps = meta.page_size
        qo_start = meta.qo_indptr.tolist()
        decode_idx = [i for i, q in enumerate(meta.qo_lens) if q == 1]
        out: dict = {"decode": None, "prefill": []}
        if decode_idx:
            tables = [meta.page_tables[i][page_start[i]:] for i in decode_idx]
            lens = [meta.kv_lens[i] - page_start[i] * ps for i in decode_idx]
            max_pages = max(len(t) for t in tables)
            page_idx = torch.zeros((len(decode_idx), max_pages), dtype=torch.int64)
            for row, t in enumerate(tables):
                page_idx[row, : len(t)] = torch.tensor(t, dtype=torch.int64)
            span = max_pages * ps
            lens_t = torch.tensor(lens)
            if bool((lens_t == span).all()):
                mask = None
            else:
                valid = torch.arange(span)[None, :] < lens_t[:, None]
                mask = torch.zeros(valid.shape).masked_fill(~valid, _NEG_INF)[:, None, None, :].to(device)
            out["decode"] = (torch.tensor([qo_start[i] for i in decode_idx], dtype=torch.int64, device=device),
                             page_idx.to(device), span, mask, lens_t.to(torch.int64))
        for i, q_len in enumerate(meta.qo_lens):
            if q_len == 1:
                continue
            kv_len = meta.kv_lens[i]
            first = page_start[i] * ps  # absolute position of the first key attended here
            pages = _pages_ref(meta.page_tables[i][page_start[i]:], device)
            q_pos = torch.arange(kv_len - q_len, kv_len, device=device)
            k_pos = torch.arange(first, kv_len, device=device)
            visible = (k_pos[None, :] <= q_pos[:, None]).repeat(group, 1)  # rows ordered (g, i) like the folded q
            mask = torch.zeros(visible.shape, device=device).masked_fill(~visible, _NEG_INF)[None, None]
            out["prefill"].append((qo_start[i], q_len, kv_len - first, pages, mask))
        return out

    # ---------------------------------------------------------------------------- execution
    def forward(self, layer, q, k, v, k_cache, v_cache, meta, scale):
        plan = meta.backend_state["torch"]
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        _store(k_cache, meta.slot_mapping, k)
        _store(v_cache, meta.slot_mapping, v)
        if plan["cascade"] is None:
            return self._private(q, k_cache, v_cache, plan, scale, num_kv_heads, head_dim, with_lse=False)[0]
        o_acc, lse_acc = self._private(q, k_cache, v_cache, plan, scale, num_kv_heads, head_dim, with_lse=True)
        if self._native_groups(q, k_cache, v_cache, plan["cascade_flat"], scale, o_acc, lse_acc):
            return o_acc.to(q.dtype)
        group = plan["group"]
        for rows, pages in plan["cascade"]:
            m = rows.shape[0]
            qg = q.index_select(0, rows).view(m, num_kv_heads, group, head_dim)
            qg = qg.permute(1, 0, 2, 3).reshape(1, num_kv_heads, m * group, head_dim)  # [1, Hkv, M*G, D]
            kg = _as(k_cache[pages], q.dtype).view(-1, num_kv_heads, head_dim).transpose(0, 1)[None]  # [1, Hkv, N, D]
            vg = _as(v_cache[pages], q.dtype).view(-1, num_kv_heads, head_dim).transpose(0, 1)[None]
            og, lg = _attend_lse(qg, kg, vg, None, scale)
            og = og[0].view(num_kv_heads, m, group, head_dim).permute(1, 0, 2, 3).reshape(m, -1, head_dim)
            lg = lg[0].view(num_kv_heads, m, group).permute(1, 0, 2).reshape(m, -1)  # [M, H]
            o_new, l_new = _merge(o_acc.index_select(0, rows), lse_acc.index_select(0, rows), og, lg)
            o_acc.index_copy_(0, rows, o_new)
            lse_acc.index_copy_(0, rows, l_new)
        return o_acc.to(q.dtype)

    def _private(self, q, k_cache, v_cache, plan, scale, num_kv_heads, head_dim, with_lse: bool):
        group = plan["group"]
        T = q.shape[0]
        out = torch.empty(q.shape, dtype=torch.float32 if with_lse else q.dtype, device=q.device)  # [T, H, D]
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if with_lse else None  # [T, H]
        dec = plan["decode"]
        if dec is not None and self._native_decode(q, k_cache, v_cache, dec, scale, out, lse):
            dec = None
        if dec is not None:
            rows, page_idx, span, mask, _ = dec
            bd = rows.shape[0]
            qd = q.index_select(0, rows).view(bd, num_kv_heads, group, head_dim)  # [Bd, Hkv, G, D]
            kd = _as(k_cache[page_idx], q.dtype).view(bd, span, num_kv_heads, head_dim).transpose(1, 2)  # [Bd, Hkv, S, D]
            vd = _as(v_cache[page_idx], q.dtype).view(bd, span, num_kv_heads, head_dim).transpose(1, 2)
            if lse is not None:  # with_lse
                od, ld = _attend_lse(qd, kd, vd, mask, scale)
                lse.index_copy_(0, rows, ld.reshape(bd, -1))
            else:
                od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)
            out.index_copy_(0, rows, od.reshape(bd, -1, head_dim).to(out.dtype))
        for start, q_len, n_keys, pages, mask in plan["prefill"]:
            qp = q[start:start + q_len].view(q_len, num_kv_heads, group, head_dim)
            qp = qp.permute(1, 2, 0, 3).reshape(1, num_kv_heads, group * q_len, head_dim)  # [1, Hkv, G*q, D]
            row = k_cache.shape[-1]  # head_dim (q8: + its scale)
            kp = _as(k_cache[pages].view(-1, num_kv_heads, row)[:n_keys], q.dtype).transpose(0, 1)[None]  # [1, Hkv, n, D]
            vp = _as(v_cache[pages].view(-1, num_kv_heads, row)[:n_keys], q.dtype).transpose(0, 1)[None]
            if lse is not None:  # with_lse
                op, lp = _attend_lse(qp, kp, vp, mask, scale)
                lse[start:start + q_len] = lp[0].view(num_kv_heads, group, q_len).permute(2, 0, 1).reshape(q_len, -1)
            else:
                op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale)
            op = op[0].view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)  # [q, Hkv, G, D]
            out[start:start + q_len] = op.reshape(q_len, -1, head_dim).to(out.dtype)
        del T
        return out, lse

    def _native_ops(self, q, k_cache, v_cache):
        """The native operators (``torch.ops.opencoti``) when their attention kernels apply here, else None."""
        from .. import native

        if not self.native or q.device.type != "cpu" or q.dtype != torch.float32 \
                or native.kv_type(k_cache.dtype) is None or v_cache.dtype != k_cache.dtype \
                or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            return None
        return native.lib()

    def _native_groups(self, q, k_cache, v_cache, flat, scale, out, lse) -> bool:
        """The shared page runs of a cascade plan through the native kernel (each page read once for all
        the query rows of its group), merged into ``out`` / ``lse``; False when it does not apply here."""
        ops = self._native_ops(q, k_cache, v_cache)
        if ops is None:
            return False
        page_ptr, pages, row_ptr, rows = flat
        ops.cascade_groups.default(q.contiguous(), k_cache, v_cache, page_ptr, pages, row_ptr, rows, float(scale),
                                   out, lse)
        return True

    def _native_decode(self, q, k_cache, v_cache, dec, scale, out, lse) -> bool:
        """Decode rows through the native kernel; False when it does not apply here."""
        ops = self._native_ops(q, k_cache, v_cache)
        if ops is None:
            return False
        rows, page_idx, _span, _mask, lens = dec
        ops.paged_decode.default(q.contiguous(), rows, k_cache, v_cache, page_idx, lens, float(scale), out, lse)
        return True
