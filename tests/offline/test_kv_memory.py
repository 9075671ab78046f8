"""Issue 49 (6): the KV cache's memory is visible. On CPU its pages are committed as they are first
written, so the process grows toward the budget while the prefix cache fills pages and stays there;
/props (opencoti.polykv.kv_memory), engine stats and /metrics show reserved (the cap), resident and
used KV bytes."""

from __future__ import annotations

from starlette.testclient import TestClient

from opencoti.engine import SamplingParams
from opencoti.server import create_app


def test_resident_kv_bytes_grow_as_pages_are_first_written_and_stay(make_engine):
    eng = make_engine(kv_budget_tokens=1024)  # 256 pages of 4 tokens
    kv = eng.kv
    mem = eng.stats()["kv_memory"]
    assert mem == {"reserved_bytes": 256 * kv.page_bytes, "resident_bytes": 0, "used_bytes": 0,
                   "touched_pages": 0, "allocation": "on_demand"}
    for seed in range(4):  # different prompts: the prefix cache keeps their pages after each request
        eng.generate([100 + seed] * 40, params=SamplingParams.greedy(4))
    mem = eng.stats()["kv_memory"]
    assert 0 < mem["resident_bytes"] == mem["touched_pages"] * kv.page_bytes <= mem["reserved_bytes"]
    assert mem["used_bytes"] <= mem["resident_bytes"]
    grown = mem["resident_bytes"]
    big = eng.create_pool(tokens=[7] * 400)  # takes pages never written before: resident grows with it
    assert eng.stats()["kv_memory"]["resident_bytes"] > grown
    eng.release_pool(big.pool_id, immediate=True)
    assert eng.stats()["kv_memory"]["resident_bytes"] > grown  # freed pages stay resident (the OS keeps them)


def test_props_and_metrics_show_reserved_resident_and_used_kv_bytes(make_engine):
    eng = make_engine(kv_budget_tokens=1024)
    with TestClient(create_app(eng), raise_server_exceptions=False) as client:
        r = client.post("/completion", json={"prompt": "hello there", "n_predict": 3, "temperature": 0})
        assert r.status_code == 200
        mem = client.get("/props").json()["opencoti"]["polykv"]["kv_memory"]
        assert mem["reserved_bytes"] == eng.kv.num_pages * eng.kv.page_bytes
        assert 0 < mem["resident_bytes"] <= mem["reserved_bytes"] and mem["allocation"] == "on_demand"
        text = client.get("/metrics").text
        values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                  if line.startswith("opencoti:kv_cache_bytes_")}
        assert values["opencoti:kv_cache_bytes_reserved"] == mem["reserved_bytes"]
        assert 0 < values["opencoti:kv_cache_bytes_resident"] <= mem["reserved_bytes"]
        assert "opencoti:kv_cache_bytes_used" in values
