"""What the Engine is built from, on its step thread: the model (loaded and its forward prepared in the
chosen weight format), the KV page pool sized from the budget, the attention backend (checked against
torch's on this model), and the device / dtype / KV dtype resolved from ``EngineConfig``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..attention import select_backend
from ..attention.selfcheck import checked_backend
from ..config import EngineConfig
from ..errors import InvalidRequestError
from ..kv.pages import PagePool

_DEFAULT_KV_TOKENS = 32768


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError("device cuda requested but CUDA is not available")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


_KV_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "q8": torch.int8}  # q8: attention/q8.py


def resolve_kv_dtype(name: str, act_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the KV pages for ``EngineConfig.kv_dtype``. auto: fp16 under fp32 activations
    (measured on the bundled model, benchmarks/bench_kv_dtype.py: perplexity x0.99992 and the same
    greedy tokens as fp32 pages; decode as fast at 512 tokens of context and faster at 3,500, where
    attention reads the pages; q8 pages are half fp16's bytes but less accurate and, converted on
    the torch path, slower there), else the activations' dtype."""
    if name == "auto":
        return torch.float16 if act_dtype == torch.float32 else act_dtype
    return _KV_DTYPES[name]


@dataclass
class Parts:
    loaded: Any  # model.types.LoadedModel
    model: Any  # the forward (model/llama.py)
    kv: PagePool
    backend: Any
    attention_check: Any
    max_context: int


def build_parts(config: EngineConfig, device: torch.device, dtype: torch.dtype, *,
                progress: Callable[[str], None] | None = None, loaded=None) -> Parts:
    """Load the model (unless ``loaded``), build its forward, the KV pages and the attention backend."""
    from ..model.loader import load_model
    from ..model.weights import build_forward

    loaded = loaded or load_model(config.model, cache_dir=config.cache_dir, dtype=dtype, progress=progress)
    hf = loaded.hf_config
    max_ctx = config.max_context or hf.max_position_embeddings
    max_ctx = min(max_ctx, hf.max_position_embeddings)
    window = getattr(hf, "sliding_window", None)
    if window and getattr(hf, "use_sliding_window", True) and hf.model_type == "mistral":
        max_ctx = min(max_ctx, window)  # no sliding-window attention: stay inside the window
    if progress:
        progress("preparing weights")
    saved_kv = None
    if config.state_dir is not None and config.weights == "auto":
        from ..persist.kvfile import saved_weight_formats
        saved_kv = saved_weight_formats(*(Path(config.state_dir).expanduser() / d for d in ("kv", "session_kv")))
    model = build_forward(loaded, weights=config.weights, dtype=dtype, device=device,
                          max_positions=max_ctx, cache_dir=config.cache_dir, progress=progress,
                          adapt_threads=config.num_threads is None, saved_kv=saved_kv)
    loaded.state_dict = None  # the forward holds its own (fused) copies
    d = model.dims
    kv_dtype = resolve_kv_dtype(config.kv_dtype, dtype)
    bpt = PagePool.bytes_per_token(d.num_layers, d.num_kv_heads, d.head_dim, kv_dtype)
    if config.kv_budget_mib is not None:
        budget_tokens = int(config.kv_budget_mib * 2**20 // bpt)
    else:
        budget_tokens = config.kv_budget_tokens or min(_DEFAULT_KV_TOKENS, max_ctx * config.max_running)
    num_pages = max(budget_tokens // config.page_size, 1)
    kv = PagePool(num_layers=d.num_layers, num_pages=num_pages, page_size=config.page_size,
                  num_kv_heads=d.num_kv_heads, head_dim=d.head_dim, dtype=kv_dtype, device=device)
    backend = select_backend(config.attention_backend, device, config.cascade)
    # on CUDA a backend other than torch must first match the torch backend on this model (else: torch)
    backend, check = checked_backend(backend, model, device, page_size=config.page_size, cascade=config.cascade,
                                     cache_dir=config.cache_dir, model_name=loaded.name)
    return Parts(loaded=loaded, model=model, kv=kv, backend=backend, attention_check=check, max_context=max_ctx)
