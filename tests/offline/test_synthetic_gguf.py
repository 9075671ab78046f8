"""The synthetic GGUF generator (opencoti/engine/model/synthetic.py): deterministic files, the tensor
types of every mix (llama-quantize's choices for the k-quant mixes), blocks that decode (with
gguf-py's own dequantize) to zero-mean weights of std ~ 1/sqrt(fan_in), llama.cpp's metadata keys
and tensor names for each architecture, the bundled tokenizer copied, bad arguments refused."""

from __future__ import annotations

import math

import numpy as np
import pytest

import gguf
from gguf.quants import dequantize  # noqa: E402

from opencoti.engine.model import synthetic as syn  # noqa: E402

SMALL = dict(hidden=256, layers=2, ffn=512, heads=4, kv_heads=2)


def _bundled_tokenizer():
    return syn.tokenizer_kv()  # the set-up installs the bundled model: a missing one fails here


@pytest.fixture(scope="module")
def tok_kv():
    return _bundled_tokenizer()


class _T:
    def __init__(self, data, qtype):
        self.data, self.tensor_type = data, qtype


def _read(path):
    """({key: value}, {tensor name: (type name, numpy shape, (.data, .tensor_type))}); gguf-py's
    GGUFReader would take ~10 s per file on the 49152-entry vocabulary."""
    kv, infos = syn.read_gguf_header(path)
    tensors = {}
    with open(path, "rb") as f:
        for t in infos:
            f.seek(t.offset)
            data = np.frombuffer(f.read(t.nbytes), dtype=np.uint8)
            qtype = gguf.GGMLQuantizationType(t.qtype)
            if qtype == gguf.GGMLQuantizationType.F32:
                data = data.view(np.float32)
            data = data.reshape(t.shape[0], -1) if len(t.shape) == 2 else data
            tensors[t.name] = (qtype.name, t.shape, _T(data, qtype))
    return {k: v for k, _, v, _ in kv}, tensors


def test_same_arguments_give_the_same_bytes(tmp_path, tok_kv):
    a = syn.write_gguf(tmp_path / "a.gguf", **SMALL, seed=3)
    b = syn.write_gguf(tmp_path / "b.gguf", **SMALL, seed=3, threads=1)  # chunks have their own streams
    c = syn.write_gguf(tmp_path / "c.gguf", **SMALL, seed=4)
    assert a["sha256"] == b["sha256"] == syn.sha256_file(tmp_path / "a.gguf")
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
    assert c["sha256"] != a["sha256"] and c["bytes"] == a["bytes"]
    assert a["bytes"] == (tmp_path / "a.gguf").stat().st_size
    assert not list(tmp_path.glob("*.partial"))


def test_layers_that_get_more_bits_match_llama_quantize():
    # llama.cpp's use_more_bits for 32 layers: the first 4, the last 4, every third in between
    picked = [i for i in range(32) if syn.use_more_bits(i, 32)]
    assert picked == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert [i for i in range(2) if syn.use_more_bits(i, 2)] == [1]  # 2/8 == 0: only the last


EXPECTED = {  # mix -> (token_embd untied, attn_q, attn_v layer 0/1 of 8, ffn_down layer 0/1, output)
    "F16": ("F16", "F16", ("F16", "F16"), ("F16", "F16"), "F16"),
    "Q8_0": ("Q8_0", "Q8_0", ("Q8_0", "Q8_0"), ("Q8_0", "Q8_0"), "Q8_0"),
    "Q4_0": ("Q4_0", "Q4_0", ("Q4_0", "Q4_0"), ("Q4_0", "Q4_0"), "Q4_0"),
    "Q4_1": ("Q4_1", "Q4_1", ("Q4_1", "Q4_1"), ("Q4_1", "Q4_1"), "Q4_1"),
    "Q4_K_M": ("Q4_K", "Q4_K", ("Q6_K", "Q4_K"), ("Q6_K", "Q4_K"), "Q6_K"),
    "Q4_K_S": ("Q4_K", "Q4_K", ("Q5_K", "Q5_K"), ("Q5_K", "Q4_K"), "Q6_K"),
    "Q5_K_M": ("Q5_K", "Q5_K", ("Q6_K", "Q5_K"), ("Q6_K", "Q5_K"), "Q6_K"),
}


@pytest.mark.parametrize("mix", syn.MIXES)
def test_every_mix_has_llama_quantize_types_and_decodes_to_the_intended_std(tmp_path, tok_kv, mix):
    path = tmp_path / f"{mix}.gguf"
    info = syn.write_gguf(path, hidden=256, layers=8, ffn=512, heads=4, kv_heads=2, tied=False, mix=mix,
                          head_scale=8.0)
    kv, tensors = _read(path)
    assert kv["general.file_type"] == syn.FILE_TYPES[mix]
    embd, q, (v0, v1), (d0, d1), out = EXPECTED[mix]
    assert tensors["token_embd.weight"][0] == embd and tensors["blk.0.attn_q.weight"][0] == q
    assert (tensors["blk.0.attn_v.weight"][0], tensors["blk.1.attn_v.weight"][0]) == (v0, v1)
    assert (tensors["blk.0.ffn_down.weight"][0], tensors["blk.1.ffn_down.weight"][0]) == (d0, d1)
    assert tensors["output.weight"][0] == out
    assert sum(info["types"].values()) == len(tensors) == info["tensors"]
    for name, (tname, shape, t) in tensors.items():
        data = t.data[:4096]  # a sample of the big embedding is enough
        w = dequantize(data, t.tensor_type).astype(np.float64)
        assert tuple(w.shape) == (min(shape[0], 4096), *shape[1:]) and np.isfinite(w).all(), name
        if len(shape) == 1:
            assert tname == "F32"
            if name.endswith("norm.weight"):
                assert abs(w.mean() - 1.0) < 0.02 and w.min() > 0.9 and w.max() < 1.1, name
            continue
        rows = w
        target = (8.0 if name == "output.weight" else 1.0) / math.sqrt(shape[1])
        assert abs(rows.std() / target - 1) < 0.06, (name, tname, rows.std() / target)
        assert abs(rows.mean()) < 0.03 * target, (name, tname, rows.mean() / target)


def test_metadata_keys_and_tokenizer_are_llama_cpps(tmp_path, tok_kv):
    path = tmp_path / "m.gguf"
    syn.write_gguf(path, **SMALL, context=2048, rope_theta=500000.0, mix="Q4_K_M", name="unit")
    kv, tensors = _read(path)
    assert kv["general.architecture"] == "llama" and kv["general.name"] == "unit"
    assert kv["llama.context_length"] == 2048 and kv["llama.embedding_length"] == 256
    assert kv["llama.block_count"] == 2 and kv["llama.feed_forward_length"] == 512
    assert kv["llama.attention.head_count"] == 4 and kv["llama.attention.head_count_kv"] == 2
    assert kv["llama.rope.freq_base"] == 500000.0 and kv["llama.rope.dimension_count"] == 64
    assert kv["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert kv["llama.vocab_size"] == syn.VOCAB_SIZE
    assert kv["general.quantization_version"] == 2 and "llama.rope.scaling.type" not in kv
    for key, _, value, _ in tok_kv:  # every tokenizer key of the bundled file, verbatim
        assert kv[key] == value, key
    assert len(kv["tokenizer.ggml.tokens"]) == tensors["token_embd.weight"][1][0] == 49152
    assert "output.weight" not in tensors  # tied: the head is the embedding
    # tied: the head scale sits on output_norm (the embedding also feeds the first layer)
    norm = tensors["output_norm.weight"][2].data
    assert abs(norm.mean() - syn.DEFAULT_HEAD_SCALE) < 0.02 * syn.DEFAULT_HEAD_SCALE
    names = set(tensors)
    for i in range(2):
        assert {f"blk.{i}.{t}.weight" for t in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                                                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")} <= names
    assert tensors["blk.0.attn_k.weight"][1] == (128, 256) and tensors["blk.0.ffn_down.weight"][1] == (256, 512)


def test_qwen2_has_biases_and_qwen3_has_qk_norms_and_its_own_head_dim(tmp_path, tok_kv):
    syn.write_gguf(tmp_path / "q2.gguf", arch="qwen2", **SMALL, tied=False, mix="Q8_0")
    kv, tensors = _read(tmp_path / "q2.gguf")
    assert kv["general.architecture"] == "qwen2" and kv["qwen2.embedding_length"] == 256
    assert tensors["blk.1.attn_q.bias"][:2] == ("F32", (256,))
    assert tensors["blk.1.attn_k.bias"][:2] == ("F32", (128,)) and "blk.1.attn_v.bias" in tensors
    assert "output.weight" in tensors and "qwen2.rope.dimension_count" not in kv

    syn.write_gguf(tmp_path / "q3.gguf", arch="qwen3", **{**SMALL, "heads": 4}, head_dim=128, mix="Q4_K_M")
    kv, tensors = _read(tmp_path / "q3.gguf")
    assert kv["general.architecture"] == "qwen3"
    assert kv["qwen3.attention.key_length"] == kv["qwen3.attention.value_length"] == 128
    assert tensors["blk.0.attn_q_norm.weight"][:2] == ("F32", (128,))
    assert tensors["blk.0.attn_k_norm.weight"][:2] == ("F32", (128,))
    assert tensors["blk.0.attn_q.weight"][1] == (512, 256) and tensors["blk.0.attn_output.weight"][1] == (256, 512)
    assert not any(n.endswith(".bias") for n in tensors)


def test_rope_scaling_linear_keys_and_llama3_rope_freqs(tmp_path, tok_kv):
    syn.write_gguf(tmp_path / "lin.gguf", **SMALL, rope_scaling=("linear", 4.0), mix="Q4_0")
    kv, tensors = _read(tmp_path / "lin.gguf")
    assert kv["llama.rope.scaling.type"] == "linear" and kv["llama.rope.scaling.factor"] == 4.0
    assert "rope_freqs.weight" not in tensors

    syn.write_gguf(tmp_path / "l3.gguf", **SMALL, rope_theta=500000.0, rope_scaling=("llama3", 8.0, 1.0, 4.0, 64),
                   mix="Q4_0")
    kv, tensors = _read(tmp_path / "l3.gguf")
    assert "llama.rope.scaling.type" not in kv  # llama3 scaling is the tensor, as convert_hf_to_gguf.py writes it
    tname, shape, t = tensors["rope_freqs.weight"]
    factors = t.data
    assert tname == "F32" and shape == (32,)
    # the converter's formula, written out: wavelengths under 64/4 keep 1, over 64/1 get the factor
    freqs = 1.0 / (500000.0 ** (np.arange(0, 64, 2) / 64))
    wavelen = 2 * np.pi / freqs
    smooth = (64 / wavelen - 1.0) / (4.0 - 1.0)
    expect = np.where(wavelen < 16, 1.0, np.where(wavelen > 64, 8.0, 1 / ((1 - smooth) / 8.0 + smooth)))
    np.testing.assert_allclose(factors, expect, rtol=1e-5)
    assert factors[0] == 1.0 and factors[-1] == 8.0 and ((factors > 1) & (factors < 8)).any()


def test_rows_that_are_not_multiples_of_256_fall_back_like_llama_quantize(tmp_path, tok_kv):
    # SmolLM2 shapes: hidden 576 = 2.25 * 256
    syn.write_gguf(tmp_path / "s.gguf", hidden=576, layers=2, ffn=1536, heads=9, kv_heads=3, mix="Q4_K_M")
    _, tensors = _read(tmp_path / "s.gguf")
    assert tensors["token_embd.weight"][0] == "Q8_0"  # tied: the output's type, Q6_K -> Q8_0
    assert tensors["blk.0.attn_q.weight"][0] == "Q5_0"  # Q4_K -> Q5_0
    assert tensors["blk.0.attn_v.weight"][0] == "Q5_0"  # Q4_K -> Q5_0 (2 layers: only the last gets more bits)
    assert tensors["blk.1.attn_v.weight"][0] == "Q8_0"  # Q6_K -> Q8_0
    assert tensors["blk.1.ffn_down.weight"][0] == "Q6_K"  # 1536 columns: no fallback
    for name in ("blk.0.attn_q.weight", "blk.1.attn_v.weight", "token_embd.weight"):
        t = tensors[name][2]
        w = dequantize(t.data[:4096], t.tensor_type)
        assert abs(w.std() * math.sqrt(576) - 1) < 0.06


@pytest.mark.parametrize("kwargs, message", [
    (dict(arch="gpt2"), "arch must be one of"),
    (dict(mix="Q3_K"), "mix must be one of"),
    (dict(hidden=0), "hidden must be a positive integer"),
    (dict(layers=2.5), "layers must be a positive integer"),
    (dict(heads=4, kv_heads=3), "multiple of kv_heads"),
    (dict(hidden=250, heads=5, kv_heads=5), "multiples of 32"),
    (dict(hidden=256, heads=3, kv_heads=3), "multiple of heads"),
    (dict(head_dim=63), "head_dim must be even"),
    (dict(rope_scaling=("yarn", 4.0)), "unknown rope_scaling type"),
    (dict(rope_scaling=("linear",)), "('linear', factor)"),
    (dict(rope_scaling=("llama3", 8.0, 4.0, 1.0, 8192)), "low_freq_factor < high_freq_factor"),
    (dict(arch="qwen2", rope_scaling=("llama3", 8.0, 1.0, 4.0, 8192)), "only read by llama.cpp's llama"),
    (dict(arch="qwen3", qkv_bias=True), "qwen3 has no q/k/v biases"),
    (dict(head_scale=0.0), "head_scale must be > 0"),
    (dict(rope_theta=-1.0), "rope_theta must be > 0"),
    (dict(seed=-1), "seed must be a non-negative integer"),
])
def test_bad_arguments_are_refused_with_a_clear_message(tmp_path, kwargs, message):
    args = {**SMALL, **kwargs}
    with pytest.raises(ValueError) as err:
        syn.write_gguf(tmp_path / "bad.gguf", **args)
    assert message in str(err.value)
    assert not list(tmp_path.iterdir())


def test_presets_and_the_cli(tmp_path, tok_kv, capsys):
    import importlib.util
    import json
    from pathlib import Path

    assert syn.preset_args("8b")["tied"] is False and syn.preset_args("1b")["hidden"] == 2048
    with pytest.raises(ValueError, match="unknown preset"):
        syn.preset_args("70b")
    script = Path(__file__).resolve().parents[2] / "scripts" / "make_gguf.py"
    spec = importlib.util.spec_from_file_location("make_gguf", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "cli.gguf"
    assert mod.main(["-o", str(out), "--preset", "tiny", "--arch", "qwen3", "--head-dim", "128", "--mix", "Q4_0",
                     "--layers", "1", "--quiet"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["sha256"] == syn.sha256_file(out) and summary["args"]["arch"] == "qwen3"
    assert summary["head_dim"] == 128 and summary["types"] == {"Q4_0": 8, "F32": 5}
    assert mod.main(["-o", str(tmp_path / "x.gguf"), "--hidden", "200", "--quiet"]) == 2
    assert "multiples of 32" in capsys.readouterr().err
