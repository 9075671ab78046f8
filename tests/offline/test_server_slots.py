"""POST /slots/{id}?action=save|restore|erase over HTTP in-process: 501 without a state directory, and a
tenant's slots are its own sessions."""

from __future__ import annotations

from starlette.testclient import TestClient

from opencoti.server import create_app
from opencoti.server.config import ServerConfig

GREEDY = {"temperature": 0, "ignore_eos": True, "n_predict": 3}
PROMPT = list(range(30, 70))


def test_slots_need_a_state_dir_and_stay_within_a_tenant(make_engine, tmp_path):
    plain = make_engine()
    with TestClient(create_app(plain), raise_server_exceptions=False) as c:
        c.post("/completion", json={"prompt": PROMPT, "session_id": "a", **GREEDY})
        r = c.post("/slots/a?action=save", json={"filename": "a.bin"})
        assert r.status_code == 501 and "--state-dir" in r.json()["error"]["message"]
    eng = make_engine(state_dir=str(tmp_path / "state"))
    keys = {"sk-alice-0123456789": "alice", "sk-bob-0123456789": "bob"}
    alice, bob = ({"Authorization": f"Bearer sk-{t}-0123456789"} for t in ("alice", "bob"))
    with TestClient(create_app(eng, config=ServerConfig(tenant_keys=keys)), raise_server_exceptions=False) as c:
        c.post("/completion", json={"prompt": PROMPT, "session_id": "a", **GREEDY}, headers=alice)
        assert c.post("/slots/a?action=save", json={"filename": "a.bin"}, headers=bob).status_code == 404
        assert c.post("/slots/a?action=erase", headers=bob).status_code == 404
        r = c.post("/slots/a?action=save", json={"filename": "a.bin"}, headers=alice)
        assert r.status_code == 200 and r.json()["n_saved"] == len(PROMPT) + 2, r.text
        r = c.post("/slots/a?action=restore", json={"filename": "a.bin"}, headers=bob)  # alice's file names ...
        assert r.status_code == 400 and "no slot file" in r.json()["error"]["message"], r.text  # ... are hers
        assert c.get("/slots", headers=bob).json() == []
        r = c.post("/slots/b?action=restore", json={"filename": "a.bin"}, headers=alice)
        assert r.status_code == 200 and r.json()["n_restored"] == len(PROMPT) + 2, r.text
        assert sorted(s["session_id"] for s in c.get("/slots", headers=alice).json()) == ["a", "b"]
