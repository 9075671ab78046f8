"""``auto`` on GGUF files read in place: the file's own precision, the formats within the file's size,
memory against the file recorded and a fallback said loudly (generated files: no downloads)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from opencoti.engine.model import choose, weights
from opencoti.engine.model.gguf_weights import GGUFWeight
from opencoti.engine.model.loader import load_model
from opencoti.engine.model.synthetic import write_gguf


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def _file(tmp_path_factory, mix: str, **kw):
    path = tmp_path_factory.mktemp("gguf") / f"m-{mix}.gguf"
    # small shapes (auto's AUTO_MIN_BYTES is lowered by the tests that need it)
    write_gguf(path, arch="llama", hidden=256, layers=3, ffn=1024, heads=4, kv_heads=2, tied=False, mix=mix,
               seed=5, **kw)
    return path


@pytest.mark.parametrize("mix, own, exact", [("Q4_K_M", "int4", ("Q4_K",)), ("Q4_0", "int4", ("Q4_0",)),
                                             ("Q8_0", "int8", ())])
def test_auto_takes_the_files_own_precision_within_its_size(tmp_path_factory, cache, monkeypatch, mix, own, exact):
    monkeypatch.setenv("OPENCOTI_AUTOTUNE", "0")
    monkeypatch.setattr(weights, "AUTO_MIN_BYTES", 1)  # the test files are small
    # step times of each candidate stand in for a measurement (this test is about which formats compete)
    table = {"int4": (0.010, 0.030, 0.2), "int8": (0.012, 0.030, 0.2), "bf16": (0.02, 0.05, 0.2),
             "fp32": (0.03, 0.06, 0.2)}
    monkeypatch.setattr(choose, "time_steps", lambda models, rounds=0: {f: choose.StepTimes(*table[f]) for f in models})
    monkeypatch.setattr(choose, "others_load", lambda *a: 0.0)
    monkeypatch.setattr(weights, "gate_metrics", lambda *a, **k: {"passed": True, "kl": 0.0, "ppl_ratio": 1.0,
                                                                   "top1_agreement": 1.0,
                                                                   "top1_agreement_clear": 1.0})
    loaded = load_model(_file(tmp_path_factory, mix), cache_dir=cache)
    assert all(isinstance(v, GGUFWeight) for v in loaded.state_dict.values())
    assert weights.own_format(loaded) == own
    lines: list[str] = []
    model = weights.build_forward(loaded, weights="auto", dtype=torch.float32, device="cpu", max_positions=128,
                                  adapt_threads=False, cache_dir=cache, progress=lines.append)
    choice = model.weights_choice
    assert choice["own_format"] == own and "fp32" not in choice["candidates"] and "bf16" not in choice["candidates"]
    assert choice["memory"]["file_mb"] > 0 and choice["memory"]["ratio"] <= weights.GGUF_MEMORY_FACTOR
    assert "memory_warning" not in choice and not any("WARNING" in line for line in lines)
    # the stand-in times make int4 the fastest: a Q8_0 file's int4 (a requantization, gated) can win
    assert model.weights in choice["candidates"] and model.weights == "int4"
    limit = weights.GGUF_MEMORY_FACTOR * choice["file_mb"]
    assert set(choice["candidates"]) == {f for f, mb in choice["weights_mb"].items() if mb <= limit} | {own}
    kinds = set(model.kernel_names.values())
    if exact:  # the 4-bit tensors run int4 from their blocks; the file's Q6_K ones as stored (never fewer bits)
        assert any(k.startswith("int4:") for k in kinds)
        q6 = [w for w in loaded.state_dict.values() if isinstance(w, GGUFWeight) and w.type_name == "Q6_K"]
        assert (mix == "Q4_K_M") == bool(q6)
        if q6:  # a Q4_K_M file: every projection read as stored (int8 rows with OPENCOTI_KQUANT=0: test_native_kquant)
            assert kinds == {"int4:native_kquant"}, kinds


def test_a_format_above_the_files_size_says_so(tmp_path_factory, cache, monkeypatch):
    monkeypatch.setenv("OPENCOTI_AUTOTUNE", "0")
    loaded = load_model(_file(tmp_path_factory, "Q4_0"), cache_dir=cache)
    lines: list[str] = []
    model = weights.build_forward(loaded, weights="fp32", dtype=torch.float32, device="cpu", max_positions=128,
                                  adapt_threads=False, cache_dir=cache, progress=lines.append)
    choice = model.weights_choice
    assert choice["memory"]["ratio"] > 3
    assert "memory_warning" in choice and "--weights int4" in choice["memory_warning"]
    assert any(line.startswith("WARNING: weights: fp32 holds") for line in lines)


def test_int4_of_a_q4_file_is_its_blocks(tmp_path_factory, cache, monkeypatch):
    """The int4 model of a Q4_0 file computes with the file's values: logits within fp32 rounding of an
    fp32 model built from gguf's own decoding of the same file (the activations are the only change)."""
    monkeypatch.setenv("OPENCOTI_AUTOTUNE", "0")
    loaded = load_model(_file(tmp_path_factory, "Q4_0"), cache_dir=cache)
    kw = dict(dtype=torch.float32, device="cpu", max_positions=128, adapt_threads=False, cache_dir=cache)
    ref = weights.build_forward(loaded, weights="fp32", **kw)
    q4 = weights.build_forward(loaded, weights="int4", **kw)
    assert q4.weights_choice.get("memory_warning") is None
    ids = torch.tensor(loaded.tokenizer.encode("The file's own blocks, read in place and never copied in fp32.")[:48])
    m = weights.gate_metrics(ref.dense_logits(ids), q4.dense_logits(ids), ids, 64)
    assert m["kl"] < 1e-3 and m["top1_agreement_clear"] == 1.0, m
