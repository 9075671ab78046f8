"""Pools on the bundled SmolLM2-135M-Instruct with real chat text (nested fork and branch,
KV attributed by ownership: docs/polykv.md, "Pools and sessions").

The engine runs in-process (no server): one engine for the module, loaded once from the
converted cache. Greedy tokens with a pool must equal the tokens of the same prompt without one.
"""

from __future__ import annotations

import copy
import itertools
import json

import pytest

from opencoti.engine import Engine, EngineConfig, SamplingParams

pytestmark = pytest.mark.bundled

SYSTEM = ("You are the coordinator of a team of research agents. Answer precisely, cite the tool you used, "
          "and never invent tool results. Keep answers short.")

TOOLS_A = [
    {"type": "function", "function": {"name": "web_search", "description": "Search the web for a query.",
                                      "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                                                     "required": ["query"]}}},
    {"type": "function", "function": {"name": "read_page", "description": "Fetch a web page as text.",
                                      "parameters": {"type": "object", "properties": {"url": {"type": "string"}},
                                                     "required": ["url"]}}},
]
TOOLS_B = [
    {"type": "function", "function": {"name": "run_sql", "description": "Run a read-only SQL query.",
                                      "parameters": {"type": "object", "properties": {"sql": {"type": "string"}},
                                                     "required": ["sql"]}}},
    {"type": "function", "function": {"name": "plot", "description": "Plot a table as a chart.",
                                      "parameters": {"type": "object", "properties": {"table": {"type": "string"}},
                                                     "required": ["table"]}}},
]


def system_message(tools: list[dict]) -> dict:
    # SmolLM2's chat template ignores `tools`, so the definitions are part of the system text.
    return {"role": "system", "content": SYSTEM + "\n\nYou can call these tools:\n" + json.dumps(tools, indent=1)}


def greedy(n: int = 16) -> SamplingParams:
    return SamplingParams.greedy(n, ignore_eos=True)


def pages_for(n_tokens: int, page_size: int) -> int:
    return -(-n_tokens // page_size)


@pytest.fixture(scope="module")
def eng(bundled_model):
    # fp32 weights: the exactness reference (quantized kernels may flip near-tie argmaxes between batch shapes);
    # the session's loaded model (the same file and config), not a second load of it
    loaded = copy.copy(bundled_model)
    loaded.state_dict = dict(bundled_model.state_dict)
    engine = Engine(EngineConfig(page_size=16, kv_budget_tokens=8192, weights="fp32"), loaded=loaded)
    yield engine
    try:
        engine.check_integrity()
    finally:
        engine.shutdown()


@pytest.fixture(autouse=True)
def _clean(eng):
    yield
    eng.check_integrity()
    st = eng.pools()
    for p in st["pools"]:
        for s in p["sessions"]:
            eng.release_session(s["session_id"])
    for p in sorted(st["pools"], key=lambda p: -p["pool_id"]):  # leaves (newer ids) first
        eng.release_pool(p["pool_id"], immediate=True)  # not deferred by the grace TTL
    assert eng.stats()["sessions"] == 0 and eng.pools()["kv_pages_used"] == 0


def chat_tokens(eng, messages, tools=None, add_generation_prompt=True) -> list[int]:
    return eng.tokenize(eng.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt))


_refs = itertools.count(1)


def reference(eng, prompt: list[int], n: int = 16) -> list[int]:
    # a cache_salt of its own: computed from scratch, not from the prefix cache
    res = eng.generate(prompt, params=greedy(n), session_id="reference", cache_salt=f"reference-{next(_refs)}")
    assert res.cache_n == 0
    eng.release_session("reference")
    return res.token_ids


def run_streams(eng, requests: list[dict]):
    streams = [eng.stream(r.pop("prompt"), **r) for r in requests]
    out = []
    for s in streams:
        for _ in s:
            pass
        out.append(s.result)
    return out


def test_journey_a_subagents_on_an_extended_pool(eng):
    sys_msgs = [system_message(TOOLS_A)]
    p0_tokens = chat_tokens(eng, sys_msgs, TOOLS_A, add_generation_prompt=False)
    p0 = eng.create_pool(messages=sys_msgs, tools=TOOLS_A)
    assert p0.prefix_len == len(p0_tokens) and p0.residency == "resident"

    task = sys_msgs + [
        {"role": "user", "content": "Compare the populations of the three largest cities of Japan in 2020. "
                                    "Split the work between sub-agents, one city each."},
        {"role": "assistant", "content": "Plan: one sub-agent per city; each reports the 2020 census figure."},
    ]
    p1_tokens = chat_tokens(eng, task, TOOLS_A, add_generation_prompt=False)
    assert p1_tokens[:len(p0_tokens)] == p0_tokens
    p1 = eng.fork_pool(p0.pool_id, tokens=p1_tokens)
    assert (p1.parent, p1.branch_pos, p1.prefix_len) == (p0.pool_id, len(p0_tokens), len(p1_tokens))

    cities = ["Tokyo", "Yokohama", "Osaka", "Nagoya"]
    prompts = [chat_tokens(eng, task + [{"role": "user", "content": f"Sub-agent {i}: report on {c}."}], TOOLS_A)
               for i, c in enumerate(cities)]
    for p in prompts:
        assert p[:len(p1_tokens)] == p1_tokens
    refs = [reference(eng, p) for p in prompts]
    results = run_streams(eng, [dict(prompt=p, params=greedy(), pool_id=p1.pool_id, session_id=f"city-{i}")
                                for i, p in enumerate(prompts)])
    for res, ref in zip(results, refs):
        assert res.cache_n == len(p1_tokens) and res.info.pool_id == p1.pool_id
        assert res.token_ids == ref
    st = eng.pools()
    assert st["tree_depth"] == 2
    by_id = {p["pool_id"]: p for p in st["pools"]}
    assert by_id[p0.pool_id]["children"] == [p1.pool_id]
    assert len(by_id[p1.pool_id]["sessions"]) == 4
    assert by_id[p0.pool_id]["subtree_kv_bytes"] == st["kv_bytes_used"]


def test_journey_b_branch_with_a_different_toolset(eng):
    tokens_a = chat_tokens(eng, [system_message(TOOLS_A)], TOOLS_A, add_generation_prompt=False)
    tokens_b = chat_tokens(eng, [system_message(TOOLS_B)], TOOLS_B, add_generation_prompt=False)
    d = next(i for i, (x, y) in enumerate(zip(tokens_a, tokens_b)) if x != y)
    assert 0 < d < len(tokens_a)
    p0 = eng.create_pool(tokens=tokens_a)
    used = eng.pools()["kv_pages_used"]
    pb = eng.fork_pool(p0.pool_id, branch_pos=d, tokens=tokens_b)
    assert (pb.parent, pb.branch_pos, pb.prefix_len) == (p0.pool_id, d, len(tokens_b))
    # the shared system preamble [0, D) is not copied
    assert eng.pools()["kv_pages_used"] - used == pages_for(len(tokens_b), 16) - d // 16

    questions = ["How many orders were placed in March?", "Plot monthly revenue for 2023."]
    for tools, pool, base in ((TOOLS_B, pb, tokens_b), (TOOLS_A, p0, tokens_a)):
        prompts = [chat_tokens(eng, [system_message(tools), {"role": "user", "content": q}], tools) for q in questions]
        refs = [reference(eng, p) for p in prompts]
        results = run_streams(eng, [dict(prompt=p, params=greedy(), pool_id=pool.pool_id) for p in prompts])
        for p, res, ref in zip(prompts, results, refs):
            assert p[:len(base)] == base
            assert res.cache_n == len(base) and res.token_ids == ref
    st = eng.pools()
    own = sum(p["own_kv_bytes"] for p in st["pools"])
    sess = sum(s["marginal_kv_bytes"] for p in st["pools"] for s in p["sessions"])
    assert own + sess == st["kv_bytes_used"]


def test_sixteen_sessions_share_a_1024_token_pool(eng):
    def tools(n: int) -> list[dict]:
        return [{"type": "function", "function": {
            "name": f"tool_{i}", "description": f"Tool number {i}: looks up record {i} in the archive and returns it "
                                                "as JSON with its author, date and summary.",
            "parameters": {"type": "object", "properties": {"record_id": {"type": "integer"}}}}} for i in range(n)]

    n = 1
    while len(chat_tokens(eng, [system_message(tools(n))], add_generation_prompt=False)) < 1040:
        n += 1
    sys_msg = system_message(tools(n))
    full = chat_tokens(eng, [sys_msg], add_generation_prompt=False)
    assert 1040 <= len(full) < 1300
    pool_tokens = full[:1024]
    pool = eng.create_pool(tokens=pool_tokens)
    assert pool.prefix_len == 1024 and pool.own_kv_bytes == 64 * eng.kv.page_bytes

    prompts = [chat_tokens(eng, [sys_msg, {"role": "user", "content": f"Agent {i}: which tool reads record {i}?"}])
               for i in range(16)]
    for p in prompts:
        assert p[:1024] == pool_tokens and len(p) - 1024 < 300
    refs = {i: reference(eng, prompts[i], 8) for i in (0, 15)}
    used_before = eng.pools()["kv_pages_used"]
    results = run_streams(eng, [dict(prompt=p, params=greedy(8), pool_id=pool.pool_id, session_id=f"agent-{i}")
                                for i, p in enumerate(prompts)])
    for i, res in enumerate(results):
        assert res.cache_n == 1024
        if i in refs:
            assert res.token_ids == refs[i]
    st = eng.pools()
    pb = eng.kv.page_bytes
    own = sum(p["own_kv_bytes"] for p in st["pools"]) // pb
    sess = sum(s["marginal_kv_bytes"] for p in st["pools"] for s in p["sessions"]) // pb
    assert st["kv_pages_used"] == own + sess and own == 64 == used_before
    bound = 64 + sum(pages_for(len(p) - 1024 + 8, 16) + 1 for p in prompts)
    private = sum(pages_for(len(p) + 8, 16) for p in prompts)
    assert st["kv_pages_used"] <= bound
    assert st["kv_pages_used"] * 5 < private, (st["kv_pages_used"], private)
