"""Shared fixtures. Engines are checked with check_integrity() after every test that uses one."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OPENCOTI_DEBUG_CHECKS", "1")  # engines check their KV invariants whenever they go idle


# Every engine start runs a full garbage collection (weights.release_memory), and a test process holds
# what every collected test module imported (about 440,000 objects: 0.2-0.3 s a collection, and over a
# second once a test has loaded mypy's or a tokenizer's millions): the start heap is frozen, as
# `opencoti serve` freezes its own (server/state.py), and again at each test file's end, after a
# collection, so that later collections walk only what is new. Objects a test makes are collected as
# before; what is frozen is what the process keeps anyway (modules, session fixtures, caches). A test
# that unfreezes (test_server_event_loop's) leaves the rest of its file unfrozen.
def _freeze_heap() -> None:
    import gc

    gc.collect()
    gc.freeze()


def pytest_collection_finish(session):
    _freeze_heap()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the item's fixtures (the module's too, when it was the module's last) are finalized
    if nextitem is None or nextitem.path != item.path:  # (not gc.get_freeze_count(): it walks the frozen list)
        _freeze_heap()


# `make test` runs the offline, live and browser tests in one pytest-xdist run with --dist loadscope,
# whose work unit is made a test file here (xdist's own unit is a module's functions or a class's
# methods): a file's tests stay on one worker, so module-scoped servers and engines are made once,
# except in the files below, whose tests share nothing but session fixtures (the bundled model, its
# engines) and go one by one to whichever worker is free, so that neither worker waits at the end on a
# long file (test_langgraph_live alone was ~4 minutes of one worker). Units with more tests go first.
_SPREAD = {"test_langgraph_live.py", "test_docs_live.py", "test_dashboard.py"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return nodeid if path.rsplit("/", 1)[-1] in _SPREAD else path

    return FileScheduling(config, log)


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
def scalar_lib():
    """The native library built without AVX2/FMA/F16C: the portable code a user on another CPU runs. Its
    typed operators (``torch.ops.opencoti_x<key>``, beside the default build's ``torch.ops.opencoti``).

    Built once per machine, not once per test worker and run: ``native.build`` names the file by a hash of
    the sources, the flags, the compiler, the CPU and torch (a changed kernel is a new file, built again),
    writes it atomically (two workers may build it at once) and finds it already built otherwise; it is
    kept in ``<native cache>/tests-scalar``, where the builds of earlier sources are removed."""
    from opencoti.engine import native

    out_dir = native._build_dir() / "tests-scalar"
    path = native.build(("-mno-avx2", "-mno-fma", "-mno-f16c", "-mno-avx512f"), out_dir)
    for old in out_dir.glob("opencoti_kernels-*.so"):  # a process that maps an older one keeps its pages
        if old != path:
            old.unlink(missing_ok=True)
    ops = native.load(path)
    assert ops.simd() == 0
    return ops
