"""Attention backends, chosen at runtime. flashinfer is imported lazily (CUDA only)."""

from __future__ import annotations

import importlib.util
import logging

import torch

from ..errors import InvalidRequestError
from .base import AttentionMetadata, SeqBatchEntry, build_metadata  # noqa: F401

log = logging.getLogger("opencoti.attention")


def flashinfer_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None


def select_backend(name: str, device: torch.device, cascade: str = "auto"):
    """``auto`` picks flashinfer on CUDA when installed (extra ``gpu``), else torch.

    An installed flashinfer that fails to import or to set up falls back to torch under ``auto``
    (with a warning); asked for by name, it is an InvalidRequestError saying why.
    """
    if name == "auto":
        if device.type == "cuda" and flashinfer_available() and _has_flashinfer_backend():
            try:
                return _flashinfer_backend(device, cascade)
            except InvalidRequestError as e:
                log.warning("attention backend: flashinfer unusable, using torch: %s", e)
        name = "torch"
    if name == "torch":
        from .torch_backend import TorchAttentionBackend
        return TorchAttentionBackend(cascade=cascade)
    if name == "flashinfer":
        if device.type != "cuda":
            raise InvalidRequestError(f"attention_backend 'flashinfer' needs a CUDA device (this engine runs on "
                                      f"{device.type}); use attention_backend='torch' or 'auto'")
        if not flashinfer_available():
            raise InvalidRequestError("attention_backend 'flashinfer' needs flashinfer-python: install the 'gpu' "
                                      "extra (pip install 'opencoti-langgraph[gpu]')")
        if not _has_flashinfer_backend():
            raise InvalidRequestError("the flashinfer backend is not part of this build yet; use attention_backend='torch'")
        return _flashinfer_backend(device, cascade)
    raise InvalidRequestError(f"unknown attention backend {name!r}")


def _flashinfer_backend(device: torch.device, cascade: str):
    from .flashinfer_backend import FlashInferBackend  # lazy: it imports flashinfer itself (CUDA only)

    try:
        return FlashInferBackend(device, cascade=cascade)
    except InvalidRequestError:
        raise
    except Exception as e:  # a broken install: a missing dependency, no kernels for this GPU
        raise InvalidRequestError(f"attention_backend 'flashinfer' could not start: {type(e).__name__}: {e}") from e


def _has_flashinfer_backend() -> bool:
    return importlib.util.find_spec(__name__ + ".flashinfer_backend") is not None
