"""What a LangGraph user measures in a second hour with opencoti, on the bundled model:

* gate: six ``Send`` workers behind a ``CapacityGateNode`` (``on_hold="wait"``, a shared
  ``SpawnPacer``) on an advisory pool with ``target_tps_per_session=--floor`` (8): when each worker's model
  call started (s after the invoke), with batches (cold engine, then warm) and one at a time
  (``max_batch=1``);
* forced tool choice: calls per answer for ``tool_choice="any"`` and a tool's name, in-process,
  over HTTP and through ``ChatOpenAI``;
* restart: a ``create_agent`` thread (``PolyKVMiddleware``, SQLite checkpointer) against
  ``opencoti serve --state-dir``; the server is killed (SIGKILL) after turn 1 and started again;
  turn 2's first model call: prompt tokens and how many were read from the KV cache (with and
  without session KV files).

    .venv/bin/python scripts/langgraph_user_checks.py [--out scripts/results/langgraph_user_checks.json]
        [--only gate|tools|restart] [--floor 8]

The result file keeps the sections not run (``--only``); ``load`` has the machine's load average
before and after each section as it ran.
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ============================================================================ gate
def gate_runs(floor: float) -> dict:
    from langchain_core.messages import HumanMessage, SystemMessage
    from langgraph.graph import END, START, StateGraph
    from langgraph.types import Send

    from opencoti.engine import Engine
    from opencoti.langgraph import CapacityGateNode, OpencotiChatModel, PolyKVState, SpawnPacer

    class Fan(PolyKVState, total=False):
        tasks: list[str]
        results: Annotated[list, operator.add]

    class Task(PolyKVState, total=False):
        task: str
        results: Annotated[list, operator.add]

    engine = Engine.from_default(pool_grace_ttl_s=0, weights="int4")
    model = OpencotiChatModel(engine=engine, temperature=0, max_tokens=24)
    c = model.polykv_client
    system = "You are a terse research assistant."

    def run(label: str, pacer: SpawnPacer, floor: float | None) -> dict:
        starts: list[float] = []
        ends: list[float] = []
        tps: list[float] = []

        def work(state: Task) -> dict:
            starts.append(time.monotonic())
            msg = model.invoke([SystemMessage(system), HumanMessage("Answer in ten words: " + state["task"])],
                               pool_id=state["pool_id"], session_id=state["session_id"])
            ends.append(time.monotonic())
            tps.append(msg.response_metadata.get("session_tps") or 0.0)
            c.release_session(state["session_id"])
            return {"results": [state["task"]]}

        w = StateGraph(Task)
        w.add_node("gate", CapacityGateNode(c, spawn="work", hold=END, on_hold="wait", max_wait_s=120, pacer=pacer))
        w.add_node("work", work)
        w.add_edge(START, "gate")
        w.add_edge("work", END)
        g = StateGraph(Fan)
        g.add_node("worker", w.compile())
        g.add_conditional_edges(START, lambda s: [Send("worker", {"task": t, "pool_id": s["pool_id"],
                                                                  "session_id": f"{label}-{i}"})
                                                  for i, t in enumerate(s["tasks"])], ["worker"])
        g.add_edge("worker", END)
        pool = c.create_pool(messages=[{"role": "system", "content": system}])
        if floor is not None:
            c.set_admission(pool.pool_id, target_tps_per_session=floor)
        t0 = time.monotonic()
        out = g.compile().invoke({"tasks": [f"What is topic {i}?" for i in range(6)], "pool_id": pool.pool_id})
        total = time.monotonic() - t0
        c.release_pool(pool.pool_id)
        assert len(out["results"]) == 6
        return {"run": label, "floor": floor, "max_batch": pacer.max_batch,
                "starts_s": sorted(round(t - t0, 2) for t in starts), "total_s": round(total, 2),
                "durations_s": sorted(round(e - s, 2) for s, e in zip(sorted(starts), sorted(ends))),
                "session_tps": sorted(round(x, 1) for x in tps),
                "spawns_in_batches": sum(1 for e in pacer.log if e["decision"] == "spawn" and e.get("batch"))}

    rows = [run("batched-cold", SpawnPacer(), floor), run("batched-warm", SpawnPacer(), floor),
            run("one-at-a-time", SpawnPacer(max_batch=1), floor), run("no-floor", SpawnPacer(), None)]
    engine.shutdown()
    return {f"gate_floor_{floor:g}": rows}


# ============================================================================ server
class Server:
    def __init__(self, state_dir: str, session_kv_mib: float):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "opencoti", "serve", "--port", str(self.port), "--state-dir", state_dir,
                     "--session-kv-budget-mib", str(session_kv_mib), "--weights", "int4", "--page-size", "16",
                     "--kv-budget-tokens", "16384", "--pool-grace-ttl", "0", "--log-level", "warning"]
        self.proc = None

    def start(self) -> "Server":
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.3)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


def forced_tool_calls(server: Server) -> list[dict]:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    from opencoti.engine import Engine
    from opencoti.langgraph import OpencotiChatModel

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"It is sunny in {city}."

    engine = Engine.from_default(pool_grace_ttl_s=0, weights="int4")
    models = {"in-process": OpencotiChatModel(engine=engine, temperature=0, max_tokens=96),
              "http": OpencotiChatModel(base_url=server.base, temperature=0, max_tokens=96),
              "ChatOpenAI": ChatOpenAI(base_url=server.base + "/v1", api_key="unused", model="opencoti",
                                       temperature=0, max_tokens=96, max_retries=0)}
    rows = []
    for name, m in models.items():
        for choice in ("any", "get_weather"):
            msg = m.bind_tools([get_weather], tool_choice=choice).invoke("What is the weather in Paris?")
            rows.append({"transport": name, "tool_choice": choice, "calls": len(msg.tool_calls),
                         "args": [c["args"] for c in msg.tool_calls], "content": msg.text})
    engine.shutdown()
    return rows


def restart_turns(session_kv_mib: float) -> dict:
    from langchain.agents import create_agent
    from langchain_core.tools import tool
    from langgraph.checkpoint.sqlite import SqliteSaver

    from opencoti.langgraph import OpencotiChatModel, PolyKVMiddleware

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"It is sunny in {city}."

    state = tempfile.mkdtemp()
    threads = SqliteSaver(sqlite3.connect(f"{state}/threads.sqlite", check_same_thread=False))
    cfg = {"configurable": {"thread_id": "restart"}}
    srv = Server(state, session_kv_mib).start()

    def agent():
        m = OpencotiChatModel(base_url=srv.base, temperature=0, max_tokens=48)
        return create_agent(m, tools=[get_weather], system_prompt="Use a tool when it helps.",
                            middleware=[PolyKVMiddleware()], checkpointer=threads)

    t1 = agent().invoke({"messages": [{"role": "user", "content": "Weather in Paris?"}]}, cfg)
    time.sleep(2)  # the KV file is written in the background after the turn
    srv.kill()
    srv.start()
    t2 = agent().invoke({"messages": [{"role": "user", "content": "And in Rome?"}]}, cfg)
    srv.stop()
    first = next(m for m in t2["messages"][len(t1["messages"]):] if m.type == "ai")
    last1 = t1["messages"][-1].usage_metadata
    return {"session_kv_budget_mib": session_kv_mib, "turn1_last_call_input_tokens": last1["input_tokens"],
            "turn2_first_call_input_tokens": first.usage_metadata["input_tokens"],
            "turn2_first_call_cached": first.usage_metadata["input_token_details"]["cache_read"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results" / "langgraph_user_checks.json"))
    ap.add_argument("--only", choices=["gate", "tools", "restart"], default=None)
    ap.add_argument("--floor", type=float, default=8.0, help="the pool's tps floor in the gate runs (default 8)")
    args = ap.parse_args()
    out: dict = {"machine": {"cpus": os.cpu_count()}}
    load: dict = {}  # per section: the load average (1, 5, 15 min) before and after it ran

    def measured(name: str, fn):
        before = [round(x, 2) for x in os.getloadavg()]
        value = fn()
        load[name] = {"before": before, "after": [round(x, 2) for x in os.getloadavg()]}
        return value

    if args.only in (None, "gate"):
        gate = measured(f"gate_floor_{args.floor:g}", lambda: gate_runs(args.floor))
        out.update(gate)
        print(json.dumps(gate, indent=1), flush=True)
    if args.only in (None, "tools"):
        srv = Server(tempfile.mkdtemp(), 0).start()
        try:
            out["forced_tool_choice"] = measured("forced_tool_choice", lambda: forced_tool_calls(srv))
        finally:
            srv.stop()
        print(json.dumps(out["forced_tool_choice"], indent=1), flush=True)
    if args.only in (None, "restart"):
        out["restart"] = measured("restart", lambda: [restart_turns(1024.0), restart_turns(0.0)])
        print(json.dumps(out["restart"], indent=1), flush=True)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(path.read_text()) if path.exists() else {}
    out["load"] = {**old.get("load", {}), **load}  # sections not run now keep the load they ran under
    path.write_text(json.dumps({**old, **out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
