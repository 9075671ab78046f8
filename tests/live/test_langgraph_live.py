"""opencoti.langgraph on the real bundled model (SmolLM2-135M-Instruct), in-process: the
langchain-tests integration suite, a tool-call round trip, a paced fan-out under an enforced
floor, compaction end to end; and a `langgraph dev` smoke test serving examples/ over REST."""

from __future__ import annotations

import json
import operator
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Annotated

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send

from opencoti.langgraph import (CapacityGateNode, CompactionNode, OpencotiChatModel, PolyKVMessagesState, PolyKVState,
                                SpawnPacer, convert_messages, polykv_update)

ROOT = Path(__file__).resolve().parents[2]

SMALL_MODEL = "a 135M-parameter model"


# ============================================================================ the standard integration suite
@pytest.mark.bundled
class TestOpencotiIntegration(ChatModelIntegrationTests):
    engine = None

    @pytest.fixture(autouse=True)
    def _bundled(self, int4_engine):
        type(self).engine = int4_engine

    @property
    def chat_model_class(self):
        return OpencotiChatModel

    @property
    def chat_model_params(self) -> dict:
        # greedy and bounded: the suite's own defaults set neither, and an unbounded answer from a small
        # model can run to the context length
        return {"engine": self.engine, "model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": 100}

    @property
    def supports_model_override(self) -> bool:
        return False  # one engine serves one model: a per-call `model` only renames it in traces

    @property
    def supported_usage_metadata_details(self):
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        model = OpencotiChatModel(engine=self.engine, temperature=0, max_tokens=8)
        system = "You are a helpful assistant that answers questions about the weather."
        pool = model.polykv_client.create_pool(messages=[{"role": "system", "content": system}])
        try:
            msgs = [SystemMessage(system), HumanMessage("Is it sunny?")]
            if stream:
                full = None
                for chunk in model.stream(msgs, pool_id=pool.pool_id):
                    full = chunk if full is None else full + chunk
                return full
            msg = model.invoke(msgs, pool_id=pool.pool_id)
            assert msg.usage_metadata["input_token_details"]["cache_read"] == pool.prefix_len
            return msg
        finally:
            model.polykv_client.release_pool(pool.pool_id)

    # ---- tool calls and forced calls are grammar-constrained, and their arguments follow the tool's
    # schema (no invented keys): the suite's test_tool_calling* pass unchanged. What the bundled 135M
    # model does not do (greedy, fp32 engine; measured: it fails every run) is the agent loop's answer.
    # structured output (the default method, json_schema: the answer decoded under the schema, closed
    # within max_tokens when the model loops inside a string) parses for every schema type: the
    # suite's own test_structured_output* run unchanged
    @pytest.mark.xfail(strict=True, reason=f"{SMALL_MODEL} does not follow the suite's agent loop to the expected answer")
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_agent_loop(self, model):
        super().test_agent_loop(model)


# ============================================================================ our own checks on the real model
@pytest.fixture
def model(int4_engine):
    return OpencotiChatModel(engine=int4_engine, temperature=0, max_tokens=48)


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"It is sunny and 22 degrees Celsius in {city}."


@pytest.mark.bundled
def test_forced_tool_call_round_trip(model):
    model = model.model_copy(update={"max_tokens": 96})
    bound = model.bind_tools([get_weather], tool_choice="get_weather")
    msgs = [HumanMessage("What is the weather in Paris?")]
    first = bound.invoke(msgs)
    assert first.tool_calls and first.tool_calls[0]["name"] == "get_weather"
    assert first.response_metadata["finish_reason"] == "tool_calls"
    call = first.tool_calls[0]
    assert "paris" in str(call["args"].get("city", "")).lower(), call
    result = ToolMessage(get_weather.invoke({"city": call["args"]["city"]}), tool_call_id=call["id"])
    answer = model.bind_tools([get_weather]).invoke(msgs + [first, result])
    assert answer.text.strip() and not answer.tool_calls


class FanState(PolyKVState, total=False):
    tasks: list[str]
    results: Annotated[list, operator.add]


class WorkerState(PolyKVState, total=False):
    task: str
    results: Annotated[list, operator.add]


@pytest.mark.bundled
def test_paced_fan_out_under_an_enforced_floor(int4_engine):
    model = OpencotiChatModel(engine=int4_engine, temperature=0, max_tokens=24)
    client = model.polykv_client
    system = "You are a sub-agent. Answer in one sentence."
    pool = client.create_pool(messages=[{"role": "system", "content": system}])
    client.set_admission(pool.pool_id, target_tps_per_session=0.5, mode="enforced", on_saturation="queue",
                         settle_tokens=8, settle_max_ms=3000)
    pacer = SpawnPacer(claim_timeout_s=10, max_batch=1)  # one at a time: no batch skips a settle window

    def agent(state: WorkerState):
        msg = model.invoke([SystemMessage(system), HumanMessage(state["task"])], pool_id=state["pool_id"],
                           session_id=state["session_id"])
        client.release_session(state["session_id"])
        return {"results": [(state["task"], msg.text)]}

    w = StateGraph(WorkerState)
    w.add_node("gate", CapacityGateNode(client, spawn="agent", hold=END, on_hold="wait", max_wait_s=120, pacer=pacer))
    w.add_node("agent", agent)
    w.add_edge(START, "gate")
    w.add_edge("agent", END)
    g = StateGraph(FanState)
    g.add_node("worker", w.compile())
    g.add_conditional_edges(START, lambda s: [Send("worker", {"task": t, "pool_id": s["pool_id"]})
                                              for t in s["tasks"]], ["worker"])
    g.add_edge("worker", END)
    tasks = ["Name a colour.", "Name a fruit.", "Name an animal.", "Name a city."]
    out = g.compile().invoke({"tasks": tasks, "pool_id": pool.pool_id})
    assert sorted(t for t, _ in out["results"]) == sorted(tasks) and all(a for _, a in out["results"])
    spawns = [e for e in pacer.log if e["decision"] == "spawn"]
    assert len(spawns) == 4 and not any(e["settling"] for e in spawns)
    assert any(e["decision"] == "wait" and e["settling"] for e in pacer.log), pacer.log  # held while settling
    admits = [e for e in client.events(pool.pool_id) if e["event"] == "admit"]
    assert len(admits) == 4
    client.release_pool(pool.pool_id)
    int4_engine.check_integrity()


@pytest.mark.bundled
def test_compaction_end_to_end(bundled_engine):  # fp32 greedy: its answer is checked for the name
    model = OpencotiChatModel(engine=bundled_engine, temperature=0, max_tokens=40)
    client = model.polykv_client
    system = "You are a helpful assistant."
    root = client.create_pool(messages=[{"role": "system", "content": system}], label="system")
    convo = [SystemMessage(system), HumanMessage("Hi! My name is Alice and I live in Paris."),
             AIMessage("Nice to meet you, Alice! Paris is a beautiful city, famous for the Eiffel Tower, the Louvre "
                       "museum, its cafes and its long walks along the river Seine."),
             HumanMessage("I have a cat called Tom."),
             AIMessage("Tom is a lovely name for a cat! Cats are curious, independent animals. Make sure Tom has "
                       "fresh water, a comfortable place to sleep and some toys to play with."),
             HumanMessage("What is a good book to read?")]
    work = client.fork_pool(root.pool_id, messages=convert_messages(convo[:-1]), label="working")
    answer = model.invoke(convo, pool_id=work.pool_id, session_id="alice")
    convo.append(answer)

    class ChatState(PolyKVMessagesState, total=False):
        compact_now: bool

    def agent(state):
        msg = model.invoke(state["messages"], pool_id=state["pool_id"], session_id=state["session_id"])
        return {"messages": [msg], **polykv_update(msg)}

    g = StateGraph(ChatState)
    g.add_node("compact", CompactionNode(model, keep_last=2, summary_max_tokens=80))
    g.add_node("agent", agent)
    g.add_edge(START, "compact")
    g.add_edge("compact", "agent")
    g.add_edge("agent", END)
    app = g.compile(checkpointer=InMemorySaver(), interrupt_after=["compact"])
    cfg = {"configurable": {"thread_id": "alice"}}
    pages_before = client.pools().kv_pages_used
    out = app.invoke({"messages": convo + [HumanMessage("What is my name?")], "pool_id": work.pool_id,
                      "root_pool_id": root.pool_id, "session_id": "alice", "compact_now": True}, cfg)
    tree = client.pools()
    assert work.pool_id not in {p.pool_id for p in tree.pools}  # the old working pool was released
    assert tree.kv_pages_used < pages_before  # compaction is a re-fork: net KV goes down
    out = app.invoke(None, cfg)  # the graph continues with the agent
    msgs = out["messages"]
    summary = msgs[1].content
    assert summary.startswith("Summary of the conversation so far:") and len(msgs) == 5
    assert out["pool_id"] not in (work.pool_id, root.pool_id)
    new = client.pool(out["pool_id"])
    assert new.parent == root.pool_id and new.branch_pos == root.prefix_len
    last = msgs[-1]
    assert last.usage_metadata["input_token_details"]["cache_read"] >= new.prefix_len  # continued on the new pool
    assert "alice" in summary.lower(), summary
    assert "alice" in last.text.lower(), (summary, last.text)  # answered from the summary
    client.release_session("alice")
    client.release_pool(new.pool_id)
    client.release_pool(root.pool_id)
    bundled_engine.check_integrity()


# ============================================================================ langgraph dev
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


@pytest.mark.bundled
def test_langgraph_dev_serves_the_examples(tmp_path, opencoti_cache):
    exe = Path(sys.executable).with_name("langgraph")
    if not exe.exists():
        pytest.fail("langgraph-cli is not installed (pip install 'langgraph-cli[inmem]'; the dev extra has it)")
    port = _free_port()
    env = {**os.environ, "LANGGRAPH_CLI_NO_ANALYTICS": "1", "LANGSMITH_TRACING": "false"}
    env.pop("OPENCOTI_BASE_URL", None)
    env.pop("OPENCOTI_MODEL", None)  # the bundled model (the agent's tools need more context than tiny:llama's)
    log = open(tmp_path / "langgraph-dev.log", "w")
    examples = shutil.copytree(ROOT / "examples", tmp_path / "examples")  # it writes .langgraph_api/ there
    proc = subprocess.Popen([str(exe), "dev", "--no-browser", "--no-reload", "--host", "127.0.0.1", "--port",
                             str(port), "--config", str(examples / "langgraph.json")],
                            cwd=examples, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{base}/ok", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, (tmp_path / "langgraph-dev.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "langgraph dev did not start"
            time.sleep(0.5)
        graphs = {a["graph_id"] for a in _post(f"{base}/assistants/search", {})}
        assert graphs == {"agent", "fanout", "branching", "compaction"}
        thread = _post(f"{base}/threads", {})
        out = _post(f"{base}/threads/{thread['thread_id']}/runs/wait",
                    {"assistant_id": "compaction", "input": {"messages": [{"role": "user", "content": "hello"}]}})
        assert [m["type"] for m in out["messages"]] == ["system", "human", "ai"], out
        assert out["pool_id"] == out["root_pool_id"] and out["session_id"].startswith("chat-")
        assert out["messages"][-1]["response_metadata"]["pool_id"] == out["pool_id"]
        out = _post(f"{base}/runs/wait", {"assistant_id": "fanout", "input": {
            "brief": "colours", "subtasks": ["red", "blue"], "floor_tps": 1.0}})
        assert sorted(r["subtask"] for r in out["results"]) == ["blue", "red"], out
        # the create_agent example: the thread's second turn reads its first from the KV cache
        thread = _post(f"{base}/threads", {})
        turns = [_post(f"{base}/threads/{thread['thread_id']}/runs/wait", {"assistant_id": "agent", "input": {
            "messages": [{"role": "user", "content": q}]}}) for q in ("hello", "and again")]
        first, second = (t["messages"][-1] for t in turns)
        assert turns[1]["session_id"] == f"thread-{thread['thread_id']}"
        assert second["usage_metadata"]["input_token_details"]["cache_read"] >= \
            first["usage_metadata"]["input_tokens"], turns
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.mark.bundled
def test_agent_example_as_a_script(opencoti_cache):
    """examples/agent.py on the bundled model, as a user runs it: turn 2 reads turn 1 from the KV cache
    (through the thread's session; see PolyKVMiddleware)."""
    env = {**os.environ, "LANGSMITH_TRACING": "false"}
    for k in ("OPENCOTI_BASE_URL", "OPENCOTI_MODEL"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, "agent.py"], cwd=ROOT / "examples", env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    import re
    turns = re.findall(r"input tokens (\d+), read from the KV cache (\d+)", r.stdout)
    assert len(turns) == 2, r.stdout
    (in1, _), (in2, read2) = [(int(a), int(b)) for a, b in turns]
    assert read2 >= in1 and in2 > in1, r.stdout
