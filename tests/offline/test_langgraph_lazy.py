"""LazyEngine / model_from_env: graph files import at once (the engine loads in the background),
the first use waits, a failed load is raised where the engine is used, one engine per process."""

from __future__ import annotations

import threading
import time

import pytest

from opencoti.langgraph import LazyEngine, OpencotiChatModel, model_from_env, polykv_tools
from opencoti.langgraph import lazy as lazy_module


def test_lazy_engine_returns_at_once_and_waits_on_use(make_engine):
    gate = threading.Event()

    def build():
        gate.wait(10)
        return make_engine()

    t0 = time.monotonic()
    eng = LazyEngine(build, "tiny")
    model = OpencotiChatModel(engine=eng, temperature=0, max_tokens=2)
    tools = polykv_tools(model)  # what a graph file does at import: nothing waits for the engine
    assert time.monotonic() - t0 < 2 and not eng.ready and not eng.is_closed and "loading" in repr(eng)
    assert "max_input_tokens" not in model.profile
    gate.set()
    assert model.invoke("hi").response_metadata["finish_reason"] in ("stop", "length")  # waits, then runs
    assert eng.ready and tools[0].invoke({"text": "a lazy prefix"})["prefix_len"] > 0
    assert model._get_ls_params()["ls_model_name"] == eng.model_name


def test_lazy_engine_failure_is_raised_on_use():
    def build():
        raise RuntimeError("no such model")

    eng = LazyEngine(build, "broken")
    with pytest.raises(RuntimeError, match="no such model"):
        eng.result(5)
    assert eng.is_closed
    with pytest.raises(RuntimeError, match="no such model"):
        OpencotiChatModel(engine=eng).invoke("hi")


def test_model_from_env_shares_one_engine(monkeypatch):
    monkeypatch.delenv("OPENCOTI_BASE_URL", raising=False)
    monkeypatch.setenv("OPENCOTI_MODEL", "tiny:llama")
    monkeypatch.setenv("OPENCOTI_KV_BUDGET_TOKENS", "2048")
    monkeypatch.setattr(lazy_module, "_ENGINES", {})
    a, b = model_from_env(max_tokens=2), model_from_env(temperature=0)
    assert a.engine is b.engine and isinstance(a.engine, LazyEngine)
    try:
        assert b.invoke("hi", max_tokens=2).response_metadata["model_name"] == a.engine.model_name
    finally:
        a.engine.result().shutdown()
    monkeypatch.setenv("OPENCOTI_BASE_URL", "http://127.0.0.1:9")
    assert model_from_env().base_url == "http://127.0.0.1:9"
