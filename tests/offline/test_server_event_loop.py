"""Work that a large request costs stays off the event loop and never holds the GIL in one long call:
answers are JSON-encoded in slices (the same bytes as one call), large bodies are validated against
their model in a worker thread (the same answers and errors as on the loop)."""

from __future__ import annotations

import json
import math
import random

import pytest
from starlette.testclient import TestClient

from opencoti.server import create_app, json_steps
from opencoti.server.routing import INLINE_BYTES


def reference(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


@pytest.mark.parametrize("obj", [
    {"content": "héllo \n\"wörld\" \\ \u0001 😀 你好 " * 3000}, "x" * 50, ["é\t" * 40_000, {"k": "\u2028" * 70_000}],
    {"tokens": list(range(20_000))},
    {"tokens": [{"id": i, "piece": f"p{i} é\n\"q\""} for i in range(9_000)]},
    [list(range(5_000)), {"a": [1.5, None, True, "x"] * 2_000}],
    {1: list(range(json_steps.SLICE + 1)), 2.5: "v", None: {"k": ()}, "t": tuple(range(json_steps.SLICE * 2))},
    {True: list(range(json_steps.SLICE + 1))},
    {"small": [1, 2, 3], "text": "héllo", "nested": {"a": {"b": {"c": list(range(10))}}}},
    list(range(json_steps.SLICE)), list(range(json_steps.SLICE + 1)), [], {}, "s", 3, None,
])
def test_sliced_encoding_gives_the_same_bytes(obj, monkeypatch):
    monkeypatch.setattr(json_steps, "STR_SLICE", 1000)
    assert json_steps.dumps(obj) == reference(obj)


def test_large_detection_and_errors():
    assert json_steps.is_large({"tokens": list(range(json_steps.SLICE + 1))})
    assert json_steps.is_large([[0] * (json_steps.SLICE + 1)])
    assert not json_steps.is_large({"tokens": list(range(100)), "text": "x" * 10**6})
    assert json_steps.is_large({"text": "x" * (json_steps.STR_SLICE + 1)})
    with pytest.raises(ValueError):
        json_steps.dumps({"x": [math.nan] * (json_steps.SLICE + 1)})
    with pytest.raises(TypeError):
        json_steps.dumps({"x": [object()] * (json_steps.SLICE + 1)})


def _random_json(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 4 else 5)
    if kind == 0:
        return rng.randint(-10**20, 10**20)
    if kind == 1:
        return rng.choice([0.5, -1e-7, 3.25e22, 0.0, -0.0, 1e308])
    if kind == 2:
        if rng.random() < 0.5:
            return rng.choice(["", "a", "é\n\"\\/\t", "\ud83d\ude00", "\u0000x", "\ud800"])
        alphabet = ["a", "b", " ", "é", "你", "😀", "\\", '"', "\n", "\u0001", "\ud800", "\udc00", "/"]
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 200)))
    if kind == 3:
        return rng.choice([True, False, None])
    if kind == 4:
        return [rng.randint(-5, 10**6) for _ in range(rng.randrange(0, 3000))]  # a run of numbers
    if kind in (5, 6):
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(0, 6))]
    return {rng.choice(["k", "é", "", "a b", "k"]) + str(rng.randrange(4)): _random_json(rng, depth + 1)
            for _ in range(rng.randrange(0, 6))}


def _texts(obj, rng: random.Random) -> list[str]:
    return [json.dumps(obj), json.dumps(obj, indent=rng.choice([1, "\t", " \r\n "])),
            json.dumps(obj, separators=(" ,  ", " : "), ensure_ascii=False)]


def test_stepwise_parsing_gives_what_json_loads_gives(monkeypatch):
    monkeypatch.setattr(json_steps, "STEP_BYTES", 0)  # every document takes the stepwise path ...
    monkeypatch.setattr(json_steps, "WINDOW", 16)  # ... with windows of a few array elements ...
    monkeypatch.setattr(json_steps, "STRING_PIECE", 7)  # ... and strings decoded a few characters at a time
    rng = random.Random(0)
    for _ in range(150):
        for text in _texts(_random_json(rng), rng):
            got, want = json_steps.loads(text), json.loads(text)
            assert got == want and json.dumps(got) == json.dumps(want)  # -0.0, key order, ints vs floats
            for encoding in ("utf-8", "utf-16", "utf-32"):
                raw = text.encode(encoding, "surrogatepass")
                assert json.dumps(json_steps.loads(raw)) == json.dumps(json.loads(raw))
    for text in ["[NaN, Infinity, -Infinity]", '{"a": [1, 2.5e3, -0, 1E+2]}', '[1,2,3 , 4 ,5]', "  [ ]  ", "{ }",
                 '{"a": 1, "a": 2}', '"\\ud800"', "123456789012345678901234567890", "[[[[[]]]]]"]:
        got, want = json_steps.loads(text), json.loads(text)
        assert json.dumps(got) == json.dumps(want), text
    bad = ["[1,2,]", "[01]", "{\"a\" 1}", "{\"a\": 1,}", "[1 2]", "[1,,2]", "", "[", "{", '"abc', "[1]x",
           "\ufeff[1]", "{1: 2}", "[tru]", '["\x01"]', "[1.]", "[-]", "[1e]", "[" * 5000 + "]" * 5000]
    for text in bad:
        with pytest.raises((json.JSONDecodeError, RecursionError)) as mine:
            json_steps.loads(text)
        with pytest.raises((json.JSONDecodeError, RecursionError)) as theirs:
            json.loads(text)
        assert type(mine.value) is type(theirs.value), text
        if isinstance(theirs.value, json.JSONDecodeError):
            assert mine.value.msg == theirs.value.msg, text


def test_large_bodies_validated_off_the_loop_answer_as_small_ones(engine):
    pad = "x" * (INLINE_BYTES + 10)  # an unknown field makes the body large, not the request
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        for extra in ({}, {"padding": pad}):
            r = c.post("/tokenize", json={"content": "hello", **extra})
            assert r.status_code == 200 and r.json() == {"tokens": list(b"hello")}, r.text
            r = c.post("/tokenize", json={"content": 5, **extra})
            assert r.status_code == 400 and "content" in r.json()["error"]["message"], r.text
            r = c.post("/completion", json={"prompt": [1, 2, "x"], "n_predict": 1, **extra})
            assert r.status_code == 400 and "prompt" in r.json()["error"]["message"], r.text
            r = c.post("/polykv/pools", json={"tokens": [], **extra})
            assert r.status_code == 400, r.text
            r = c.post("/completion", json={"prompt": [1, 2, 3], "n_predict": 1, "temperature": 0, **extra})
            assert r.status_code == 200 and r.json()["tokens_evaluated"] == 3, r.text
        small = c.post("/completion", json={"prompt": [1, 2, "x"], "n_predict": 1}).json()
        large = c.post("/completion", json={"prompt": [1, 2, "x"], "n_predict": 1, "padding": pad}).json()
        assert small == large
        # a large prompt of ids: validated in the thread, answered like any other
        ids = [65] * (INLINE_BYTES // 3)
        r = c.post("/tokenize", json={"content": "A" * len(ids)})
        assert r.json()["tokens"] == ids
        r = c.post("/detokenize", json={"tokens": ids})
        assert r.status_code == 200 and r.json()["content"] == "A" * len(ids)
        # broken JSON: the same 400 (in FastAPI's words) whether the body is small or large
        for body in (b'{"content": "x",', b'{"content": "' + b"x" * (INLINE_BYTES + 10) + b'",'):
            r = c.post("/tokenize", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"], r.text


def _body_field(path: str, method: str = "POST"):
    from opencoti.server.routes_generate import router
    from opencoti.server.routes_ops import operations_router

    for r in [*router.routes, *operations_router().routes]:
        if getattr(r, "path", None) == path and method in getattr(r, "methods", ()) and r.body_field is not None:
            return r.body_field
    raise LookupError(path)


def test_long_id_lists_validated_in_steps_give_the_same_models_and_errors():
    from fastapi.exceptions import RequestValidationError

    from opencoti.ops.schemas import lone_surrogate_path
    from opencoti.ops.validation import validation_message
    from opencoti.server import routing

    ids = list(range(json_steps.SLICE + 4))
    assert len(json.dumps(ids * 4)) > INLINE_BYTES  # (the first case takes the large-body path)
    cases = [("/completion", {"prompt": ids * 4, "n_predict": 1}, 1),
             ("/completion", {"prompt": [ids, ids[:10], ids], "n_predict": 1}, 2),
             ("/v1/completions", {"prompt": ids, "max_tokens": 1}, 1),
             ("/detokenize", {"tokens": ids}, 1),
             ("/polykv/pools", {"tokens": ids, "label": "x"}, 1)]
    for path, body, n_stand_ins in cases:
        field = _body_field(path)
        raw = json.dumps(body).encode()
        assert len(routing._stand_in_id_lists(json.loads(raw), field.field_info.annotation)) == n_stand_ins
        got = routing._parse(raw, field)
        want, errors = field.validate(json.loads(raw), {}, loc=("body",))
        assert not errors and type(got) is type(want) and got == want, path
    field = _body_field("/completion")
    for body in ({"prompt": ids, "temperature": "hot"}, {"prompt": ids[:100] + ["x"]}, {"prompt": [ids, 5]},
                 {"prompt": ids, "n_predict": 1, "stop": ids}):
        raw = json.dumps(body).encode()
        with pytest.raises(RequestValidationError) as e:
            routing._parse(raw, field)
        _, want = field.validate(json.loads(raw), {}, loc=("body",))
        assert validation_message(e.value.errors()) == validation_message(want), body
    for body in ({"prompt": ["a"] * 5000 + ["\ud800"]}, {"prompt": "x" * 70_000 + "\udc00"},
                 {"prompt": ids, "stop": ["ok", "bad\ud800"]}, {"\ud800" + "k" * 70_000: 1}):
        raw = json.dumps(body).encode()
        with pytest.raises(RequestValidationError) as e:
            routing._parse(raw, field)
        assert e.value.errors()[0]["msg"].startswith(lone_surrogate_path(json.loads(raw))), body


def test_a_prompt_of_many_ids_is_refused_like_a_short_one(engine):
    from opencoti.engine import engine as engine_mod

    n = engine_mod._LOOP_TOKENS + 10  # copied off the event loop (Engine.astream)
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        long = c.post("/completion", json={"prompt": [65] * n, "n_predict": 1})
        short = c.post("/completion", json={"prompt": [65] * (engine.max_context + 1), "n_predict": 1})
        assert long.status_code == short.status_code == 400, long.text
        assert long.json()["error"]["type"] == short.json()["error"]["type"]
        ok = c.post("/completion", json={"prompt": [65, 66], "n_predict": 1, "temperature": 0})
        assert ok.status_code == 200


def test_a_server_that_loads_its_model_freezes_the_start_heap(make_engine):
    import gc
    import time

    gc.unfreeze()
    try:
        with TestClient(create_app(engine_factory=make_engine), raise_server_exceptions=False) as c:
            for _ in range(600):
                if c.get("/health").status_code == 200:
                    break
                time.sleep(0.1)
            assert c.get("/health").status_code == 200
            assert gc.get_freeze_count() > 0  # later collections skip what the start made
    finally:
        gc.unfreeze()
