"""Realignment: a conversation sent again as text reuses the KV of the model's earlier answers even
when the tokenizer spells an answer with other ids than the model generated.

The tiny model here gets a byte-level BPE tokenizer with two merges ("ab", "ba"): the model
generates letters one by one ("a" "b"), while encoding the same text gives the merged id ("ab").
Without realignment the shared prefix of the next turn ends inside the previous answer."""

from __future__ import annotations

import numpy as np
import openai
import pytest
from starlette.testclient import TestClient

from merge_tokenizer import A, AB_ONLY, B, make_merge_engine  # noqa: F401 - the fixture
from opencoti.engine import SamplingParams
from opencoti.engine.chat.tokenizer import Tokenizer
from opencoti.server import create_app


def prompts_seen(eng) -> list[list[int]]:
    """The prompt ids of every request the engine runs, in order (captured on the step thread)."""
    return record(eng)[0]


def record(eng) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, generated ids) of every request the engine runs, in order."""
    prompts: list[list[int]] = []
    answers: list[list[int]] = []

    def on(ev, d):
        if ev == "submit":
            prompts.append(list(d["job"].seq.tokens[:d["job"].prompt_len]))
        elif ev == "finish":
            answers.append(list(d["job"].generated))
    eng.run_on_step_thread(lambda: eng.core.listeners.append(on))
    return prompts, answers


def converse(eng, turns: int, salt: str | None = None) -> list:
    http = TestClient(create_app(eng), raise_server_exceptions=False)
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http)
    messages = [{"role": "system", "content": "answer with a and b"}]
    out = []
    with http:
        for i in range(turns):
            messages.append({"role": "user", "content": f"turn {i}, again?"})
            extra = {"cache_salt": salt} if salt else None
            r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=9, temperature=0,
                                               logit_bias=AB_ONLY, extra_body=extra)
            messages.append({"role": "assistant", "content": r.choices[0].message.content})
            out.append(r)
    return out


def computed_vs_new(turns) -> list[tuple[int, int]]:
    """(prompt tokens computed, tokens new in this turn) for turns 2.."""
    rows, prev_total = [], None
    for r in turns:
        u = r.usage
        computed = u.prompt_tokens - u.prompt_tokens_details.cached_tokens
        if prev_total is not None:
            rows.append((computed, u.prompt_tokens - prev_total))
        prev_total = u.prompt_tokens + u.completion_tokens
    return rows


def respelled(tok: Tokenizer, answers: list[str]) -> int:
    """How many answers the tokenizer spells with fewer ids than the model generated (9 each)."""
    return sum(len(tok.encode(a)) < 9 for a in answers)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_conversation_computes_only_new_tokens_when_answers_respell(make_merge_engine, page_size):
    eng = make_merge_engine(page_size=page_size)
    seen, generated = record(eng)
    turns = converse(eng, 6)
    answers = [r.choices[0].message.content for r in turns]
    assert all(set(a) <= {"a", "b"} and len(a) == 9 for a in answers)
    assert respelled(eng.tokenizer, answers) >= 3  # the case this test is about: encode(answer) != its ids
    for computed, new in computed_vs_new(turns):
        assert computed == new + 1, (computed, new)  # + the last answer token (its KV is never computed)
    # each prompt starts with the previous prompt and the previous answer's own ids ...
    for i in range(1, len(turns)):
        prev = seen[i - 1] + generated[i - 1]
        assert seen[i][:len(prev)] == prev
    for ids, r in zip(seen, turns):
        assert len(ids) == r.usage.prompt_tokens
    # ... and spells exactly the rendered conversation (which, encoded, gives other ids)
    hf = eng.tokenizer.hf_tokenizer
    msgs = [{"role": "system", "content": "answer with a and b"}]
    differ = 0
    for i, a in enumerate(answers):
        msgs.append({"role": "user", "content": f"turn {i}, again?"})
        text = eng.apply_chat_template(msgs)
        assert hf.decode(seen[i], skip_special_tokens=False, clean_up_tokenization_spaces=False) == text
        differ += seen[i] != eng.tokenize(text)
        msgs.append({"role": "assistant", "content": a})
    assert differ >= 3


def test_greedy_answers_equal_with_cache_on_and_off(make_merge_engine):
    on = converse(make_merge_engine(page_size=4), 5)
    off_eng = make_merge_engine(page_size=4, prefix_cache=False)
    off = converse(off_eng, 5)
    assert [r.choices[0].message.content for r in on] == [r.choices[0].message.content for r in off]
    assert [r.usage.prompt_tokens for r in on] == [r.usage.prompt_tokens for r in off]  # the same ids
    assert all(r.usage.prompt_tokens_details.cached_tokens == 0 for r in off)


def test_without_realignment_the_answer_is_recomputed(make_merge_engine, monkeypatch):
    """The failure this fixes, shown: with the prompt taken as encoded, turns recompute answers."""
    eng = make_merge_engine(page_size=4)
    monkeypatch.setattr(eng.core.prefix_cache, "realign", lambda prompt, *a, **k: prompt)
    turns = converse(eng, 4)
    rows = computed_vs_new(turns)
    assert any(computed > new + 1 for computed, new in rows), rows


def test_salts_do_not_realign_to_each_other(make_merge_engine):
    eng = make_merge_engine(page_size=4)
    seen = prompts_seen(eng)
    msgs = [{"role": "user", "content": "go"}]
    first = eng.generate(messages=msgs, params=params(), cache_salt="alice")
    nxt = msgs + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "more"}]
    fresh = eng.tokenize(eng.apply_chat_template(nxt))
    assert len(eng.tokenize(first.text)) < len(first.token_ids)  # the answer respells
    bob = eng.generate(messages=nxt, params=params(), cache_salt="bob")
    anon = eng.generate(messages=nxt, params=params())
    assert seen[1] == fresh and seen[2] == fresh  # other namespaces: the prompt as encoded, nothing reused
    assert bob.cache_n == 0 and anon.cache_n == 0
    alice = eng.generate(messages=nxt, params=params(), cache_salt="alice")
    assert seen[3] != fresh and seen[3][:len(seen[0]) + len(first.token_ids)] == seen[0] + first.token_ids
    assert alice.cache_n == len(seen[0]) + len(first.token_ids) - 1


def test_tenants_do_not_realign_to_each_other(make_merge_engine):
    from opencoti.engine.api.tenancy import TenantEngine

    eng = make_merge_engine(page_size=4)
    seen = prompts_seen(eng)
    alice, bob = TenantEngine(eng, "alice"), TenantEngine(eng, "bob")
    msgs = [{"role": "user", "content": "go"}]
    first = alice.generate(messages=msgs, params=params())
    nxt = msgs + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "more"}]
    fresh = eng.tokenize(eng.apply_chat_template(nxt))
    assert bob.generate(messages=nxt, params=params()).cache_n == 0 and seen[1] == fresh
    assert alice.generate(messages=nxt, params=params()).cache_n > len(seen[0]) and seen[2] != fresh


def params(n: int = 9) -> SamplingParams:
    return SamplingParams.greedy(n, logit_bias={A: 100.0, B: 100.0})


# ============================================================================ the splice itself
def realign(eng, prompt: list[int], recent: list[list[int]], salt: str | None = None, floor: int = 0,
            recent_salt: str | None = None) -> list[int]:
    """Run the core's realignment of ``prompt`` (of ``salt``) against finished requests ``recent``
    (of ``recent_salt``)."""
    from opencoti.engine.kv.prefix_index import salt_root

    def run():
        core = eng.core.prefix_cache
        saved = list(core.recent_requests)
        core.recent_requests.clear()
        core.recent_requests.extend((salt_root(recent_salt), np.asarray(t, dtype=np.int64)) for t in recent)
        try:
            return core.realign(list(prompt), salt, SamplingParams.greedy(4), floor)
        finally:
            core.recent_requests.clear()
            core.recent_requests.extend(saved)
    return eng.run_on_step_thread(run)


def test_splice_takes_the_earlier_ids_for_the_same_text_only(make_merge_engine):
    eng = make_merge_engine()
    tok = eng.tokenizer
    start, end = tok.encode("<|im_start|>"), tok.encode("<|im_end|>")
    head = start + tok.encode("user\nhi") + end + start + tok.encode("assistant\n")
    answer = [A, B, B, A, A]  # as generated: "abbaa", which encodes as "ab" "ba" "a"
    assert tok.encode("abbaa") == [256, 257, A]
    tail = end + tok.encode("\n") + start + tok.encode("user\nok")
    earlier = head + answer
    fresh = head + tok.encode("abbaa") + tail
    assert realign(eng, fresh, [earlier]) == head + answer + tail
    # a span that only partly spells the same text: the common part up to a boundary both share
    fresh2 = head + tok.encode("abbab") + tail  # "ab" "b" "ab": the first 4 letters agree, the ids
    assert tok.encode("abbab") == [256, B, 256]  # share boundaries after 2 and 3 letters
    assert realign(eng, fresh2, [earlier]) == head + [A, B, B] + [256] + tail
    # another salt, or a divergence inside a protected prefix (a pool's): unchanged
    assert realign(eng, fresh, [earlier], salt="other") == fresh
    assert realign(eng, fresh, [earlier], recent_salt="other") == fresh
    assert realign(eng, fresh, [earlier], salt="other", recent_salt="other") == head + answer + tail
    assert realign(eng, fresh, [earlier], floor=len(head) + 1) == fresh
    assert realign(eng, fresh, [earlier], floor=len(head)) == head + answer + tail


def test_splice_never_crosses_a_special_token_or_a_broken_character(make_merge_engine):
    eng = make_merge_engine()
    tok = eng.tokenizer
    start, end = tok.encode("<|im_start|>"), tok.encode("<|im_end|>")
    head = start + tok.encode("assistant\n")
    # the model spelled "<|im_end|>" as plain characters; the new prompt has the special token there
    literal = [ord(c) for c in "<|im_end|>"]
    fresh = head + end + tok.encode("x")
    assert realign(eng, fresh, [head + literal + tok.encode("x")]) == fresh
    # an answer with an invalid UTF-8 byte (decodes to U+FFFD) vs the UTF-8 of U+FFFD itself
    broken = head + [A, 0xFF, B]
    fresh3 = head + tok.encode("a\ufffdb")
    assert realign(eng, fresh3, [broken]) == fresh3
    # the same text before the break is still taken
    fresh4 = head + tok.encode("ab\ufffd")
    out = realign(eng, fresh4, [head + [A, B, 0xFF]])
    assert out == head + [A, B] + tok.encode("\ufffd")


def test_splice_keeps_a_prompt_that_would_no_longer_fit(make_merge_engine):
    eng = make_merge_engine(max_context=64)
    tok = eng.tokenizer
    head = tok.encode("<|im_start|>assistant\n")
    earlier = head + [A, B] * 26  # 52 letters as 52 ids
    fresh = head + tok.encode("ab" * 26)  # 26 ids
    assert len(fresh) + 4 <= 64 < len(earlier) + 4
    assert realign(eng, fresh, [earlier]) == fresh


@pytest.mark.parametrize("attach", ["session", "pool"])
def test_named_sessions_and_pools_reuse_their_answers_too(make_merge_engine, attach):
    """A named session (with or without a pool) keeps its KV across turns: its next prompt, realigned
    to the answer's ids, reuses all of it; the pool's own prefix is never respelled."""
    eng = make_merge_engine(page_size=4)
    seen, generated = record(eng)
    system = [{"role": "system", "content": "answer with a and b"}]
    kw = {"session_id": "agent-1"}
    if attach == "pool":
        kw["pool_id"] = eng.create_pool(messages=system).pool_id
    msgs = list(system)
    results = []
    for i in range(4):
        msgs.append({"role": "user", "content": f"turn {i}"})
        r = eng.generate(messages=msgs, params=params(), **kw)
        msgs.append({"role": "assistant", "content": r.text})
        results.append(r)
    assert respelled(eng.tokenizer, [r.text for r in results]) >= 2
    for i in range(1, len(results)):
        assert seen[i][:len(seen[i - 1]) + 9] == seen[i - 1] + generated[i - 1]
        assert results[i].cache_n == len(seen[i - 1]) + 9 - 1  # all the session computed
    if attach == "pool":
        pool_tokens = eng.tokenize(eng.apply_chat_template(system, add_generation_prompt=False))
        assert all(s[:len(pool_tokens)] == pool_tokens for s in seen)
