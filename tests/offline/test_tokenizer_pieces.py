"""Long texts are tokenized in pieces (no single call holds the GIL for long) and give exactly the
ids of the whole text; tokenizers for which a cut would change the ids are never cut."""

from __future__ import annotations

import random

import pytest

from opencoti.engine.chat import tokenizer as tokmod
from opencoti.engine.chat.tokenizer import Tokenizer

WORDS = ("the of pool session prefix token branch fork cache hello world déjà vu 你好 世界 naïve x1 23 4567 "
         "it's don't (a) [b] {c} end. Next, 😀 emoji_ok tab").split()
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]


def _corpus(rng: random.Random, n_words: int) -> str:
    seps = [" "] * 12 + ["\n", "  ", "\t", " \n", "\n\n", "   "]
    out = []
    for _ in range(n_words):
        out.append(rng.choice(WORDS) if rng.random() > 0.01 else rng.choice(SPECIALS))
        out.append(rng.choice(seps))
    return "".join(out)


def _hf(raw):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>")
    hf.add_special_tokens({"additional_special_tokens": SPECIALS})
    return hf


def _byte_level_bpe():
    """A GPT-2 style tokenizer (byte-level BPE, regex pre-tokenizer), trained here on the test words."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator([_corpus(random.Random(1), 3000)], trainer=trainer)
    return _hf(raw)


def _prepending_normalizer():
    """A Llama-2 style tokenizer: the normalizer prepends '▁' to every input and no pre-tokenizer
    splits words, so encoding a piece on its own would add a marker the whole text does not have."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, normalizers, trainers

    raw = RawTokenizer(models.BPE(unk_token="<unk>"))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", *SPECIALS])
    raw.train_from_iterator([_corpus(random.Random(2), 2000)], trainer=trainer)
    return _hf(raw)


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(tokmod, "PIECE_CHARS", 64)
    monkeypatch.setattr(tokmod, "BATCH_PIECES", 3)
    monkeypatch.setattr(tokmod, "DECODE_PIECE", 5)


def _count_batches(tok, monkeypatch) -> list[int]:
    calls: list[int] = []
    backend = tok._backend
    real = backend.encode_batch

    class Spy:
        def __getattr__(self, name):
            return getattr(backend, name)

        def encode_batch(self, texts, **kw):
            calls.append(len(texts))
            return real(texts, **kw)

    monkeypatch.setattr(tok, "_backend", Spy())
    return calls


def test_pieces_give_the_ids_of_the_whole_text(small_pieces, monkeypatch):
    hf = _byte_level_bpe()
    tok = Tokenizer.from_hf(hf, vocab_size=len(hf))
    assert tok.piece_separators == (" ", "\n")
    calls = _count_batches(tok, monkeypatch)
    rng = random.Random(0)
    for n in (40, 200, 1000, 3000):
        text = _corpus(rng, n)
        assert tok.encode(text) == list(hf.encode(text, add_special_tokens=False)), n
    assert len(calls) > 10 and max(calls) <= 3  # cut into pieces, a few per call
    # a text with no place to cut (one long word) and whitespace runs only: one piece, same ids
    for text in ("x" * 1000, " " * 500 + "a", "\n" * 300, "a" + " " * 400 + "b"):
        assert tok.encode(text) == list(hf.encode(text, add_special_tokens=False))
    # special tokens added by the tokenizer: the whole-text path (pieces would add them to each)
    text = _corpus(rng, 300)
    assert tok.encode(text, add_special_tokens=True) == list(hf.encode(text, add_special_tokens=True))


def test_a_tokenizer_that_cannot_be_cut_is_not(small_pieces, monkeypatch):
    hf = _prepending_normalizer()
    tok = Tokenizer.from_hf(hf, vocab_size=len(hf))
    a, b = "hello", "world"
    whole = list(hf.encode(f"{a} {b}", add_special_tokens=False))
    parts = [i for e in tok._backend.encode_batch([a, f" {b}"], add_special_tokens=False) for i in e.ids]
    assert whole != parts  # cutting would change the ids ...
    assert " " not in tok.piece_separators  # ... so the probe refuses that cut
    calls = _count_batches(tok, monkeypatch)
    text = _corpus(random.Random(3), 1000)
    assert tok.encode(text) == list(hf.encode(text, add_special_tokens=False))
    if not tok.piece_separators:
        assert calls == []


def test_cut_points_sit_between_non_space_characters():
    text = "aaaa bbbb  cccc\ndddd eeee"
    cuts = tokmod._cut_points(text, (" ", "\n"), 4)
    assert cuts[0] == 0 and cuts == sorted(set(cuts))
    for c in cuts[1:]:
        assert text[c] in " \n" and not text[c - 1].isspace() and not text[c + 1].isspace()
    assert tokmod._cut_points("x" * 100, (" ",), 10) == [0]


def test_long_id_lists_decode_in_pieces_to_the_same_text(small_pieces, monkeypatch):
    hf = _byte_level_bpe()
    tok = Tokenizer.from_hf(hf, vocab_size=len(hf))
    assert tok.decode_in_pieces
    calls: list[int] = []
    real = hf.decode
    monkeypatch.setattr(hf, "decode", lambda ids, **kw: calls.append(len(ids)) or real(ids, **kw))
    rng = random.Random(5)
    for n in (30, 300, 2000):
        ids = list(real.__self__.encode(_corpus(rng, n), add_special_tokens=False))
        for skip in (True, False):
            calls.clear()
            assert tok.decode(ids, skip_special_tokens=skip) == real(ids, skip_special_tokens=skip), (n, skip)
    assert max(calls) < 40  # in pieces (a piece may grow to reach a clean cut)
    # ids that are not whole characters at every cut (bytes of one emoji split over tokens)
    emoji_ids = list(hf.encode("😀" * 300, add_special_tokens=False))
    assert tok.decode(emoji_ids) == real(emoji_ids)


def test_a_decoder_that_cannot_be_cut_is_not(small_pieces):
    hf = _prepending_normalizer()  # no decoder: tokens are joined with spaces, so no cut is clean
    tok = Tokenizer.from_hf(hf, vocab_size=len(hf))
    assert not tok.decode_in_pieces
    ids = list(hf.encode(_corpus(random.Random(6), 500), add_special_tokens=False))
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_id_lists_are_checked_in_slices_without_a_copy(monkeypatch):
    monkeypatch.setattr(tokmod, "CHECK_SLICE", 7)
    ids = list(range(50))
    assert tokmod.first_bad_id(ids, 50) is None and tokmod.first_bad_id([], 5) is None
    for at, bad in [(0, -1), (13, 50), (49, True), (20, 3.0), (35, "7"), (6, None), (7, 10**30), (48, False)]:
        wrong = list(ids)
        wrong[at] = bad
        assert tokmod.first_bad_id(wrong, 50) == at, (at, bad)
    tok = Tokenizer.byte_level()
    good = list(b"hello") * 20
    assert tok._check_ids(good) is good  # checked, not copied
    assert tok.decode(good) == "hello" * 20
    with pytest.raises(Exception, match="out of range"):
        tok.decode(good + [10**6])
    with pytest.raises(Exception, match="must be integers"):
        tok.decode(good + ["x"])
    assert tok._check_ids(tuple(good)) == good  # other sequences: a checked copy, as before


def test_long_id_lists_hold_shared_objects():
    from opencoti.server import json_steps

    ids = [int(str(300 + i % 500)) for i in range(5000)]  # a new object per element, as a parser makes
    shared = tokmod.shared_ids(ids)
    assert shared == ids and len({id(x) for x in shared}) == 500 < len({id(x) for x in ids})
    for other in ([], [1, 2, -3], [5, tokmod.SHARED_IDS], [1, True], [1, 2.0], [1, "2"]):
        assert tokmod.shared_ids(other) is other  # anything but ids in range: left as it is
    ids *= 6  # a large document: parsed in windows, each run of ids made shared
    parsed = json_steps.loads(("[" + ",".join(map(str, ids)) + ", 1.5, true]").encode())
    assert parsed == ids + [1.5, True] and type(parsed[-1]) is bool and type(parsed[-2]) is float
    assert len({id(x) for x in parsed[:20_000]}) == 500  # (the last window, with the float, is not)
