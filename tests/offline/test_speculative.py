"""Prompt-lookup speculative decoding: drafts, verification in one step, rollback, equality of outputs."""

from __future__ import annotations

import pytest
import torch

from opencoti.engine import EngineConfig, InvalidRequestError, SamplingParams
from opencoti.engine.constraints import ConstraintSpec
from opencoti.engine import speculation
from opencoti.engine.core import speculative
from opencoti.engine.core.speculative import DraftState, StepCosts, expected_tokens

LOOP = [11, 12, 13, 14, 15, 16, 17, 18] * 6  # a context that repeats itself


def test_draft_follows_the_latest_longest_match():
    st = DraftState(4)
    st.hits, st.tried = 9.5, 10.0
    toks = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert st.propose(toks, 4) == [7, 8, 1, 2]  # the latest occurrence of (1, 2, 3) (a tie), not the first
    assert DraftState(4).propose(toks, 4) == [7, 8]  # at the prior's rate the unsure draft ends sooner
    assert st.propose(toks + [5], 4) == []  # (3, 5) never occurred before
    assert st.propose([4, 4], 4) == [] and st.propose(toks, 0) == []
    assert DraftState(4).propose([1, 2, 5, 1, 2], 2) == [5, 1]  # a bigram is enough


def _costs_of_a_cpu():
    """The cost line of a 2-core CPU: 6.2 ms a step + 1.1 ms a row."""
    costs = StepCosts()
    for rows in (1, 2, 9):
        costs.observe(rows, 0.0062 + 0.0011 * rows)
    return costs


def test_a_continuation_that_always_repeated_drafts_long():
    """(1, 2, 3) was followed by 4 5 6 7 8 three times (other tokens between): every position
    keeps the job's rate, and a sure job drafts all of it."""
    toks = [1, 2, 3, 4, 5, 6, 7, 8, 20, 1, 2, 3, 4, 5, 6, 7, 8, 21, 22, 1, 2, 3, 4, 5, 6, 7, 8, 23, 1, 2, 3]
    st = DraftState(8)
    st.hits, st.tried = 9.5, 10.0
    assert st.propose(toks, 5) == [4, 5, 6, 7, 8]
    assert st.probs == pytest.approx([0.95] * 5)
    assert _costs_of_a_cpu().plan([st], 1, [5]) == [5]


def test_occurrences_that_disagree_at_the_first_token_draft_short_or_nothing():
    """(9, 1, 2, 3) was followed by 5, by 6, then by 7 (a name, new each time): the draft takes
    the latest (a three-way tie), its first position gets a ninth of the rate (none of the two
    others agrees: (0 + 0.25) / (2 + 0.25)), and the step drafts nothing; at the prior's rate
    the draft itself ends after one token. Two that differ give a fifth of the rate."""
    toks = [1, 2, 3, 4, 9, 1, 2, 3, 5, 9, 1, 2, 3, 6, 9, 1, 2, 3, 7, 9, 1, 2, 3]
    st = DraftState(8)
    st.hits, st.tried = 9.5, 10.0
    draft = st.propose(toks, 8)
    assert draft[:1] == [7]
    assert st.probs[0] == pytest.approx(0.95 * 0.25 / 2.25)
    assert _costs_of_a_cpu().plan([st], 1, [len(draft)]) == [0]
    assert DraftState(8).propose(toks, 8) == [7]  # 0.6 / 9, then 0.6 / 9 * 0.6 < STOP_BELOW
    two = DraftState(8)
    two.hits, two.tried = 9.5, 10.0
    assert two.propose(toks[5:], 8)[:1] == [7] and two.probs[0] == pytest.approx(0.95 * 0.25 / 1.25)
    # three occurrences of (1, 2, 3), two followed by 4: the majority wins over the latest
    maj = [1, 2, 3, 4, 8, 1, 2, 3, 4, 7, 1, 2, 3, 5, 6, 1, 2, 3]
    st2 = DraftState(8)
    st2.hits, st2.tried = 9.5, 10.0
    assert st2.propose(maj, 2) == [4, 7]  # then, of the two followed by 4, the latest
    assert st2.probs[0] == pytest.approx(st2.rate * 1.25 / 2.25)  # one of the two others agrees
    assert st2.probs[1] == pytest.approx(st2.rate * 0.25 / 1.25)  # 8 vs 7: the two left differ


def test_only_the_latest_occurrences_vote():
    """An n-gram keeps its OCCURRENCES latest ends: old continuations stop voting."""
    old = [1, 2, 3, 4] * speculation.OCCURRENCES
    new = [1, 2, 3, 5] * speculation.OCCURRENCES
    st = DraftState(4)
    assert st.propose(old + new + [1, 2, 3], 1) == [5]
    assert st.probs == pytest.approx([st.rate])  # the kept occurrences all agree
    assert all(isinstance(ends, int) or len(ends) <= speculation.OCCURRENCES for ends in st.ends.values())


def test_drafts_of_a_match_length_that_fails_get_a_lower_rate_never_a_higher_one():
    """A job whose two-token matches missed drafts them with a lower rate than its four-token
    ones (which kept the job's rate, not more, however well they did)."""
    st = DraftState(8)
    st.hits, st.tried = 8.0, 10.0
    for n, accepted in ((2, 0), (4, 8), (2, 0), (4, 8)):
        st.source = n
        st.update(8, accepted)
    rate = st.rate
    assert st.order_rate(2) < 0.7 * rate and st.order_rate(4) == pytest.approx(rate)
    assert st.order_rate(3) == pytest.approx(rate)  # nothing drafted on three tokens yet: the job's rate
    toks = [5, 6, 7, 8, 9, 30, 6, 7]  # (6, 7) once before: a two-token match
    assert st.propose(toks, 3) == [8, 9, 30] and st.source == 2
    assert st.probs[0] == pytest.approx(st.order_rate(2))


def test_plan_weighs_each_position_of_the_draft():
    """Two jobs of the same rate: the one whose draft is sure for 4 positions and then unsure
    drafts 4; the one whose first position is unsure drafts none; the expected tokens are
    1 + p1 + p1*p2 + ..."""
    sure_then_not, unsure = DraftState(8), DraftState(8)
    for st in (sure_then_not, unsure):
        st.hits, st.tried = 8.0, 10.0
    sure_then_not.probs = [0.99] * 4 + [0.05] * 4
    unsure.probs = [0.05] + [0.99] * 7
    assert sure_then_not.expected(2) == pytest.approx(1 + 0.99 + 0.99 ** 2)
    assert unsure.expected(9) == pytest.approx(1 + sum(0.05 * 0.99 ** i for i in range(8)) + 0.05 * 0.99 ** 7 * 0.8)
    costs = _costs_of_a_cpu()
    assert costs.plan([sure_then_not], 1, [8]) == [4]
    assert costs.plan([unsure], 1, [8]) == [0]
    assert costs.plan([sure_then_not, unsure], 2, [8, 8]) == [4, 0]


def test_acceptance_rate_is_the_decayed_share_of_tested_positions():
    st = DraftState(8)
    assert st.rate == pytest.approx(0.6)
    st.update(8, 8)
    assert st.rate == pytest.approx((0.96 + 8) / (1.6 + 8))
    for _ in range(20):
        st.update(4, 0)  # each tests one position and misses
    assert st.rate < 0.05 and (st.drafted, st.accepted) == (88, 8)


def test_step_cost_plan_drafts_only_where_tokens_per_second_grow():
    costs = StepCosts()
    fast, slow = DraftState(8), DraftState(8)
    fast.hits, fast.tried = 9.5, 10.0  # rate 0.95
    slow.hits, slow.tried = 3.0, 10.0  # rate 0.3
    assert costs.plan([fast], 1, [8]) == [0]  # nothing measured: explores only every few steps
    # a GPU-like step: rows are nearly free -> the fast job drafts all it can, the slow one a little
    for rows, t in ((1, 0.010), (4, 0.0102), (9, 0.0105)):
        costs.observe(rows, t)
    assert costs.plan([fast, slow], 2, [8, 8])[0] == 8
    # a CPU whose rows cost nearly linearly: only a very high rate pays, and not with long drafts
    cpu = StepCosts()
    for rows, t in ((1, 0.020), (2, 0.034), (5, 0.075), (9, 0.130)):
        cpu.observe(rows, t)
    k_fast, k_slow = cpu.plan([fast, slow], 2, [8, 8])
    assert k_slow == 0 and 0 < k_fast < 8
    a, b = cpu.line()
    gain = (2 - 1 + expected_tokens(0.95, k_fast)) / (a + b * (2 + k_fast)) / (2 / (a + b * 2))
    assert gain >= speculative.MIN_GAIN


def test_one_stalled_step_does_not_stop_drafting():
    """Step times of a CPU (16 ms a row alone, ~8 ms more per row) with one 107 ms six-row step
    (a stall): the line stays near the typical steps, so a job whose drafts are always accepted
    still drafts. (The earlier fit of decayed means, one point per row count, went through the
    origin and planned no drafts at all.)"""
    costs = StepCosts()
    for rows, t, n in ((1, 0.0163, 30), (2, 0.0232, 3), (3, 0.0338, 2), (4, 0.0395, 1), (5, 0.0501, 1),
                       (6, 0.1069, 1)):
        for _ in range(n):
            costs.observe(rows, t)
    a, b = costs.line()
    assert 0.005 < a < 0.012 and 0.005 < b < 0.012
    sure = DraftState(8)
    sure.hits, sure.tried = 9.9, 10.0
    assert costs.plan([sure], 1, [8]) == [8]
    assert costs.seconds[6] == pytest.approx(0.1069)


def test_step_costs_keep_the_median_of_recent_samples():
    costs = StepCosts()
    for t in (0.010, 0.011, 0.5, 0.012, 0.010):
        costs.observe(2, t)
    assert costs.seconds[2] == pytest.approx(0.011)
    for _ in range(speculative.SAMPLES):
        costs.observe(2, 0.020)
    assert costs.seconds[2] == pytest.approx(0.020)  # old samples leave the window


def test_recent_outputs_draft_by_salt_and_longest_match():
    rec = speculation.RecentOutputs(size=2)
    rec.add(b"a", [5, 6, 7, 8, 9])
    rec.add(b"b", [5, 6, 1, 2])
    assert rec.lookup(b"a", (6, 7), 2) == [8, 9] and rec.lookup(b"b", (5, 6), 4) == [1, 2]
    assert rec.lookup(b"c", (5, 6), 4) == [] and rec.lookup(b"a", (8, 9), 4) == []  # nothing after (8, 9)
    st = DraftState(4)
    # the context's own bigram match loses to a longer match in a recent answer
    toks = [1, 6, 7, 3, 5, 6, 7]
    assert st.propose(toks, 3) == [3, 5, 6]
    assert st.propose(toks, 3, lambda key, k: rec.lookup(b"a", key, k)) == [8, 9]
    rec.add(b"a", [0, 0, 0])
    assert len(rec) == 2 and rec.lookup(b"b", (5, 6), 4) == [1, 2] and rec.lookup(b"a", (6, 7), 2) == []
    rec.add(b"a", [4])  # too short to hold an n-gram with a follower: not kept
    assert len(rec) == 2


def test_recent_outputs_index_forgets_only_what_left():
    """One index over every kept answer: an n-gram two answers share stays findable (in the later
    one) when the earlier leaves; the later answer's own entries leave with it."""
    rec = speculation.RecentOutputs(size=2)
    rec.add(b"a", [1, 2, 3, 4])
    rec.add(b"a", [1, 2, 9, 9])
    assert rec.lookup(b"a", (1, 2), 2) == [9, 9]  # the latest answer holding it
    rec.add(b"b", [7, 7, 7])  # [1, 2, 3, 4] leaves
    assert rec.lookup(b"a", (1, 2), 2) == [9, 9] and rec.lookup(b"a", (2, 3), 1) == []
    rec.add(b"b", [8, 8, 8])  # [1, 2, 9, 9] leaves
    assert rec.lookup(b"a", (1, 2), 2) == [] and rec.lookup(b"b", (7, 7), 1) == [7]
    assert len(rec) == 2 and rec.ngrams == 2  # nothing of the answers that left is kept


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_a_request_drafts_from_an_earlier_answer_of_its_salt(make_engine, monkeypatch, prefix_cache):
    """The same request twice: the second drafts the first's answer (all accepted) and emits the
    same tokens; a request of another salt, or any request of an engine without the prefix
    cache, drafts only from its own context, exactly as the first did."""
    monkeypatch.setattr(StepCosts, "plan", lambda self, jobs, rows, limits: list(limits))  # every draft runs
    engine = make_engine(prefix_cache=prefix_cache)
    prompt = [7, 3, 91, 45, 18, 2, 77, 150, 33, 61]

    def run(salt):
        return engine.generate(prompt, params=SamplingParams(temperature=0.0, max_tokens=40, speculative_max=8),
                               cache_salt=salt)

    first = run("team-1")
    again, other = run("team-1"), run("team-2")
    assert again.token_ids == first.token_ids == other.token_ids
    own = first.timings.get("draft_n", 0)
    assert other.timings.get("draft_n", 0) == own
    if prefix_cache:
        assert again.timings["draft_n_accepted"] >= len(first.token_ids) // 2
        assert again.timings["draft_n_accepted"] == again.timings["draft_n"]
    else:
        assert again.timings.get("draft_n", 0) == own


def _gen(engine, prompt, spec, **kw):
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 40)
    return engine.generate(prompt, params=SamplingParams(speculative_max=spec, **kw))


@pytest.fixture
def oracle(monkeypatch):
    """Drafts from known futures: ``futures[tuple(prompt)] = tokens`` a plain run emitted; every
    ``wrong_every``-th draft has a wrong token at ``wrong_at`` (partial accepts and rollbacks). A
    random tiny model never repeats itself, so the prompt-lookup drafter would propose nothing."""
    futures: dict = {}
    calls = {"n": 0, "wrong_every": 2, "wrong_at": 2}

    def propose(self, tokens, k, recent=None):
        for prompt, future in futures.items():
            if tokens[:len(prompt)] == list(prompt):
                done = len(tokens) - len(prompt)
                draft = list(future[done:done + k])
                calls["n"] += 1
                if draft and calls["n"] % calls["wrong_every"] == 0:
                    i = min(calls["wrong_at"], len(draft) - 1)
                    draft[i] = (draft[i] + 1) % 300
                return draft
        return []

    monkeypatch.setattr(DraftState, "propose", propose)
    monkeypatch.setattr(StepCosts, "plan", lambda self, jobs, rows, limits: list(limits))  # every draft runs
    return futures


KWS = [{}, {"temperature": 0.9, "seed": 7, "top_k": 0, "top_p": 1.0, "min_p": 0.0}, {"temperature": 0.7, "seed": 3},
       {"logprobs": 3}, {"repeat_penalty": 1.3, "repeat_last_n": 16}]


@pytest.mark.parametrize("kw", KWS, ids=["greedy", "seeded-full-vocab", "seeded-filters", "logprobs", "penalty"])
def test_speculative_output_equals_plain_decoding(make_engine, oracle, kw):
    """Greedy: the same tokens; seeded sampling: the same tokens too (one draw per emitted token)."""
    engine = make_engine(prefix_cache=False)
    plain = _gen(engine, LOOP, 0, **kw)
    oracle[tuple(LOOP)] = plain.token_ids
    spec = _gen(engine, LOOP, 8, **kw)
    assert spec.token_ids == plain.token_ids and spec.text == plain.text
    assert spec.stop_reason == plain.stop_reason
    t = spec.timings
    assert "draft_n" not in plain.timings and 0 < t["draft_n_accepted"] < t["draft_n"]
    assert t["draft_n_accepted"] >= len(plain.token_ids) // 3  # most tokens came from accepted drafts
    if kw.get("logprobs"):
        assert [d.logprob for d in spec.logprobs] == pytest.approx([d.logprob for d in plain.logprobs], abs=1e-4)
        assert [[t for t, _ in d.top_logprobs] for d in spec.logprobs] == \
            [[t for t, _ in d.top_logprobs] for d in plain.logprobs]


def test_a_wrong_draft_token_is_never_emitted(make_engine, oracle):
    engine = make_engine(prefix_cache=False)
    plain = _gen(engine, LOOP, 0, max_tokens=30)
    oracle[tuple(LOOP)] = [(t + 1) % 300 for t in plain.token_ids]  # every draft wrong at its first token
    spec = _gen(engine, LOOP, 8, max_tokens=30)
    assert spec.token_ids == plain.token_ids and spec.timings["draft_n_accepted"] == 0


def test_speculation_in_a_batch_with_plain_sessions(make_engine, oracle):
    """Drafted and plain jobs in the same steps: each output equals its solo run."""
    engine = make_engine(prefix_cache=False, speculative="ngram")
    prompts = [LOOP, [3, 1, 4, 1, 5, 9, 2, 6], LOOP[5:] + [40, 41]]
    solo = [_gen(engine, p, 0).token_ids for p in prompts]
    oracle.update({tuple(p): out for p, out in zip(prompts, solo)})
    streams = [engine.stream(p, params=SamplingParams(temperature=0.0, max_tokens=40,
                                                       speculative_max=None if i != 1 else 0))
               for i, p in enumerate(prompts)]
    for s in streams:
        for _ in s:
            pass
    assert [s.result.token_ids for s in streams] == solo
    assert "draft_n" not in streams[1].result.timings and streams[0].result.timings["draft_n_accepted"] > 0


def test_max_tokens_and_stop_strings_end_inside_a_draft(make_engine, oracle):
    engine = make_engine(prefix_cache=False)
    full = _gen(engine, LOOP, 0)
    oracle[tuple(LOOP)] = full.token_ids
    for n in (1, 2, 5, 13):
        spec = _gen(engine, LOOP, 8, max_tokens=n)
        assert spec.token_ids == full.token_ids[:n]
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
    plain, spec = _gen(engine, LOOP, 0, stop=[stop]), _gen(engine, LOOP, 8, stop=[stop])
    assert plain.stop_reason == "stop"
    assert (spec.text, spec.stop_reason, spec.stopping_word) == (plain.text, plain.stop_reason, plain.stopping_word)


def test_constrained_output_is_unchanged(make_engine, oracle):
    engine = make_engine(prefix_cache=False)
    c = ConstraintSpec.regex(r"(ab|cd){3,12}")
    plain = _gen(engine, LOOP, 0, constraint=c)
    oracle[tuple(LOOP)] = plain.token_ids
    spec = _gen(engine, LOOP, 8, constraint=c)
    assert spec.token_ids == plain.token_ids and spec.text == plain.text and spec.timings["draft_n_accepted"] > 0


def test_a_session_on_a_pool_never_writes_the_pools_pages(make_engine, oracle):
    engine = make_engine(prefix_cache=False)
    pool = engine.create_pool(tokens=LOOP[:32]).pool_id
    pages = engine.run_on_step_thread(lambda: list(engine.core.tree.pools[pool].seq.page_table))
    before = engine.kv.k_cache[:, pages].clone(), engine.kv.v_cache[:, pages].clone()
    plain = _gen(engine, LOOP, 0)
    oracle[tuple(LOOP)] = plain.token_ids
    r = engine.generate(LOOP, params=SamplingParams(temperature=0.0, max_tokens=40, speculative_max=8),
                        session_id="a", pool_id=pool)
    assert r.token_ids == plain.token_ids and r.timings["draft_n_accepted"] > 0
    assert torch.equal(engine.kv.k_cache[:, pages], before[0]) and torch.equal(engine.kv.v_cache[:, pages], before[1])
    follow = LOOP + r.token_ids + [20, 21]
    ref = _gen(engine, follow, 0, max_tokens=20)
    oracle.clear()
    again = engine.generate(follow, params=SamplingParams(temperature=0.0, max_tokens=20, speculative_max=0),
                            session_id="a")
    assert again.token_ids == ref.token_ids  # the session's KV after rollbacks is right
    assert again.info.cached_prefix_tokens >= len(LOOP) + len(r.token_ids) - 1


def test_drafts_use_free_pages_only(make_engine, oracle):
    """In a full cache drafts shrink or stop; they never evict an idle session's KV."""
    engine = make_engine(prefix_cache=False, kv_budget_tokens=64, page_size=4)
    engine.generate([7] * 10, params=SamplingParams(temperature=0.0, max_tokens=1), session_id="keep")
    prompt = LOOP[:40]
    plain = engine.generate(prompt, params=SamplingParams(temperature=0.0, max_tokens=12), session_id="p")
    engine.release_session("p")
    oracle[tuple(prompt)] = plain.token_ids
    spec = engine.generate(prompt, params=SamplingParams(temperature=0.0, max_tokens=12, speculative_max=8),
                           session_id="s")
    assert spec.token_ids == plain.token_ids and spec.timings["draft_n"] > 0
    assert engine.run_on_step_thread(lambda: engine.core.sessions["keep"].seq.num_cached) == 10
    assert engine.run_on_step_thread(lambda: engine.core.counters["evicted_sessions"]) == 0


def test_bad_speculative_settings_are_clear_errors():
    with pytest.raises(InvalidRequestError, match="speculative_max must be an integer in \\[0, 64\\]"):
        SamplingParams(speculative_max=-1)
    with pytest.raises(InvalidRequestError, match="speculative_max must be an integer"):
        SamplingParams(speculative_max="4")
    with pytest.raises(InvalidRequestError, match="speculative must be ngram\\|off"):
        EngineConfig(speculative="eagle")
    with pytest.raises(InvalidRequestError, match="speculative_max must be an integer in \\[1, 64\\]"):
        EngineConfig(speculative_max=0)


# ------------------------------------------------------------------------------------ HTTP
from long_context_server import client, engine  # noqa: E402,F401 - fixtures


def test_http_speculative_n_max_per_request(client, oracle):
    """llama.cpp's ``speculative.n_max`` on /completion and the OpenAI routes: same text, the
    drafts in ``timings``; out of range or not an integer -> 400, nothing generated."""
    body = {"prompt": LOOP, "n_predict": 24, "temperature": 0, "return_tokens": True}
    plain = client.post("/completion", json=body).json()
    oracle[tuple(LOOP)] = plain["tokens"]
    spec = client.post("/completion", json={**body, "speculative.n_max": 6}).json()
    assert spec["content"] == plain["content"] and "draft_n" not in plain["timings"]
    assert spec["timings"]["draft_n"] > 0
    off = client.post("/completion", json={**body, "speculative.n_max": 0}).json()
    assert off["content"] == plain["content"] and "draft_n" not in off["timings"]
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                                                     "temperature": 0, "speculative.n_max": 4})
    assert chat.status_code == 200, chat.text
    for bad in (-1, 65, "4", 2.5, True):
        r = client.post("/completion", json={**body, "speculative.n_max": bad})
        assert r.status_code == 400, (bad, r.text)
        assert "speculative" in r.json()["error"]["message"], r.text


def test_http_n_choices_with_drafts_equal_plain_choices(client, oracle, monkeypatch):
    """OpenAI ``n = 2`` (two sessions on one temporary pool, seeds 5 and 6), seeded sampling: the
    choices with drafts are the choices without them."""
    drafts = []
    update = DraftState.update
    monkeypatch.setattr(DraftState, "update", lambda self, p, a: (drafts.append((p, a)), update(self, p, a))[1])
    sampling = {"temperature": 0.9, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    one = client.post("/completion", json={"prompt": LOOP, "n_predict": 24, "seed": 5, "return_tokens": True,
                                           "speculative.n_max": 0, **sampling}).json()
    oracle[tuple(LOOP)] = one["tokens"]  # choice 0's future when both routes sample alike; choice 1 drafts wrong
    body = {"model": "m", "prompt": LOOP, "n": 2, "max_tokens": 24, "seed": 5, **sampling}
    plain = client.post("/v1/completions", json={**body, "speculative.n_max": 0})
    spec = client.post("/v1/completions", json={**body, "speculative.n_max": 6})
    assert plain.status_code == spec.status_code == 200, (plain.text, spec.text)

    def texts(r):
        return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]

    assert texts(spec) == texts(plain) and len(set(texts(plain))) == 2
    assert any(a for _, a in drafts) and any(a < p for p, a in drafts)  # choice 0 accepted, choice 1 rolled back


def test_serve_flags_set_the_engine_default():
    import argparse

    from opencoti.server.serve import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--speculative", "ngram", "--draft-max", "12"])
    assert (args.speculative, args.draft_max) == ("ngram", 12)
    args = parser.parse_args(["--spec-type", "off", "--draft", "3"])
    assert (args.speculative, args.draft_max) == ("off", 3)
    assert parser.parse_args([]).speculative == EngineConfig().speculative
    assert parser.parse_args([]).draft_max == EngineConfig().speculative_max


def test_a_sessions_draft_rows_never_take_shared_prefix_attention(make_engine, oracle):
    """A draft's rows are decode rows over one page table; shared-prefix planning treats them as the
    one sequence they are, so a session alone never takes cascade attention (its one-row steps would
    not), even forced on, and its output equals plain decoding's token for token."""
    engine = make_engine(prefix_cache=False, cascade="on")
    plain = _gen(engine, LOOP, 0)
    oracle[tuple(LOOP)] = plain.token_ids
    spec = _gen(engine, LOOP, 8)
    assert spec.timings["draft_n_accepted"] > 0
    assert spec.token_ids == plain.token_ids
    assert engine.backend.num_cascade_steps == 0


def test_drafts_of_sessions_sharing_a_pool_in_the_fused_cascade_decode(make_engine, oracle, monkeypatch, tmp_path):
    """Sessions on one pool, cascade on, native int8 projections (the one-call fused decode with the
    shared runs): every row of a draft attends to the shared pages with its session, and each output
    equals the same batch decoded without drafts."""
    from opencoti.engine.model import fused as fused_mod

    monkeypatch.setenv("OPENCOTI_AUTOTUNE", "0")  # the native int8 kernels: the fused decode applies
    monkeypatch.setenv("OPENCOTI_CACHE", str(tmp_path))
    drafted_cascade = []
    orig = fused_mod.decode_step

    def counted(model, layers, x, meta, *a):
        used = orig(model, layers, x, meta, *a)
        if used and meta.cascade is not None and len(set(meta.seq_of)) < len(meta.seq_of):
            drafted_cascade.append(meta.seq_of)
        return used

    monkeypatch.setattr(fused_mod, "decode_step", counted)
    engine = make_engine(model="tiny:llama", weights="int8", prefix_cache=False, cascade="on")
    assert engine.model.fused_layers is not None
    pool = engine.create_pool(tokens=LOOP[:40]).pool_id
    prompts = [LOOP + [40 + i] for i in range(3)]

    def batch(spec):
        streams = [engine.stream(p, pool_id=pool, params=SamplingParams(temperature=0.0, max_tokens=24,
                                                                        speculative_max=spec)) for p in prompts]
        for s in streams:
            for _ in s:
                pass
        return [s.result.token_ids for s in streams]

    plain = batch(0)
    oracle.update({tuple(p): out for p, out in zip(prompts, plain)})
    assert batch(8) == plain
    assert drafted_cascade  # steps with draft rows ran the shared runs in the fused call


def test_drafts_go_on_once_the_prefix_cache_fills_the_free_pages(make_engine, oracle):
    """A long-running engine's prefix cache holds every page no request holds; draft rows then take
    the cache's least recently used pages (never a session's), so speculation does not stop."""
    engine = make_engine(kv_budget_tokens=512, speculative="ngram")
    kv = engine.core.tables.kv
    i = 0
    while kv.num_free > 0:  # distinct prompts until the cache has taken every free page
        engine.generate([200 + i % 50, 100 + i // 50] + list(range(3, 43)), params=SamplingParams.greedy(4))
        i += 1
        assert i < 200
    assert engine.core.tables.num_cache_only() > 0
    plain = _gen(engine, LOOP, 0, max_tokens=30)
    oracle[tuple(LOOP)] = plain.token_ids
    evicted = engine.core.tables.evicted_pages
    spec = _gen(engine, LOOP, 8, max_tokens=30)
    assert spec.token_ids == plain.token_ids
    assert spec.timings["draft_n_accepted"] > 0
    assert engine.core.tables.evicted_pages > evicted  # the drafts' pages came from the cache
