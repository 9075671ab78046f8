"""Automatic prefix reuse on the bundled model: a conversation sent whole each turn over the OpenAI
SDK, with no pool and no session id, computes only each turn's new tokens — also where SmolLM2's
tokenizer spells the model's answers with other ids than it generated (the prompt is realigned to
the answer's own ids)."""

from __future__ import annotations

import uuid

import openai
import pytest
from starlette.testclient import TestClient

from opencoti.server import create_app

pytestmark = pytest.mark.bundled

TURNS = [
    "List the files under opencoti/engine and say what each one does.",
    "Which of them owns the KV page tables? Quote the class name.",
    "Read that class and tell me which methods change a refcount.",
    "Summarize what we found in three short sentences.",
]


def test_conversation_without_ids_computes_only_new_tokens(bundled_engine):
    eng = bundled_engine
    seen: list[list[int]] = []

    def on(ev, d):
        if ev == "submit":
            seen.append(list(d["job"].seq.tokens[:d["job"].prompt_len]))

    eng.run_on_step_thread(lambda: eng.core.listeners.append(on))
    salt = uuid.uuid4().hex  # nothing cached by other tests counts here
    try:
        http = TestClient(create_app(eng), raise_server_exceptions=False)
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http)
        messages = [{"role": "system", "content": "You are a careful coding agent. Answer briefly."}]
        rows, prev_total, respelled = [], None, 0
        with http:
            for q in TURNS:
                messages.append({"role": "user", "content": q})
                r = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=32, temperature=0,
                                                   extra_body={"cache_salt": salt})
                u = r.usage
                answer = r.choices[0].message.content
                respelled += len(eng.tokenize(answer)) != u.completion_tokens
                if prev_total is not None:
                    rows.append((u.prompt_tokens - u.prompt_tokens_details.cached_tokens, u.prompt_tokens - prev_total))
                prev_total = u.prompt_tokens + u.completion_tokens
                messages.append({"role": "assistant", "content": answer})
    finally:
        eng.run_on_step_thread(lambda: eng.core.listeners.remove(on))
    for computed, new in rows:  # + the last answer token, whose KV is never computed
        assert computed == new + 1, rows
    # every prompt spells the rendered conversation exactly
    hf = eng.tokenizer.hf_tokenizer
    for i in range(len(TURNS)):
        text = eng.apply_chat_template(messages[:2 + 2 * i])
        assert hf.decode(seen[-len(TURNS) + i], skip_special_tokens=False, clean_up_tokenization_spaces=False) == text
    print(f"answers whose text encodes to other ids than generated: {respelled}/{len(TURNS)}; (computed, new): {rows}")
