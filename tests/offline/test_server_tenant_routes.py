"""Every route of the API, called by a tenant (``--api-keys-file``): each answers as it does without
tenants (never a 500 from the tenant's view of the engine). The routes in the table below get a
request that succeeds; any other route of the OpenAPI document (a new one) gets an empty request
and must not answer a 5xx either."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from opencoti.server import create_app
from opencoti.server.config import ServerConfig

KEYS = {"sk-alice-0123456789": "alice", "sk-bob-0123456789": "bob"}
A = {"Authorization": "Bearer sk-alice-0123456789"}
SYS = list(range(20, 52))
CHAT = [{"role": "user", "content": "hi"}]
TINY = {"temperature": 0, "max_tokens": 2}

# (method, OpenAPI path, concrete path, JSON body, query): {pool} is alice's pool, {child} its fork
CALLS = [
    ("GET", "/health", "/health", None, None),
    ("GET", "/v1/models", "/v1/models", None, None),
    ("GET", "/props", "/props", None, None),
    ("GET", "/slots", "/slots", None, None),
    ("POST", "/tokenize", "/tokenize", {"content": "hello", "with_pieces": True}, None),
    ("POST", "/detokenize", "/detokenize", {"tokens": [20, 21]}, None),
    ("POST", "/apply-template", "/apply-template", {"messages": CHAT}, None),
    ("GET", "/polykv/pools", "/polykv/pools", None, None),
    ("POST", "/polykv/pools", "/polykv/pools", {"messages": CHAT, "label": "chat"}, None),
    ("GET", "/polykv/pools/{pool_id}", "/polykv/pools/{pool}", None, None),
    ("POST", "/polykv/pools/{pool_id}/fork", "/polykv/pools/{pool}/fork", {"tokens": SYS + [7]}, None),
    ("POST", "/polykv/pools/{pool_id}/pin", "/polykv/pools/{pool}/pin", None, None),
    ("POST", "/polykv/pools/{pool_id}/unpin", "/polykv/pools/{pool}/unpin", None, None),
    ("GET", "/polykv/pools/{pool_id}/admission", "/polykv/pools/{pool}/admission", None, None),
    ("POST", "/polykv/pools/{pool_id}/admission", "/polykv/pools/{pool}/admission",
     {"target_tps_per_session": 1.0}, None),
    ("GET", "/polykv/pools/{pool_id}/capacity", "/polykv/pools/{pool}/capacity", None, {"expected_tokens": 8}),
    ("GET", "/polykv/events", "/polykv/events", None, None),
    ("POST", "/completion", "/completion", {"prompt": SYS + [9], "pool_id": "{pool}", "session_id": "agent",
                                            "n_predict": 2, "temperature": 0}, None),
    ("POST", "/v1/completions", "/v1/completions", {"prompt": "hello", **TINY}, None),
    ("POST", "/v1/chat/completions", "/v1/chat/completions", {"messages": CHAT, **TINY}, None),
    ("POST", "/infill", "/infill", {"input_prefix": "def f(", "input_suffix": "):", "n_predict": 2}, None),
    ("POST", "/slots/{slot_id}", "/slots/agent", {"filename": "agent.bin"}, {"action": "save"}),
    ("GET", "/polykv/tps", "/polykv/tps", None, {"once": 1}),
    ("GET", "/polykv/tps/history", "/polykv/tps/history", None, None),
    ("POST", "/polykv/sessions/{session_id}/compact", "/polykv/sessions/agent/compact",
     {"ancestor_pool_id": "{pool}", "tokens": SYS + [9]}, None),
    ("DELETE", "/polykv/sessions/{session_id}", "/polykv/sessions/agent", None, None),
    ("POST", "/polykv/pools/{pool_id}/flush", "/polykv/pools/{pool}/flush", None, None),
    ("POST", "/polykv/pools/{pool_id}/evict", "/polykv/pools/{child}/evict", None, None),
    ("DELETE", "/polykv/pools/{pool_id}", "/polykv/pools/{child}", None, {"immediate": True}),
    ("GET", "/polykv/integrity", "/polykv/integrity", None, None),
    ("GET", "/metrics", "/metrics", None, None),  # a tenant's key: refused (403), never a 500
]


def _fill(value, ids: dict):
    if isinstance(value, str) and value in ("{pool}", "{child}"):
        return ids[value.strip("{}")]
    if isinstance(value, str):
        return value.format(**ids)
    if isinstance(value, dict):
        return {k: _fill(v, ids) for k, v in value.items()}
    return value


@pytest.fixture
def client(make_engine, tmp_path):
    engine = make_engine(state_dir=str(tmp_path / "state"))
    app = create_app(engine, config=ServerConfig(tenant_keys=KEYS))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def test_the_table_names_routes_that_exist(client):
    doc = client.get("/openapi.json", headers=A).json()
    routes = {(m.upper(), p) for p, item in doc["paths"].items() for m in item}
    assert {(m, p) for m, p, *_ in CALLS} <= routes


def test_routes_outside_the_table_answer_a_tenant_without_a_server_error(client):
    doc = client.get("/openapi.json", headers=A).json()
    known = {(m, p) for m, p, *_ in CALLS}
    for path, item in doc["paths"].items():
        for method in item:
            if (method.upper(), path) in known:
                continue
            concrete = path.replace("{", "").replace("}", "")  # {response_id} -> response_id: an unknown id
            r = client.request(method.upper(), concrete, json={} if method in ("post", "put", "patch") else None,
                               headers=A)
            assert r.status_code < 500, (method, path, r.status_code, r.text[:300])


def test_every_route_answers_a_tenant(client):
    pool = client.post("/polykv/pools", json={"tokens": SYS}, headers=A)
    assert pool.status_code == 200, pool.text
    ids = {"pool": pool.json()["pool_id"]}
    for method, _, path, body, query in CALLS:
        if path == "/polykv/pools/{child}/evict":  # the fork made above
            ids["child"] = max(p["pool_id"] for p in client.get("/polykv/pools", headers=A).json()["pools"])
        r = client.request(method, _fill(path, ids), json=_fill(body, ids), params=query, headers=A)
        want = {"/metrics": 403, "/infill": 501}.get(path, 200)  # the tiny model has no FIM tokens
        assert r.status_code == want, (method, path, r.status_code, r.text[:300])
    props = client.get("/props", headers=A).json()
    assert props["opencoti"]["polykv"]["max_pools"] > 0 and props["model_path"]
    # the connection is still usable after every call (a 500 used to reset it)
    assert client.get("/props", headers=A).status_code == 200


def test_metrics_are_the_operators_under_tenants(engine):
    op = {"Authorization": "Bearer sk-metrics-0123456789"}
    app = create_app(engine, config=ServerConfig(tenant_keys=KEYS, metrics_key="sk-metrics-0123456789"))
    with TestClient(app, raise_server_exceptions=False) as c:
        pid = c.post("/polykv/pools", json={"tokens": SYS}, headers=A).json()["pool_id"]
        for headers in (A, {"X-Api-Key": "sk-bob-0123456789"}):  # a tenant sees no one's series
            r = c.get("/metrics", headers=headers)
            assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", r.text
            assert f'pool="{pid}"' not in r.text
        assert c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers={"Authorization": "Bearer sk-wrong-0123456789"}).status_code == 401
        r = c.get("/metrics", headers=op)
        assert r.status_code == 200 and f'opencoti_polykv:pool_kv_bytes{{pool="{pid}"}}' in r.text
        assert c.get("/polykv/pools", headers=op).status_code == 401  # the metrics key opens /metrics only
        assert "403" in c.get("/openapi.json", headers=A).json()["paths"]["/metrics"]["get"]["responses"]
    with pytest.raises(ValueError, match="metrics_key"):
        create_app(engine, config=ServerConfig(tenant_keys=KEYS, metrics_key="sk-bob-0123456789"))


def test_metrics_key_beside_one_api_key(engine):
    app = create_app(engine, config=ServerConfig(api_key="sk-api-0123456789", metrics_key="sk-metrics-0123456789"))
    with TestClient(app, raise_server_exceptions=False) as c:
        for key in ("sk-api-0123456789", "sk-metrics-0123456789"):
            assert c.get("/metrics", headers={"X-Api-Key": key}).status_code == 200
        assert c.get("/props", headers={"X-Api-Key": "sk-metrics-0123456789"}).status_code == 401
