"""llama.cpp's numeric slot ids: slot N is the session named "N" on every route that takes one
(``id_slot`` on the three generation routes, ``/slots/N``, the ``id`` of ``GET /slots``)."""

from __future__ import annotations

import json

from starlette.testclient import TestClient

from opencoti.server import create_app
from opencoti.server.config import ServerConfig

GREEDY = {"temperature": 0, "ignore_eos": True, "n_predict": 3}
PROMPT = list(range(30, 70))


def error_of(r, status: int = 400) -> str:
    assert r.status_code == status, r.text
    return r.json()["error"]["message"]


def slots_by_session(c, **kw) -> dict:
    return {s["session_id"]: s["id"] for s in c.get("/slots", **kw).json()}


def test_id_slot_names_the_session_of_that_number(make_engine, tmp_path):
    eng = make_engine(state_dir=str(tmp_path / "state"))
    with TestClient(create_app(eng), raise_server_exceptions=False) as c:
        r = c.post("/completion", json={"prompt": PROMPT, "id_slot": 0, **GREEDY})
        assert r.status_code == 200 and r.headers["x-session-id"] == "0", r.text
        first = r.json()
        assert first["id_slot"] == 0 and first["session_id"] == "0"
        # the same slot again: llama.cpp reuses the slot's cache, here the session's
        r = c.post("/completion", json={"prompt": PROMPT + first["tokens"] + [80], "id_slot": 0, "return_tokens": True,
                                        **GREEDY})
        assert r.json()["tokens_cached"] >= len(PROMPT) and r.json()["id_slot"] == 0
        # session_id "0" is the same session as id_slot 0; both given must agree
        assert c.post("/completion", json={"prompt": PROMPT, "id_slot": 0, "session_id": "0", **GREEDY}).status_code == 200
        msg = error_of(c.post("/completion", json={"prompt": PROMPT, "id_slot": 0, "session_id": "chat", **GREEDY}))
        assert "id_slot 0" in msg and "'chat'" in msg
        # the OpenAI routes take id_slot too (llama.cpp reads it on every generation route)
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "id_slot": 1,
                                                  "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-session-id"] == "1", r.text
        r = c.post("/v1/completions", json={"prompt": "hello", "id_slot": 2, "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-session-id"] == "2", r.text
        # -1 is llama.cpp's "any slot": no session is named (an anonymous one serves the request)
        r = c.post("/completion", json={"prompt": PROMPT, "id_slot": -1, **GREEDY})
        assert r.status_code == 200 and r.json()["id_slot"] == -1 and r.headers["x-session-id"] not in ("-1", "0")
        for bad in (-2, "3", True, 1.5):
            assert "id_slot" in error_of(c.post("/completion", json={"prompt": PROMPT, "id_slot": bad, **GREEDY})), bad
        # a stream's events carry the slot too
        with c.stream("POST", "/completion", json={"prompt": PROMPT, "id_slot": 0, "stream": True, **GREEDY}) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
        assert events and all(e["id_slot"] == 0 for e in events if "id_slot" in e) and events[0]["id_slot"] == 0
        # GET /slots: the numbered sessions have their number, other sessions -1
        c.post("/completion", json={"prompt": PROMPT, "session_id": "chat", **GREEDY})
        ids = slots_by_session(c)
        assert ids["0"] == 0 and ids["1"] == 1 and ids["2"] == 2 and ids["chat"] == -1
        assert [v for k, v in ids.items() if k not in ("0", "1", "2")] == [-1] * (len(ids) - 3)
        # /slots/N acts on the session "N": what id_slot N made
        saved = c.post("/slots/0?action=save", json={"filename": "zero.bin"})
        assert saved.status_code == 200, saved.text
        assert saved.json()["id_slot"] == 0 and saved.json()["session_id"] == "0" and saved.json()["n_saved"] > 0
        r = c.post("/slots/7?action=restore", json={"filename": "zero.bin"})  # a new slot: the session "7"
        assert r.status_code == 200 and r.json()["id_slot"] == 7 and r.json()["n_restored"] == saved.json()["n_saved"]
        assert slots_by_session(c)["7"] == 7
        r = c.post("/completion", json={"prompt": PROMPT + [1], "id_slot": 7, **GREEDY})  # continues the restored KV
        assert r.json()["tokens_cached"] >= len(PROMPT), r.text
        assert c.post("/slots/07?action=erase").json() == {"id_slot": 7, "session_id": "7", "n_erased": len(PROMPT) + 1 + 3}
        r = c.post("/slots/chat?action=erase")  # a named session keeps its name as the slot id
        assert r.status_code == 200 and r.json()["id_slot"] == "chat", r.text
        assert "names no session" in error_of(c.post("/slots/-1?action=erase"))
        assert "too large" in error_of(c.post("/slots/" + "9" * 40 + "?action=erase"))
        assert c.post("/slots/8?action=erase").status_code == 404  # no session "8"


def test_slot_numbers_are_per_tenant(make_engine):
    keys = {"sk-alice-0123456789": "alice", "sk-bob-0123456789": "bob"}
    alice, bob = ({"Authorization": f"Bearer sk-{t}-0123456789"} for t in ("alice", "bob"))
    with TestClient(create_app(make_engine(), config=ServerConfig(tenant_keys=keys)),
                    raise_server_exceptions=False) as c:
        a = c.post("/completion", json={"prompt": PROMPT, "id_slot": 0, **GREEDY}, headers=alice)
        b = c.post("/completion", json={"prompt": PROMPT[:5], "id_slot": 0, **GREEDY}, headers=bob)
        assert a.json()["id_slot"] == 0 and b.json()["id_slot"] == 0
        assert a.headers["x-session-id"] == b.headers["x-session-id"] == "0"
        assert slots_by_session(c, headers=alice) == {"0": 0} and slots_by_session(c, headers=bob) == {"0": 0}
        assert [s["ctx_used"] for s in c.get("/slots", headers=bob).json()] == [5 + 3]
