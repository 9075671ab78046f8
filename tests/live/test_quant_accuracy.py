"""Accuracy gate of the weight formats on the bundled SmolLM2 (fp32 is the reference).

Per format: perplexity on a fixed text of >= 1,000 tokens within 3 % of fp32, and greedy top-1
agreement with fp32 >= 95 % over 256 forced-decoding positions, with the prefill kernels; with the
decode kernels (one row at a time) as the gate ``auto`` runs on the text's first 256 tokens. Also: the GGUF's Q4_1 blocks
loaded as int4 are exactly the weights the converter dequantized, and ``auto`` says what it chose.
"""

from __future__ import annotations

import pytest
import torch

from opencoti.engine.model import weights
from opencoti.engine.model.gate_text import GATE_TEXT
from opencoti.engine.model.qformats import Int4Weight

pytestmark = pytest.mark.bundled

KW = dict(dtype=torch.float32, device="cpu", max_positions=2048, adapt_threads=False)


@pytest.fixture(scope="module")
def gate_ids(bundled_model):
    ids = torch.tensor(bundled_model.tokenizer.encode(GATE_TEXT), dtype=torch.long)
    assert ids.numel() >= 1000, f"the gate text is only {ids.numel()} tokens"
    return ids


@pytest.fixture(scope="module")
def fp32_logits(bundled_model, gate_ids):
    return weights.build_forward(bundled_model, weights="fp32", **KW).dense_logits(gate_ids)


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
    assert bundled_model.source_gguf is not None
    q = weights.gguf_int4_weights(bundled_model.source_gguf, bundled_model.hf_config)
    layers = bundled_model.hf_config.num_hidden_layers
    assert len(q) == 7 * layers  # every projection of every layer is Q4_1 (the embeddings are Q8_0)
    for name, w in q.items():
        assert isinstance(w, Int4Weight) and w.group == 32
        assert torch.equal(w.dequantize(), bundled_model.state_dict[name]), name  # q/k permutation included


def test_auto_chooses_and_says_why(bundled_model, tmp_path):
    # a cache of its own: the gate and the timings are measured here, not read from an earlier run
    model = weights.build_forward(bundled_model, weights="auto", cache_dir=tmp_path, **KW)
    choice = model.weights_choice
    print(f"\nauto -> {model.weights}: {choice}")
    assert choice["requested"] == "auto" and choice["reason"].startswith("auto:")
    # every format passes the gate auto ran on the first 256 tokens of the text, with the prefill
    # kernels and one row at a time (a decode step's)
    for fmt in ("bf16", "int8", "int4"):
        g = choice["gate"][fmt]
        assert not g.get("cached") and not choice.get("cached"), choice
        print(f"{fmt}: ppl x{g['ppl_ratio']:.4f}, top-1 {g['top1_agreement']:.1%} over {g['top1_positions']} "
              f"positions; decode kernels {g['decode_path']}")
        assert g["top1_positions"] == 256
        for m in (g, g["decode_path"]):
            assert m["passed"] and m["ppl_ratio"] <= 1.03 and m["top1_agreement"] >= 0.95, (fmt, g)
    measured = choice["measured"]  # real steps of every format that passed the gate, fp32 included
    assert set(measured) == {f for f, g in choice["gate"].items() if g["passed"]} | {"fp32"}
    assert {"int8", "int4"} <= set(measured)
    if model.weights != "fp32":
        assert choice["gate"][model.weights]["passed"]
    assert measured[model.weights]["turn_cost_ms"] == min(m["turn_cost_ms"] for m in measured.values())
