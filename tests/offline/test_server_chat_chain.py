"""One chat rendering chain: the same messages + tools give the same prompt token ids through
``Engine`` (apply_chat_template, generate(messages=...), create_pool(messages=...)), the in-process
client (sync and async) and the HTTP server, on a template without native tool support (like the
bundled SmolLM2's) and on one with it (the tiny models' byte-level template)."""

from __future__ import annotations

import asyncio

import pytest
from starlette.testclient import TestClient

from opencoti.client import AsyncPolyKVClient, PolyKVClient
from opencoti.engine.chat import TemplateCaps, render_chat, template_caps
from opencoti.server import create_app

# ChatML that ignores tools and tool calls (like SmolLM2's template)
PLAIN_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
                  "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SYSTEM = [{"role": "system", "content": "You route questions."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
HISTORY = SYSTEM + [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "-3 C"},
    {"role": "user", "content": "And tomorrow?"}]
GREEDY = {"temperature": 0, "max_tokens": 2}


def record_prompts(monkeypatch, engine) -> list[list[int]]:
    """Every prompt the engine is asked to generate from (sync and async entry points)."""
    seen: list[list[int]] = []
    stream, astream = engine.stream, engine.astream

    def spy(prompt=None, **kw):
        seen.append(list(prompt))
        return stream(prompt, **kw)

    async def aspy(prompt=None, **kw):
        seen.append(list(prompt))
        return await astream(prompt, **kw)

    monkeypatch.setattr(engine, "stream", spy)
    monkeypatch.setattr(engine, "astream", aspy)
    return seen


def check_one_chain(engine, monkeypatch, expect_injected: bool) -> None:
    expected = engine.tokenize(engine.apply_chat_template(HISTORY, tools=TOOLS))
    assert expected == engine.tokenize(render_chat(engine.tokenizer, HISTORY, TOOLS))
    text = engine.detokenize(expected)
    assert ("You are provided with function signatures" in text) is expect_injected and "get_weather" in text
    # Engine.generate(messages=..., tools=...) renders the same prompt
    result = engine.generate(messages=HISTORY, tools=TOOLS, params=None, session_id="eng")
    assert result.info.prompt_tokens == len(expected)
    engine.release_session("eng")
    # a pool made from the same messages + tools is a token-exact prefix of the request (attaching
    # reuses all of it: the request only adds the assistant header)
    pool = engine.create_pool(messages=HISTORY, tools=TOOLS)
    assert expected[:pool.prefix_len] == engine.tokenize(render_chat(engine.tokenizer, HISTORY, TOOLS, False))
    cached = pool.prefix_len

    seen = record_prompts(monkeypatch, engine)
    with TestClient(create_app(engine), raise_server_exceptions=False) as tc:
        r = tc.post("/v1/chat/completions", json={"messages": HISTORY, "tools": TOOLS, "pool_id": pool.pool_id,
                                                  **GREEDY})
        assert r.status_code == 200, r.text
        assert r.headers["x-cached-prefix-tokens"] == str(cached)
        http_client = PolyKVClient(http_client=tc)
        done = http_client.chat(HISTORY, tools=TOOLS, pool_id=pool.pool_id, **GREEDY)
        assert done.info.cached_prefix_tokens == cached
        assert http_client.apply_template(HISTORY, TOOLS) == engine.apply_chat_template(HISTORY, tools=TOOLS)
    local = PolyKVClient(engine=engine)
    assert local.chat(HISTORY, tools=TOOLS, pool_id=pool.pool_id, **GREEDY).info.cached_prefix_tokens == cached
    assert local.apply_template(HISTORY, TOOLS) == engine.apply_chat_template(HISTORY, tools=TOOLS)

    async def run_async():
        async with AsyncPolyKVClient(engine=engine) as c:
            await c.chat(HISTORY, tools=TOOLS, pool_id=pool.pool_id, **GREEDY)

    asyncio.run(run_async())
    assert len(seen) == 4 and all(s == expected for s in seen)
    engine.release_pool(pool.pool_id)


@pytest.fixture
def tiny_engine():
    """A tiny model with a 2048-token context (the injected tool block is long in bytes); the
    test may swap its chat template before building the engine."""
    from opencoti.engine import Engine, EngineConfig
    from opencoti.engine.model.loader import tiny_model

    made = []

    def build(template: str | None = None):
        loaded = tiny_model("llama", max_position_embeddings=2048)
        if template is not None:
            loaded.tokenizer.chat_template = template
        eng = Engine(EngineConfig(model="tiny:llama", page_size=4, kv_budget_tokens=8192, pool_grace_ttl_s=0.0),
                     loaded=loaded)
        made.append(eng)
        return eng

    yield build
    for eng in made:
        try:
            eng.check_integrity()
        finally:
            eng.shutdown()


def test_template_without_native_tools(tiny_engine, monkeypatch):
    engine = tiny_engine(PLAIN_TEMPLATE)
    assert template_caps(engine.tokenizer) == TemplateCaps(False, False)
    check_one_chain(engine, monkeypatch, expect_injected=True)


def test_template_with_native_tools(tiny_engine, monkeypatch):
    engine = tiny_engine()
    assert template_caps(engine.tokenizer) == TemplateCaps(True, True)
    check_one_chain(engine, monkeypatch, expect_injected=False)
