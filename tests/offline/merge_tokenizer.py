"""A tiny model whose tokenizer spells the model's answers with other ids than it generated.

Byte-level BPE with two merges: ids 0..255 are bytes, 256 = "ab", 257 = "ba", then the ChatML
specials (258 ``<|im_start|>``, 259 ``<|im_end|>``, 260 ``<|endoftext|>``). The model generates
letters one id each ("a" "b"); encoding the same text gives the merged id ("ab")."""

from __future__ import annotations

import dataclasses

import pytest

from opencoti.engine import Engine, EngineConfig
from opencoti.engine.chat.tokenizer import BYTE_LEVEL_CHAT_TEMPLATE, Tokenizer

A, B = ord("a"), ord("b")
AB_ONLY = {str(A): 100, str(B): 100}  # logit_bias: answers of a's and b's only (never EOS)


def merge_tokenizer() -> Tokenizer:
    """Byte-level BPE: ids 0..255 are bytes, 256 = "ab", 257 = "ba", then the ChatML specials."""
    from tokenizers import Tokenizer as RustTokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    b2u = bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    merges = [("a", "b"), ("b", "a")]
    for x, y in merges:
        vocab[x + y] = len(vocab)
    rust = RustTokenizer(models.BPE(vocab=vocab, merges=merges))
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=rust, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                 additional_special_tokens=["<|endoftext|>"], chat_template=BYTE_LEVEL_CHAT_TEMPLATE)
    return Tokenizer.from_hf(hf, vocab_size=320)


@pytest.fixture
def make_merge_engine():
    """Factory for tiny-model engines with the merge tokenizer (integrity-checked, shut down)."""
    from opencoti.engine.model.tiny import tiny_model

    made = []

    def factory(**kw):
        cfg = dict(model="tiny:llama", page_size=4, kv_budget_tokens=8192, max_batch_tokens=64, pool_grace_ttl_s=0.0)
        cfg.update(kw)
        loaded = dataclasses.replace(tiny_model("llama"), tokenizer=merge_tokenizer())
        eng = Engine(EngineConfig(**cfg), loaded=loaded)
        made.append(eng)
        return eng

    yield factory
    for eng in made:
        try:
            eng.check_integrity()
        finally:
            eng.shutdown()
