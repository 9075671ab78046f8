"""Automatic prefix reuse over HTTP with the OpenAI SDK: a conversation that names no pool and no
session computes only each turn's new tokens (the server's ASGI app in-process, no sockets)."""

from __future__ import annotations

import openai
import pytest
from starlette.testclient import TestClient

from opencoti.server import create_app

# the byte-level test tokenizer: lowercase letters only, so the answer text re-encodes to the same ids
LETTERS = {str(b): 100 for b in range(ord("a"), ord("z") + 1)}


def sdk(engine) -> tuple[openai.OpenAI, TestClient]:
    http = TestClient(create_app(engine), raise_server_exceptions=False)
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http), http


def converse(client: openai.OpenAI, turns: int) -> list:
    messages = [{"role": "system", "content": "You answer in lowercase letters. " * 2}]
    out = []
    for i in range(turns):
        messages.append({"role": "user", "content": f"turn {i}: and what about {i * 7}?"})
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                           logit_bias=LETTERS)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        out.append(r)
    return out


@pytest.mark.parametrize("page_size", [4, 16])
def test_six_turns_over_the_openai_sdk_compute_only_new_tokens(make_engine, page_size):
    eng = make_engine(page_size=page_size, kv_budget_tokens=8192)
    client, http = sdk(eng)
    with http:
        turns = converse(client, 6)
    prev_total = None
    for i, r in enumerate(turns):
        u = r.usage
        cached = u.prompt_tokens_details.cached_tokens
        computed = u.prompt_tokens - cached
        assert r.model_extra["timings"]["cache_n"] == cached and r.model_extra["timings"]["prompt_n"] == computed
        if i:
            new = u.prompt_tokens - prev_total  # tokens neither in the last prompt nor in its answer
            assert computed == new + 1, (i, computed, new)  # + the last answer token (its KV never computed)
        prev_total = u.prompt_tokens + u.completion_tokens
    # the same conversation with the prefix cache off: the same answers, everything recomputed
    off = make_engine(page_size=page_size, kv_budget_tokens=8192, prefix_cache=False)
    client_off, http_off = sdk(off)
    with http_off:
        ref = converse(client_off, 6)
    assert [r.choices[0].message.content for r in turns] == [r.choices[0].message.content for r in ref]
    assert all(r.usage.prompt_tokens_details.cached_tokens == 0 for r in ref)


def test_cache_salt_isolates_over_http(make_engine):
    eng = make_engine(page_size=4)
    client, http = sdk(eng)
    msgs = [{"role": "user", "content": "the same question, asked by two tenants"}]
    with http:
        def ask(salt):
            extra = {"cache_salt": salt} if salt else None
            r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, temperature=0,
                                               extra_body=extra)
            return r.usage.prompt_tokens_details.cached_tokens
        assert ask("a") == 0
        assert ask("b") == 0
        assert ask("a") > 0
        pools = http.get("/polykv/pools").json()
        assert pools["cache_kv_bytes"] >= 0 and 0 < pools["cache_hit_rate"] < 1
