"""Fixtures shared by the server tests that send tool definitions or schemas: a tiny model with a
2048-token context (byte-level tokens: a prompt with tool definitions is ~800 tokens, past the
usual 512) and a TestClient on it. Import both names into a test module to use them."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from opencoti.server import create_app


@pytest.fixture
def engine():
    from opencoti.engine import Engine, EngineConfig
    from opencoti.engine.model.loader import tiny_model

    eng = Engine(EngineConfig(page_size=4, kv_budget_tokens=16384, max_batch_tokens=512, pool_grace_ttl_s=0.0),
                 loaded=tiny_model("llama", max_position_embeddings=2048))
    yield eng
    eng.check_integrity()
    eng.shutdown()


@pytest.fixture
def client(engine):
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        yield c
