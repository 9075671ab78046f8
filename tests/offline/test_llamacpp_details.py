"""llama.cpp details its users script against (issue 50, 6; its own server suite, tools/server/tests/unit):
the ``llamacpp:*`` series in /metrics under llama.cpp's names and types, with values that add up to
the answers' timings; the ``Process-Start-Time-Unix`` header; prompts mixing token ids and texts in
one sequence on /completion; and ``--no-metrics``, whose help says what the route answers (501)."""

from __future__ import annotations

import argparse
import json
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


# ============================================================================ return_progress
def _sse(text: str) -> list:
    return [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: ") and line != "data: [DONE]"]


def _check_progress(progress: list[dict], batch: int, alone: bool = True) -> None:
    """llama.cpp's shape (tools/server/tests/unit/test_chat_completion.py::test_return_progress): the first
    event before any prompt token is computed (processed == cache), then one per computed chunk of at most
    ``batch`` tokens (all of it for a request computed ``alone``), processed rising to the total; total
    and cache the same throughout."""
    total, cache = progress[0]["total"], progress[0]["cache"]
    assert total > 0 and progress[0]["processed"] == cache
    chunks = len(progress) - 1
    assert chunks == -(-(total - cache) // batch) if alone else chunks >= -(-(total - cache) // batch), progress
    done = [p["processed"] for p in progress]
    assert done == sorted(set(done)) and done[-1] == total
    assert all(b - a <= batch for a, b in zip(done, done[1:]))
    assert all(p["total"] == total and p["cache"] == cache for p in progress)


def test_return_progress_reports_each_prompt_chunk(client, engine):
    """An event per chunk of the prompt the engine computes (its batch: 64 tokens here), before the first
    token; before this, only the first and the last were sent, whatever the prompt's length."""
    ids = engine.tokenize("the quick brown fox jumps over the lazy dog " * 4)  # byte-level: > 2 batches
    assert len(ids) > 2 * 64
    events = _sse(client.post("/completion", json={"prompt": ids, "n_predict": 3, "stream": True,
                                                  "return_progress": True, "timings_per_token": True}).text)
    progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    _check_progress(progress, 64)
    first_token = next(i for i, e in enumerate(events) if e.get("tokens"))
    assert all("prompt_progress" in e for e in events[:first_token])  # every chunk's event comes before it
    timings = [e["timings"] for e in events if "prompt_progress" in e]
    assert timings[0]["prompt_n"] == 0 and timings[0]["prompt_ms"] == 0  # (test_metrics.py's checks)
    assert all(b["prompt_ms"] >= a["prompt_ms"] for a, b in zip(timings, timings[1:])) and timings[-1]["prompt_ms"] > 0
    # sent again: all but the last token from the cache, so one chunk of 1 token
    again = [e["prompt_progress"] for e in _sse(client.post("/completion", json={
        "prompt": ids, "n_predict": 1, "stream": True, "return_progress": True}).text) if "prompt_progress" in e]
    assert again[0]["cache"] == len(ids) - 1
    _check_progress(again, 64)
    # chat: chunks with no choices; the Responses API: response.in_progress events
    chat = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "This is a test " * 12}], "max_tokens": 2, "stream": True,
        "return_progress": True})
    chunks = [e for e in _sse(chat.text) if "prompt_progress" in e]
    assert all(e["choices"] == [] for e in chunks)
    _check_progress([e["prompt_progress"] for e in chunks], 64)
    resp = client.post("/v1/responses", json={"input": "Another test " * 14, "max_output_tokens": 2, "stream": True,
                                              "return_progress": True})
    in_progress = [e for e in _sse(resp.text) if "prompt_progress" in e]
    assert all(e["type"] == "response.in_progress" for e in in_progress)
    _check_progress([e["prompt_progress"] for e in in_progress], 64)
    assert len(in_progress) > 2


def test_return_progress_only_when_asked_and_streamed(client, engine):
    ids = engine.tokenize("x y z " * 30)
    plain = _sse(client.post("/completion", json={"prompt": ids, "n_predict": 2, "stream": True}).text)
    assert not any("prompt_progress" in e for e in plain) and len(plain) == 3  # 2 tokens, the final event
    whole = client.post("/completion", json={"prompt": ids, "n_predict": 2, "return_progress": True})
    assert whole.status_code == 200 and "prompt_progress" not in whole.json()  # not streamed: nothing to report
    # several prompts in one request: each prompt's events carry its index, each rises to its own total
    events = _sse(client.post("/completion", json={"prompt": ["a b c " * 30, "d e " * 50], "n_predict": 1,
                                                  "stream": True, "return_progress": True}).text)
    for i in (0, 1):
        _check_progress([e["prompt_progress"] for e in events if e["index"] == i and "prompt_progress" in e], 64,
                        alone=False)  # the two share each step's batch
    # a bad value is a 400, as any other field's
    r = client.post("/completion", json={"prompt": "x", "stream": True, "return_progress": "sometimes"})
    assert r.status_code == 400, r.text


# ============================================================================ prompt + n_predict > context
def test_completion_past_the_context_stops_there_as_llamacpp(client, engine):
    """llama.cpp's /completion takes a prompt that fits the context whatever n_predict asks for and stops
    when the context is full (truncated, stop_type limit); before, opencoti refused it with a 400."""
    n_ctx = engine.max_context
    ids = (engine.tokenize("the quick brown fox ") * n_ctx)[:n_ctx - 5]
    body = {"prompt": ids, "n_predict": 50, "ignore_eos": True, "temperature": 0}
    r = client.post("/completion", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["truncated"] is True and out["stop_type"] == "limit"
    assert out["tokens_predicted"] == out["timings"]["predicted_n"] == 5  # to the last position of the context
    assert out["generation_settings"]["n_predict"] == 50  # what was asked for
    events = _sse(client.post("/completion", json={**body, "stream": True}).text)
    assert events[-1]["stop"] and events[-1]["truncated"] is True and events[-1]["tokens_predicted"] == 5
    # a limit that fits is kept (and stops there, not truncated); a prompt longer than the context is refused
    fits = client.post("/completion", json={**body, "n_predict": 3}).json()
    assert fits["tokens_predicted"] == 3 and fits["truncated"] is False
    r = client.post("/completion", json={"prompt": ids + ids[:10], "n_predict": 1})
    assert r.status_code == 400 and r.json()["error"]["type"] == "exceed_context_size_error"


def test_openai_routes_keep_refusing_an_explicit_max_tokens_past_the_context(engine):
    """OpenAI's APIs refuse a max_tokens that does not fit (context_length_exceeded) and give a request
    without one the rest of the context: the server's --n-predict default never refuses it; Anthropic's
    max_tokens is always explicit, so refused."""
    n_ctx = engine.max_context
    ids = (engine.tokenize("the quick brown fox ") * n_ctx)[:n_ctx - 5]
    with TestClient(create_app(engine, config=ServerConfig(default_max_tokens=64)),
                    raise_server_exceptions=False) as c:
        r = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 50})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = c.post("/v1/completions", json={"prompt": ids, "ignore_eos": True})  # the default (64) does not fit
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 5
        fits = c.post("/v1/completions", json={"prompt": ids[:20], "ignore_eos": True}).json()  # the default fits
        assert fits["usage"]["completion_tokens"] == 64
        text = "the quick brown fox " * (n_ctx // 20)
        msgs = [{"role": "user", "content": text[:n_ctx - 60]}]
        n = len(c.post("/apply-template", json={"messages": msgs}).json()["prompt"])  # byte-level tokens
        assert n + 64 > n_ctx >= n, n
        r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 64})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = c.post("/v1/chat/completions", json={"messages": msgs, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
        r = c.post("/v1/messages", json={"messages": msgs, "max_tokens": 64})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert r.json()["error"]["message"].startswith("prompt is too long")


# ============================================================================ short prompts sent again
# A prompt shorter than a KV page plus one token (9 tokens at the served page size of 16) sent twice reused
# nothing (cache_n 0; 23 tokens reused 22). Why: PrefixCache.auto_start (engine/polykv/prefix.py) looks the
# prompt up in the prefix index only when it has a full page's key (``if job.prompt_keys``); the index does
# keep a finished request's partial page as a *tail* under the root (KVTables.cache_tail) and
# PrefixIndex.match finds it, so the lookup was skipped, not impossible. The fix was that guard
# (``if self.tables.index is not None``).
@pytest.mark.parametrize("n", [2, 9, 16])
def test_a_short_prompt_sent_again_reuses_all_but_its_last_token(make_engine, n):
    engine = make_engine(page_size=16)  # the served page size
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        ids = engine.tokenize("the quick brown fox jumps over the lazy dog")[:n]
        first = c.post("/completion", json={"prompt": ids, "n_predict": 2}).json()
        again = c.post("/completion", json={"prompt": ids, "n_predict": 2}).json()
        assert first["timings"]["cache_n"] == 0
        assert again["timings"]["cache_n"] == again["tokens_cached"] == n - 1  # llama.cpp's: all but the last
        assert again["timings"]["prompt_n"] == 1
