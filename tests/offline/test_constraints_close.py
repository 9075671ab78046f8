"""A constrained output closes within its token budget (constraints/close.py): when max_tokens is
about to cut a JSON document, the output takes the shortest way to a complete, valid document
and reports finish "length". Byte-level test tokenizer, logits that loop inside a string (what a
small model does under greedy decoding) or random ones."""

from __future__ import annotations

import json

import pytest
import torch

from opencoti.engine.config import SamplingParams
from opencoti.engine.constraints import Constraint, ConstraintSpec, llg_tokenizer
from opencoti.engine.constraints.close import CLOSE_MARGIN, closing_path
from opencoti.engine.sampling import Sampler, make_generator
from opencoti.engine.sampling.state import SamplerState
from opencoti.engine.chat.tokenizer import Tokenizer

TOK = Tokenizer.byte_level(320)
V = TOK.vocab_size
EOS = set(TOK.eos_token_ids)

# the standard LangChain suite's Joke: two strings without a length bound
JOKE = {"type": "object", "properties": {"setup": {"type": "string", "description": "question to set up a joke"},
                                         "punchline": {"type": "string", "description": "answer to resolve the joke"}},
        "required": ["setup", "punchline"], "additionalProperties": False}
NESTED = {"type": "object", "required": ["a", "n", "items", "flag", "kind"], "additionalProperties": False,
          "properties": {"a": {"type": "string"}, "n": {"type": "integer", "minimum": 3, "maximum": 9},
                         "items": {"type": "array", "minItems": 1,
                                   "items": {"type": "object", "properties": {"x": {"type": "string"}},
                                             "required": ["x"], "additionalProperties": False}},
                         "flag": {"type": "boolean"}, "kind": {"enum": ["alpha", "beta"]}}}


def decode(ids) -> str:
    return TOK.decode([t for t in ids if t not in EOS])


def looping_logits(n: int) -> torch.Tensor:
    """Every row prefers 'a', then 'b': inside a string the output never closes by itself."""
    logits = torch.zeros(n, V)
    logits[:, ord("a")] = 10.0
    logits[:, ord("b")] = 5.0
    return logits


def decode_rows(params, logits_fn, steps: int = 400) -> list[list[int]]:
    sampler = Sampler()
    states = [SamplerState.for_request(p, [1, 2], TOK, V) for p in params]
    gens = [make_generator(i, 0) for i in range(len(params))]
    out: list[list[int]] = [[] for _ in params]
    done = [False] * len(params)
    for step in range(steps):
        toks = sampler.sample(logits_fn(len(params), step), params, gens, states).token_ids
        for i, t in enumerate(toks):
            if done[i]:
                continue
            out[i].append(t)
            if t in EOS or (params[i].max_tokens is not None and len(out[i]) >= params[i].max_tokens):
                done[i] = True
        if all(done):
            return out
    raise AssertionError("rows did not end")


def test_closing_path_from_inside_a_string():
    c = Constraint(ConstraintSpec.json_schema(JOKE), llg_tokenizer(TOK))
    for t in TOK.encode('{"setup": "why did the cat'):
        c.advance(t)
    path = closing_path(c.matcher, c.lt, 50)
    assert decode(path) == '", "punchline": ""}'
    assert closing_path(c.matcher, c.lt, len(path) - 1) is None  # no shorter way found: give up
    assert not c.matcher.is_accepting()  # the search ran on a copy


@pytest.mark.parametrize("max_tokens", [34, 40, 64, 150])  # the shortest document: 30 tokens
def test_a_looping_output_is_closed_within_max_tokens(max_tokens):
    spec = ConstraintSpec.json_schema(JOKE)
    params = [SamplingParams.greedy(max_tokens, constraint=spec)]
    (ids,) = decode_rows(params, lambda n, step: looping_logits(n))
    assert len(ids) <= max_tokens
    value = json.loads(decode(ids))
    assert set(value) == {"setup", "punchline"} and value["setup"].startswith("a")
    # the budget is used: the way out starts only when the slack is down to CLOSE_MARGIN tokens
    assert len(ids) >= max_tokens - CLOSE_MARGIN - 1


def test_budget_too_small_to_close_is_left_alone():
    spec = ConstraintSpec.json_schema(JOKE)
    (ids,) = decode_rows([SamplingParams.greedy(4, constraint=spec)], lambda n, step: looping_logits(n))
    assert decode(ids) == '{"se'  # the shortest document needs 30 tokens: plain truncation


@pytest.mark.parametrize("seed", range(3))
def test_random_outputs_of_a_nested_schema_always_parse_within_the_budget(seed):
    spec = ConstraintSpec.json_schema(NESTED)
    g = torch.Generator().manual_seed(seed)
    params = [SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, max_tokens=m, seed=seed * 10 + i,
                             constraint=spec) for i, m in enumerate((80, 100, 130, 200))]  # the shortest: 71
    outs = decode_rows(params, lambda n, step: torch.randn(n, V, generator=g) * 2.0)
    for p, ids in zip(params, outs):
        assert len(ids) <= p.max_tokens
        v = json.loads(decode(ids))
        assert list(v) == ["a", "n", "items", "flag", "kind"] and 3 <= v["n"] <= 9 and len(v["items"]) >= 1
        assert v["kind"] in ("alpha", "beta") and isinstance(v["flag"], bool)


def test_outputs_that_end_on_their_own_are_untouched():
    spec = ConstraintSpec.json_schema(JOKE)

    def closing_soon(n, step):
        logits = looping_logits(n)
        if step % 6 == 5:
            logits[:, ord('"')] = 20.0  # the model closes its strings itself
        return logits

    (free,) = decode_rows([SamplingParams.greedy(None, constraint=spec)], closing_soon)
    (budgeted,) = decode_rows([SamplingParams.greedy(len(free) + 10, constraint=spec)], closing_soon)
    assert budgeted == free and free[-1] in EOS


def test_engine_reports_a_budget_closed_answer_as_length(engine):
    spec = ConstraintSpec.json_schema(JOKE)
    bias = {ord("a"): 50.0}  # loop inside the strings, whatever the random weights say
    r = engine.generate("Tell me a joke:", params=SamplingParams.greedy(48, constraint=spec, logit_bias=bias))
    assert r.stop_reason == "length" and len(r.token_ids) <= 48
    assert set(json.loads(r.text)) == {"setup", "punchline"} and "aaaa" in r.text
    plain = engine.generate("Tell me a joke:", params=SamplingParams.greedy(48, logit_bias=bias))
    assert plain.stop_reason == "length" and plain.text == "a" * 48  # unconstrained: nothing to close
    short = engine.generate("x", params=SamplingParams.greedy(200, constraint=ConstraintSpec.json_schema(
        {"type": "object", "properties": {"k": {"enum": ["v"]}}, "required": ["k"], "additionalProperties": False})))
    assert short.stop_reason == "eos" and json.loads(short.text) == {"k": "v"}  # ended by itself: eos


def test_a_budget_that_cannot_close_searches_rarely(monkeypatch):
    """A way out that does not fit the budget (minItems beyond it) costs a search of the whole
    budget: the search runs again only when half of what is left is spent."""
    import opencoti.engine.constraints.close as cc

    calls = []
    real = cc.closing_path
    monkeypatch.setattr(cc, "closing_path", lambda m, lt, limit: calls.append(limit) or real(m, lt, limit))
    spec = ConstraintSpec.json_schema({"type": "array", "items": {"type": "integer"}, "minItems": 500})
    (ids,) = decode_rows([SamplingParams.greedy(96, constraint=spec)], lambda n, step: looping_logits(n))
    assert len(ids) == 96 and decode(ids).startswith("[")  # left to length, no way to close it
    assert calls and len(calls) <= 8 and calls[0] == 96, calls


# ---- several tool calls: a repeated call ends the output; no call is started that the budget would cut
CITY = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def writer_of(text: str):
    """Logits that write ``text`` again and again (a model that repeats its call)."""
    ids = TOK.encode(text + "\n")

    def logits_fn(n, step):
        logits = torch.zeros(n, V)
        logits[:, ids[step % len(ids)]] = 10.0
        return logits
    return logits_fn


@pytest.mark.parametrize("max_tokens", [None, 400])
def test_a_repeated_tool_call_ends_the_output(max_tokens):
    spec = ConstraintSpec.tool_calls(CITY, "get_weather")
    (ids,) = decode_rows([SamplingParams.greedy(max_tokens, constraint=spec)], writer_of(CALL))
    assert decode(ids) == CALL + "\n" + CALL and ids[-1] in EOS  # the first repeat, then the end


def test_distinct_tool_calls_go_on():
    spec = ConstraintSpec.tool_calls(CITY, "get_weather")
    other = CALL.replace("Oslo", "Rome")
    state = SamplerState.for_request(SamplingParams.greedy(None, constraint=spec), [1], TOK, V)
    for t in TOK.encode(CALL + "\n" + other):
        state.constraint.advance(t)
    state.constraint.budget(None)
    assert not state.constraint.mask_ready  # nothing forced: a different call may be followed by more


def test_no_tool_call_is_started_that_the_budget_would_cut():
    spec = ConstraintSpec.tool_calls(CITY, "get_weather")
    first = len(TOK.encode(CALL + "\n"))  # one call and its separator: 84 byte tokens
    calls = [CALL.replace("Oslo", c) for c in ("Oslo", "Rome", "Lima")]
    text = "\n".join(calls)
    (ids,) = decode_rows([SamplingParams.greedy(first + 60, constraint=spec)], writer_of(text))
    # a second call like the first needs ~84 tokens and 60 are left: the output ends after the
    # first, whole (the closing way would otherwise finish the second with invented values)
    assert decode(ids) == calls[0] and ids[-1] in EOS
    c = Constraint(spec, llg_tokenizer(TOK))
    for t in TOK.encode(calls[0]):
        c.advance(t)
    c.budget(90)
    assert not c.mask_ready  # room for another call like it: the model decides
    c.budget(60)
    assert c.mask_ready and not c.closed_by_budget  # ended as the model would: finish "eos" (tool calls)


def test_the_end_of_a_json_document_is_left_to_the_grammar():
    spec = ConstraintSpec.json_schema(JOKE)
    c = Constraint(spec, llg_tokenizer(TOK))
    for t in TOK.encode('{"setup": "a", "punchline": "b"}'):
        c.advance(t)
    c.budget(10)
    assert not c.mask_ready  # only tool calls end early; the grammar itself allows only the end here
