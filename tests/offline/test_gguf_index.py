"""The engine's GGUF header reader against gguf-py's ``GGUFReader``, and its errors on bad files."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf import quants

from opencoti.engine.model.gguf_index import GGUFIndex
from opencoti.engine.errors import ModelLoadError
from opencoti.engine.model.gguf_convert import _gguf_architecture


def _write(path, *, alignment: int | None = None):
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_block_count(2)
    w.add_rope_freq_base(10000.0)
    w.add_token_list([f"tok{i}" * (i % 5) for i in range(300)])        # an array of strings
    w.add_token_types([gguf.TokenType.NORMAL] * 300)                    # an array of int32
    w.add_token_merges(["t o", "o k"])
    w.add_chat_template("{{ messages }}")
    w.add_array("test.nested", [[1, 2], [3]])                            # an array of arrays
    w.add_bool("test.flag", True)
    tensors = {
        "blk.0.attn_q.weight": quants.quantize(rng.standard_normal((8, 64)).astype(np.float32), GT.Q4_1),
        "blk.0.ffn_down.weight": rng.integers(0, 256, (4, 144), dtype=np.uint8),  # Q4_K blocks (any bytes)
        "output_norm.weight": rng.standard_normal(64).astype(np.float32),
        "token_embd.weight": rng.standard_normal((3, 64)).astype(np.float16),
    }
    for name, x in tensors.items():
        if x.dtype == np.uint8:
            qt = GT.Q4_1 if "attn_q" in name else GT.Q4_K
            w.add_tensor(name, x, raw_shape=x.shape, raw_dtype=qt)
        else:
            w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_tensors_and_metadata_match_gguf_reader(tmp_path, alignment):
    path = tmp_path / "m.gguf"
    _write(path, alignment=alignment)
    idx, ref = GGUFIndex(path), gguf.GGUFReader(str(path))
    assert idx.architecture == "llama" == _gguf_architecture(path)
    assert idx.metadata["llama.block_count"] == 2 and idx.metadata["test.flag"] is True
    assert idx.metadata["tokenizer.chat_template"] == "{{ messages }}"
    assert "tokenizer.ggml.tokens" not in idx.metadata  # arrays are stepped over
    assert [t.name for t in idx.tensors] == [t.name for t in ref.tensors]
    for got, want in zip(idx.tensors, ref.tensors):
        assert got.shape == tuple(int(d) for d in want.shape)
        assert got.type_name == want.tensor_type.name
        assert np.array_equal(got.data, np.asarray(want.data).view(np.uint8).reshape(-1)), got.name


def test_bad_files_are_clear_errors(tmp_path):
    good = tmp_path / "m.gguf"
    _write(good)
    raw = good.read_bytes()
    cases = {
        "empty": (b"", "empty"),
        "magic": (b"GGUX" + raw[4:], "bad magic"),
        "version": (raw[:4] + (9).to_bytes(4, "little") + raw[8:], "version 9"),
        "big-endian": (raw[:4] + (3).to_bytes(4, "big") + raw[8:], "big-endian"),
        "header cut": (raw[:200], "ends early"),
        "data cut": (raw[:-100], "past the end"),
    }
    for name, (data, message) in cases.items():
        p = tmp_path / f"{name}.gguf"
        p.write_bytes(data)
        with pytest.raises(ValueError, match=message):
            GGUFIndex(p)
        with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
            _gguf_architecture(p)
