"""Start-up memory: KV pages resident only once written, weights held once (no view of the
checkpoint kept), the memory start-up frees given back to the OS, no candidate format of
``weights=auto`` kept alive. Tiny random models only."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from opencoti.engine import Engine, EngineConfig
from opencoti.engine.kv.pages import PagePool
from opencoti.engine.model import choose, llama, weights
from opencoti.engine.model.loader import tiny_model

linux = pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(),
                           reason="measures resident memory through Linux's /proc/self/smaps_rollup, "
                                  "which this platform does not have")


def _rss_mib() -> float:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Rss:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no Rss line")


@linux
def test_kv_pages_become_resident_as_they_are_written():
    before = _rss_mib()
    kv = PagePool(num_layers=8, num_pages=4096, page_size=16, num_kv_heads=4, head_dim=64, dtype=torch.float32)
    budget_mib = 2 * 8 * 4096 * 16 * 4 * 64 * 4 / 2**20  # 512 MiB of K and V
    assert kv.k_cache.shape == (8, 4096, 16, 4, 64) and kv.k_cache.is_contiguous()
    assert _rss_mib() - before < budget_mib / 8  # nothing of the budget is resident yet
    pages = kv.allocate(64)  # 1 / 64 of the pages, written in every layer
    kv.k_cache[:, pages] = 1.0
    kv.v_cache[:, pages] = 2.0
    grown = _rss_mib() - before
    assert grown < budget_mib / 8, grown
    assert float(kv.k_cache[:, pages].sum()) == 8 * 64 * 16 * 4 * 64
    assert float(kv.v_cache[3, 4000].abs().sum()) == 0.0  # pages never written read as zeros
    kv.v_cache[3, 4000, 5] = -1.0
    assert float(kv.v_cache[3, 4000].sum()) == -4 * 64.0


def test_kv_pages_in_other_dtypes_and_sizes():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        kv = PagePool(num_layers=2, num_pages=3, page_size=4, num_kv_heads=1, head_dim=8, dtype=dtype)
        assert kv.k_cache.dtype == dtype and kv.v_cache.shape == (2, 3, 4, 1, 8)
        assert not kv.k_cache.any() and not kv.v_cache.any()
        kv.k_cache[1, 2] = 3
        assert kv.k_cache[1, 2].eq(3).all() and kv.page_bytes == 4 * 2 * 2 * 8 * dtype.itemsize


def test_the_forward_holds_no_view_of_the_checkpoint():
    loaded = tiny_model("llama")
    model = weights.build_forward(loaded, weights="fp32", dtype=torch.float32, device="cpu", max_positions=64,
                                  adapt_threads=False)
    ckpt = {t.untyped_storage().data_ptr() for t in loaded.state_dict.values()}
    held = [model.embed, model.final_norm] + [t for layer in model.layers for t in (layer.in_norm, layer.post_norm)]
    assert not [t.shape for t in held if t.untyped_storage().data_ptr() in ckpt]
    torch.testing.assert_close(model.embed, loaded.state_dict["model.embed_tokens.weight"], rtol=0, atol=0)


@linux
def test_release_memory_gives_freed_heap_back():
    # a fresh process: 3,000 tensors of 64 KiB come from the C heap; all but the last freed, the
    # heap cannot shrink from its top, so the freed memory stays resident until it is given back
    code = f"""
import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
import torch
from opencoti.engine.model import weights
def rss():
    return [int(l.split()[1]) / 1024 for l in open('/proc/self/smaps_rollup') if l.startswith('Rss:')][0]
keep = [torch.ones(16384) for _ in range(3000)]
last = keep.pop()
del keep
held = rss()
ok = weights.release_memory()
print(ok, held - rss())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    ok, freed = out.stdout.split()
    assert ok == "True" and float(freed) > 100, out.stdout  # of 187 MiB freed by Python


def test_engine_start_gives_memory_back(monkeypatch):
    calls = []
    real = weights.release_memory
    monkeypatch.setattr(weights, "release_memory", lambda: calls.append(1) or real())
    eng = Engine(EngineConfig(model="tiny:llama", kv_budget_tokens=256, weights="fp32"))
    try:
        assert calls == [1]
        assert eng.loaded.state_dict is None
    finally:
        eng.close()


def test_auto_keeps_only_the_chosen_format_alive(monkeypatch, tmp_path):
    monkeypatch.setattr(weights, "AUTO_MIN_BYTES", 0)
    monkeypatch.setenv("OPENCOTI_AUTOTUNE", "0")  # each format's first kernel: no per-shape timing
    table = {"fp32": (0.03, 0.08, 0.2), "bf16": (0.02, 0.06, 0.15), "int8": (0.012, 0.04, 0.3),
             "int4": (0.010, 0.035, 0.4)}
    monkeypatch.setattr(choose, "time_steps", lambda models, rounds=5: {f: choose.StepTimes(*table[f]) for f in models})
    monkeypatch.setattr(choose, "others_load", lambda *a: 0.0)
    made: list = []
    init = llama.LlamaForward.__init__

    def counted(self, *a, **k):
        init(self, *a, **k)
        made.append(weakref.ref(self))

    monkeypatch.setattr(llama.LlamaForward, "__init__", counted)
    import gc

    gc.disable()  # freed by reference counts alone, not left for a later collection
    try:
        model = weights.build_forward(tiny_model("llama"), weights="auto", dtype=torch.float32, device="cpu",
                                      max_positions=300, adapt_threads=False, cache_dir=str(tmp_path))
        alive = [r() for r in made if r() is not None]
    finally:
        gc.enable()
    assert len(made) >= 3 and model.weights != "fp32"  # the reference, the candidates, one chosen
    assert alive == [model]


def test_the_step_loop_gives_memory_back_when_it_goes_idle(monkeypatch):
    from opencoti.engine import SamplingParams
    from opencoti.engine.api import engine as engine_mod

    calls: list = []
    monkeypatch.setattr(weights, "release_memory", lambda collect=True: calls.append(collect) or True)
    eng = Engine(EngineConfig(model="tiny:llama", kv_budget_tokens=512, weights="fp32"))
    try:
        assert calls == [True]  # start-up: gc and trim
        eng.generate([5, 6, 7, 8], params=SamplingParams.greedy(4, ignore_eos=True))
        eng.post_to_step_thread(lambda: None).result(timeout=30)  # the loop has passed its idle point
        assert calls == [True, False]  # idle: trim only (no gc pass on the step thread)
        monkeypatch.setattr(engine_mod, "_TRIM_EVERY_S", 3600.0)
        eng.generate([5, 6, 7], params=SamplingParams.greedy(4, ignore_eos=True))
        eng.post_to_step_thread(lambda: None).result(timeout=30)
        assert calls == [True, False]  # not again within _TRIM_EVERY_S
    finally:
        eng.close()
