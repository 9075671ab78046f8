"""Accuracy gate of the weight formats on the bundled SmolLM2 (fp32 is the reference).

Per format: perplexity on a fixed text of >= 1,000 tokens within 3 % of fp32, and greedy top-1
agreement with fp32 >= 95 % over 256 forced-decoding positions, with the prefill kernels; with the
decode kernels (one row at a time) as the gate ``auto`` runs on the text's first 256 tokens. Also: the GGUF's Q4_1 blocks
read as int4 are exactly the values gguf's decoder gives, and ``auto`` says what it chose.
"""

from __future__ import annotations

import pytest
import torch

from opencoti.engine.model import weights
from opencoti.engine.model.gate_text import GATE_TEXT

pytestmark = pytest.mark.bundled

KW = dict(dtype=torch.float32, device="cpu", max_positions=2048, adapt_threads=False)


@pytest.fixture(scope="module")
def gate_ids(bundled_model):
    ids = torch.tensor(bundled_model.tokenizer.encode(GATE_TEXT), dtype=torch.long)
    assert ids.numel() >= 1000, f"the gate text is only {ids.numel()} tokens"
    return ids


@pytest.fixture(scope="module")
def fp32_model(bundled_model):
    """The fp32 reference, built once for the module (every test compares with it)."""
    return weights.build_forward(bundled_model, weights="fp32", **KW)


@pytest.fixture(scope="module")
def fp32_logits(fp32_model, gate_ids):
    return fp32_model.dense_logits(gate_ids)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_format_passes_the_accuracy_gate(bundled_model, gate_ids, fp32_logits, fmt):
    model = weights.build_forward(bundled_model, weights=fmt, **KW)
    # the projections on the whole text (a prefill's kernels); the decode kernels (one row at a time)
    # are held to the same bounds by the gate auto runs (test_auto_chooses_and_says_why)
    m = weights.gate_metrics(fp32_logits, model.dense_logits(gate_ids), gate_ids, 256)
    print(f"\n{fmt} (prefill kernels): {model.weights_info['weight_bytes'] / 1e6:.1f} "
          f"MB/step, ppl {m['ppl']:.3f} vs fp32 {m['ppl_fp32']:.3f} (x{m['ppl_ratio']:.4f}) on {m['tokens']} "
          f"tokens, top-1 agreement {m['top1_agreement']:.1%} over {m['top1_positions']} positions; kernels "
          f"{model.weights_info['kernels']}")
    assert m["tokens"] >= 1000 and m["top1_positions"] == 256
    assert m["ppl_ratio"] <= 1.03, m
    assert m["top1_agreement"] >= 0.95, m


def test_gguf_q4_1_blocks_load_as_int4_exactly(bundled_model):
    """Every layer projection of the bundled file is Q4_1; read as the native int4 layout it holds the
    values gguf's decoder gives for the file, bit for bit (q/k permutation included)."""
    assert bundled_model.source_gguf is not None
    layer_weights = {n: w for n, w in bundled_model.state_dict.items() if n.endswith("_proj.weight")}
    assert len(layer_weights) == 7 * bundled_model.hf_config.num_hidden_layers
    for name, w in layer_weights.items():
        assert w.type_name == "Q4_1" and w.is_exact_int4, name
        assert torch.equal(w.to_int4().dequantize(), w.dequantize()), name


def test_auto_chooses_and_says_why(bundled_model, fp32_model, tmp_path, monkeypatch):
    """auto on the bundled file: its own precision (int4: Q4_1 layers, the Q8_0 head in int8), the only
    format within 1.25x the file's size, so no other format is built, gated or timed; the memory held
    against the file is recorded."""
    # the fresh cache (no choice remembered from earlier runs) would also time each shape's kernels
    # again (~10 s; the machine's cache has them): each format's first kernel, the native ones, is used
    monkeypatch.setenv("OPENCOTI_AUTOTUNE", "0")
    model = weights.build_forward(bundled_model, weights="auto", cache_dir=tmp_path, **KW)
    choice = model.weights_choice
    print(f"\nauto -> {model.weights}: {choice}")
    assert choice["requested"] == "auto" and choice["reason"].startswith("auto: int4, the file's own precision")
    assert model.weights == "int4" and choice["candidates"] == ["int4"] and "measured" not in choice
    assert choice["weights_mb"]["int8"] > weights.GGUF_MEMORY_FACTOR * choice["file_mb"]
    assert choice["memory"]["ratio"] < 1.5 and "memory_warning" not in choice
    # and it computes what the fp32 model of the file computes, within the gate's bounds
    ids = torch.tensor(bundled_model.tokenizer.encode(GATE_TEXT)[:256])
    reference = fp32_model.dense_logits(ids)  # the module's fp32 model (its kernels timed in the machine's cache)
    for rows in (None, 1):  # prefill kernels, then one row at a time (a decode step's)
        m = weights.gate_metrics(reference, model.dense_logits(ids, rows_per_call=rows), ids, 256)
        print(f"int4 vs fp32 (rows per call {rows}): {m}")
        assert m["passed"], m
