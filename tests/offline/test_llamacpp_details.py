"""llama.cpp details its users script against (issue 50, 6; its own server suite, tools/server/tests/unit):
the ``llamacpp:*`` series in /metrics under llama.cpp's names and types, with values that add up to
the answers' timings; the ``Process-Start-Time-Unix`` header; prompts mixing token ids and texts in
one sequence on /completion; and ``--no-metrics``, whose help says what the route answers (501)."""

from __future__ import annotations

import argparse
import time

import pytest
from starlette.testclient import TestClient

from opencoti.server import ServerConfig, create_app

# tools/server/tests/unit/test_metrics.py: every name with its type
COUNTERS = ["prompt_tokens_total", "prompt_tokens_cached_total", "prompt_seconds_total", "tokens_predicted_total",
            "tokens_predicted_seconds_total", "n_decode_total", "n_tokens_max",
            "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
            "spec_decode_num_drafts_total"]
GAUGES = ["prompt_tokens_seconds", "predicted_tokens_seconds", "requests_processing", "requests_deferred",
          "n_busy_slots_per_decode", "kv_cache_usage_ratio", "kv_cache_tokens"]


@pytest.fixture
def client(engine):
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        yield c


def parse_metrics(text: str) -> dict:
    """{name: (type, value)} of the llamacpp:* samples, as llama.cpp's test reads them."""
    out, types = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line.startswith("llamacpp:") and "{" not in line:
            name, value = line.split(" ", 1)
            assert name in types, f"{name} has no # TYPE line"
            out[name] = (types[name], float(value))
    return out


def fetch(client) -> tuple[dict, str]:
    r = client.get("/metrics")
    assert r.status_code == 200, r.text
    return parse_metrics(r.text), r


def test_llamacpp_series_names_types_and_values(client):
    t0 = int(time.time())
    prompt = "the quick brown fox jumps over the lazy dog"
    processed = cached = predicted = 0
    for n_predict in (4, 4, 1):  # the second reuses the first's prompt
        r = client.post("/completion", json={"prompt": prompt, "n_predict": n_predict})
        assert r.status_code == 200, r.text
        t = r.json()["timings"]
        processed, cached, predicted = processed + t["prompt_n"], cached + t["cache_n"], predicted + t["predicted_n"]
    metrics, r = fetch(client)
    for name in COUNTERS:
        assert metrics["llamacpp:" + name][0] == "counter", name
    for name in GAUGES:
        assert metrics["llamacpp:" + name][0] == "gauge", name
    for name in COUNTERS + GAUGES:
        assert f"# HELP llamacpp:{name} " in r.text
    assert cached > 0
    assert metrics["llamacpp:prompt_tokens_total"][1] == processed
    assert metrics["llamacpp:prompt_tokens_cached_total"][1] == cached
    assert metrics["llamacpp:tokens_predicted_total"][1] == predicted
    assert metrics["llamacpp:n_decode_total"][1] > 0 and metrics["llamacpp:requests_processing"][1] == 0
    assert metrics["llamacpp:n_tokens_max"][1] >= len(prompt) // 8
    assert metrics["llamacpp:prompt_seconds_total"][1] > 0 and metrics["llamacpp:prompt_tokens_seconds"][1] > 0
    assert metrics["llamacpp:n_busy_slots_per_decode"][1] >= 1
    assert 0 <= metrics["llamacpp:kv_cache_usage_ratio"][1] <= 1
    # the header llama.cpp's suite checks: the server's start, Unix seconds
    start = int(r.headers["Process-Start-Time-Unix"])
    assert t0 - 600 <= start <= time.time()
    # the throughput gauges are over the window since the previous scrape; the counters stay
    again, _ = fetch(client)
    assert again["llamacpp:prompt_tokens_seconds"][1] == 0 and again["llamacpp:predicted_tokens_seconds"][1] == 0
    assert again["llamacpp:prompt_tokens_total"][1] == processed
    # a chat completion with n choices counts each choice's tokens
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "n": 2,
                                                  "max_tokens": 3})
    assert r.status_code == 200, r.text
    after, _ = fetch(client)
    n_out = r.json()["usage"]["completion_tokens"]
    assert after["llamacpp:tokens_predicted_total"][1] == predicted + n_out


def test_no_metrics_help_and_docs_say_501(engine):
    from pathlib import Path

    from opencoti.server.serve import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    help_text = " ".join(p.format_help().split())
    said = help_text[help_text.index("--no-metrics no GET"):][:200]  # its entry (not the usage line)
    assert "501" in said and "404" not in said, said
    docs = (Path(__file__).resolve().parents[2] / "docs" / "http-api.md").read_text()
    row = next(line for line in docs.splitlines() if line.startswith("| `--no-metrics`"))
    assert "501" in row
    with TestClient(create_app(engine, config=ServerConfig(metrics=False)), raise_server_exceptions=False) as c:
        assert c.get("/metrics").status_code == 501  # what the code answers


# ============================================================================ mixed prompts
def test_a_prompt_mixing_token_ids_and_texts_is_one_prompt(client, engine):
    a, b = engine.tokenize("Hello"), engine.tokenize(" world")
    mixed = [*a, " there,", *b]
    r = client.post("/completion", json={"prompt": mixed, "n_predict": 2, "return_tokens": True})
    assert r.status_code == 200, r.text
    want = a + engine.tokenize(" there,") + b
    assert r.json()["tokens_evaluated"] == len(want)
    r2 = client.post("/completion", json={"prompt": want, "n_predict": 2, "temperature": 0})  # the same as ids alone
    r1 = client.post("/completion", json={"prompt": mixed, "n_predict": 2, "temperature": 0})
    assert r2.status_code == 200 and r2.json()["tokens_evaluated"] == len(want)
    assert r1.json()["content"] == r2.json()["content"]
    # a text first, and a list of prompts one of which is mixed: one result each
    r = client.post("/completion", json={"prompt": ["Hi", [" there", *b]], "n_predict": 1})
    assert r.status_code == 200, r.text
    results = r.json()
    assert [x["index"] for x in results] == [0, 1]
    assert results[1]["tokens_evaluated"] == len(engine.tokenize(" there") + b)
    r = client.post("/completion", json={"prompt": ["Hi", 5], "n_predict": 1})  # a text first, then an id
    assert r.status_code == 200 and r.json()["tokens_evaluated"] == len(engine.tokenize("Hi")) + 1, r.text
    # a bad id in a mixed prompt is refused like any other
    r = client.post("/completion", json={"prompt": ["Hi", 10 ** 9], "n_predict": 1})
    assert r.status_code == 400, r.text
