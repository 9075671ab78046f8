"""The input embedding of a GGUF model held in the file's own blocks (Q8_0, or any type): rows bit for
bit those of the fp32 table gguf's decoder gives, a fraction of its bytes, the same logits, the same
errors."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from opencoti.engine.model import weights
from opencoti.engine.model.embedding import BlockEmbedding, Q8Embedding
from opencoti.engine.model.llama import LlamaForward

from gguf import GGMLQuantizationType as GT
from gguf import quants


def _q8_table(v=70, k=64, seed=0):
    """A random table in Q8_0 blocks and its fp32 form by gguf's own decoder."""
    w = (torch.randn(v, k, generator=torch.Generator().manual_seed(seed)) * 0.3).numpy()
    w[3] = 0.0  # an all-zero row (scale 0)
    w[5, :32] = -0.0
    blocks = quants.quantize(w, GT.Q8_0)
    return blocks, torch.from_numpy(quants.dequantize(blocks, GT.Q8_0).astype(np.float32).reshape(v, k))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def test_q8_rows_are_the_decoded_rows_bit_for_bit():
    blocks, table = _q8_table()
    for dtype in (torch.float32, torch.bfloat16):
        emb = Q8Embedding.from_blocks(blocks, 70, 64, dtype)
        ref = table.to(dtype)
        ids = torch.arange(70)
        assert torch.equal(_bits(emb.index_select(0, ids)), _bits(ref))
        assert torch.equal(_bits(emb.index_select(0, torch.tensor([9, 9, 0, 69]))), _bits(ref[[9, 9, 0, 69]]))
        assert torch.equal(_bits(emb[:4]), _bits(ref[:4])) and torch.equal(_bits(emb[-4:]), _bits(ref[-4:]))
        assert torch.equal(_bits(emb[7]), _bits(ref[7])) and torch.equal(_bits(emb.dense()), _bits(ref))
        assert emb.equals(ref) and emb.shape == (70, 64) and emb.dtype == dtype
        assert emb.nbytes == 70 * 64 + 70 * 2 * 4  # int8 values, one fp32 scale per 32
    changed = table.clone()
    changed[40, 17] = torch.nextafter(changed[40, 17], torch.tensor(1.0))  # one ulp off
    assert not Q8Embedding.from_blocks(blocks, 70, 64, torch.float32).equals(changed)


def test_ids_out_of_range_raise_as_the_float_table_did():
    blocks, table = _q8_table()
    emb = Q8Embedding.from_blocks(blocks, 70, 64, torch.float32)
    for bad in ([70], [0, 1000], [-1]):
        with pytest.raises(IndexError, match="index out of range") as want:
            table.index_select(0, torch.tensor(bad))
        with pytest.raises(IndexError) as got:
            emb.index_select(0, torch.tensor(bad))
        assert str(got.value) == str(want.value)
    with pytest.raises(ValueError, match="dim 0"):
        emb.index_select(1, torch.tensor([0]))
    with pytest.raises(ValueError, match="multiple of 32"):
        Q8Embedding(torch.zeros(4, 48, dtype=torch.int8), torch.zeros(4, 1, dtype=torch.float16), torch.float32)


@pytest.fixture(scope="module")
def bundled():
    from opencoti.engine.model.loader import load_model

    return load_model("default")  # the setup step installs it: a missing model fails here


@pytest.mark.bundled
def test_bundled_embedding_bit_identical_and_smaller(bundled, monkeypatch, tmp_path):
    monkeypatch.setenv("OPENCOTI_AUTOTUNE", "0")  # each format's first kernel: no per-shape timing
    table = bundled.state_dict["model.embed_tokens.weight"].dequantize()  # gguf's decoder, the whole table
    v, k = table.shape
    # an empty timing cache of its own: timings other runs left in the shared one may give the head 16 bits
    model = weights.build_forward(bundled, weights="int8", dtype=torch.float32, device="cpu", max_positions=64,
                                  adapt_threads=False, cache_dir=str(tmp_path))
    assert isinstance(model.embed, Q8Embedding)
    # every token id of the vocabulary: the rows of the fp32 table the engine held before
    assert torch.equal(_bits(model.embed.index_select(0, torch.arange(v))), _bits(table))
    # the model's tensors: int8 values and fp32 block scales instead of the fp32 table
    held = model.tensor_bytes()
    assert held["embedding"] == v * k + v * (k // 32) * 4
    assert v * k * 4 - held["embedding"] > 75 * 2**20  # 108 MiB -> 30.4 MiB on SmolLM2-135M
    with pytest.raises(IndexError, match="index out of range"):
        model.embed.index_select(0, torch.tensor([v]))
    # the same logits as with the fp32 table (greedy outputs cannot change)
    ids = torch.tensor(bundled.tokenizer.encode("The tied embedding of a small model, looked up row by row."))
    dense = LlamaForward(bundled.hf_config, bundled.state_dict, dtype=torch.float32, device="cpu", max_positions=64,
                         weights="int8")
    assert isinstance(dense.embed, torch.Tensor) and dense.tensor_bytes()["embedding"] == v * k * 4
    assert torch.equal(model.dense_logits(ids), dense.dense_logits(ids))


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q4_0", "F16"])
def test_block_rows_are_the_decoded_rows(type_name):
    """Any other type stays in its blocks; each row looked up is what gguf's decoder gives for it."""
    from gguf_blocks import random_blocks

    v, k = 12, 256
    w = (torch.randn(v, k, generator=torch.Generator().manual_seed(1)) * 0.3).numpy()
    blocks = random_blocks(type_name, v, k, seed=1) if type_name != "F16" else w.astype(np.float16).view(np.uint8)
    table = torch.from_numpy(quants.dequantize(blocks, GT[type_name]).astype(np.float32).reshape(v, k))
    emb = BlockEmbedding(torch.from_numpy(np.ascontiguousarray(blocks).view(np.uint8).reshape(v, -1)), type_name, k,
                         torch.float32)
    assert emb.shape == (v, k) and emb.nbytes == blocks.nbytes
    assert torch.equal(emb.index_select(0, torch.tensor([3, 0, 3, 11])), table[[3, 0, 3, 11]])
    assert torch.equal(emb[5], table[5]) and torch.equal(emb.dense(), table)
    with pytest.raises(IndexError):
        emb.index_select(0, torch.tensor([v]))
    with pytest.raises(ValueError, match="dim 0"):
        emb.index_select(1, torch.tensor([0]))


def test_models_without_a_gguf_keep_the_float_table():
    from opencoti.engine.model.loader import tiny_model

    loaded = tiny_model("llama")
    model = weights.build_forward(loaded, weights="fp32", dtype=torch.float32, device="cpu", max_positions=64,
                                  adapt_threads=False)
    assert isinstance(model.embed, torch.Tensor)
    assert torch.equal(model.embed, loaded.state_dict["model.embed_tokens.weight"])
