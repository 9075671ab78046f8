"""The demo's long-running agent: turn after turn in its own pool until compaction by re-fork."""

from __future__ import annotations

import time
from typing import Literal

from langchain_core.messages import HumanMessage, SystemMessage
from langgraph.graph import END, START, StateGraph

from ..langgraph import CompactionNode, polykv_update
from .hooks import text_of
from .scenario_state import AgentOutput, AgentState, _Empty
from .script import LONG_ROLE, LONG_STEPS, SYSTEM_PROMPT


class LongAgentMixin:
    """Part of ``Scenario``: the logistics lead, compacted when its context pressure crosses a threshold."""

    def long_setup(self, state: AgentState) -> dict:
        msgs = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": LONG_ROLE}]
        pool = self._tool("fork_pool", parent_pool_id=state["root_pool_id"], text=self._render(msgs),
                          label="logistics")
        # the threshold: the pressure (context used / context length) after about compact_after_turns turns
        budget = pool["prefix_len"] + self.cfg.compact_after_turns * (self.cfg.max_tokens + 24)
        self.compact_threshold = round(min(0.95, budget / max(self.ctx_total, 1)), 3)
        self._compactor.pressure_threshold = self.compact_threshold
        self.rec.phase("long-running agent", "the logistics lead works turn after turn in its own pool "
                                             f"(extend of the root); compaction threshold: pressure >= "
                                             f"{self.compact_threshold:.2f} (~{budget} of {self.ctx_total} tokens)")
        self._pool_made("extend", pool)
        self._policy(pool["pool_id"])
        return {"pool_id": pool["pool_id"], "session_id": "logistics", "agent": "logistics", "role": "long",
                "messages": [SystemMessage(SYSTEM_PROMPT), HumanMessage(LONG_ROLE), HumanMessage(LONG_STEPS[0])],
                "turns": 0, "compactions": 0, "expected_tokens": 80 + self.cfg.max_tokens}

    def compact(self, state: AgentState) -> dict:
        compactor = self._compactor
        if not compactor.should_compact(state):
            return {}
        t_start = time.time()
        before = self.client.pools().model_dump()
        old_pool = state.get("pool_id")
        pressure, _ = compactor.pressure(state)
        pressure = pressure or 0.0
        ctx_before = (self.client.session_status(state["session_id"]) or _Empty()).ctx_used
        self.rec.phase("compaction", f"logistics crossed the threshold (pressure {pressure:.2f} >= "
                                     f"{self.compact_threshold:.2f}, context {ctx_before} tokens): summarize, "
                                     f"re-fork the root, move the session, release pool {old_pool}")
        update = compactor(state)
        if not update:
            return {}
        after = self.client.pools().model_dump()
        new_pool = update.get("pool_id")
        live = {p["pool_id"] for p in after["pools"]}
        info = next((p for p in after["pools"] if p["pool_id"] == new_pool), {"pool_id": new_pool})
        self._pool_made("compacted (re-fork)", info)
        if old_pool not in live:
            self.rec.pool_op("release", {"pool_id": old_pool, "label": "logistics (compacted away)"})
        msgs = state.get("messages") or []
        kept = len(update["messages"]) - 1  # minus RemoveMessage
        _, old, recent = compactor.split(msgs)
        self.rec.compaction({"t_start": t_start, "agent": state["agent"], "session_id": state["session_id"],
                             "old_pool_id": old_pool,
                             "new_pool_id": new_pool, "ancestor_pool_id": state.get("root_pool_id"),
                             "pressure": pressure, "threshold": self.compact_threshold, "ctx_before": ctx_before,
                             "ctx_after": info.get("prefix_len"), "n_summarized": len(old), "n_kept": len(recent),
                             "messages_after": kept, "kv_pages_before": before.get("kv_pages_used"),
                             "kv_pages_after": after.get("kv_pages_used"), "old_pool_released": old_pool not in live})
        return {**update, "compactions": (state.get("compactions") or 0) + 1}

    def long_turn(self, state: AgentState) -> dict:
        name = state["agent"]
        if not state.get("turns"):
            cap = self.last_caps.pop(name, None)
            self.rec.decision(name, state["pool_id"], "spawn", cap.model_dump() if cap else None)
        self.rec.agent(name, "running", pool_id=state["pool_id"], session_id=state["session_id"])
        msg = self._call(name, "long", state["messages"], pool_id=state["pool_id"], session_id=state["session_id"],
                         max_tokens=state.get("max_tokens"))
        turns = (state.get("turns") or 0) + 1
        nxt = LONG_STEPS[turns % len(LONG_STEPS)]
        out = {"messages": [msg, HumanMessage(nxt)], "turns": turns, **polykv_update(msg)}
        if self._long_done({**state, **out}):
            self.rec.agent(name, "done")
            out["results"] = [{"agent": name, "role": "long", "pool_id": state["pool_id"], "text": text_of(msg)}]
        return out

    def _long_done(self, state: dict) -> bool:
        turns = state.get("turns") or 0
        if turns >= self.cfg.long_max_turns:
            return True
        return bool(state.get("compactions")) and turns >= self._turns_at_compaction.get(state["agent"], 0) + \
            self.cfg.long_turns_after_compaction

    def long_route(self, state: AgentState) -> Literal["compact", "__end__"]:
        return END if self._long_done(state) else "compact"

    def _mark_compaction(self, state: AgentState) -> dict:
        if state.get("compactions") and state["agent"] not in self._turns_at_compaction:
            self._turns_at_compaction[state["agent"]] = state.get("turns") or 0
        return {}

    def long_graph(self):
        self._turns_at_compaction: dict[str, int] = {}
        self._compactor = CompactionNode(self.model, client=self.client, tools=self.pool_tools,
                                         pressure_threshold=0.95, keep_last=2,  # set in long_setup
                                         summary_max_tokens=self.cfg.max_tokens)
        g = StateGraph(AgentState, output_schema=AgentOutput)
        g.add_node("setup", self.long_setup)
        g.add_node("arrive", self.arrive)
        g.add_node("gate", self._gate("long", spawn="turn"))
        g.add_node("hold", self.hold)
        g.add_node("compact", self.compact)
        g.add_node("mark", self._mark_compaction)
        g.add_node("turn", self.long_turn)
        g.add_edge(START, "setup")
        g.add_edge("setup", "arrive")
        g.add_edge("arrive", "gate")
        g.add_edge("hold", "gate")
        g.add_edge("compact", "mark")
        g.add_edge("mark", "turn")
        g.add_conditional_edges("turn", self.long_route, ["compact", END])
        return g.compile(name="long_agent")
