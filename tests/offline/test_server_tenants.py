"""Several API keys, each a tenant (``--api-keys-file``), over HTTP in-process: pools and sessions
are private (404 for everyone else), listings show only one's own, one key behaves as before."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from opencoti.server import create_app
from opencoti.server.config import ServerConfig
from opencoti.server.tenants import KeysFileError, load_keys_file

KEYS = {"sk-alice-0123456789": "alice", "sk-alice-rotated-42": "alice", "sk-bob-0123456789": "bob"}
A = {"Authorization": "Bearer sk-alice-0123456789"}
A2 = {"X-Api-Key": "sk-alice-rotated-42"}
B = {"Authorization": "Bearer sk-bob-0123456789"}
GREEDY = {"temperature": 0, "ignore_eos": True, "n_predict": 2}
SYS = list(range(20, 52))


@pytest.fixture
def client(engine):
    with TestClient(create_app(engine, config=ServerConfig(tenant_keys=KEYS)), raise_server_exceptions=False) as c:
        yield c


def ok(r) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def not_found(r, what: str) -> None:
    assert r.status_code == 404, r.text
    e = r.json()["error"]
    assert e["code"] == 404 and e["type"] == "not_found_error" and what in e["message"], e


def test_keys_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# tenants\n\nalice sk-alice-0123456789\nalice  sk-alice-rotated-42\n bob\tsk-bob-0123456789 \n")
    assert load_keys_file(f) == KEYS
    for text, match in (("alice\n", "expected '<tenant> <key>'"), ("al ice k-0123456789\n", "expected"),
                        ("al/ice sk-0123456789\n", "tenant name"), ("alice short\n", "8-512 printable"),
                        ("a sk-0123456789\nb sk-0123456789\n", "already the key of tenant 'a'"), ("# none\n", "no keys")):
        f.write_text(text)
        with pytest.raises(KeysFileError, match=match):
            load_keys_file(f)
    with pytest.raises(KeysFileError, match="cannot read"):
        load_keys_file(tmp_path / "missing")


def test_authentication(client):
    assert client.get("/health").status_code == 200
    r = client.get("/polykv/pools")
    assert r.status_code == 401 and "missing API key" in r.json()["error"]["message"]
    assert client.get("/polykv/pools", headers={"Authorization": "Bearer sk-mallory-0000"}).status_code == 401
    assert client.get("/polykv/pools", headers=A2).status_code == 200  # a tenant's second key


def test_pools_are_private(client):
    pid = ok(client.post("/polykv/pools", json={"tokens": SYS, "label": "alice"}, headers=A))["pool_id"]
    child = ok(client.post(f"/polykv/pools/{pid}/fork", json={"tokens": SYS + [5, 6]}, headers=A2))["pool_id"]
    bob_pool = ok(client.post("/polykv/pools", json={"tokens": SYS}, headers=B))["pool_id"]
    assert [p["pool_id"] for p in ok(client.get("/polykv/pools", headers=A))["pools"]] == [pid, child]
    assert [p["pool_id"] for p in ok(client.get("/polykv/pools", headers=B))["pools"]] == [bob_pool]
    for method, path, body in (("GET", f"/polykv/pools/{pid}", None), ("DELETE", f"/polykv/pools/{child}", None),
                               ("POST", f"/polykv/pools/{pid}/fork", {"tokens": SYS + [1]}),
                               ("POST", f"/polykv/pools/{pid}/pin", None), ("POST", f"/polykv/pools/{pid}/unpin", None),
                               ("POST", f"/polykv/pools/{pid}/evict", None), ("POST", f"/polykv/pools/{pid}/flush", None),
                               ("GET", f"/polykv/pools/{pid}/admission", None),
                               ("POST", f"/polykv/pools/{pid}/admission", {"target_tps_per_session": 1.0}),
                               ("GET", f"/polykv/pools/{pid}/capacity", None),
                               ("POST", "/completion", {"prompt": SYS + [9], "pool_id": pid, **GREEDY}),
                               ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                                 "pool_id": pid, "max_tokens": 2})):
        target = child if path == f"/polykv/pools/{child}" else pid
        not_found(client.request(method, path, json=body, headers=B), f"pool {target} not found")
    not_found(client.get("/polykv/pools/424242", headers=B), "pool 424242 not found")  # the same answer
    assert ok(client.get(f"/polykv/pools/{pid}", headers=A))["children"] == [child]
    assert ok(client.get("/polykv/integrity", headers=B))["ok"]


def test_sessions_are_per_tenant(client):
    pid = ok(client.post("/polykv/pools", json={"tokens": SYS}, headers=A))["pool_id"]
    ra = client.post("/completion", json={"prompt": SYS + [7, 8], "pool_id": pid, "session_id": "agent", **GREEDY},
                     headers=A)
    rb = client.post("/completion", json={"prompt": [5, 6, 7], "session_id": "agent", **GREEDY}, headers=B)
    assert ra.headers["x-session-id"] == rb.headers["x-session-id"] == "agent"
    assert ok(ra)["session_id"] == "agent" and ok(rb)["tokens_cached"] == 0
    assert [s["session_id"] for s in ok(client.get("/slots", headers=A))] == ["agent"]
    assert [s["pool_id"] for s in ok(client.get("/slots", headers=B))] == [None]
    assert [s["session_id"] for s in ok(client.get("/polykv/tps?once=1", headers=B))["sessions"]] == ["agent"]
    assert set(ok(client.get("/polykv/tps/history", headers=B))["sessions"]) <= {"agent"}
    assert ok(client.get("/polykv/pools", headers=A))["pools"][0]["sessions"][0]["session_id"] == "agent"
    ok(client.delete("/polykv/sessions/agent", headers=B))  # bob's agent only
    not_found(client.delete("/polykv/sessions/agent", headers=B), "session 'agent' not found")
    assert [s["session_id"] for s in ok(client.get("/slots", headers=A))] == ["agent"]
    r = client.post("/polykv/pools", json={"from_session": "agent"}, headers=B)
    not_found(r, "session 'agent' not found")
    assert "alice" not in r.text
    ev = client.post(f"/polykv/pools/{pid}/admission", json={"target_tps_per_session": 1.0}, headers=A)
    ok(ev)
    assert {e["pool_id"] for e in ok(client.get("/polykv/events", headers=A))["events"]} == {pid}
    assert ok(client.get("/polykv/events", headers=B))["events"] == []


def test_one_key_and_tenants_do_not_mix(engine):
    with pytest.raises(ValueError, match="api_key"):
        create_app(engine, config=ServerConfig(api_key="k" * 12, tenant_keys=KEYS))


def test_automatic_prefix_reuse_never_crosses_tenants(client):
    req = {"prompt": list(range(60, 110)), **GREEDY}
    assert ok(client.post("/completion", json=req, headers=A))["tokens_cached"] == 0
    assert ok(client.post("/completion", json=req, headers=B))["tokens_cached"] == 0  # not alice's cache
    assert ok(client.post("/completion", json={**req, "cache_salt": "x"}, headers=A))["tokens_cached"] == 0
    assert ok(client.post("/completion", json=req, headers=A2))["tokens_cached"] > 0  # alice's, by her other key
    r = client.post("/completion", json=req, headers=A)
    assert ok(r)["tokens_cached"] > 0 and r.headers["x-session-id"].startswith("s-")
    assert [s["session_id"] for s in ok(client.get("/slots", headers=B))] != []  # bob sees his anonymous one ...
    assert all(s["session_id"] not in {r.headers["x-session-id"]} for s in ok(client.get("/slots", headers=B)))
