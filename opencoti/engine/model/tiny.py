"""Tiny random-weight models for tests (``"tiny:<arch>[:<seed>]"``), with the byte-level tokenizer."""

from __future__ import annotations

import atexit
import copy
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..errors import ModelLoadError
from ..chat.tokenizer import Tokenizer
from .types import CONVERTER_VERSION, MARKER_FILE, SUPPORTED_ARCHITECTURES, LoadedModel, normalize_names

# Rope scaling as in Llama 3.1, sized for the tiny models (pass as ``rope_scaling=``
# to :func:`tiny_config` / :func:`tiny_model`): with head_dim 16 and theta 10000
# some frequencies are scaled, some smoothed and some kept.
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


_TINY_COMMON = dict(
    vocab_size=320,  # byte-level tokenizer: 256 bytes + 3 specials + reserved ids
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA: 2 query heads per kv head
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    initializer_range=0.2,  # large on purpose: logits must be far from uniform
    bos_token_id=257,
    eos_token_id=258,
    pad_token_id=None,
)

_TINY_ARCH: dict[str, dict[str, Any]] = {
    # mirrors SmolLM2: tied embeddings
    "llama": dict(tie_word_embeddings=True, rope_theta=10000.0),
    "mistral": dict(tie_word_embeddings=False, rope_theta=10000.0, sliding_window=None),
    # q/k/v bias (always on in Qwen2)
    "qwen2": dict(tie_word_embeddings=False, rope_theta=1000000.0),
    # q/k RMSNorm, head_dim explicit and != hidden/heads, no attention bias
    "qwen3": dict(tie_word_embeddings=True, rope_theta=1000000.0, head_dim=32, attention_bias=False),
}

_TINY_CACHE: dict[tuple, tuple[Any, dict[str, torch.Tensor], Path]] = {}


def tiny_config(arch: str, **overrides):
    """A small config of ``arch`` (llama | mistral | qwen2 | qwen3) for tests.

    Defaults: vocab 320, hidden 64, 2 layers, 4 heads, 2 kv heads, intermediate
    128, max_position_embeddings 512. ``overrides`` are config kwargs, e.g.
    ``rope_scaling=LLAMA3_ROPE_SCALING`` or ``num_hidden_layers=3``.
    """
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    classes = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
    if arch not in classes:
        raise ModelLoadError(f"unknown tiny architecture {arch!r} (choose from {', '.join(SUPPORTED_ARCHITECTURES)})")
    kwargs = {**_TINY_COMMON, **_TINY_ARCH[arch], **overrides}
    if kwargs.get("rope_scaling") is not None:
        kwargs["rope_scaling"] = dict(kwargs["rope_scaling"])  # configs keep (and may mutate) the dict
    return classes[arch](**kwargs)


def tiny_model(arch: str = "llama", *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> LoadedModel:
    """A tiny random-weight model with the byte-level tokenizer.

    Weights are drawn from ``seed`` without touching the global RNG: linear and
    embedding weights ~ N(0, 0.2), norm weights ~ U(0.5, 1.5), biases ~ N(0, 0.1),
    so logits are informative. ``model_dir`` is a temporary HF directory (made
    once per (arch, seed, overrides) per process) for the transformers reference.
    Every call returns fresh tensors and a fresh config.
    """
    key = (arch, int(seed), json.dumps(overrides, sort_keys=True, default=str))
    if key not in _TINY_CACHE:
        _TINY_CACHE[key] = _build_tiny(arch, int(seed), overrides)
    config, state, model_dir = _TINY_CACHE[key]
    return LoadedModel(
        hf_config=copy.deepcopy(config),
        state_dict={k: v.to(dtype, copy=True) for k, v in state.items()},
        tokenizer=Tokenizer.byte_level(config.vocab_size),
        model_dir=model_dir,
        name=f"tiny-{arch}-{seed}",
        architecture=arch,
    )


def _build_tiny(arch: str, seed: int, overrides: dict):
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, **overrides)
    std = config.initializer_range
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.uniform_(0.5, 1.5)
                elif name.endswith(".bias"):
                    param.normal_(0.0, 0.1)
                else:
                    param.normal_(0.0, std)
    model.eval()
    model_dir = Path(tempfile.mkdtemp(prefix=f"opencoti-tiny-{arch}-{seed}-"))
    atexit.register(shutil.rmtree, model_dir, True)
    model.save_pretrained(str(model_dir))
    marker = {"converter_version": CONVERTER_VERSION, "name": f"tiny-{arch}-{seed}", "architecture": arch,
              "tokenizer": "byte_level"}
    (model_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state = normalize_names(state, config)
    return config, state, model_dir


def parse_tiny_spec(spec: str) -> tuple[str, int]:
    parts = spec.split(":")
    if len(parts) not in (2, 3) or parts[1] not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"bad tiny model spec {spec!r}: use 'tiny:<arch>' or 'tiny:<arch>:<seed>' "
            f"with arch one of {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if len(parts) == 2:
        return parts[1], 0
    try:
        return parts[1], int(parts[2])
    except ValueError:
        raise ModelLoadError(f"bad tiny model spec {spec!r}: the seed must be an integer") from None
