"""The bundled SmolLM2-135M-Instruct: read in place from its GGUF file, the cached config and tokenizer,
the chat template."""

from __future__ import annotations

import time

import pytest
import torch

from opencoti.engine.chat import render_chat
from opencoti.engine.model import loader
from opencoti.engine.model.gguf_weights import GGUFWeight
from opencoti.engine.model.loader import BUNDLED_NAME, expected_weight_names, load_model

pytestmark = pytest.mark.bundled


def test_default_model_loads(bundled_model):
    m = bundled_model
    assert m.name == BUNDLED_NAME and m.architecture == "llama"
    cfg = m.hf_config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (576, 30, 9, 3)
    assert cfg.vocab_size == 49152 == m.tokenizer.vocab_size
    assert cfg.tie_word_embeddings and "lm_head.weight" not in m.state_dict
    assert not getattr(cfg, "quantization_config", None)
    assert set(m.state_dict) == set(expected_weight_names(cfg))
    # references into the file, not tensors: nothing of the model is read until the forward is built
    assert all(isinstance(t, GGUFWeight) for t in m.state_dict.values())
    assert {t.type_name for t in m.state_dict.values() if t.name.startswith("blk.") and len(t.shape) == 2} == {"Q4_1"}
    assert (m.model_dir / loader.MARKER_FILE).is_file()
    assert not list(m.model_dir.glob("*.safetensors"))
    leftovers = list(m.model_dir.parent.glob(".tmp-*"))
    assert not leftovers, f"conversion left temp dirs: {leftovers}"


def test_second_load_uses_the_cache(bundled_model):
    started = time.perf_counter()
    again = load_model("default", dtype=torch.bfloat16)
    print(f"\ncached load of the bundled model: {time.perf_counter() - started:.2f} s")
    assert again.model_dir == bundled_model.model_dir
    name = "model.layers.3.self_attn.k_proj.weight"
    assert torch.equal(again.state_dict[name].dequantize(), bundled_model.state_dict[name].dequantize())


def test_chat_template_renders(bundled_model):
    tok = bundled_model.tokenizer
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    text = render_chat(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}])
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text)
    assert ids.count(tok.encode("<|im_start|>")[0]) == 3
    assert tok.decode(ids) == "system\nBe brief.\nuser\nHi!\nassistant\n"
    # the template's default system prompt when none is given
    assert "SmolLM" in render_chat(tok, [{"role": "user", "content": "Hi!"}])


def test_eos_ids_include_im_end(bundled_model):
    tok = bundled_model.tokenizer
    (im_end,) = tok.encode("<|im_end|>")
    assert im_end in tok.eos_token_ids
    assert tok.eos_token_ids[0] == im_end == bundled_model.hf_config.eos_token_id
    assert tok.decode(tok.encode("Hello world")) == "Hello world"


def test_file_read_in_place_matches_the_gguf_reference(bundled_model, transformers_ref):
    """Every tensor read from the file is what transformers' GGUF loader dequantizes (q/k un-permuted
    from llama.cpp's layout), and our fp32 forward over them gives its logits."""
    from opencoti.engine.model.weights import build_forward

    reference = transformers_ref  # loader.transformers_reference's model of the file (tests/live/conftest.py)
    ref_state = reference.state_dict()
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",  # q/k are un-permuted from llama.cpp's layout
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.17.mlp.down_proj.weight",
        "model.layers.29.post_attention_layernorm.weight",
        "model.norm.weight",
    ]
    for name in names:
        assert torch.equal(ref_state[name], bundled_model.state_dict[name].dequantize()), name
    model = build_forward(bundled_model, weights="fp32", dtype=torch.float32, device="cpu", max_positions=64,
                          adapt_threads=False)
    ids = torch.tensor(bundled_model.tokenizer.encode("The capital of France is"))
    with torch.no_grad():
        torch.testing.assert_close(model.dense_logits(ids), reference(ids[None]).logits[0], atol=2e-3, rtol=2e-3)
