"""Constrained decoding on the bundled SmolLM2 model: at temperature 1.0, over many seeds, every
output parses and validates (JSON Schema, GBNF, regex), and forced tool calls are valid calls."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from opencoti.engine import SamplingParams
from opencoti.engine.constraints import ConstraintSpec
from opencoti.ops.constraints_request import constraint_from_request
from opencoti.engine.chat.tool_calls import parse_tool_calls, tool_choice_prefill, ToolChoice

pytestmark = pytest.mark.bundled

SEEDS = range(16)

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "city": {"type": "string", "maxLength": 24}, "hobbies": {"type": "array", "maxItems": 3,
                                                            "items": {"type": "string", "maxLength": 16}},
    "employed": {"type": "boolean"}, "role": {"enum": ["engineer", "teacher", "artist", "other"]}},
    "required": ["name", "age", "city", "hobbies", "employed", "role"], "additionalProperties": False}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                                    "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
                   "required": ["a", "b"], "additionalProperties": False}}}


def check_person(v: dict) -> None:
    assert set(v) == set(PERSON["properties"])
    assert isinstance(v["name"], str) and len(v["name"]) <= 24 and isinstance(v["city"], str)
    assert isinstance(v["age"], int) and not isinstance(v["age"], bool) and 0 <= v["age"] <= 130
    assert isinstance(v["hobbies"], list) and len(v["hobbies"]) <= 3 and all(isinstance(h, str) for h in v["hobbies"])
    assert isinstance(v["employed"], bool) and v["role"] in PERSON["properties"]["role"]["enum"]


def generate_all(eng, prompt: list[int], make_params) -> list:
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda s: eng.generate(prompt, params=make_params(s)), SEEDS))
    for r in results:
        eng.release_session(r.session_id)
    return results


def chat_prompt(eng, text: str, tools=None, prefill: str = "") -> list[int]:
    return eng.tokenize(eng.apply_chat_template([{"role": "user", "content": text}], tools=tools) + prefill)


def test_json_schema_outputs_parse_and_validate_at_temperature_1(int4_engine):
    eng = int4_engine
    spec = ConstraintSpec.json_schema(PERSON)
    prompt = chat_prompt(eng, "Invent a person and describe them as JSON.")
    results = generate_all(eng, prompt, lambda s: SamplingParams(temperature=1.0, seed=s, max_tokens=300,
                                                                 constraint=spec))
    for r in results:
        assert r.stop_reason == "eos", r.text
        check_person(json.loads(r.text))
    assert len({r.text for r in results}) > 1  # sampled, not one forced answer


def test_json_object_grammar_and_regex_at_temperature_1(int4_engine):
    eng = int4_engine
    prompt = chat_prompt(eng, "Give me a small JSON object about cats.")
    for r in generate_all(eng, prompt, lambda s: SamplingParams(temperature=1.0, seed=s, max_tokens=120,
                                                                constraint=ConstraintSpec.json_object())):
        if r.stop_reason == "eos":
            assert isinstance(json.loads(r.text), dict)
        else:  # an object can be arbitrarily long; what was generated is still a valid prefix
            assert r.stop_reason == "length" and r.text.startswith("{")
    gbnf = 'root ::= answer " because " reason\nanswer ::= "yes" | "no"\nreason ::= [a-z ]{1,40}'
    prompt = chat_prompt(eng, "Is the sky blue? Answer yes or no and say why.")
    for r in generate_all(eng, prompt, lambda s: SamplingParams(temperature=1.0, seed=s, max_tokens=60,
                                                                constraint=ConstraintSpec.gbnf(gbnf))):
        assert re.fullmatch(r"(yes|no) because [a-z ]{1,40}", r.text), r.text
    prompt = chat_prompt(eng, "What is today's date?")
    for r in generate_all(eng, prompt, lambda s: SamplingParams(
            temperature=1.0, seed=s, max_tokens=20, constraint=ConstraintSpec.regex(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"))):
        assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", r.text), r.text


@pytest.mark.parametrize("choice", [ToolChoice("required", None), ToolChoice("required", "add")])
def test_required_and_named_tool_calls_are_valid(int4_engine, choice):
    eng = int4_engine
    tools = [WEATHER, ADD]
    prefill = tool_choice_prefill(choice)
    spec = constraint_from_request(tool_mode=choice.mode, tool_name=choice.name, tools=tools, prefill=prefill,
                                   parallel_tool_calls=False)
    prompt = chat_prompt(eng, "What is 17 plus 25? And how warm is it in Paris?", tools=tools, prefill=prefill)
    for r in generate_all(eng, prompt, lambda s: SamplingParams(temperature=1.0, seed=s, max_tokens=120,
                                                                constraint=spec)):
        assert r.stop_reason == "eos", r.text
        content, calls = parse_tool_calls(prefill + r.text, {"get_weather", "add"})
        assert content == "" and len(calls) == 1, r.text
        args = json.loads(calls[0].arguments)
        assert isinstance(args, dict)
        if choice.name == "add" or calls[0].name == "add":
            assert calls[0].name == "add" and set(args) == {"a", "b"}
            assert all(isinstance(args[k], int) and -1000 <= args[k] <= 1000 for k in "ab")
        else:
            assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
