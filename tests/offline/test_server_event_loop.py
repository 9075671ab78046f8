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
    assert json_steps.dumps_bytes(obj) == reference(obj).encode("utf-8")
    assert json_steps.dumps(obj, ensure_ascii=True) == json.dumps(obj, allow_nan=False, separators=(",", ":"))


@pytest.mark.parametrize("obj", [{"content": "ok é " * 5000 + "\ud800" + "x" * 3000}, ["\udc00", 1],
                                 {"tokens": list(range(json_steps.SLICE + 1)), "text": "a\ud83d"}])
def test_text_that_is_not_unicode_is_sent_escaped(obj, monkeypatch):
    monkeypatch.setattr(json_steps, "STR_SLICE", 1000)
    want = json.dumps(obj, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")
    assert json_steps.dumps_bytes(obj) == want


def test_large_detection_and_errors():
    assert json_steps.is_large({"tokens": list(range(json_steps.SLICE + 1))})
    assert json_steps.is_large([[0] * (json_steps.SLICE + 1)])
    assert not json_steps.is_large({"tokens": list(range(100)), "text": "x" * json_steps.STR_SLICE})
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
            r = c.post("/completion", json={"prompt": [1, 2, None], "n_predict": 1, **extra})
            assert r.status_code == 400 and "prompt" in r.json()["error"]["message"], r.text
            r = c.post("/completion", json={"prompt": [1, 2, "x"], "n_predict": 1, **extra})  # ids and text: one prompt
            assert r.status_code == 200 and r.json()["tokens_evaluated"] == 3, r.text
            r = c.post("/polykv/pools", json={"tokens": [], **extra})
            assert r.status_code == 400, r.text
            r = c.post("/completion", json={"prompt": [1, 2, 3], "n_predict": 1, "temperature": 0, **extra})
            assert r.status_code == 200 and r.json()["tokens_evaluated"] == 3, r.text
        small = c.post("/completion", json={"prompt": [1, 2, None], "n_predict": 1}).json()
        large = c.post("/completion", json={"prompt": [1, 2, None], "n_predict": 1, "padding": pad}).json()
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
    # errors, also of long lists of ids with an element that is not one (they stand in as [first, that
    # one]): the same errors, with the same indexes and inputs, as when pydantic validates all of it
    mixed = [("/completion", {"prompt": ids + [None]}), ("/completion", {"prompt": ids[:7] + [True] + ids}),
             ("/completion", {"prompt": [ids, ids[:3] + [None] + ids], "n_predict": 1}),
             ("/completion", {"prompt": [ids + [1.5], "a"]}), ("/completion", {"prompt": ids + [[1]], "stop": 5}),
             ("/v1/completions", {"prompt": ids + ["x"], "max_tokens": 1}), ("/detokenize", {"tokens": ids + ["7"]}),
             ("/polykv/pools", {"tokens": ids[:1] + [-1.5] + ids, "label": "x"})]  # (-1.0 is a whole number: an id)
    for path, body in [("/completion", b) for b in ({"prompt": ids, "temperature": "hot"},
                                                    {"prompt": ids[:100] + [None]}, {"prompt": [ids, 5]},
                                                    {"prompt": ids, "n_predict": 1, "stop": ids})] + mixed:
        field = _body_field(path)
        raw = json.dumps(body).encode()
        with pytest.raises(RequestValidationError) as e:
            routing._parse(raw, field)
        _, want = field.validate(json.loads(raw), {}, loc=("body",))
        assert e.value.errors() == want, body
        assert validation_message(e.value.errors()) == validation_message(want), body
    field = _body_field("/completion")
    for body in ({"prompt": ["a"] * 5000 + ["\ud800"]}, {"prompt": "x" * 70_000 + "\udc00"},
                 {"prompt": ids, "stop": ["ok", "bad\ud800"]}, {"\ud800" + "k" * 70_000: 1}):
        raw = json.dumps(body).encode()
        with pytest.raises(RequestValidationError) as e:
            routing._parse(raw, field)
        assert e.value.errors()[0]["msg"].startswith(lone_surrogate_path(json.loads(raw))), body


def test_a_prompt_of_many_ids_is_refused_like_a_short_one(engine):
    from opencoti.engine.api import engine as engine_mod

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


def test_error_answers_to_large_bodies_stay_short(engine):
    """An error names the problem, never echoes the body: a 400 for megabytes of ids is < 1 KB."""
    from opencoti.server.middleware import LARGE_BODY

    n = LARGE_BODY // 3
    ids = [65] * n
    cases = [("/completion", {"prompt": ids, "n_predict": 1}, ["exceeds the context"]),
             ("/completion", {"prompt": ids + [None], "n_predict": 1}, [f"prompt.list[int].{n}:", "(got null)"]),
             ("/completion", {"prompt": ids[:7] + [True] + ids}, ["prompt.list[int].7:", "(got true)"]),
             ("/completion", {"prompt": ["x"] * n + [None]}, [f"prompt.list[str].{n}:", "(got null)"]),
             ("/detokenize", {"tokens": ids + [None]}, [f"tokens.{n}:", "(got null)"]),
             ("/detokenize", {"tokens": ids + [10**6]}, ["token id 1000000 outside the vocabulary"]),
             ("/polykv/pools", {"tokens": ids + ["x"]}, [f"tokens.{n}:"]),
             ("/completion", {"prompt": ids, "response_fields": list(range(n))}, ["response_fields.0:"])]
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        for path, body, words in cases:
            r = c.post(path, json=body)
            assert r.status_code == 400, (path, r.text[:300])
            assert len(r.content) < 1024, (path, len(r.content))
            message = r.json()["error"]["message"]
            assert all(w in message for w in words), message


def test_validation_messages_are_bounded():
    from opencoti.ops.validation import MAX_PROBLEMS, short_repr, validation_message

    text = "x" * 10**6
    errors = [{"type": "int_type", "loc": ("body", "tokens", i), "msg": "Input should be a valid integer",
               "input": text} for i in range(10**5)]
    message = validation_message(errors)
    assert message.count("tokens.") == MAX_PROBLEMS and message.endswith(f"and {10**5 - MAX_PROBLEMS} more problems")
    assert len(message) < 1500
    # short_repr renders only what its cut keeps, and keeps what json.dumps would show
    rng = random.Random(3)
    for _ in range(300):
        value = _random_json(rng)
        full = json.dumps(value)
        assert short_repr(value) == (full if len(full) <= 60 else full[:57] + "..."), value
    assert short_repr(list(range(10**6))) == json.dumps(list(range(40)))[:57] + "..."


def test_large_bodies_are_handled_with_gc_paused():
    import asyncio
    import gc

    from opencoti.server.middleware import LARGE_BODY, BodyLimitMiddleware

    seen = []

    async def app(scope, receive, send):
        while (await receive()).get("more_body"):
            pass
        seen.append(gc.isenabled())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def call(headers, chunks):
        msgs = [{"type": "http.request", "body": c, "more_body": i + 1 < len(chunks)} for i, c in enumerate(chunks)]

        async def receive():
            return msgs.pop(0)

        async def send(msg):
            pass

        await BodyLimitMiddleware(app, limit=1 << 30)({"type": "http", "headers": headers}, receive, send)

    assert gc.isenabled()
    asyncio.run(call([(b"content-length", b"10")], [b"x" * 10]))
    asyncio.run(call([(b"content-length", str(LARGE_BODY).encode())], [b"x" * LARGE_BODY]))
    asyncio.run(call([], [b"x" * (LARGE_BODY // 2)] * 3))  # no Content-Length: paused once it grew large
    assert seen == [True, False, False] and gc.isenabled()


def test_gc_pauses_overlap_and_are_bounded(monkeypatch):
    import gc

    from opencoti.server import gcpause

    with gcpause.paused():
        assert not gc.isenabled()
        with gcpause.paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the first is still in flight
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with gcpause.paused():
            raise RuntimeError("a failed request")
    assert gc.isenabled()
    monkeypatch.setattr(gcpause, "MAX_PAUSE_S", -1.0)  # a pause past its limit is lifted
    gcpause.enter()
    assert not gc.isenabled()
    gcpause.enter()
    assert gc.isenabled()
    gcpause.leave()
    gcpause.leave()
    assert gc.isenabled()
    gc.disable()  # collection the program turned off stays off
    try:
        with gcpause.paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_large_request_leaves_no_long_list_behind(engine):
    """What a large request made is freed by reference counting when it ends (before automatic
    collection resumes): no collection ever walks it."""
    import gc

    from opencoti.server.middleware import LARGE_BODY

    ids = [65] * (LARGE_BODY // 3)
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        assert c.post("/detokenize", json={"tokens": ids}).json()["content"] == "A" * len(ids)
        assert c.post("/completion", json={"prompt": ids, "n_predict": 1}).status_code == 400
        assert c.post("/detokenize", json={"tokens": ids + ["x"]}).status_code == 400
        assert c.post("/tokenize", json={"content": "A" * len(ids)}).json()["tokens"] == ids
        assert gc.isenabled()
        left = [o for o in gc.get_objects() if type(o) is list and len(o) >= len(ids) and o is not ids]
        assert not left, [len(o) for o in left]


def test_a_prompt_longer_than_the_context_is_refused_before_its_ids_are_walked(engine, monkeypatch):
    from opencoti.engine import SamplingParams
    from opencoti.engine.errors import ContextLengthError

    checked: list[int] = []
    real = engine.core.limits.check_tokens
    monkeypatch.setattr(engine.core.limits, "check_tokens", lambda toks, *a: checked.append(len(toks)) or real(toks, *a))
    for prompt in ([65] * (engine.max_context + 1), [65] * engine.max_context + ["x"]):
        with pytest.raises(ContextLengthError):
            engine.generate(prompt, params=SamplingParams(max_tokens=1))
    assert checked == []
    engine.generate([65, 66], params=SamplingParams(max_tokens=1))
    assert checked == [2]
