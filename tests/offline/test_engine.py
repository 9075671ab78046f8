"""Engine core on tiny random-weight models: logits vs transformers, batching, sessions, paging, errors."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from opencoti.engine import (ContextLengthError, EngineClosedError, InvalidRequestError, SamplingParams,
                             SessionBusyError, SessionNotFoundError)
from opencoti.engine.attention.base import SeqBatchEntry, build_metadata
from opencoti.engine.attention.torch_backend import TorchAttentionBackend
from opencoti.engine.kv.pages import PagePool
from opencoti.engine.model.llama import LlamaForward
from opencoti.engine.model.loader import LLAMA3_ROPE_SCALING, tiny_model

ARCHS = [("llama", {}), ("llama", {"rope_scaling": LLAMA3_ROPE_SCALING}), ("mistral", {}), ("qwen2", {}),
         ("qwen3", {})]


def _reference(loaded):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(loaded.model_dir), dtype=torch.float32).eval()


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("arch,overrides", ARCHS, ids=["llama", "llama3-rope", "mistral", "qwen2", "qwen3"])
def test_logits_match_transformers(arch, overrides, page_size):
    loaded = tiny_model(arch, seed=1, **overrides)
    ref = _reference(loaded)
    fw = LlamaForward(loaded.hf_config, loaded.state_dict, dtype=torch.float32, device="cpu", max_positions=256)
    d = fw.dims
    kv = PagePool(num_layers=d.num_layers, num_pages=512, page_size=page_size, num_kv_heads=d.num_kv_heads,
                  head_dim=d.head_dim, dtype=torch.float32)
    be = TorchAttentionBackend()
    g = torch.Generator().manual_seed(0)
    lens = [5, 37, 1, 12, 70]
    prompts = [torch.randint(0, d.vocab_size, (n,), generator=g) for n in lens]
    tables = [kv.allocate(kv.pages_for(n + 8)) for n in lens]
    # prefill: all prompts in one mixed batch (a length-1 prompt rides the decode path)
    meta = build_metadata([SeqBatchEntry(t, 0, len(p)) for p, t in zip(prompts, tables)], page_size)
    rows = torch.tensor(meta.qo_indptr[1:].tolist()) - 1
    out = fw.forward(torch.cat(prompts), meta, kv.k_cache, kv.v_cache, be, rows)
    with torch.no_grad():
        for j, p in enumerate(prompts):
            assert (out[j] - ref(p[None]).logits[0, -1]).abs().max().item() <= 1e-4
    # step-by-step decode of everybody, plus a chunk of 3 tokens for one of them (mixed batch)
    seqs = [p.clone() for p in prompts]
    for step in range(4):
        nxt = [torch.randint(0, d.vocab_size, (3 if (i == 1 and step == 2) else 1,), generator=g)
               for i in range(len(seqs))]
        meta = build_metadata([SeqBatchEntry(t, len(s), len(x)) for s, t, x in zip(seqs, tables, nxt)], page_size)
        rows = torch.tensor(meta.qo_indptr[1:].tolist()) - 1
        out = fw.forward(torch.cat(nxt), meta, kv.k_cache, kv.v_cache, be, rows)
        seqs = [torch.cat([s, x]) for s, x in zip(seqs, nxt)]
        with torch.no_grad():
            for j, s in enumerate(seqs):
                assert (out[j] - ref(s[None]).logits[0, -1]).abs().max().item() <= 1e-4, (arch, step, j)


def _prompt(i: int, n: int) -> list[int]:
    return [(i * 31 + j * 7) % 250 + 1 for j in range(n)]


def test_greedy_generation_matches_transformers(engine):
    from opencoti.engine.model.loader import tiny_model as tm
    ref = _reference(tm("llama"))
    prompt = _prompt(3, 9)
    r = engine.generate(prompt, params=SamplingParams.greedy(12, ignore_eos=True))
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    assert r.token_ids == out[0, len(prompt):].tolist()
    assert r.stop_reason == "length" and len(r.token_ids) == 12


def test_concurrent_requests_join_at_different_steps(engine):
    prompts = [_prompt(i, 3 + 9 * i) for i in range(8)]
    params = SamplingParams.greedy(10, ignore_eos=True)
    alone = [engine.generate(p, params=params).token_ids for p in prompts]
    streams = []
    for p in prompts:  # each new request joins while the earlier ones are mid-decode
        streams.append(engine.stream(p, params=params))
        next(iter(streams[0]), None)
    got = []
    for s in streams:
        for _ in s:
            pass
        got.append(s.result.token_ids)
    assert got == alone


def test_threads_and_async_give_same_tokens(engine):
    prompts = [_prompt(i, 4 + 5 * i) for i in range(6)]
    params = SamplingParams.greedy(8, ignore_eos=True)
    alone = [engine.generate(p, params=params).token_ids for p in prompts]
    res = [None] * len(prompts)

    def run(i):
        res[i] = engine.generate(prompts[i], params=params).token_ids

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert res == alone

    async def main():
        return await asyncio.gather(*(engine.agenerate(p, params=params) for p in prompts))

    assert [r.token_ids for r in asyncio.run(main())] == alone


def test_session_reuse_computes_only_new_tokens(engine):
    first = _prompt(1, 20)
    r1 = engine.generate(first, params=SamplingParams.greedy(6, ignore_eos=True), session_id="agent")
    assert r1.cache_n == 0 and r1.timings["prompt_n"] == 20
    second = first + r1.token_ids + _prompt(2, 5)
    r2 = engine.generate(second, params=SamplingParams.greedy(6, ignore_eos=True), session_id="agent")
    cached = len(first) + len(r1.token_ids) - 1  # the last sampled token was never fed back
    assert r2.cache_n == cached
    assert r2.timings["cache_n"] == cached
    assert r2.timings["prompt_n"] == len(second) - cached
    fresh = engine.generate(second, params=SamplingParams.greedy(6, ignore_eos=True))
    assert fresh.token_ids == r2.token_ids
    # a divergent turn reuses the common prefix only
    third = first[:10] + _prompt(9, 4)
    r3 = engine.generate(third, params=SamplingParams.greedy(3, ignore_eos=True), session_id="agent")
    assert r3.cache_n == 10
    engine.release_session("agent")
    with pytest.raises(SessionNotFoundError):
        engine.release_session("agent")


@pytest.mark.parametrize("budget", [96, 160])
def test_page_exhaustion_queues_and_preempts(make_engine, budget):
    eng = make_engine(kv_budget_tokens=budget, page_size=4, max_batch_tokens=32)
    prompts = [_prompt(i, 20 + 3 * i) for i in range(8)]
    params = SamplingParams.greedy(20, ignore_eos=True)
    alone = []
    for p in prompts:
        r = eng.generate(p, params=params)
        alone.append(r.token_ids)
    res = [None] * 8

    def run(i):
        res[i] = eng.generate(prompts[i], params=params).token_ids

    ts = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert res == alone
    st = eng.stats()
    assert st["evicted_sessions"] > 0  # idle cached sessions made room
    eng.check_integrity()


def test_stop_strings_eos_and_max_tokens(engine):
    tok = engine.tokenizer
    prompt = _prompt(5, 8)
    full = engine.generate(prompt, params=SamplingParams.greedy(16, ignore_eos=True))
    assert full.stop_reason == "length" and not full.truncated
    text = full.text
    if len(text) >= 6:
        stop = text[3:5]
        r = engine.generate(prompt, params=SamplingParams.greedy(16, ignore_eos=True, stop=[stop]))
        assert r.stop_reason == "stop"
        assert r.text == text[: text.index(stop)]
        assert r.stopping_word == stop
    # an explicit stop token id
    r = engine.generate(prompt, params=SamplingParams.greedy(16, ignore_eos=True, stop_token_ids=[full.token_ids[2]]))
    assert r.stop_reason == "stop" and r.token_ids == full.token_ids[:3]
    # EOS ends generation unless ignore_eos: force EOS with a token id the model would pick
    eos = tok.eos_token_ids[0]
    assert eos in tok.eos_token_ids


def test_streaming_text_equals_result(engine):
    s = engine.stream(_prompt(2, 10), params=SamplingParams(temperature=0.9, seed=7, max_tokens=20, ignore_eos=True))
    deltas = list(s)
    assert "".join(d.text for d in deltas) == s.result.text
    assert [d.token_id for d in deltas] == s.result.token_ids
    assert s.info.session_id == s.result.session_id


def test_seed_is_reproducible_and_logprobs(engine):
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234, max_tokens=12, ignore_eos=True,
                       logprobs=3)
    a = engine.generate(_prompt(1, 6), params=p)
    b = engine.generate(_prompt(1, 6), params=p)
    c = engine.generate(_prompt(1, 6), params=SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                                                             seed=99, max_tokens=12, ignore_eos=True))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
    assert len(a.logprobs) == 12
    for d in a.logprobs:
        assert d.logprob <= 0 and len(d.top_logprobs) == 3
        assert [lp for _, lp in d.top_logprobs] == sorted((lp for _, lp in d.top_logprobs), reverse=True)


def test_context_full_ends_with_length_truncated(make_engine):
    eng = make_engine(max_context=40)
    r = eng.generate(_prompt(1, 30), params=SamplingParams.greedy(None, ignore_eos=True))
    assert r.stop_reason == "length" and r.truncated
    assert 30 + len(r.token_ids) == 40


def _state(eng):
    s = eng.stats()
    return (s["kv_pages_used"], s["sessions"], s["requests"], eng.pools()["pools_used"])


@pytest.mark.parametrize("kwargs,exc", [
    (dict(prompt=[]), InvalidRequestError),
    (dict(prompt=""), InvalidRequestError),
    (dict(prompt=[1, 2, 100000]), InvalidRequestError),
    (dict(prompt=[1, -3]), InvalidRequestError),
    (dict(prompt=[1, 2.5]), InvalidRequestError),
    (dict(prompt=None), InvalidRequestError),
    (dict(prompt=[1] * 500, params=SamplingParams.greedy(100)), ContextLengthError),
    (dict(prompt=[1, 2], params=SamplingParams.greedy(1000)), ContextLengthError),
    (dict(prompt=[1, 2], session_id=""), InvalidRequestError),
    (dict(prompt=[1, 2], session_id=5), InvalidRequestError),
    (dict(prompt=[1, 2], pool_id=77), Exception),
    (dict(prompt=[1, 2], shared_prefix_n_tokens=1), InvalidRequestError),
    (dict(prompt=[1, 2], params=SamplingParams.greedy(4, stop_token_ids=[10**6])), InvalidRequestError),
])
def test_bad_requests_leave_state_untouched(engine, kwargs, exc):
    engine.generate(_prompt(1, 5), params=SamplingParams.greedy(2), session_id="keep")
    before = _state(engine)
    with pytest.raises(exc) as info:
        engine.generate(**kwargs)
    assert str(info.value)
    assert _state(engine) == before


@pytest.mark.parametrize("kw", [
    dict(temperature=-1), dict(temperature=float("nan")), dict(temperature=1e9), dict(top_k=-5),
    dict(top_p=0), dict(top_p=1.5), dict(min_p=-0.1), dict(max_tokens=0), dict(max_tokens=-4),
    dict(max_tokens=2.5), dict(seed="x"), dict(stop=[""]), dict(stop=[1]), dict(logprobs=1000),
    dict(stop_token_ids=[-1]),
])
def test_bad_sampling_values(kw):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kw)


def test_busy_session_and_cancel(engine):
    s = engine.stream(_prompt(1, 5), params=SamplingParams.greedy(200, ignore_eos=True), session_id="busy")
    next(iter(s))
    with pytest.raises(SessionBusyError):
        engine.generate(_prompt(2, 5), session_id="busy")
    s.close()  # the client went away
    r = engine.generate(_prompt(1, 5), params=SamplingParams.greedy(3), session_id="busy")
    assert r.cache_n > 0


def test_tokenize_roundtrip_and_closed_engine(make_engine):
    eng = make_engine()
    ids = eng.tokenize("hello, world")
    assert eng.detokenize(ids) == "hello, world"
    with pytest.raises(InvalidRequestError):
        eng.detokenize([10**6])
    eng.shutdown()
    with pytest.raises(EngineClosedError):
        eng.generate([1, 2, 3])


# ----------------------------------------------------------------------------- KV tables
def _tables(num_pages: int = 8, page_size: int = 4):
    from opencoti.engine.kv.tables import KVTables
    kv = PagePool(num_layers=1, num_pages=num_pages, page_size=page_size, num_kv_heads=1, head_dim=2,
                  dtype=torch.float32)
    return kv, KVTables(kv)


def test_kv_tables_share_copy_truncate_drop():
    from opencoti.engine.requests import SeqState
    kv, tables = _tables()
    a = SeqState(list(range(1, 11)))
    assert tables.extend_reclaiming(a, 10) and len(a.page_table) == 3
    tables.advance(a, 10)
    kv.k_cache[:, a.page_table[1]] = 7.0
    b = SeqState(list(range(1, 8)))
    assert tables.share_into(b, a.page_table, 6, borrowed=1)  # one full page shared, the partial one copied
    assert b.page_table[0] == a.page_table[0] and b.page_table[1] != a.page_table[1]
    assert kv.refcount[a.page_table[0]] == 2 and bool((kv.k_cache[:, b.page_table[1]] == 7.0).all())
    tables.check_integrity([a, b])
    c = SeqState(list(range(1, 7)))
    old_table = list(a.page_table)
    assert tables.continue_from(a, c, 6, borrowed=0)  # a's own partial page: truncated in place
    assert c.page_table == old_table[:2] and a.page_table == [] and kv.num_used == 3
    tables.check_integrity([a, b, c])
    with pytest.raises(AssertionError, match="held by 3 page tables"):
        tables.check_integrity([b, c, c])
    b.num_borrowed_pages = 0  # b claims the page it shares with c
    with pytest.raises(AssertionError, match="two owners"):
        tables.check_integrity([b, c])
    b.num_borrowed_pages = 1
    tables.drop(b)
    tables.drop(c)
    assert kv.num_used == 0
    tables.check_integrity([a, b, c])


def test_kv_tables_refuse_without_pages():
    from opencoti.engine.requests import SeqState
    kv, tables = _tables(num_pages=2)
    a = SeqState(list(range(1, 9)))
    assert tables.extend_reclaiming(a, 8) and not tables.extend_reclaiming(SeqState([1]), 1)
    tables.advance(a, 6)
    b = SeqState(list(range(1, 7)))
    assert not tables.share_into(b, a.page_table, 6, borrowed=1)  # no page for the partial copy
    assert b.page_table == [] and kv.refcount == [1, 1]  # nothing changed


def test_idle_integrity_check_reports_corruption(make_engine):
    eng = make_engine(debug_checks=True)
    eng.generate(_prompt(1, 9), params=SamplingParams.greedy(2), session_id="a")
    eng.check_integrity()
    page = eng.run_on_step_thread(lambda: eng.core.sessions["a"].seq.page_table[0])
    eng.run_on_step_thread(lambda: eng.kv.refcount.__setitem__(page, eng.kv.refcount[page] + 1))  # a leaked reference
    eng.generate(_prompt(2, 9), params=SamplingParams.greedy(2))  # the loop goes idle after it: checked there
    eng.run_on_step_thread(lambda: None)  # the loop has gone idle since
    assert eng._integrity_error is not None
    with pytest.raises(AssertionError, match="refcount"):
        eng.check_integrity()
    eng.shutdown()
