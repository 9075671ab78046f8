"""Grammar-constrained sampling, logit bias, penalties and post-sampling probabilities (no model:
random logits over the byte-level test tokenizer, so any token could be drawn without the mask)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from opencoti.engine.config import SamplingParams
from opencoti.engine.constraints import ConstraintSpec
from opencoti.engine.errors import InvalidRequestError
from opencoti.engine.sampling import Sampler, make_generator
from opencoti.engine.sampling.state import SamplerState
from opencoti.engine.chat.tokenizer import Tokenizer
from opencoti.engine.chat.tool_calls import parse_tool_calls

TOK = Tokenizer.byte_level(320)
V = TOK.vocab_size
EOS = set(TOK.eos_token_ids)

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                     "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
    "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "integer", "minimum": -12, "maximum": 12}},
    "required": ["tz"], "additionalProperties": False}}}


def sp(**kw) -> SamplingParams:
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, max_tokens=None)
    base.update(kw)
    return SamplingParams(**base)


def run(params: list[SamplingParams], steps: int = 400, seed: int = 0, prompt=(1, 2, 3), scale: float = 2.0,
        free_text: bytes = b"") -> list[list[int]]:
    """Decode every row until EOS with random logits; returns the generated ids (EOS excluded).
    ``free_text``: bytes made very likely for the first tokens (drives a lazy trigger)."""
    sampler = Sampler()
    states = [SamplerState.for_request(p, list(prompt), TOK, V) for p in params]
    gens = [make_generator(seed * 1000 + i, 0) for i in range(len(params))]
    g = torch.Generator().manual_seed(seed)
    out: list[list[int]] = [[] for _ in params]
    done = [False] * len(params)
    for step in range(steps):
        logits = torch.randn(len(params), V, generator=g) * scale
        if step < len(free_text):
            logits[:, free_text[step]] += 50.0
        toks = sampler.sample(logits, params, gens, states).token_ids
        for i, t in enumerate(toks):
            if done[i]:
                continue
            if t in EOS:
                done[i] = True
            else:
                out[i].append(t)
        if all(done):
            return out
    raise AssertionError(f"not all rows ended within {steps} steps: {[TOK.decode(o) for o in out]}")


def check_person(value) -> None:
    assert set(value) == {"name", "age", "tags"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 150
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 3 and set(value["tags"]) <= {"a", "bb"}


# ============================================================================ validation
@pytest.mark.parametrize("make, needle", [
    (lambda: ConstraintSpec.json_schema({"type": "frob"}), "frob"),
    (lambda: ConstraintSpec.json_schema({"type": "integer", "minimum": 5, "maximum": 1}), "minimum"),
    (lambda: ConstraintSpec.json_schema("{not json"), "not valid JSON"),
    (lambda: ConstraintSpec.json_schema([1, 2]), "JSON object"),
    (lambda: ConstraintSpec.json_schema({"$ref": "#/nope"}), "nope"),
    (lambda: ConstraintSpec.gbnf('root ::= foo'), "foo"),
    (lambda: ConstraintSpec.gbnf('start: "a" undefined_rule'), "undefined_rule"),
    (lambda: ConstraintSpec.gbnf(""), "non-empty"),
    (lambda: ConstraintSpec.regex("(("), "unclosed group"),
    (lambda: ConstraintSpec.tool_calls([WEATHER], name="nope"), "nope"),
    (lambda: ConstraintSpec.tool_calls([{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "strin"}}}}}]), "'f'"),
    (lambda: ConstraintSpec("yaml", "x"), "kind"),
])
def test_invalid_constraints_are_rejected_with_the_problem_named(make, needle):
    with pytest.raises(InvalidRequestError) as e:
        make()
    assert needle in str(e.value)


def test_sampling_params_validate_new_fields():
    for kw in (dict(logit_bias={"a": 1.0}), dict(logit_bias={3: math.nan}), dict(repeat_penalty=0.0),
               dict(repeat_last_n=-2), dict(presence_penalty=math.inf), dict(penalty_scope="all"),
               dict(post_sampling_probs=1), dict(constraint={"type": "object"})):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**kw)
    p = SamplingParams(logit_bias={3: -math.inf, 4: 1.5})
    assert p.logit_bias == {3: -math.inf, 4: 1.5} and not p.has_penalties
    assert SamplingParams(repeat_penalty=1.1).has_penalties
    assert not SamplingParams(repeat_penalty=1.1, repeat_last_n=0).has_penalties


def test_state_checks_token_ids_against_the_vocabulary():
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        SamplerState.for_request(SamplingParams(logit_bias={V: 1.0}), [1], TOK, V)
    assert SamplerState.for_request(SamplingParams(), [1], TOK, V) is None  # plain requests carry nothing


# ============================================================================ constrained outputs
@pytest.mark.parametrize("seed", range(4))
def test_json_schema_outputs_always_parse_and_validate(seed):
    spec = ConstraintSpec.json_schema(PERSON)
    outs = run([sp(constraint=spec) for _ in range(6)], seed=seed)
    for ids in outs:
        check_person(json.loads(TOK.decode(ids)))


def test_json_object_and_regex_and_gbnf():
    outs = run([sp(constraint=ConstraintSpec.json_object()) for _ in range(4)], seed=7, scale=1.0, steps=3000)
    for ids in outs:
        assert isinstance(json.loads(TOK.decode(ids)), dict)
    outs = run([sp(constraint=ConstraintSpec.regex(r"[0-9]{3}-[a-c]{2,4}")) for _ in range(4)], seed=8)
    for ids in outs:
        assert re.fullmatch(r"[0-9]{3}-[a-c]{2,4}", TOK.decode(ids))
    gbnf = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'
    outs = run([sp(constraint=ConstraintSpec.gbnf(gbnf)) for _ in range(4)], seed=9)
    for ids in outs:
        assert re.fullmatch(r"\((?:[0-9]|x)(?:,(?:[0-9]|x))*\)", TOK.decode(ids))


def test_greedy_constrained_rows_and_unconstrained_rows_share_a_batch():
    spec = ConstraintSpec.regex(r"yes|no")
    params = [sp(constraint=spec), sp(temperature=0.0, top_k=0, constraint=spec), sp(), sp(temperature=0.0)]
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, V, generator=g)
    states = [SamplerState.for_request(p, [1], TOK, V) for p in params]
    gens = [make_generator(i, 0) for i in range(4)]
    out = Sampler().sample(logits, params, gens, states)
    assert chr(out.token_ids[0]) in "yn" and chr(out.token_ids[1]) in "yn"
    # the unconstrained rows draw exactly what they draw without any state in the batch
    plain = Sampler().sample(logits[2:], params[2:], [make_generator(i, 0) for i in (2, 3)])
    assert out.token_ids[2:] == plain.token_ids
    assert out.token_ids[1] == (ord("y") if logits[1, ord("y")] > logits[1, ord("n")] else ord("n"))


def test_required_and_named_tool_calls_are_valid_calls():
    names = {"get_weather", "get_time"}
    for spec, single in ((ConstraintSpec.tool_calls([WEATHER, TIME], parallel=False), True),
                         (ConstraintSpec.tool_calls([WEATHER, TIME], name="get_time"), False)):
        outs = run([sp(constraint=spec) for _ in range(3)], seed=11, steps=600)
        for ids in outs:
            text = TOK.decode(ids)
            content, calls = parse_tool_calls(text, names)
            assert content == "" and calls and (len(calls) == 1 or not single), text
            for call in calls:
                args = json.loads(call.arguments)
                if spec.source["name"] == "get_time" or call.name == "get_time":
                    assert call.name == "get_time" and set(args) == {"tz"} and -12 <= args["tz"] <= 12
                else:
                    assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f")


def test_tool_call_prefix_is_fed_to_the_grammar():
    prefill = '<tool_call>\n{"name": "get_weather", "arguments": '
    spec = ConstraintSpec.tool_calls([WEATHER, TIME], name="get_weather", prefix=prefill, parallel=False)
    outs = run([sp(constraint=spec) for _ in range(3)], seed=12, steps=600)
    for ids in outs:
        _, calls = parse_tool_calls(prefill + TOK.decode(ids), {"get_weather"})
        assert len(calls) == 1 and set(json.loads(calls[0].arguments)) == {"city", "unit"}
    with pytest.raises(InvalidRequestError, match="does not match"):
        SamplerState.for_request(sp(constraint=ConstraintSpec.tool_calls([WEATHER], prefix="hello")), [1], TOK, V)


def test_lazy_tool_call_is_free_until_the_trigger_then_constrained():
    spec = ConstraintSpec.tool_calls([WEATHER], lazy=True, parallel=False)
    free = b"Sure. <tool_call>"
    outs = run([sp(constraint=spec) for _ in range(3)], seed=13, steps=800, free_text=free)
    for ids in outs:
        text = TOK.decode(ids)
        assert text.startswith("Sure. <tool_call>")
        content, calls = parse_tool_calls(text, {"get_weather"})
        assert content == "Sure." and len(calls) == 1, text
    # without the trigger the output is not constrained at all
    state = SamplerState.for_request(sp(constraint=spec), [1], TOK, V)
    assert not state.constrained
    for b in b"no call":
        state.accept(b)
    assert not state.constrained


# ============================================================================ logit bias and penalties
def test_logit_bias_bans_and_forces_tokens():
    logits = torch.zeros(2, V)
    logits[:, 65] = 30.0
    params = [sp(logit_bias={65: -math.inf}), sp(temperature=0.0, logit_bias={66: 100.0})]
    states = [SamplerState.for_request(p, [1], TOK, V) for p in params]
    for seed in range(20):
        out = Sampler().sample(logits, params, [make_generator(seed, 0), None], states)
        assert out.token_ids[0] != 65 and out.token_ids[1] == 66


def test_a_row_with_every_allowed_token_banned_can_only_end():
    spec = ConstraintSpec.regex("a")
    p = sp(constraint=spec, logit_bias={ord("a"): -math.inf})
    state = SamplerState.for_request(p, [1], TOK, V)
    out = Sampler().sample(torch.randn(1, V), [p], [make_generator(0, 0)], [state])
    assert out.token_ids[0] in EOS


def _penalized(logits, counts, rep, freq, pres):
    out = logits.clone()
    for t, c in counts.items():
        x = out[t]
        x = x / rep if x > 0 else x * rep
        out[t] = x - c * freq - pres
    return out


@pytest.mark.parametrize("scope", ["context", "output"])
def test_penalties_follow_the_llama_cpp_formula_over_the_window(scope):
    prompt = [10, 11, 11, 12, 13]
    p = sp(temperature=0.0, repeat_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.25, repeat_last_n=4,
           penalty_scope=scope, logprobs=0, post_sampling_probs=False)
    state = SamplerState.for_request(p, prompt, TOK, V)
    generated = [20, 11]
    for t in generated:
        state.accept(t)
    window = (prompt + generated)[-4:] if scope == "context" else generated[-4:]
    counts = {t: window.count(t) for t in set(window)}
    logits = torch.randn(1, V)
    logits[0, 11] = 5.0
    logits[0, 13] = -2.0
    from opencoti.engine.sampling.state import process_logits
    got = logits.clone()
    process_logits(got, [p], [state])
    want = _penalized(logits[0], counts, 1.3, 0.4, 0.25)
    assert torch.allclose(got[0], want)


def test_penalties_change_what_is_sampled():
    logits = torch.zeros(1, V)
    logits[0, 65] = 3.0
    logits[0, 66] = 2.5
    p = sp(temperature=0.0, presence_penalty=1.0, repeat_last_n=-1, penalty_scope="output")
    state = SamplerState.for_request(p, [65, 65], TOK, V)  # the prompt does not count for "output"
    s = Sampler()
    assert s.sample(logits, [p], [None], [state]).token_ids == [65]
    assert s.sample(logits, [p], [None], [state]).token_ids == [66]  # 65 now seen: 3.0 - 1.0 < 2.5


# ============================================================================ post-sampling probabilities
def test_post_sampling_probs_are_the_filtered_tempered_distribution():
    logits = torch.full((2, V), -10.0)
    logits[:, 65], logits[:, 66], logits[:, 67] = 2.0, 1.0, 0.5
    params = [sp(top_k=2, temperature=0.5, logprobs=3, post_sampling_probs=True),
              sp(temperature=0.0, top_k=0, logprobs=2, post_sampling_probs=True)]
    out = Sampler().sample(logits, params, [make_generator(1, 0), None], [None, None])
    z = math.exp(2.0 / 0.5) + math.exp(1.0 / 0.5)
    top = dict(out.top_logprobs[0])
    assert set(top) == {65, 66}  # only the survivors of top_k=2
    assert math.isclose(math.exp(top[65]), math.exp(4.0) / z, rel_tol=1e-5)
    assert math.isclose(out.logprobs[0], top[out.token_ids[0]], rel_tol=1e-6)
    assert out.top_logprobs[1] == [(65, 0.0)] and out.logprobs[1] == 0.0
    raw = Sampler().sample(logits[:1], [sp(top_k=2, temperature=0.5, logprobs=3)], [make_generator(1, 0)])
    assert len(raw.top_logprobs[0]) == 3 and raw.top_logprobs[0][0][1] < 0  # raw model distribution


# ============================================================================ request fields
from opencoti.ops.constraints_request import (  # noqa: E402
    constraint_from_request, logit_bias_from_request, penalty_kwargs)


def test_logit_bias_request_forms():
    enc = TOK.encode
    assert logit_bias_from_request({"65": 2, "66": -1.5}, enc, openai=True) == {65: 2.0, 66: -1.5}
    assert logit_bias_from_request([[65, 1.0], [66, False]], enc) == {65: 1.0, 66: -math.inf}
    assert logit_bias_from_request([["ab", -3]], enc) == {97: -3.0, 98: -3.0}  # every token of the string
    assert logit_bias_from_request({"ab": False}, enc) == {97: -math.inf, 98: -math.inf}
    assert logit_bias_from_request([[65, 1.0], [65, 2.0]], enc) == {65: 3.0}
    assert logit_bias_from_request({"65": 500}, enc) == {65: 500.0}  # llama.cpp: no range
    for bad, msg in (({"65": 101}, r"\[-100, 100\]"), ({"65": True}, "number or false"), ([[65, 1]], "object"),
                     ("x", "object"), ({"": 1}, "token ids"), ({"ab": 1}, "token ids"), ({"65": math.nan}, "number or false")):
        with pytest.raises(InvalidRequestError, match=msg):
            logit_bias_from_request(bad, enc, openai=True)  # OpenAI: {"<token id>": bias} only
    for bad, msg in (([[65]], "pairs"), ({"": 1}, "non-empty"), ("x", "object")):
        with pytest.raises(InvalidRequestError, match=msg):
            logit_bias_from_request(bad, enc)


def test_penalty_semantics_per_route():
    assert penalty_kwargs(presence_penalty=0.5, openai=True) == {
        "presence_penalty": 0.5, "penalty_scope": "output", "repeat_last_n": -1}
    assert penalty_kwargs(repeat_penalty=1.1, repeat_last_n=32) == {"repeat_penalty": 1.1, "repeat_last_n": 32}
    with pytest.raises(InvalidRequestError, match=r"\[-2, 2\]"):
        penalty_kwargs(frequency_penalty=3.0, openai=True)
    assert penalty_kwargs(frequency_penalty=3.0) == {"frequency_penalty": 3.0}  # llama.cpp: no range


def test_constraint_from_request_fields():
    js = {"type": "object", "properties": {"a": {"type": "integer"}}}
    strict = {**js, "required": ["a"], "additionalProperties": False}  # OpenAI's strict mode rules
    c = constraint_from_request(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": strict,
                                                                                        "strict": True}})
    assert c.kind == "json_schema" and c.source == strict
    with pytest.raises(InvalidRequestError, match="'additionalProperties' is required to be supplied"):
        constraint_from_request(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": js,
                                                                                         "strict": True}})
    assert constraint_from_request(response_format={"type": "json_object"}).kind == "json_object"
    assert constraint_from_request(response_format={"type": "json_object", "schema": js}).kind == "json_schema"
    assert constraint_from_request(response_format={"type": "text"}) is None
    assert constraint_from_request(json_schema=js).kind == "json_schema"
    assert constraint_from_request(grammar='root ::= "a"').kind == "grammar"
    auto = constraint_from_request(tool_mode="auto", tools=[WEATHER])
    assert auto.kind == "tool_calls" and auto.trigger == "<tool_call>"
    req = constraint_from_request(tool_mode="required", tool_name="get_time", tools=[WEATHER, TIME],
                                  prefill='<tool_call>\n{"name": "get_time", "arguments": ')
    assert req.kind == "tool_calls" and req.trigger is None and req.source["name"] == "get_time"
    assert constraint_from_request(tool_mode="none", tools=[WEATHER]) is None
    either = constraint_from_request(response_format={"type": "json_object"}, tool_mode="auto", tools=[WEATHER])
    (answer,) = run([sp(constraint=either)], seed=21, free_text=b"{}")
    assert json.loads(TOK.decode(answer)) == {}
    (call,) = run([sp(constraint=either)], seed=22, steps=600, free_text=b"<tool_call>")
    assert parse_tool_calls(TOK.decode(call), {"get_weather"})[1], TOK.decode(call)
    for kw, msg in ((dict(json_schema=js, grammar='root ::= "a"'), "at most one"),
                    (dict(response_format={"type": "xml"}), "xml"),
                    (dict(response_format={"type": "json_schema", "json_schema": {}}), "json_schema"),
                    (dict(response_format="json"), "object"),
                    (dict(grammar='root ::= "a"', tool_mode="auto", tools=[WEATHER]), "cannot be combined"),
                    (dict(json_schema={"type": "strnig"}), "strnig")):
        with pytest.raises(InvalidRequestError, match=msg):
            constraint_from_request(**kw)


# ============================================================================ through the engine
def test_engine_constrained_generation_with_preemption_free_batching(engine):
    """Four constrained requests and one plain one decode together in the tiny engine."""
    from concurrent.futures import ThreadPoolExecutor

    spec = ConstraintSpec.json_schema(PERSON)
    params = [sp(constraint=spec, seed=s, max_tokens=300) for s in range(4)] + [sp(seed=9, max_tokens=20)]
    with ThreadPoolExecutor(5) as pool:
        results = list(pool.map(lambda p: engine.generate("Make a person:", params=p), params))
    for r in results[:4]:
        assert r.stop_reason == "eos", r
        check_person(json.loads(r.text))
    alone = engine.generate("Make a person:", params=params[4])
    assert results[4].token_ids == alone.token_ids  # the plain request is not affected by its neighbours


def test_engine_rejects_bad_sampler_settings_before_accepting(engine):
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.generate("x", params=SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(InvalidRequestError, match="does not match the constraint"):
        engine.generate("x", params=SamplingParams(constraint=ConstraintSpec.regex("a", prefix="b")))
    stats = engine.stats()
    assert stats["requests"] == 0 and stats["sessions"] == 0  # nothing was accepted
    r = engine.generate("x", params=SamplingParams.greedy(4, logit_bias={t: -math.inf for t in range(V) if t != 65}))
    assert set(r.token_ids) <= {65} | EOS


# ============================================================================ n choices
def test_n_choices_share_the_prompt_through_a_temporary_pool(engine):
    import asyncio

    from opencoti.server.choices import Choices, choice_params

    prompt = engine.tokenize("The same long prompt shared by every choice of this request. " * 3)

    async def run_choices(params, n, **kw):
        ch = Choices(engine, prompt, params, n, **kw)
        await ch.start()
        try:
            seen = set()
            async for i, d in ch.events():
                seen.add(i)
            return ch.results, [s.info for s in ch.streams], seen
        finally:
            await ch.aclose()

    results, infos, seen = asyncio.run(run_choices(SamplingParams.greedy(6), 3))
    assert engine.stats()["sessions"] == 0  # the choices' sessions are released
    alone = engine.generate(prompt, params=SamplingParams.greedy(6))
    assert seen == {0, 1, 2} and all(r.token_ids == alone.token_ids for r in results)
    assert all(i.cached_prefix_tokens == len(prompt) - 1 for i in infos)  # the prompt was computed once
    assert engine.pools()["pools"] == []  # the temporary pool is gone
    seeded, _, _ = asyncio.run(run_choices(sp(seed=5, max_tokens=8), 3))
    assert len({tuple(r.token_ids) for r in seeded}) > 1  # choice i samples with seed + i
    assert [p.seed for p in choice_params(sp(seed=5), 3)] == [5, 6, 7]
    with pytest.raises(InvalidRequestError, match="session_id"):
        Choices(engine, prompt, sp(), 2, session_id="s1")
    with pytest.raises(InvalidRequestError, match=r"\[1, 16\]"):
        choice_params(sp(), 0)
