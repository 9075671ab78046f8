"""Shared fixtures. Engines are checked with check_integrity() after every test that uses one."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OPENCOTI_DEBUG_CHECKS", "1")  # engines check their KV invariants whenever they go idle


def _make_engine(**kw):
    from opencoti.engine import Engine, EngineConfig

    cfg = dict(model="tiny:llama", page_size=4, kv_budget_tokens=4096, max_batch_tokens=64, pool_grace_ttl_s=0.0)
    cfg.update(kw)
    return Engine(EngineConfig(**cfg))


@pytest.fixture
def make_engine():
    """Factory for tiny-model engines; every engine made is integrity-checked and shut down."""
    made = []

    def factory(**kw):
        eng = _make_engine(**kw)
        made.append(eng)
        return eng

    yield factory
    for eng in made:
        if eng.is_closed:
            continue
        try:
            eng.check_integrity()
        finally:
            eng.shutdown()


@pytest.fixture
def engine(make_engine):
    """A tiny random-weight Llama engine (page size 4, 4096-token KV budget)."""
    return make_engine()


@pytest.fixture(scope="session")
def scalar_lib(tmp_path_factory):
    """The native library built without AVX2/FMA/F16C: the portable code a user on another CPU runs. Its
    typed operators (``torch.ops.opencoti_x<key>``, beside the default build's ``torch.ops.opencoti``)."""
    from opencoti.engine import native

    path = native.build(("-mno-avx2", "-mno-fma", "-mno-f16c", "-mno-avx512f"), tmp_path_factory.mktemp("scalar"))
    ops = native.load(path)
    assert ops.simd() == 0
    return ops
