"""Sampler, make_generator, StopStringMatcher and IncrementalDetokenizer (no model needed)."""

from __future__ import annotations

import math

import pytest
import torch

from opencoti.engine.config import SamplingParams
from opencoti.engine.sampling import (
    IncrementalDetokenizer,
    Sampler,
    SampleOutput,
    StopStringMatcher,
    make_generator,
)

V = 1000


def sp(**kw) -> SamplingParams:
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    base.update(kw)
    return SamplingParams(**base)


def rand_logits(b: int, v: int = V, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, v, generator=g) * scale


def draw(sampler: Sampler, logits: torch.Tensor, p: SamplingParams, n: int, seed: int = 0) -> list[int]:
    """n independent draws of one row's distribution, done as one batch of n rows."""
    out = sampler.sample(logits.expand(n, -1).contiguous(), [p] * n,
                         [make_generator(seed + i, 0) for i in range(n)])
    return out.token_ids


# -- Sampler ---------------------------------------------------------------------------------


def test_greedy_is_argmax_and_consumes_no_rng():
    logits = rand_logits(6)
    gens = [make_generator(i, 0) for i in range(6)]
    states = [g.get_state() for g in gens]
    out = Sampler().sample(logits, [SamplingParams.greedy()] * 6, gens)
    assert isinstance(out, SampleOutput)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None
    assert all(torch.equal(g.get_state(), s) for g, s in zip(gens, states))


def test_top_k_1_and_tiny_top_p_are_argmax():
    logits = rand_logits(8, seed=1)
    want = logits.argmax(-1).tolist()
    sampler = Sampler()
    gens = [make_generator(i, 0) for i in range(8)]
    assert sampler.sample(logits, [sp(top_k=1, temperature=1.5)] * 8, gens).token_ids == want
    # not greedy by params, but the nucleus is one token: exercises the sorted and probe paths
    for p in (sp(top_p=1e-6, temperature=2.0), sp(top_k=50, top_p=1e-6, temperature=2.0),
              sp(min_p=1.0, temperature=5.0)):
        assert not p.is_greedy
        for _ in range(3):
            assert sampler.sample(logits, [p] * 8, gens).token_ids == want


def test_seed_reproducible_regardless_of_batch():
    steps = [rand_logits(1, v=V, seed=100 + s, scale=1.0)[0] for s in range(12)]
    targets = [
        sp(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
        sp(temperature=1.2, top_p=0.9),  # probe ladder
        sp(temperature=0.7, top_p=0.999),  # flat-ish nucleus: widens past the first probe
        sp(temperature=1.0, min_p=0.1),  # unsorted path
        sp(temperature=1.0),
    ]
    others = [SamplingParams.greedy(), sp(top_k=5), sp(top_p=0.5), sp(min_p=0.2),
              sp(top_k=40, top_p=0.95, min_p=0.05), sp(temperature=0.3)]
    for target in targets:
        sampler = Sampler()
        gen = make_generator(1234, 0)
        alone = [sampler.sample(x[None], [target], [gen]).token_ids[0] for x in steps]
        # same seed, now at varying positions among other rows with other params and logits
        gen = make_generator(1234, 0)
        other_gens = [make_generator(7 + i, 0) for i in range(len(others))]
        batched = []
        for s, x in enumerate(steps):
            pos = s % (len(others) + 1)
            noise = rand_logits(len(others), seed=s, scale=2.0)
            rows = list(noise)
            rows.insert(pos, x)
            ps = list(others)
            ps.insert(pos, target)
            gs: list = list(other_gens)
            gs.insert(pos, gen)
            out = sampler.sample(torch.stack(rows), ps, gs)
            batched.append(out.token_ids[pos])
        assert batched == alone, target
        assert len(set(alone)) > 1  # actually sampling


def test_seed_same_and_unseeded_differ():
    logits = rand_logits(1, scale=0.5)
    p = sp()
    a = [Sampler().sample(logits, [p], [g]).token_ids[0] for g in [make_generator(5, 0)] * 20]
    b = [Sampler().sample(logits, [p], [g]).token_ids[0] for g in [make_generator(5, 0)] * 20]
    assert a == b
    g1, g2 = make_generator(None, 0), make_generator(None, 0)
    assert not torch.equal(torch.rand(4, generator=g1), torch.rand(4, generator=g2))
    make_generator(-1, 0), make_generator(2**64 - 1, 0)  # config's whole seed range is accepted


def test_top_k_filters():
    logits = rand_logits(1, scale=1.0)
    allowed = set(logits[0].topk(5).indices.tolist())
    got = draw(Sampler(), logits, sp(top_k=5, temperature=3.0), 400)
    assert set(got) == allowed  # all 5 seen at a high temperature, nothing else


def test_top_p_filters():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None]
    for kw in ({}, {"top_k": 3}):  # probe path and renormalized-top-k path
        got = draw(Sampler(), logits, sp(top_p=0.75, **kw), 400)
        assert set(got) == {0, 1}
    # top_p after top_k is measured on the top-k renormalized distribution:
    # top_k=2 -> (0.625, 0.375); top_p=0.6 keeps only token 0
    assert set(draw(Sampler(), logits, sp(top_k=2, top_p=0.6), 200)) == {0}


def test_min_p_filters():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None]
    for kw in ({}, {"top_k": 4}, {"top_p": 0.999}):  # unsorted, sorted and probe paths
        got = draw(Sampler(), logits, sp(min_p=0.2, **kw), 600)  # threshold 0.1
        assert set(got) == {0, 1, 2}, kw


def test_temperature_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log()[None]
    for temperature in (0.5, 1.0, 2.0):
        want = probs ** (1 / temperature)
        want = want / want.sum()
        for kw in ({}, {"top_k": 3}, {"top_p": 0.9999}):
            n = 3000
            got = torch.bincount(torch.tensor(draw(Sampler(), logits, sp(temperature=temperature, **kw), n,
                                                   seed=int(temperature * 1000))), minlength=3).double()
            expected = want.double() * n
            chi2 = float(((got - expected) ** 2 / expected).sum())
            assert chi2 < 20.0, (temperature, kw, got.tolist(), expected.tolist())  # df=2: p ~ 5e-5


def test_distribution_on_a_wide_vocab():
    """Wide rows are sampled in two levels (block, then column); check the law end to end."""
    v = 2000  # not a multiple of the block size: exercises the padding
    where = [3, 100, 1999]  # two share the first block
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = torch.full((1, v), -30.0)
    logits[0, where] = probs.log()
    logits[0, 1000:1010] = -6.0  # a little mass elsewhere, removed by min_p below
    n = 3000
    for kw in ({"min_p": 0.01}, {"top_p": 0.99, "min_p": 0.01}):
        got_ids = draw(Sampler(), logits, sp(**kw), n, seed=77)
        assert set(got_ids) <= set(where)
        got = torch.tensor([got_ids.count(w) for w in where]).double()
        expected = probs.double() * n
        chi2 = float(((got - expected) ** 2 / expected).sum())
        assert chi2 < 20.0, (kw, got.tolist())


def test_large_vocab_flat_nucleus_falls_back_to_full_sort():
    v = 49152
    logits = rand_logits(2, v=v, scale=0.01)  # nearly uniform: the 0.9 nucleus is ~44k tokens
    p = sp(top_p=0.9)
    gens = [make_generator(3, 0), make_generator(4, 0)]
    out = Sampler().sample(logits, [p, p], gens)
    for row, tok in enumerate(out.token_ids):
        order = logits[row].argsort(descending=True)
        rank = (order == tok).nonzero().item()
        assert rank < int(0.92 * v)


def test_sampled_tokens_stay_in_the_reference_support():
    """Random params against a naive full-sort reference of the kept set."""
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(32, V, generator=g) * 2
    params = []
    for i in range(32):
        params.append(sp(temperature=[0.5, 1.0, 1.7][i % 3], top_k=[0, 3, 40, 500][i % 4],
                         top_p=[1.0, 0.9, 0.5][i % 3], min_p=[0.0, 0.05, 0.3][(i // 3) % 3]))
    sampler = Sampler()
    gens = [make_generator(i, 0) for i in range(32)]
    for _ in range(5):
        out = sampler.sample(logits, params, gens)
        for row, (p, tok) in enumerate(zip(params, out.token_ids)):
            vals, ids = logits[row].sort(descending=True)
            k = p.top_k if 0 < p.top_k < V else V
            vals, ids = vals[:k], ids[:k]
            probs = torch.softmax(vals, -1)
            cum_before = torch.cumsum(probs, -1) - probs
            keep = (cum_before < p.top_p) if p.top_p < 1 else torch.ones(k, dtype=torch.bool)
            if p.min_p > 0:
                keep &= probs >= p.min_p * probs[0]
            keep[0] = True
            assert tok in set(ids[keep].tolist()), (row, p)


def test_logprobs():
    logits = rand_logits(4, seed=3)
    params = [sp(logprobs=5, temperature=0.7), SamplingParams.greedy(logprobs=0),
              sp(top_k=10), SamplingParams.greedy(logprobs=3)]
    out = Sampler().sample(logits, params, [make_generator(i, 0) for i in range(4)])
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs is not None and out.top_logprobs is not None
    for row, tok in enumerate(out.token_ids):
        assert out.logprobs[row] == pytest.approx(ref[row, tok].item(), abs=1e-5)
    assert [len(t) for t in out.top_logprobs] == [5, 0, 0, 3]
    for row in (0, 3):
        tops = out.top_logprobs[row]
        lps = [lp for _, lp in tops]
        assert lps == sorted(lps, reverse=True)
        assert tops[0][0] == logits[row].argmax().item()
        for tok, lp in tops:
            assert lp == pytest.approx(ref[row, tok].item(), abs=1e-5)
        assert math.exp(out.top_logprobs[row][0][1]) <= 1.0


def test_bad_shapes():
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(2, 5), [sp()], [None])
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(5), [sp()], [None])
    assert Sampler().sample(torch.zeros(0, 5), [], []).token_ids == []
    assert Sampler().sample(torch.zeros(1, 5), [sp()], [None]).token_ids[0] in range(5)


# -- StopStringMatcher -----------------------------------------------------------------------


def run_stream(stop, chunks):
    m = StopStringMatcher(stop)
    out, hit = [], False
    for c in chunks:
        text, hit = m.feed(c)
        out.append(text)
        if hit:
            break
    if not hit:
        out.append(m.flush())
    return "".join(out), hit


def test_stop_in_middle_of_chunk():
    m = StopStringMatcher(["STOP"])
    assert m.feed("hello STOP world") == ("hello ", True)
    assert m.matched == "STOP"
    assert m.feed("more") == ("", True)
    assert m.flush() == ""


def test_stop_spanning_feeds():
    m = StopStringMatcher(["</end>"])
    assert m.feed("abc</") == ("abc", False)
    assert m.feed("en") == ("", False)
    assert m.feed("d>tail") == ("", True)
    assert m.flush() == ""


def test_false_start_is_released():
    m = StopStringMatcher(["</end>"])
    assert m.feed("x</e") == ("x", False)
    assert m.feed("x") == ("</ex", False)
    assert m.feed("<") == ("", False)
    assert m.flush() == "<"


def test_several_stops_earliest_wins():
    assert run_stream(["world", "lo w"], ["hello world"]) == ("hel", True)
    assert run_stream(["b", "a"], ["xxaxb"]) == ("xx", True)
    # overlapping: "bc" completes before "abcd" could; chunking does not change the answer
    for chunks in (["abcd"], ["abc", "d"], list("abcd")):
        assert run_stream(["abcd", "bc"], chunks) == ("a", True)


def test_stop_unicode():
    text = "Grüße 🙂 — 停止 here"
    assert run_stream(["停止"], list(text)) == ("Grüße 🙂 — ", True)
    assert run_stream(["🙂 —"], ["Grüße 🙂", " ", "— x"]) == ("Grüße ", True)
    assert run_stream(["停止"], ["a停", "b"]) == ("a停b", False)


@pytest.mark.parametrize("stop", [["STOP"], ["ab", "bab", "xyz"], ["aaa"], ["\n\n"]])
def test_stop_chunking_invariance(stop):
    text = "xx ba bab aa aab STOP\n\nafter aaa xyz end"
    whole = run_stream(stop, [text])
    for size in (1, 2, 3, 5):
        assert run_stream(stop, [text[i:i + size] for i in range(0, len(text), size)]) == whole
    cut = min(text.find(s) for s in stop if s in text)
    assert whole == (text[:cut], True)


def test_no_stop_strings_passthrough():
    m = StopStringMatcher([])
    assert m.feed("abc") == ("abc", False)
    assert m.flush() == ""


# -- IncrementalDetokenizer ------------------------------------------------------------------


class ByteVocab:
    """Fake byte-level tokenizer: each token is some bytes; decode replaces bad UTF-8 like HF."""

    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces
        self.max_window = 0

    def decode(self, ids) -> str:
        self.max_window = max(self.max_window, len(ids))
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def test_detokenizer_holds_split_multibyte_chars():
    euro = "€".encode()  # 3 bytes
    smile = "🙂".encode()  # 4 bytes
    pieces = [b"Hi", b" ", euro[:1], euro[1:], b"5", smile[:2], smile[2:3], smile[3:], b"!"]
    vocab = ByteVocab(pieces)
    det = IncrementalDetokenizer(vocab.decode)
    outs = [det.push(i) for i in range(len(pieces))]
    assert outs == ["Hi", " ", "", "€", "5", "", "", "🙂", "!"]
    assert det.flush() == ""
    assert "".join(outs) == vocab.decode(list(range(len(pieces))))


def test_detokenizer_window_is_bounded_and_flush():
    pieces = [b"ab", b"c", b"\xe2\x82"]  # last: an unfinished 3-byte sequence
    vocab = ByteVocab(pieces)
    det = IncrementalDetokenizer(vocab.decode, prompt_ids=[0] * 100)
    text = "".join(det.push(i % 2) for i in range(500))
    assert text == "abc" * 250
    assert vocab.max_window <= 8  # a few tokens of context, not the whole sequence
    assert det.push(2) == ""
    assert det.flush() == "\ufffd"
    assert det.flush() == ""


def test_detokenizer_uses_context_for_leading_space():
    """A SentencePiece-like decoder drops the leading space of the first token."""
    pieces = ["▁Hello", "▁world", "!"]

    def decode(ids):
        return "".join(pieces[i] for i in ids).replace("▁", " ").lstrip(" ")

    det = IncrementalDetokenizer(decode, prompt_ids=[0])
    assert det.push(1) == " world"
    assert det.push(2) == "!"
