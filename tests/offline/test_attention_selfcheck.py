"""The start-up self-check of an attention backend against the torch backend (CPU, tiny model)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import opencoti
from opencoti.engine import SamplingParams
from opencoti.engine.attention import selfcheck
from opencoti.engine.attention.flashinfer_backend import FlashInferBackend
from opencoti.engine.attention.flashinfer_reference import ReferenceKernels
from opencoti.engine.attention.torch_backend import TorchAttentionBackend
from opencoti.engine.model.loader import tiny_model
from opencoti.engine.model.weights import build_forward


class Perturbed(TorchAttentionBackend):
    """Attention with a 10 % wrong softmax scale: the kind of error a misused kernel API makes, small."""

    name = "perturbed"

    def forward(self, layer, q, k, v, k_cache, v_cache, meta, scale):
        return super().forward(layer, q, k, v, k_cache, v_cache, meta, scale * 1.1)


class DecodeOnlyWrong(TorchAttentionBackend):
    """Right on prefill, wrong (the newest token's value doubled in) on decode steps only."""

    name = "decode-wrong"

    def forward(self, layer, q, k, v, k_cache, v_cache, meta, scale):
        out = super().forward(layer, q, k, v, k_cache, v_cache, meta, scale)
        if max(meta.qo_lens) == 1:
            out = out + v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        return out


class Raising(TorchAttentionBackend):
    name = "raising"

    def forward(self, *a, **kw):
        raise RuntimeError("no kernel image is available for execution on the device")


@pytest.fixture(scope="module")
def model():
    return build_forward(tiny_model("llama"), weights="fp32", dtype=torch.float32, device="cpu", max_positions=512,
                         adapt_threads=False)


def _correct():
    return FlashInferBackend("cpu", cascade="auto", kernels=ReferenceKernels())  # FlashInfer's API, torch kernels


@pytest.mark.parametrize("page_size", [4, 16])
def test_correct_backend_passes(model, page_size):
    v = selfcheck.check_backend(_correct(), TorchAttentionBackend(cascade="off"), model, page_size=page_size)
    assert v["passed"], v
    assert v["error"] is None and v["max_rel_err"] <= v["tolerance"]
    assert v["tolerance"] == max(selfcheck.FLOOR[torch.float32], selfcheck.NOISE_FACTOR * v["noise"])
    assert 0 < v["noise"] < 1e-4  # fp32: rounding moves the logits by about 1e-6
    names = [s["step"] for s in v["steps"]]
    assert len(names) == 3 + selfcheck.DECODE_STEPS and any("cascade" in n for n in names)
    assert sum(s["rows"] for s in v["steps"]) == selfcheck.PROMPT_A + selfcheck.PROMPT_B + selfcheck.SUFFIX_C \
        + 3 * selfcheck.DECODE_STEPS


@pytest.mark.parametrize("backend", [Perturbed, DecodeOnlyWrong, Raising])
def test_wrong_backend_fails(model, backend):
    v = selfcheck.check_backend(backend(cascade="off", native=False), TorchAttentionBackend(cascade="off"), model)
    assert not v["passed"] and v["error"], v
    if backend is Raising:
        assert "RuntimeError: no kernel image" in v["error"]
    else:
        assert v["max_rel_err"] > v["tolerance"]
    if backend is DecodeOnlyWrong:  # caught on the first decode step, after the prefill steps passed
        assert [s["max_rel_err"] <= v["tolerance"] for s in v["steps"]] == [True, True, True, False]


def test_cascade_mode_restored(model):
    cand = _correct()
    selfcheck.check_backend(cand, TorchAttentionBackend(cascade="off"), model)
    assert cand.cascade == "auto"


def test_fallback_with_warning_and_cache(model, tmp_path, caplog, monkeypatch):
    monkeypatch.delenv("OPENCOTI_ATTENTION_CHECK", raising=False)
    cache = tmp_path / selfcheck.CACHE_FILE
    runs = []
    real = selfcheck.check_backend
    monkeypatch.setattr(selfcheck, "check_backend", lambda *a, **kw: runs.append(1) or real(*a, **kw))
    with caplog.at_level(logging.WARNING, logger="opencoti.attention"):
        backend, v = selfcheck.verify(Perturbed(cascade="off", native=False), model, cascade="on", cache_file=cache)
    assert type(backend) is TorchAttentionBackend and backend.cascade == "on"
    assert v["status"] == "failed" and v["active_backend"] == "torch" and not v["cached"]
    assert any("FAILED its self-check" in r.message and "using the torch backend" in r.message for r in caplog.records)
    stored = json.loads(cache.read_text())
    assert list(stored) == [v["key"]] and stored[v["key"]]["passed"] is False
    # the next start reuses the verdict: no second check, same fallback
    backend, v2 = selfcheck.verify(Perturbed(cascade="off", native=False), model, cache_file=cache)
    assert type(backend) is TorchAttentionBackend and v2["cached"] and v2["status"] == "failed"
    assert len(runs) == 1
    # a correct backend (another key: its own class) passes, is kept, and is cached too
    cand = _correct()
    backend, v3 = selfcheck.verify(cand, model, cache_file=cache)
    assert backend is cand and v3["status"] == "passed" and v3["active_backend"] == "flashinfer"
    backend, v4 = selfcheck.verify(_correct(), model, cache_file=cache)
    assert v4["cached"] and v4["status"] == "passed" and len(runs) == 2
    assert len(json.loads(cache.read_text())) == 2


def test_cache_key_per_versions_and_model(model, tmp_path, monkeypatch):
    cand = _correct()
    key = selfcheck.cache_key(cand, model, model.device, 16)
    assert f"torch {torch.__version__}" in key and "flashinfer" in key and f"opencoti {opencoti.__version__}" in key
    assert selfcheck.cache_key(cand, model, model.device, 4) != key
    other = build_forward(tiny_model("llama", seed=1), weights="fp32", dtype=torch.float32, device="cpu",
                          max_positions=512, adapt_threads=False)
    assert selfcheck.cache_key(cand, other, model.device, 16) != key  # another model's weights
    monkeypatch.setattr(opencoti, "__version__", "999.0")
    assert selfcheck.cache_key(cand, model, model.device, 16) != key  # a new release checks again


def test_env_force_and_skip(model, tmp_path, monkeypatch):
    cache = tmp_path / selfcheck.CACHE_FILE
    runs = []
    real = selfcheck.check_backend
    monkeypatch.setattr(selfcheck, "check_backend", lambda *a, **kw: runs.append(1) or real(*a, **kw))
    selfcheck.verify(_correct(), model, cache_file=cache)
    monkeypatch.setenv("OPENCOTI_ATTENTION_CHECK", "force")
    _, v = selfcheck.verify(_correct(), model, cache_file=cache)
    assert len(runs) == 2 and not v["cached"]
    monkeypatch.setenv("OPENCOTI_ATTENTION_CHECK", "0")
    cand = Perturbed(cascade="off", native=False)
    backend, v = selfcheck.verify(cand, model, cache_file=cache)
    assert backend is cand and v["status"] == "skipped" and len(runs) == 2


def test_only_non_torch_backends_on_cuda_are_checked():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert selfcheck.needs_check(_correct(), cuda)
    assert not selfcheck.needs_check(TorchAttentionBackend(), cuda)
    assert not selfcheck.needs_check(_correct(), cpu)


def test_engine_on_cpu_runs_no_check(make_engine, monkeypatch):
    monkeypatch.setattr(selfcheck, "check_backend", lambda *a, **kw: pytest.fail("checked on CPU"))
    eng = make_engine()
    assert eng.attention_check["status"] == "not needed" and "reference" in eng.attention_check["detail"]


@pytest.mark.parametrize("wrong", [Perturbed, Raising])
def test_engine_falls_back_to_torch(make_engine, monkeypatch, tmp_path, caplog, wrong):
    """As on CUDA (the device rule patched): a wrong backend is replaced by torch at start; output is right."""
    import opencoti.engine.api.build as engine_mod

    monkeypatch.delenv("OPENCOTI_ATTENTION_CHECK", raising=False)
    monkeypatch.setattr(selfcheck, "needs_check", lambda backend, device: backend.name != "torch")
    monkeypatch.setattr(engine_mod, "select_backend", lambda name, device, cascade: wrong(cascade=cascade, native=False))
    with caplog.at_level(logging.WARNING, logger="opencoti.attention"):
        eng = make_engine(cache_dir=str(tmp_path))
    assert type(eng.backend) is TorchAttentionBackend and eng.core.runner.backend is eng.backend
    check = eng.attention_check
    assert check["status"] == "failed" and check["backend"] == wrong.name and check["active_backend"] == "torch"
    assert any("FAILED its self-check" in r.message for r in caplog.records)
    assert (tmp_path / selfcheck.CACHE_FILE).exists()
    from fastapi.testclient import TestClient

    from opencoti.server import create_app

    with TestClient(create_app(eng)) as c:  # what a user sees
        shown = c.get("/props").json()["opencoti"]["polykv"]
    assert shown["attention_backend"] == "TorchAttentionBackend"
    assert shown["attention_check"]["status"] == "failed" and shown["attention_check"]["error"]
    monkeypatch.undo()
    ref = make_engine()  # the torch backend, unchecked
    prompt, params = [5, 6, 7, 8, 9], SamplingParams.greedy(6, ignore_eos=True)
    assert eng.generate(prompt, params=params).token_ids == ref.generate(prompt, params=params).token_ids
