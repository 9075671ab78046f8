"""Nested fork + branch for a different toolset (docs/polykv.md, "Pools and sessions": fork).

The root pool holds system + toolset A. Group A's pool extends it with the task brief (a fork at
D = L: nesting). Group B needs toolset B: its pool branches off the root at D = the first token
where the two renderings differ (a fork at D < L: copy-on-write branch), sharing [0, D) zero-copy.
One agent per group runs a tool-calling turn on its own pool.

    input:  {"question": "..."}
    output: {"answers": [{"group", "pool_id", "cached_prefix_tokens", "tool_calls", "answer"}], "tree": {...}}

The root is made once per process and shared by every run; each run's group pools are released at
its end.
"""

import operator
import threading
from typing import Annotated

from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.graph import END, START, StateGraph

from opencoti.client import PoolNotFoundError
from opencoti.langgraph import PolyKVState, model_from_env

SYSTEM = "You are a helpful assistant. Use a tool when it helps."

model = model_from_env(temperature=0, max_tokens=64)
client = model.polykv_client


@tool
def capital_of(country: str) -> str:
    """The capital city of a country."""
    return {"france": "Paris", "japan": "Tokyo", "italy": "Rome"}.get(country.strip().lower(), "unknown")


@tool
def celsius_to_fahrenheit(celsius: float) -> float:
    """Convert a temperature from Celsius to Fahrenheit."""
    return celsius * 9 / 5 + 32


TOOLS_A = [capital_of]
TOOLS_B = [celsius_to_fahrenheit]


class BranchState(PolyKVState, total=False):
    question: str
    groups: dict
    answers: Annotated[list, operator.add]
    tree: dict


def _openai(tools) -> list[dict]:
    from langchain_core.utils.function_calling import convert_to_openai_tool
    return [convert_to_openai_tool(t) for t in tools]


_ROOT: dict = {}
_LOCK = threading.Lock()


def root_pool(tokens: list[int]):
    """The root (system + toolset A), made once per process and shared by every run; the group
    pools are made and released per run."""
    with _LOCK:
        pool = _ROOT.get("pool")
        if pool is not None:
            try:
                if client.pool(pool.pool_id).prefix_len == len(tokens):
                    return pool
            except PoolNotFoundError:  # the engine restarted
                pass
        pool = _ROOT["pool"] = client.create_pool(tokens=tokens, label="system+toolsA")
        return pool


def build_pools(state: BranchState) -> dict:
    system = [{"role": "system", "content": SYSTEM}]
    toks_a = client.tokenize(client.apply_template(system, _openai(TOOLS_A), add_generation_prompt=False))
    toks_b = client.tokenize(client.apply_template(system, _openai(TOOLS_B), add_generation_prompt=False))
    d = next((i for i, (x, y) in enumerate(zip(toks_a, toks_b)) if x != y), min(len(toks_a), len(toks_b)))
    root = root_pool(toks_a)
    task = [*system, {"role": "user", "content": "Task brief: answer precisely."}]
    group_a = client.fork_pool(root.pool_id, messages=task, tools=_openai(TOOLS_A), label="A: brief")  # nesting
    group_b = client.fork_pool(root.pool_id, branch_pos=d, tokens=toks_b, label="B: toolsB")  # COW branch
    return {"groups": {"root": root.pool_id, "A": group_a.pool_id, "B": group_b.pool_id, "branch_pos": d}}


def run_group(group: str, state: BranchState, tools, brief: bool) -> dict:
    msgs = [SystemMessage(SYSTEM)]
    if brief:
        msgs.append(HumanMessage("Task brief: answer precisely."))
    msgs.append(HumanMessage(state.get("question") or "What is the capital of France?"))
    bound = model.bind_tools(tools)
    pool_id = state["groups"][group]
    first = bound.invoke(msgs, pool_id=pool_id)
    answer = first
    if first.tool_calls:  # one tool round
        by_name = {t.name: t for t in tools}
        results = [ToolMessage(str(by_name[c["name"]].invoke(c["args"])) if c["name"] in by_name else "unknown tool",
                               tool_call_id=c["id"]) for c in first.tool_calls]
        try:
            answer = bound.invoke(msgs + [first, *results], pool_id=pool_id)
        except Exception as e:  # noqa: BLE001 - e.g. junk arguments from a tiny model
            answer = first.model_copy(update={"content": f"(tool round failed: {e})"})
    return {"answers": [{"group": group, "pool_id": pool_id,
                         "cached_prefix_tokens": first.response_metadata.get("cached_prefix_tokens"),
                         "tool_calls": [c["name"] for c in first.tool_calls], "answer": answer.text}]}


def group_a(state: BranchState) -> dict:
    return run_group("A", state, TOOLS_A, brief=True)


def group_b(state: BranchState) -> dict:
    return run_group("B", state, TOOLS_B, brief=False)


def cleanup(state: BranchState) -> dict:
    groups = state["groups"]
    tree = client.pools()
    shown = {p.pool_id: {"parent": p.parent, "branch_pos": p.branch_pos, "prefix_len": p.prefix_len,
                         "own_kv_bytes": p.own_kv_bytes, "label": p.label} for p in tree.pools}
    for key in ("A", "B"):  # this run's pools; the root stays for the next run
        client.flush_pool(groups[key])
        client.release_pool(groups[key])
    return {"tree": shown}


builder = StateGraph(BranchState)
builder.add_node("build_pools", build_pools)
builder.add_node("group_a", group_a)
builder.add_node("group_b", group_b)
builder.add_node("cleanup", cleanup)
builder.add_edge(START, "build_pools")
builder.add_edge("build_pools", "group_a")
builder.add_edge("build_pools", "group_b")
builder.add_edge(["group_a", "group_b"], "cleanup")
builder.add_edge("cleanup", END)
graph = builder.compile()
