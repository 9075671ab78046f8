"""What the loader hands to the engine (:class:`LoadedModel`) and the names shared by the loaders."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..chat.tokenizer import Tokenizer

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")

# Bump when the layout of a converted directory changes: old caches are then ignored.
CONVERTER_VERSION = 2  # 2: config and tokenizer only; the weights are read from the GGUF
MARKER_FILE = "opencoti-model.json"  # written last; a directory without it is not a model we made

Progress = Callable[[str], None]


@dataclass
class LoadedModel:
    """A model ready for the engine.

    Attributes:
        hf_config: the transformers ``PretrainedConfig`` (model_type, sizes, rope, eps, tying).
        state_dict: HF parameter names -> tensors in the requested dtype, e.g.
            ``model.layers.0.self_attn.q_proj.weight``; ``lm_head.weight`` is
            present only when the embeddings are not tied.
        tokenizer: the engine's tokenizer for this model.
        model_dir: a plain HF directory that ``AutoModelForCausalLM.from_pretrained``
            loads (the reference for tests), or None.
        name: the model name reported by the APIs.
        architecture: one of :data:`SUPPORTED_ARCHITECTURES`.
        source_gguf: the GGUF file the model came from (its quantized blocks can be used
            directly by the int4 weight format), or None.
    """

    hf_config: Any
    state_dict: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    model_dir: Path | None
    name: str
    architecture: str
    source_gguf: Path | None = None


def normalize_names(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """HF names as ``*ForCausalLM`` uses them; drop buffers and a tied lm_head."""
    if "model.embed_tokens.weight" not in state and "embed_tokens.weight" in state:
        # a bare *Model checkpoint (no "model." prefix)
        state = {(k if k.startswith("lm_head.") else f"model.{k}"): v for k, v in state.items()}
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state
