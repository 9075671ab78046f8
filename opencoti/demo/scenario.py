"""The demo scenario as a LangGraph graph: a LangGraph multi-agent graph that builds a pool tree, fans out under a tps
floor, nests, branches, compacts and gathers — on an in-process engine or a remote ``opencoti serve``.

    from opencoti.demo import DemoConfig, run_demo
    result = run_demo(DemoConfig(agents=6, out="demo-report"))      # in-process, bundled model
    result = run_demo(DemoConfig(server="http://127.0.0.1:8080"))   # the same graph over HTTP

The steps (nested fork and branch, compaction, admission: docs/polykv.md), all visible in the live view and the report:

1. **root pool** — the lead agent's system prompt + tool definitions (the ``polykv_tools``) become
   the root pool (``create_pool`` tool).
2. **task pool (extend)** — the lead agent writes a task brief in its own session; its context
   (system + tools + task + brief) is forked from the root at ``D = root.L`` (``fork_pool`` tool).
   A control request then prefills one sub-agent's exact prompt with no pool at all: the run's own
   full-prefill TTFT to compare attaches with.
3. **fan-out under a floor** — ``agents`` sub-agents attach to the task pool through
   ``CapacityGateNode`` (shared ``SpawnPacer``) under a per-session tps floor (default: a fraction of
   the lead agent's solo decode speed measured in step 2), so not all fit: the rest wait.
4. **nested fork** — the first sub-agent (the coordinator) finds its part needs two agents: it
   forks its own context from the task pool (extend) and fans out under its own gate.
5. **COW branch** — a review group with a different toolset forks the root at the end of the shared
   system preamble (``D < root.L``): the preamble is shared, only the new tool block is computed.
6. **compaction by re-fork** — a long-running agent works turn after turn in its own pool until its
   compaction pressure crosses the threshold; ``CompactionNode`` summarizes, forks the root
   (system + tools) with the summary + recent tail, moves the session and releases the old pool.
7. **gather** — the lead agent continues on the task pool with the sub-agents' results and answers.

The text the agents write comes from the model (greedy by default); the roles, parts and instructions
are fixed by this script. Every number in the report is measured (``recorder.py``, ``report.py``).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_core.utils.function_calling import convert_to_openai_tool
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send

from ..client import PolyKVClient
from ..engine.errors import OpencotiError
from ..langgraph import OpencotiChatModel, SpawnPacer, polykv_tools, polykv_update
from .config import DemoConfig
from .hooks import RecordedGate, text_of
from .recorder import Recorder
from .scenario_long import LongAgentMixin
from .scenario_state import (MAX_GATHERED, AgentOutput, AgentState, DemoState, GroupState, _common_prefix, _dicts,
                             _message)
from .script import NESTED_PARTS, PARTS, REVIEW_PARTS, SYSTEM_PROMPT, TASK, check_facts, suggest_edit


# ============================================================================ state
# ============================================================================ the scenario
class Scenario(LongAgentMixin):
    """Builds and runs the graph; ``client``/``model`` decide the transport."""

    def __init__(self, cfg: DemoConfig, client: PolyKVClient, model: OpencotiChatModel, recorder: Recorder,
                 ctx_total: int, on_floor: Callable[[float], None] | None = None):
        self.cfg, self.client, self.model, self.rec = cfg, client, model, recorder
        self.on_floor = on_floor
        self.ctx_total = ctx_total
        self.pool_tools = polykv_tools(client)
        self.tools = {t.name: t for t in self.pool_tools}
        self.toolsets = {"main": [convert_to_openai_tool(t) for t in self.pool_tools],
                         "review": [convert_to_openai_tool(t) for t in (check_facts, suggest_edit)]}
        self.pacer = SpawnPacer()
        self.floor: float | None = cfg.floor
        self.floor_source = "given with --floor" if cfg.floor is not None else ""
        self.gates: dict[str, RecordedGate] = {}
        self.last_caps: dict[str, Any] = {}
        self.pools_made: list[int] = []
        self.sessions_made: list[str] = []
        self.task_messages: list[dict] = []
        self._agent_index: dict[str, int] = {}
        self._lock = threading.Lock()
        self.compact_threshold: float | None = None  # set when the long-running agent's pool exists

    # ---------------------------------------------------------------- helpers
    def _tool(self, name: str, **args) -> dict:
        out = self.tools[name].invoke(args)
        if not isinstance(out, dict):
            raise OpencotiError(f"{name} failed: {out}")
        return out

    def _render(self, messages: list[dict], toolset: str = "main") -> str:
        return self.client.apply_template(messages, tools=self.toolsets[toolset], add_generation_prompt=False)

    def _sampling(self, agent: str) -> dict:
        if self.cfg.seed is None:
            return {"temperature": 0.0}
        with self._lock:
            i = self._agent_index.setdefault(agent, len(self._agent_index))
        return {"temperature": 0.7, "seed": self.cfg.seed + i}

    def _call(self, agent: str, role: str, messages: list[BaseMessage], *, toolset: str = "main",
              pool_id: int | None = None, session_id: str | None = None, max_tokens: int | None = None,
              extra_body: dict | None = None) -> AIMessage:
        model = self.model.bind_tools(self.toolsets[toolset], tool_choice="none")
        if session_id:
            with self._lock:
                if session_id not in self.sessions_made:
                    self.sessions_made.append(session_id)
        return model.invoke(messages, config={"metadata": {"demo_agent": agent, "demo_role": role}},
                            pool_id=pool_id, session_id=session_id, max_tokens=max_tokens or self.cfg.max_tokens,
                            **({"extra_body": extra_body} if extra_body else {}), **self._sampling(agent))

    def _pool_made(self, kind: str, pool: dict) -> None:
        with self._lock:
            self.pools_made.append(pool["pool_id"])
        self.rec.pool_op("create", pool, kind=kind)

    def _release_session(self, sid: str) -> None:
        try:
            self.client.release_session(sid)
        except OpencotiError:
            pass

    def _policy(self, pool_id: int) -> None:
        self.client.set_admission(pool_id, target_tps_per_session=self.floor, mode="advisory",
                                  guarantee_min_sessions=1, settle_tokens=self.cfg.settle_tokens,
                                  settle_max_ms=self.cfg.settle_max_ms)

    def _gate(self, key: str, spawn: str = "work", hold: str = "hold") -> RecordedGate:
        if key not in self.gates:
            self.gates[key] = RecordedGate(self.client, spawn=spawn, hold=hold, on_hold="wait", pacer=self.pacer,
                                            max_wait_s=self.cfg.gate_wait_s, recorder=self.rec,
                                            last=self.last_caps,
                                            expected_tokens=lambda s: s.get("expected_tokens"))
        return self.gates[key]

    # ---------------------------------------------------------------- agent subgraph nodes
    def arrive(self, state: AgentState) -> dict:
        self.rec.agent(state["agent"], "waiting", pool_id=state.get("pool_id"), session_id=state.get("session_id"),
                       role=state.get("role"))
        return {}

    def hold(self, state: AgentState) -> dict:
        cap = self.last_caps.get(state["agent"])
        row = cap.model_dump() if cap is not None else {}
        row["reason"] = state.get("reason") or row.get("reason")  # the gate's own verdict (e.g. pacing)
        self.rec.decision(state["agent"], state.get("pool_id"), "hold", row,
                          note=f"no capacity within {self.cfg.gate_wait_s:g} s: back to the gate")
        return {}

    def work(self, state: AgentState) -> dict:
        name, pool, sid = state["agent"], state["pool_id"], state.get("session_id") or state["agent"]
        cap = self.last_caps.pop(name, None)
        self.rec.decision(name, pool, "spawn", cap.model_dump() if cap else None)
        self.rec.agent(name, "running", pool_id=pool, session_id=sid)
        msg = self._call(name, state.get("role", "sub-agent"), state["messages"], toolset=state.get("toolset", "main"),
                         pool_id=pool, session_id=sid, max_tokens=state.get("max_tokens"))
        self._release_session(sid)  # the agent is done: its KV goes back to the cache
        self.rec.agent(name, "done")
        return {"messages": [msg], "results": [{"agent": name, "role": state.get("role"), "pool_id": pool,
                                                "text": text_of(msg)}], **polykv_update(msg)}

    def leaf_graph(self):
        g = StateGraph(AgentState, output_schema=AgentOutput)
        g.add_node("arrive", self.arrive)
        g.add_node("gate", self._gate("agent"))
        g.add_node("hold", self.hold)
        g.add_node("work", self.work)
        g.add_edge(START, "arrive")
        g.add_edge("arrive", "gate")
        g.add_edge("hold", "gate")
        g.add_edge("work", END)
        return g.compile(name="agent")

    # ---------------------------------------------------------------- coordinator (nested fork)
    def plan_nested(self, state: AgentState) -> dict:
        name = state["agent"]
        msgs = [*_dicts(state["messages"]),
                {"role": "user", "content": "Your part is too big for one agent: split it between sub-agents."}]
        self.rec.phase("nested fork", f"{name} found fan-out work: it forks its own context from the task pool "
                                      f"(extend) and spawns {self.cfg.nested_agents} sub-agents of its own")
        pool = self._tool("fork_pool", parent_pool_id=state["pool_id"], text=self._render(msgs),
                          label=f"{name}-nested")
        self._pool_made("extend (nested)", pool)
        self._policy(pool["pool_id"])
        return {"pool_id": pool["pool_id"], "messages": [HumanMessage(msgs[-1]["content"])]}

    def fan_out_nested(self, state: AgentState) -> list[Send]:
        base = list(state["messages"])
        sends = []
        for j in range(self.cfg.nested_agents):
            part = NESTED_PARTS[j % len(NESTED_PARTS)]
            name = f"{state['agent']}.{j}"
            ask = HumanMessage(f"You are sub-agent {name}. Your part: {part}. Write your part of the schedule.")
            sends.append(Send("nested", {"agent": name, "role": "nested", "toolset": "main",
                                         "pool_id": state["pool_id"], "session_id": name,
                                         "messages": base + [ask], "expected_tokens": 40 + self.cfg.max_tokens}))
        return sends

    def close_nested(self, state: AgentState) -> dict:
        pid = state["pool_id"]
        self._tool("release_pool", pool_id=pid)
        self.rec.pool_op("release", {"pool_id": pid, "label": f"{state['agent']}-nested"})
        return {}

    def coordinator_graph(self, leaf):
        g = StateGraph(AgentState, output_schema=AgentOutput)
        g.add_node("arrive", self.arrive)
        g.add_node("gate", self._gate("agent"))
        g.add_node("hold", self.hold)
        g.add_node("work", self.work)
        g.add_node("plan_nested", self.plan_nested)
        g.add_node("nested", leaf)
        g.add_node("close_nested", self.close_nested)
        g.add_edge(START, "arrive")
        g.add_edge("arrive", "gate")
        g.add_edge("hold", "gate")
        g.add_edge("work", "plan_nested")
        g.add_conditional_edges("plan_nested", self.fan_out_nested, ["nested"])
        g.add_edge("nested", "close_nested")
        g.add_edge("close_nested", END)
        return g.compile(name="coordinator")

    # ---------------------------------------------------------------- review group (COW branch)
    def fork_branch(self, state: GroupState) -> dict:
        root = state["root_pool_id"]
        system = [{"role": "system", "content": SYSTEM_PROMPT}]
        text_b = self._render(system, "review")
        root_tokens = self.client.tokenize(self._render(system, "main"))
        tokens_b = self.client.tokenize(text_b)
        d = _common_prefix(root_tokens, tokens_b)
        self.rec.phase("COW branch", f"a review group with a different toolset forks the root pool at D={d} < "
                                     f"L={len(root_tokens)}: the shared system preamble [0, {d}) is not copied, "
                                     f"only its own tool block is computed")
        pool = self._tool("fork_pool", parent_pool_id=root, text=text_b, branch_pos=d, label="review-tools")
        self._pool_made("branch (COW)", pool)
        self._policy(pool["pool_id"])
        return {"branch_pool_id": pool["pool_id"]}

    def fan_out_review(self, state: GroupState) -> list[Send]:
        sends = []
        for j in range(self.cfg.review_agents):
            name = f"reviewer-{j}"
            msgs = [SystemMessage(SYSTEM_PROMPT),
                    HumanMessage(f"You are {name}, an editor with fact-checking tools. Review "
                                 f"{REVIEW_PARTS[j % len(REVIEW_PARTS)]} for the science fair and name two risks.")]
            sends.append(Send("reviewer", {"agent": name, "role": "reviewer", "toolset": "review",
                                           "pool_id": state["branch_pool_id"], "session_id": name, "messages": msgs,
                                           "expected_tokens": 60 + self.cfg.max_tokens}))
        return sends

    def review_graph(self, leaf):
        g = StateGraph(GroupState, output_schema=AgentOutput)
        g.add_node("fork_branch", self.fork_branch)
        g.add_node("reviewer", leaf)
        g.add_edge(START, "fork_branch")
        g.add_conditional_edges("fork_branch", self.fan_out_review, ["reviewer"])
        g.add_edge("reviewer", END)
        return g.compile(name="review_group")

    # ---------------------------------------------------------------- the lead agent
    def make_root(self, state: DemoState) -> dict:
        self.rec.phase("root pool", "the lead agent's system prompt + tool definitions become the root pool")
        system = [{"role": "system", "content": SYSTEM_PROMPT}]
        pool = self._tool("create_pool", text=self._render(system), label="system+tools")
        self._pool_made("root", pool)
        return {"root_pool_id": pool["pool_id"]}

    def write_brief(self, state: DemoState) -> dict:
        self.rec.phase("task brief", "the lead agent writes the task brief in its own session on the root pool")
        root = state["root_pool_id"]
        self.rec.agent("lead", "running", pool_id=root, session_id="lead")
        msg = self._call("lead", "lead", [SystemMessage(SYSTEM_PROMPT), HumanMessage(TASK)], pool_id=root,
                         session_id="lead")
        self.rec.agent("lead", "idle", pool_id=root, session_id="lead")
        # the lead's experienced tps at the end of the brief (the EWMA, past the first tokens' warm-up),
        # else its average over the brief
        md = msg.response_metadata or {}
        solo = md.get("session_tps") or (md.get("timings") or {}).get("predicted_per_second")
        if self.floor is None:
            if not solo:
                raise OpencotiError("could not measure the lead agent's decode speed to pick a floor; give --floor")
            self.floor = round(self.cfg.floor_fraction * solo, 2)
            self.floor_source = (f"{self.cfg.floor_fraction:g} x the lead agent's solo decode speed measured in this "
                                 f"run, {solo:.1f} tok/s")
        if self.on_floor is not None:
            self.on_floor(self.floor)
        self.rec.info["solo_tps"] = solo
        return {"brief": text_of(msg)}

    def make_task_pool(self, state: DemoState) -> dict:
        self.task_messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": TASK},
                              {"role": "assistant", "content": state["brief"]}]
        self.rec.phase("task pool (extend)", "system + tools + task + brief are forked from the root at D = root L")
        pool = self._tool("fork_pool", parent_pool_id=state["root_pool_id"], text=self._render(self.task_messages),
                          label="task brief")
        self._pool_made("extend", pool)
        self._policy(pool["pool_id"])
        self.rec.note(f"tps floor {self.floor:g} tok/s per session ({self.floor_source}); "
                      f"settle {self.cfg.settle_tokens} tokens / {self.cfg.settle_max_ms:g} ms")
        return {"task_pool_id": pool["pool_id"]}

    def _sub_messages(self, i: int) -> list[BaseMessage]:
        part = PARTS[i % len(PARTS)] + ("" if i < len(PARTS) else f" (second opinion {i // len(PARTS)})")
        return [_message(m) for m in self.task_messages] + [
            HumanMessage(f"You are sub-agent {i}. Your part: {part}. Write your part of the plan.")]

    def control(self, state: DemoState) -> dict:
        self.rec.phase("full-prefill control", "sub-agent 0's exact prompt is prefilled once with no pool, for "
                                               "the TTFT comparison")
        # a salt of its own: the automatic prefix cache must not serve this baseline from the pools' pages
        self._call("control", "control", self._sub_messages(0), max_tokens=1,
                   extra_body={"cache_salt": f"full-prefill-control-{time.time_ns()}"})
        return {}

    def dispatch(self, state: DemoState) -> list[Send]:
        self.rec.phase("fan-out", f"{self.cfg.agents} sub-agents attach to the task pool through the capacity gate "
                                  f"(floor {self.floor:g} tok/s); the review group and the long-running agent "
                                  "start at the same time")
        sends = []
        for i in range(self.cfg.agents):
            name = f"sub-{i}"
            payload = {"agent": name, "role": "coordinator" if i == 0 else "sub-agent", "toolset": "main",
                       "pool_id": state["task_pool_id"], "session_id": name, "messages": self._sub_messages(i),
                       "expected_tokens": 40 + self.cfg.max_tokens}
            sends.append(Send("coordinator" if i == 0 else "sub_agent", payload))
        sends.append(Send("review_group", {"root_pool_id": state["root_pool_id"]}))
        sends.append(Send("long_agent", {"root_pool_id": state["root_pool_id"]}))
        return sends

    def gather(self, state: DemoState) -> dict:
        self.rec.phase("gather", "the lead agent continues on the task pool with its team's results and answers")
        lines = []
        for r in sorted(state.get("results") or [], key=lambda r: r["agent"]):
            text = " ".join(r["text"].split())
            lines.append(f"- {r['agent']}: {text[:90]}")
        if len(lines) > MAX_GATHERED:  # the lead's context is bounded: the rest are counted, not quoted
            lines = lines[:MAX_GATHERED] + [f"- ... and {len(lines) - MAX_GATHERED} more reports"]
        msgs = [_message(m) for m in self.task_messages] + [HumanMessage(
            "Your team reported:\n" + "\n".join(lines) + "\nWrite the final plan in five short bullet points.")]
        self.rec.agent("lead", "running", pool_id=state["task_pool_id"], session_id="lead")
        msg = self._call("lead", "lead", msgs, pool_id=state["task_pool_id"], session_id="lead",
                         max_tokens=2 * self.cfg.max_tokens)
        self.rec.agent("lead", "done")
        return {"answer": text_of(msg)}

    def graph(self):
        leaf = self.leaf_graph()
        g = StateGraph(DemoState)
        g.add_node("root_pool", self.make_root)
        g.add_node("brief", self.write_brief)
        g.add_node("task_pool", self.make_task_pool)
        g.add_node("control", self.control)
        g.add_node("sub_agent", leaf)
        g.add_node("coordinator", self.coordinator_graph(leaf))
        g.add_node("review_group", self.review_graph(leaf))
        g.add_node("long_agent", self.long_graph())
        g.add_node("gather", self.gather)
        g.add_edge(START, "root_pool")
        g.add_edge("root_pool", "brief")
        g.add_edge("brief", "task_pool")
        g.add_edge("task_pool", "control")
        g.add_conditional_edges("control", self.dispatch, ["sub_agent", "coordinator", "review_group", "long_agent"])
        for n in ("sub_agent", "coordinator", "review_group", "long_agent"):
            g.add_edge(n, "gather")
        g.add_edge("gather", END)
        return g.compile(name="opencoti-demo")
