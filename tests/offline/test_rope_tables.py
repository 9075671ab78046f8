"""The engine's RoPE tables equal transformers' rotary embeddings bit for bit: plain RoPE is computed
by the engine (without importing the modeling modules), other RoPE types by transformers' classes."""

from __future__ import annotations

import pytest
import torch

from opencoti.engine.model import llama
from opencoti.engine.model.tiny import LLAMA3_ROPE_SCALING, tiny_config


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("overrides", [{}, {"rope_theta": 100000.0, "head_dim": 8}], ids=["defaults", "theta-headdim"])
def test_plain_rope_is_transformers_rope(arch, overrides):
    cfg = tiny_config(arch, **overrides)
    assert llama._plain_rope_table(cfg, 1024) is not None  # computed here, not by transformers
    cos, sin = llama._rotary_cos_sin(cfg, 1024, "cpu")
    ref_cos, ref_sin = llama._transformers_rope_table(cfg, 1024)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)


def test_other_rope_types_go_to_transformers():
    cfg = tiny_config("llama", rope_scaling=LLAMA3_ROPE_SCALING)
    assert llama._plain_rope_table(cfg, 64) is None
    cos, sin = llama._rotary_cos_sin(cfg, 64, "cpu")
    ref_cos, ref_sin = llama._transformers_rope_table(cfg, 64)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
