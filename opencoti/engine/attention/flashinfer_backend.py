"""Attention on CUDA with FlashInfer's paged kernels; shared-prefix (cascade) levels included.

Same metadata and cascade plan as the torch backend (``base.py``, ``cascade.py``); the index
arrays come from ``flashinfer_plan.py``. Per step, ``plan`` builds the host arrays; the kernel
wrappers are planned once, at the step's first ``forward`` (when the dtype and softmax scale
are known), and reused by every layer. One float workspace (128 MiB by default) is allocated
once and shared by all wrappers, which run one after another on the same stream.

* plain decode (every sequence computes one token): ``BatchDecodeWithPagedKVCacheWrapper``
  (tensor cores unless the GQA group size is 1, 2 or 4, for which the CUDA-core kernel is built);
* plain prefill / mixed batch: ``BatchPrefillWithPagedKVCacheWrapper``, causal (the mask is
  aligned bottom-right, so chunks over a cached prefix are right);
* cascade: one non-causal prefill wrapper per shared level (the group's queries read the
  shared pages once), then the private level (decode wrapper when every sequence decodes,
  else causal prefill), merged with ``merge_state_in_place`` — what FlashInfer's
  ``MultiLevelCascadeAttentionWrapper`` does, plus empty-group compaction (see
  ``flashinfer_plan.py``) and a kernel backend we choose. ``cascade_impl="multilevel"`` runs
  dense plans through ``MultiLevelCascadeAttentionWrapper`` itself (sparse ones fall back).

New K/V are written with one ``index_copy_`` per tensor through ``meta.slot_mapping`` (the
same write as the torch backend; no extra kernel module to JIT). RoPE is applied by the model,
so kernels use ``pos_encoding_mode="NONE"``. FlashInfer computes in fp16/bf16 only: a float32
model falls back to the torch backend (with a warning). flashinfer is imported lazily, in
``FlashInferKernels``; ``kernels=ReferenceKernels()`` runs everything on torch instead.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Protocol

import torch

from ..errors import InvalidRequestError
from .base import AttentionMetadata
from .cascade import build_cascade_plan
from .flashinfer_plan import (INT_WORKSPACE_BYTES, PagedArrays, StepPlan, build_step_plan, float_workspace_bytes,
                              workspace_device_bytes)

log = logging.getLogger("opencoti.attention")

FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)


def use_tensor_cores_for(num_heads: int, num_kv_heads: int, setting: str | bool = "auto") -> bool:
    """Decode on tensor cores unless the GQA group size has a CUDA-core decode kernel (1, 2, 4)."""
    if isinstance(setting, bool):
        return setting
    if setting != "auto":
        raise ValueError(f"use_tensor_cores must be 'auto' or a bool, got {setting!r}")
    return num_heads // num_kv_heads not in (1, 2, 4)


def _accepts(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


# ================================================================================ real kernels
class _FIWrapper:
    """Adapter: our plan(arrays, ...) / run(q, k_cache, v_cache) over a FlashInfer paged wrapper."""

    def __init__(self, wrapper, kind: str):
        self.wrapper = wrapper
        self.kind = kind

    def plan(self, arrays: PagedArrays, *, num_heads, num_kv_heads, head_dim, page_size, causal, dtype, scale):
        qo, kv_indptr, kv_indices, last = arrays
        common = dict(pos_encoding_mode="NONE", sm_scale=scale, q_data_type=dtype, kv_data_type=dtype)
        if self.kind == "decode":
            self.wrapper.plan(kv_indptr, kv_indices, last, num_heads, num_kv_heads, head_dim, page_size, **common)
        else:
            self.wrapper.plan(qo, kv_indptr, kv_indices, last, num_heads, num_kv_heads, head_dim, page_size,
                              causal=causal, **common)

    def run(self, q, k_cache, v_cache, return_lse: bool = False):
        return self.wrapper.run(q, (k_cache, v_cache), return_lse=return_lse)


class MultiLevel(Protocol):
    """A multi-level cascade wrapper (FlashInfer's, or the reference's on CPU): planned, then run."""

    def plan(self, arrays_list: list[PagedArrays], *, causal: bool, **kw: Any) -> None: ...

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor: ...


class _FIMultiLevel:
    def __init__(self, wrapper):
        self.wrapper = wrapper

    def plan(self, arrays_list, *, num_heads, num_kv_heads, head_dim, page_size, causal, dtype, scale):
        cols = list(zip(*arrays_list))  # qo_indptr list, kv_indptr list, kv_indices list, last_page_len list
        self.wrapper.plan(list(cols[0]), list(cols[1]), list(cols[2]), list(cols[3]), num_heads, num_kv_heads,
                          head_dim, page_size, causal=causal, pos_encoding_mode="NONE", sm_scale=scale,
                          q_data_type=dtype, kv_data_type=dtype)

    def run(self, q, k_cache, v_cache):
        return self.wrapper.run(q, (k_cache, v_cache))


class FlashInferKernels:
    """FlashInfer's wrappers over one shared float workspace. Imports flashinfer (CUDA only).

    ``kernel_backend`` goes to the wrappers that take one ("fa2" by default: one JIT module serves
    prefill, tensor-core decode and every cascade level; None = FlashInfer's own choice).
    """

    name = "flashinfer"
    supported_dtypes = FLASHINFER_DTYPES

    def __init__(self, device: torch.device, workspace_bytes: int, kernel_backend: str | None = "fa2"):
        import flashinfer  # lazy: CUDA machines with the `gpu` extra only

        self.fi = flashinfer
        self.version = getattr(flashinfer, "__version__", "unknown")
        self.device = device
        self.kernel_backend = kernel_backend
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self.num_wrappers = 0
        merge = getattr(flashinfer, "merge_state_in_place", None)
        if merge is None:
            from flashinfer import cascade

            merge = cascade.merge_state_in_place
        self._merge: Callable[..., None] = merge

    def _backend_kw(self, cls) -> dict:
        if self.kernel_backend and _accepts(cls.__init__, "backend"):
            return {"backend": self.kernel_backend}
        return {}

    def prefill(self, *, use_tensor_cores: bool = True) -> _FIWrapper:
        cls = self.fi.BatchPrefillWithPagedKVCacheWrapper
        self.num_wrappers += 1
        return _FIWrapper(cls(self.workspace, "NHD", **self._backend_kw(cls)), "prefill")

    def decode(self, *, use_tensor_cores: bool = False) -> _FIWrapper:
        cls = self.fi.BatchDecodeWithPagedKVCacheWrapper
        self.num_wrappers += 1
        return _FIWrapper(cls(self.workspace, "NHD", use_tensor_cores=use_tensor_cores, **self._backend_kw(cls)),
                          "decode")

    def multilevel(self, num_levels: int) -> _FIMultiLevel:
        self.num_wrappers += num_levels
        return _FIMultiLevel(self.fi.MultiLevelCascadeAttentionWrapper(num_levels, self.workspace, "NHD"))

    def merge_state_in_place(self, v, s, v_other, s_other) -> None:
        self._merge(v, s, v_other, s_other)


# ================================================================================ the backend
class FlashInferBackend:
    """Paged attention with FlashInfer. ``cascade``: "auto" | "on" | "off" (as the torch backend).

    ``kernels``: the kernel provider (default FlashInferKernels on ``device``; ReferenceKernels
    runs the same code on torch). ``cascade_impl``: "levels" (ours, default) or "multilevel".
    """

    name = "flashinfer"

    def __init__(self, device: torch.device | str, cascade: str = "auto", *, min_saved_tokens: int = 1024,
                 workspace_mib: float | None = None, use_tensor_cores: str | bool = "auto",
                 kernel_backend: str | None = "fa2", cascade_impl: str = "levels", max_cascade_levels: int = 8,
                 kernels=None):
        if cascade not in ("auto", "on", "off"):
            raise InvalidRequestError(f"cascade must be auto|on|off, got {cascade!r}")
        if cascade_impl not in ("levels", "multilevel"):
            raise InvalidRequestError(f"cascade_impl must be levels|multilevel, got {cascade_impl!r}")
        self.device = torch.device(device)
        self.cascade = cascade
        self.cascade_impl = cascade_impl
        self.min_saved_tokens = min_saved_tokens
        self.max_cascade_levels = max_cascade_levels
        self.use_tensor_cores = use_tensor_cores
        self.workspace_bytes = float_workspace_bytes(workspace_mib)
        if kernels is None:
            if self.device.type != "cuda":
                raise InvalidRequestError(f"the flashinfer backend needs a CUDA device, got {self.device}")
            try:
                kernels = FlashInferKernels(self.device, self.workspace_bytes, kernel_backend)
            except ImportError as e:
                raise InvalidRequestError(f"the flashinfer backend needs flashinfer-python (extra 'gpu'): {e}") from e
        self.kernels = kernels
        self.last_used_cascade = False
        self.num_cascade_steps = 0
        self.num_fallback_steps = 0  # steps run by the torch backend (float32 models)
        self._decode = None
        self._decode_tc: bool | None = None
        self._prefill = None
        self._levels: list = []  # one prefill wrapper per shared cascade level, made on first use
        self._multilevel: dict[int, MultiLevel] = {}
        self._torch = None
        self._warned_fallback = False

    @property
    def workspace_device_bytes(self) -> int:
        """Device memory held by the workspaces (float buffer + each wrapper's int buffer)."""
        n = getattr(self.kernels, "num_wrappers", 0)
        return workspace_device_bytes(self.workspace_bytes, n)

    # ---------------------------------------------------------------------------- planning
    def plan(self, meta: AttentionMetadata, *, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        cplan = None
        if self.cascade != "off" and meta.num_seqs >= 2:
            cplan = build_cascade_plan(meta.page_tables, meta.kv_lens, meta.qo_lens, meta.page_size,
                                       seq_of=meta.seq_of or None)
            if (not cplan.groups or (self.cascade == "auto" and cplan.saved_tokens < self.min_saved_tokens)
                    or cplan.num_levels > self.max_cascade_levels):
                cplan = None
        self.last_used_cascade = cplan is not None
        self.num_cascade_steps += cplan is not None
        meta.cascade = cplan
        step = build_step_plan(meta.page_tables, meta.kv_lens, meta.qo_lens, meta.page_size, cplan)
        device = meta.positions.device
        if step.perm is not None and step.inv_perm is not None:  # (both or neither)
            step.perm, step.inv_perm = step.perm.to(device), step.inv_perm.to(device)
        for lv in step.levels:
            if lv.rows is not None:
                lv.rows = lv.rows.to(device)
        meta.backend_state["flashinfer"] = {"step": step, "planned": None, "num_heads": num_heads,
                                            "num_kv_heads": num_kv_heads, "head_dim": head_dim}

    def _plan_kernels(self, state: dict, dtype: torch.dtype, scale: float) -> None:
        step: StepPlan = state["step"]
        h, hkv, d = state["num_heads"], state["num_kv_heads"], state["head_dim"]
        kw = dict(num_heads=h, num_kv_heads=hkv, head_dim=d, page_size=step.page_size, dtype=dtype, scale=scale)
        if step.kind == "decode":
            self._decode_wrapper(h, hkv).plan(step.arrays, causal=False, **kw)
        elif step.kind == "prefill":
            self._prefill_wrapper().plan(step.arrays, causal=True, **kw)
        elif self.cascade_impl == "multilevel" and step.is_dense:
            n = len(step.levels)
            if n not in self._multilevel:
                self._multilevel[n] = self.kernels.multilevel(n)
            self._multilevel[n].plan(step.multilevel_arrays(), causal=True, **kw)
            state["multilevel"] = self._multilevel[n]
        else:
            *shared, private = step.levels
            while len(self._levels) < len(shared):
                self._levels.append(self.kernels.prefill())
            for w, lv in zip(self._levels, shared):
                w.plan(lv.arrays, causal=False, **kw)
            last = self._decode_wrapper(h, hkv) if private.is_decode else self._prefill_wrapper()
            last.plan(private.arrays, causal=True, **kw)
            state["private"] = last
        state["planned"] = (dtype, scale)

    def _decode_wrapper(self, num_heads: int, num_kv_heads: int):
        tc = use_tensor_cores_for(num_heads, num_kv_heads, self.use_tensor_cores)
        if self._decode is None or self._decode_tc != tc:
            self._decode, self._decode_tc = self.kernels.decode(use_tensor_cores=tc), tc
        return self._decode

    def _prefill_wrapper(self):
        if self._prefill is None:
            self._prefill = self.kernels.prefill()
        return self._prefill

    # ---------------------------------------------------------------------------- execution
    def forward(self, layer, q, k, v, k_cache, v_cache, meta, scale):
        state = meta.backend_state["flashinfer"]
        if q.dtype not in self.kernels.supported_dtypes or k_cache.dtype != q.dtype:
            return self._fallback(layer, q, k, v, k_cache, v_cache, meta, scale, state)
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
        if state["planned"] != (q.dtype, scale):
            self._plan_kernels(state, q.dtype, scale)
        step: StepPlan = state["step"]
        q = q.contiguous()
        if step.kind == "decode":
            return self._decode.run(q, k_cache, v_cache)
        if step.kind == "prefill":
            return self._prefill.run(q, k_cache, v_cache)
        qp = q if step.perm is None else q.index_select(0, step.perm)  # [T, H, D] in DFS row order
        if "multilevel" in state:
            out = state["multilevel"].run(qp, k_cache, v_cache)
        else:
            out = self._run_levels(qp, k_cache, v_cache, step, state["private"])
        return out if step.inv_perm is None else out.index_select(0, step.inv_perm)

    def _run_levels(self, qp, k_cache, v_cache, step: StepPlan, private):
        out, lse = private.run(qp, k_cache, v_cache, return_lse=True)  # [T, H, D], [T, H] (log2)
        merge = self.kernels.merge_state_in_place
        for w, lv in zip(self._levels, step.levels[:-1]):
            if lv.rows is None:
                o, s = w.run(qp, k_cache, v_cache, return_lse=True)
                merge(out, lse, o, s)
                continue
            o, s = w.run(qp.index_select(0, lv.rows), k_cache, v_cache, return_lse=True)
            out_rows, lse_rows = out.index_select(0, lv.rows), lse.index_select(0, lv.rows)
            merge(out_rows, lse_rows, o, s)
            out.index_copy_(0, lv.rows, out_rows)
            lse.index_copy_(0, lv.rows, lse_rows)
        return out

    def _fallback(self, layer, q, k, v, k_cache, v_cache, meta, scale, state):
        """FlashInfer has no float32 kernels (and here none for a KV dtype other than the activations'):
        run the step on the torch backend."""
        from .torch_backend import TorchAttentionBackend

        if self._torch is None:
            self._torch = TorchAttentionBackend(cascade=self.cascade, min_saved_tokens=self.min_saved_tokens)
        if not self._warned_fallback:
            log.warning("flashinfer backend: %s activations over a %s KV cache are not supported by FlashInfer's "
                        "kernels; using the torch backend (use dtype bfloat16 or float16 on CUDA, kv_dtype auto)",
                        q.dtype, k_cache.dtype)
            self._warned_fallback = True
        if state["planned"] != "torch":
            self._torch.cascade = self.cascade
            self._torch.plan(meta, num_heads=state["num_heads"], num_kv_heads=state["num_kv_heads"],
                             head_dim=state["head_dim"])
            self.last_used_cascade = self._torch.last_used_cascade
            self.num_fallback_steps += 1
            state["planned"] = "torch"
        return self._torch.forward(layer, q, k, v, k_cache, v_cache, meta, scale)


__all__ = ["INT_WORKSPACE_BYTES", "FlashInferBackend", "FlashInferKernels", "use_tensor_cores_for"]
