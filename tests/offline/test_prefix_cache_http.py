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


@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("stream", [False, True])
def test_cached_count_of_requests_that_arrive_together(make_engine, stream, aligned):
    """x-cached-prefix-tokens against the final usage when requests sharing a prefix arrive in one
    turn of the step loop: the first computes it, the others wait for it and reuse it all (the full
    pages, and part of a page copied when the shared prefix does not end on a page boundary). The
    headers are written once the request has started (a stream) or ended (an answer sent whole)."""
    import json
    import threading
    import time

    eng = make_engine(page_size=4, kv_budget_tokens=8192)
    ps = 4

    def msgs(system: str, user: str) -> list:
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    def shared_len(system: str) -> int:
        text = eng.apply_chat_template(msgs(system, "p: what now?"))
        return len(eng.tokenize(text[:-len("p: what now?<|im_end|>\n<|im_start|>assistant\n")]))

    system = "you share this system prompt with every other request. " * 2
    system += "x" * (-shared_len(system) % ps + (0 if aligned else 2))
    shared = shared_len(system)
    assert (shared % ps == 0) == aligned
    prompts = [msgs(system, f"{c}: what now?") for c in "pqrst"]
    out: list = [None] * len(prompts)

    def post(i: int) -> None:
        body = {"messages": prompts[i], "max_tokens": 3, "temperature": 0, "logit_bias": LETTERS, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        if stream:
            events = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            final = [e for e in events if e.get("usage")][-1]
        else:
            final = r.json()
        out[i] = (int(r.headers["x-cached-prefix-tokens"]), final["usage"]["prompt_tokens_details"]["cached_tokens"],
                  final["timings"]["cache_n"])

    with TestClient(create_app(eng), raise_server_exceptions=False) as http:
        gate = threading.Event()
        held = eng.post_to_step_thread(gate.wait)  # the step thread waits: every request is accepted in one turn
        ts = [threading.Thread(target=post, args=(i,)) for i in range(len(prompts))]
        [t.start() for t in ts]
        deadline = time.monotonic() + 30
        while eng._cmds.qsize() < len(prompts) and time.monotonic() < deadline:
            time.sleep(0.01)
        gate.set()
        held.result(timeout=30)
        [t.join(timeout=120) for t in ts]
    assert all(o is not None for o in out), out
    for header, cached, cache_n in out:
        assert header == cached == cache_n, out
    got = sorted(o[1] for o in out)
    if aligned:
        assert got == [0] + [shared] * (len(prompts) - 1)
    else:  # a follower that starts before the first request's page past the prefix is listed copies no part of it
        assert got[0] == 0 and all(shared // ps * ps <= g <= shared for g in got[1:]), got
