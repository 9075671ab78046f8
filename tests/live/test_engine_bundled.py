"""The engine on the bundled SmolLM2 model: greedy output equals transformers' generate."""

from __future__ import annotations

import threading

import pytest
import torch

from opencoti.engine import SamplingParams

pytestmark = pytest.mark.bundled

CHATS = [
    [{"role": "user", "content": "Explain in detail how a bicycle works."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Describe the water cycle step by step."}],
    [{"role": "user", "content": "Write one sentence about the sea."}],
]


@pytest.fixture(scope="module")
def reference(transformers_ref):
    return transformers_ref  # transformers' model of the GGUF (tests/live/conftest.py)


@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_greedy_equals_transformers_generate(bundled_engine, reference, chat):
    eng = bundled_engine
    prompt = eng.tokenize(eng.apply_chat_template(CHATS[chat]))
    r = eng.generate(prompt, params=SamplingParams.greedy(32))
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)
    assert r.token_ids == out[0, len(prompt):].tolist()  # both stop at EOS (and include it)
    assert len(r.token_ids) == 32
    eng.release_session(r.session_id)


def test_concurrent_chats_equal_alone(bundled_engine):
    eng = bundled_engine
    prompts = [eng.tokenize(eng.apply_chat_template(c)) for c in CHATS] * 3
    params = SamplingParams.greedy(24, ignore_eos=True)
    alone = [eng.generate(p, params=params).token_ids for p in prompts]
    res = [None] * len(prompts)

    def run(i):
        res[i] = eng.generate(prompts[i], params=params).token_ids

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert res == alone


def test_chat_answer_and_eos(bundled_engine):
    r = bundled_engine.generate(messages=[{"role": "user", "content": "What is the capital of France?"}],
                                params=SamplingParams.greedy(48))
    assert "Paris" in r.text
    assert r.stop_reason == "eos"
    assert r.timings["predicted_n"] >= 1 and r.timings["predicted_per_second"] > 0
