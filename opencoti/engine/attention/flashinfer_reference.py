"""A torch stand-in for FlashInfer's paged-attention wrappers (CPU or GPU, any float dtype).

It implements the contract the FlashInfer backend relies on, as FlashInfer documents it, so the
backend's own code (planning, row permutation, empty-group compaction, LSE merges) runs and is
tested without CUDA or flashinfer, e.g. by ``benchmarks/gpu_check.py --dry-run``:

* ``plan`` takes ``PagedArrays`` (qo_indptr, kv_indptr, kv_indices, kv_last_page_len) and
  validates them as FlashInfer requires (int32, 1 <= last_page_len <= page_size, >= 1 page);
  request ``i`` attends to ``(num_pages - 1) * page_size + last_page_len`` keys.
* ``causal`` aligns the mask bottom-right: query ``j`` of a request with ``qo_len`` rows and
  ``kv_len`` keys sees keys ``< kv_len - qo_len + j + 1`` (append attention over a cached prefix).
* ``run(..., return_lse=True)`` returns the log-sum-exp in base 2 (FlashInfer's convention),
  and ``merge_state_in_place`` merges base-2 states.
* GQA: query head ``h`` reads kv head ``h // (num_heads // num_kv_heads)``.

Slow (a Python loop over requests): for tests and dry runs only.
"""

from __future__ import annotations

import math

import torch

from .flashinfer_plan import PagedArrays, check_paged_arrays

_LN2 = math.log(2.0)


class _ReferenceWrapper:
    """Plays BatchPrefillWithPagedKVCacheWrapper / BatchDecodeWithPagedKVCacheWrapper."""

    def __init__(self, kind: str):
        self.kind = kind
        self.planned: dict | None = None
        self.num_plans = 0
        self.num_runs = 0

    def plan(self, arrays: PagedArrays, *, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
             causal: bool, dtype: torch.dtype, scale: float) -> None:
        check_paged_arrays(arrays, page_size)
        if num_heads % num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.kind == "decode" and bool((arrays.qo_indptr[1:] - arrays.qo_indptr[:-1] != 1).any()):
            raise ValueError("the decode wrapper takes exactly one query row per request")
        self.planned = dict(qo=arrays.qo_indptr.tolist(), kvp=arrays.kv_indptr.tolist(),
                            idx=arrays.kv_indices.tolist(), last=arrays.kv_last_page_len.tolist(),
                            num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                            page_size=page_size, causal=causal, dtype=dtype, scale=scale)
        self.num_plans += 1

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, return_lse: bool = False):
        p = self.planned
        if p is None:
            raise RuntimeError("run before plan")
        if q.dtype != p["dtype"] or k_cache.dtype != p["dtype"]:
            raise ValueError(f"planned for {p['dtype']}, got q {q.dtype} / kv {k_cache.dtype}")
        h, hkv, d, ps = p["num_heads"], p["num_kv_heads"], p["head_dim"], p["page_size"]
        if tuple(q.shape[1:]) != (h, d) or q.shape[0] != p["qo"][-1]:
            raise ValueError(f"q {tuple(q.shape)} does not match the plan ({p['qo'][-1]}, {h}, {d})")
        if tuple(k_cache.shape[1:]) != (ps, hkv, d):
            raise ValueError(f"k_cache {tuple(k_cache.shape)} is not [P, {ps}, {hkv}, {d}] (NHD)")
        self.num_runs += 1
        group = h // hkv
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse2 = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        for i in range(len(p["last"])):
            r0, r1 = p["qo"][i], p["qo"][i + 1]
            pages = p["idx"][p["kvp"][i]:p["kvp"][i + 1]]
            kv_len = (len(pages) - 1) * ps + p["last"][i] if pages else 0
            if r1 == r0 or kv_len == 0:
                continue
            page_t = torch.tensor(pages, dtype=torch.int64, device=q.device)
            k = k_cache[page_t].reshape(-1, hkv, d)[:kv_len].float().repeat_interleave(group, dim=1)  # [N, H, D]
            v = v_cache[page_t].reshape(-1, hkv, d)[:kv_len].float().repeat_interleave(group, dim=1)
            s = torch.einsum("mhd,nhd->hmn", q[r0:r1].float(), k) * p["scale"]  # [H, M, N]
            if p["causal"]:
                m = r1 - r0
                q_pos = torch.arange(kv_len - m, kv_len, device=q.device)
                visible = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]  # [M, N]
                s = s.masked_fill(~visible, float("-inf"))
            lse = torch.logsumexp(s, dim=-1)  # [H, M]
            out[r0:r1] = torch.einsum("hmn,nhd->mhd", torch.softmax(s, dim=-1), v)
            lse2[r0:r1] = (lse / _LN2).transpose(0, 1)
        out = out.to(q.dtype)
        return (out, lse2) if return_lse else out


class _ReferenceMultiLevel:
    """Plays MultiLevelCascadeAttentionWrapper: levels over the same rows, the last one causal."""

    def __init__(self, kernels: ReferenceKernels, num_levels: int):
        self.kernels = kernels
        self.levels = [_ReferenceWrapper("prefill") for _ in range(num_levels)]

    def plan(self, arrays_list: list[PagedArrays], *, causal: bool, **kw) -> None:
        if len(arrays_list) != len(self.levels):
            raise ValueError(f"{len(self.levels)} levels planned with {len(arrays_list)} arrays")
        for i, (w, arrays) in enumerate(zip(self.levels, arrays_list)):
            w.plan(arrays, causal=causal if i == len(self.levels) - 1 else False, **kw)

    def run(self, q, k_cache, v_cache):
        out, lse = self.levels[-1].run(q, k_cache, v_cache, return_lse=True)
        for w in self.levels[:-1]:
            o, s = w.run(q, k_cache, v_cache, return_lse=True)
            self.kernels.merge_state_in_place(out, lse, o, s)
        return out


class ReferenceKernels:
    """The kernel provider the FlashInfer backend uses when it runs without FlashInfer."""

    name = "reference"
    version = "torch-reference"

    def __init__(self, supported_dtypes: tuple = (torch.float32, torch.float16, torch.bfloat16)):
        self.supported_dtypes = tuple(supported_dtypes)
        self.created: list = []

    @property
    def num_wrappers(self) -> int:
        return sum(len(w.levels) if isinstance(w, _ReferenceMultiLevel) else 1 for w in self.created)

    def prefill(self, *, use_tensor_cores: bool = True) -> _ReferenceWrapper:
        w = _ReferenceWrapper("prefill")
        self.created.append(w)
        return w

    def decode(self, *, use_tensor_cores: bool = False) -> _ReferenceWrapper:
        w = _ReferenceWrapper("decode")
        self.created.append(w)
        return w

    def multilevel(self, num_levels: int) -> _ReferenceMultiLevel:
        w = _ReferenceMultiLevel(self, num_levels)
        self.created.append(w)
        return w

    @staticmethod
    def merge_state_in_place(v: torch.Tensor, s: torch.Tensor, v_other: torch.Tensor, s_other: torch.Tensor) -> None:
        """(v, s) <- merge of two partial attentions over disjoint keys; s in base 2, [T, H]."""
        s_max = torch.maximum(s, s_other)
        s_max = torch.where(torch.isinf(s_max), torch.zeros_like(s_max), s_max)  # both empty: keep 0 weights
        w = torch.exp2(s - s_max)
        w_other = torch.exp2(s_other - s_max)
        total = w + w_other
        merged = (v.float() * w.unsqueeze(-1) + v_other.float() * w_other.unsqueeze(-1)) / total.clamp_min(1e-30).unsqueeze(-1)
        v.copy_(merged.to(v.dtype))
        s.copy_(torch.log2(total) + s_max)
