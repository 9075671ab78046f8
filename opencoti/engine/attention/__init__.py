"""Attention backends, chosen at runtime. flashinfer is imported lazily (CUDA only)."""

from __future__ import annotations

import importlib.util

import torch

from ..errors import InvalidRequestError
from .base import AttentionMetadata, SeqBatchEntry, build_metadata  # noqa: F401


def flashinfer_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None


def select_backend(name: str, device: torch.device, cascade: str = "auto"):
    """``auto`` picks flashinfer on CUDA when installed (extra ``gpu``), else torch."""
    if name == "auto":
        name = "flashinfer" if device.type == "cuda" and flashinfer_available() and _has_flashinfer_backend() else "torch"
    if name == "torch":
        from .torch_backend import TorchAttentionBackend
        return TorchAttentionBackend(cascade=cascade)
    if name == "flashinfer":
        if device.type != "cuda" or not flashinfer_available():
            raise InvalidRequestError("attention_backend 'flashinfer' needs CUDA and the 'gpu' extra (flashinfer-python)")
        if not _has_flashinfer_backend():
            raise InvalidRequestError("the flashinfer backend is not part of this build yet; use attention_backend='torch'")
        from .flashinfer_backend import FlashInferBackend  # noqa: lazy, CUDA only
        return FlashInferBackend(device, cascade=cascade)
    raise InvalidRequestError(f"unknown attention backend {name!r}")


def _has_flashinfer_backend() -> bool:
    return importlib.util.find_spec(__name__ + ".flashinfer_backend") is not None
