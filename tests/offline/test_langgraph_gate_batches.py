"""Paced fan-outs under a tps floor: gates spawn in batches when the measured headroom has room for
several sessions; gates that interrupt are resumed with ``invoke_until_done`` and say why they hold."""

from __future__ import annotations

import inspect
import operator
import threading
import time
from typing import Annotated

import pytest
from langchain_core.messages import HumanMessage, SystemMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, Send

from opencoti.client import Capacity
from opencoti.engine import SamplingParams
from opencoti.langgraph import (CapacityGateNode, CompactionNode, OpencotiChatModel, PolyKVState, SpawnPacer,
                                invoke_until_done, resume_command)
from opencoti.langgraph.gate import BATCH_REASON, BUSY_REASON, hold_message

SYSTEM = "You are a terse assistant."


class FanState(PolyKVState, total=False):
    tasks: list[str]
    results: Annotated[list, operator.add]


class WorkerState(PolyKVState, total=False):
    task: str
    results: Annotated[list, operator.add]


def fan_out(model, pacer, on_hold="wait", checkpointer=None, started=None):
    client = model.polykv_client

    def agent(state: WorkerState):
        if started is not None:
            started.append(time.monotonic())
        model.invoke([SystemMessage(SYSTEM), HumanMessage(state["task"])], pool_id=state["pool_id"],
                     session_id=state["session_id"])
        client.release_session(state["session_id"])
        return {"results": [state["task"]]}

    w = StateGraph(WorkerState)
    w.add_node("gate", CapacityGateNode(client, spawn="agent", hold=END, on_hold=on_hold, max_wait_s=60,
                                        pacer=pacer))
    w.add_node("agent", agent)
    w.add_edge(START, "gate")
    w.add_edge("agent", END)
    g = StateGraph(FanState)
    g.add_node("worker", w.compile())
    g.add_conditional_edges(START, lambda s: [Send("worker", {"task": t, "pool_id": s["pool_id"]})
                                              for t in s["tasks"]], ["worker"])
    g.add_edge("worker", END)
    return g.compile(checkpointer=checkpointer)


def warm_forecast(engine, n: int) -> None:
    """Sessions joining one by one (no pool, no floor) until n decode side by side: the engine
    measures its step time at every batch size up to n, as it does while serving."""
    stats = engine.admission_controller.forecast.stats  # step statistics per batch size
    threads = []
    for i in range(n):
        s = engine.stream(engine.tokenize(f"warm {i}"), params=SamplingParams.greedy(400, ignore_eos=True))
        threads.append(threading.Thread(target=lambda s=s: [None for _ in s]))
        threads[-1].start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (stats.get(i + 1) is None or stats[i + 1].n < 12):
            time.sleep(0.02)
    for t in threads:
        t.join(120)


def test_six_workers_above_the_floor_start_together(engine):
    """The floor is far below what six sessions get: the six gates spawn in one batch, not one per
    settle window (a window here lasts up to 20 s, so one-at-a-time would take > 100 s)."""
    warm_forecast(engine, 6)
    model = OpencotiChatModel(engine=engine, temperature=0, max_tokens=6)
    client = model.polykv_client
    pool = client.create_pool(messages=[{"role": "system", "content": SYSTEM}])
    client.set_admission(pool.pool_id, target_tps_per_session=1.0, settle_tokens=1_000_000, settle_max_ms=20_000)
    cap = client.capacity(pool.pool_id)
    assert cap.tps_headroom_sessions >= 6, cap  # measured: room for six at once
    pacer = SpawnPacer()
    started: list[float] = []
    t0 = time.monotonic()
    out = fan_out(model, pacer, started=started).invoke({"tasks": [f"task {i}" for i in range(6)],
                                                         "pool_id": pool.pool_id})
    assert sorted(out["results"]) == [f"task {i}" for i in range(6)]
    spawns = [e for e in pacer.log if e["decision"] == "spawn"]
    assert len(spawns) == 6 and sum(e["batch"] for e in spawns) == 5, pacer.log
    assert not any(e["decision"] == "wait" for e in pacer.log), pacer.log
    assert max(started) - t0 < 15, [round(t - t0, 2) for t in started]  # all within one settle window
    assert all(e["reason"] == BATCH_REASON for e in spawns if e["batch"])
    client.release_pool(pool.pool_id)


def floor_with_headroom(client, pool_id: int, most: int, least: int = 1, **admission) -> float:
    """A tps floor at which the measured report has room for ``least``..``most`` more sessions
    (bisection over the floor: the headroom falls as the floor rises)."""
    lo, hi = 0.1, 10_000.0
    for _ in range(40):
        mid = (lo * hi) ** 0.5
        client.set_admission(pool_id, target_tps_per_session=mid, **admission)
        k = client.capacity(pool_id).tps_headroom_sessions
        if k is not None and least <= k <= most:
            return mid
        lo, hi = (mid, hi) if k is None or k > most else (lo, mid)
    raise AssertionError(f"no floor leaves {least}..{most} sessions of headroom")


def test_six_workers_start_together_after_sessions_ran_one_at_a_time(engine):
    """An engine that has only run one session at a time (short workers paced one by one, then
    idle) knows the step time at one session only; far above the floor the next fan-out still
    starts in a batch: the idle report projects a full share per session from that one size."""
    warm_forecast(engine, 1)
    model = OpencotiChatModel(engine=engine, temperature=0, max_tokens=6)
    client = model.polykv_client
    pool = client.create_pool(messages=[{"role": "system", "content": SYSTEM}])
    settle = {"settle_tokens": 1_000_000, "settle_max_ms": 20_000}
    floor_with_headroom(client, pool.pool_id, 40, least=12, **settle)  # was 1 at most: nothing past size 1
    pacer = SpawnPacer()
    out = fan_out(model, pacer).invoke({"tasks": [f"task {i}" for i in range(6)], "pool_id": pool.pool_id})
    assert sorted(out["results"]) == [f"task {i}" for i in range(6)]
    spawns = [e for e in pacer.log if e["decision"] == "spawn"]
    assert len(spawns) == 6 and sum(e["batch"] for e in spawns) == 5, pacer.log
    client.release_pool(pool.pool_id)


def test_six_workers_a_floor_would_break_are_paced(engine):
    """The same fan-out on a floor that six sessions would break (the measured headroom has room for
    at most three): the gates still pace the spawns (a batch never holds more than half the measured
    headroom, so no batch of six) and every worker runs."""
    warm_forecast(engine, 6)
    model = OpencotiChatModel(engine=engine, temperature=0, max_tokens=6)
    client = model.polykv_client
    pool = client.create_pool(messages=[{"role": "system", "content": SYSTEM}])
    settle = {"settle_tokens": 3, "settle_max_ms": 400}
    floor = floor_with_headroom(client, pool.pool_id, 3, **settle)
    assert client.capacity(pool.pool_id).tps_headroom_sessions <= 3
    pacer = SpawnPacer()
    out = fan_out(model, pacer).invoke({"tasks": [f"task {i}" for i in range(6)], "pool_id": pool.pool_id})
    assert sorted(out["results"]) == [f"task {i}" for i in range(6)]
    spawns = [e for e in pacer.log if e["decision"] == "spawn"]
    assert len(spawns) == 6, pacer.log
    opened = [e for e in spawns if not e["batch"]]  # spawns decided on their own report (each may open a batch)
    assert len(opened) >= 3, (floor, pacer.log)  # batches of at most 1 + 1 (half of <= 3, and of <= 5 if faster)
    assert any(e["decision"] == "wait" for e in pacer.log), pacer.log  # someone waited for the pool
    client.release_pool(pool.pool_id)


def test_no_batch_without_a_measurement_and_max_batch_one(engine):
    cold = Capacity(pool_id=1, can_admit=True, reason="guaranteed minimum", target_tps_per_session=5.0,
                    headroom_sessions=50)
    assert SpawnPacer().batch_size(cold) == 1  # nothing measured yet: one at a time
    warm = Capacity(pool_id=1, can_admit=True, reason="ok", target_tps_per_session=5.0, headroom_sessions=3,
                    tps_headroom_sessions=6)
    assert SpawnPacer().batch_size(warm) == 3  # the KV headroom caps it
    assert SpawnPacer(max_batch=1).batch_size(warm) == 1
    no_floor = Capacity(pool_id=1, can_admit=True, reason="ok", headroom_sessions=9, tps_headroom_sessions=9)
    assert SpawnPacer().batch_size(no_floor) == 1  # not paced at all
    pacer = SpawnPacer(batch_window_s=0.2)
    assert pacer.open_batch(1, warm) == 2
    settling = warm.model_copy(update={"can_admit": False, "reason": "measurement settling", "settling": True})
    below = warm.model_copy(update={"can_admit": False, "reason": "projected mean tps below floor"})
    full = settling.model_copy(update={"context_ok": False})
    assert not pacer.take_batch_slot(1, below) and not pacer.take_batch_slot(1, full)  # hard arms still apply
    assert pacer.take_batch_slot(1, settling) and pacer.take_batch_slot(1, settling)
    assert not pacer.take_batch_slot(1, settling)  # used up
    pacer.open_batch(1, warm)
    time.sleep(0.3)
    assert not pacer.take_batch_slot(1, settling)  # the window closed
    with pytest.raises(ValueError):
        SpawnPacer(max_batch=0)


def test_interrupting_gates_resume_until_done(engine):
    """A fan-out whose gates interrupt (several pending at once) runs to the end with
    ``invoke_until_done``; each interrupt's message matches its reason."""
    model = OpencotiChatModel(engine=engine, temperature=0, max_tokens=4)
    client = model.polykv_client
    pool = client.create_pool(messages=[{"role": "system", "content": SYSTEM}])
    client.set_admission(pool.pool_id, target_tps_per_session=1.0, settle_tokens=2, settle_max_ms=300)
    graph = fan_out(model, SpawnPacer(max_batch=1), on_hold="interrupt", checkpointer=InMemorySaver())
    cfg = {"configurable": {"thread_id": "fan"}}
    first = graph.invoke({"tasks": [f"task {i}" for i in range(3)], "pool_id": pool.pool_id}, cfg)
    pending = first.get("__interrupt__") or []
    assert pending, first
    for i in pending:
        assert i.value["message"] == hold_message(Capacity(**i.value["capacity"]).model_copy(
            update={"reason": i.value["reason"]}))
        if i.value["reason"] == BUSY_REASON:
            assert "another gate" in i.value["message"] and "no capacity" not in i.value["message"]
    if len(pending) > 1:
        with pytest.raises(Exception, match="interrupt id"):
            graph.invoke(Command(resume=True), cfg)
    cmd = resume_command(first)
    assert set(cmd.resume) == {i.id for i in pending}
    out = invoke_until_done(graph, cmd, cfg)
    assert sorted(out["results"]) == [f"task {i}" for i in range(3)] and "__interrupt__" not in out
    client.release_pool(pool.pool_id)


def test_node_constructors_document_themselves():
    for cls, word in ((CapacityGateNode, "spawn"), (CompactionNode, "summary")):
        doc = inspect.getdoc(cls.__init__)
        assert word in doc and "RunnableLambda" not in doc, doc


def test_a_failing_capacity_report_gives_back_the_pools_turn(engine):
    """The capacity call after taking the pool's turn raises (a dropped connection): the turn is
    released, so the next gate of the fan-out is not held forever."""
    pacer = SpawnPacer()
    model = OpencotiChatModel(engine=engine)
    gate = CapacityGateNode(model.polykv_client, spawn="agent", hold=END, pacer=pacer, max_wait_s=5)
    floor = Capacity(pool_id=7, can_admit=True, reason="ok", target_tps_per_session=5.0, headroom_sessions=3)
    steps = gate._steps({"pool_id": 7}, 7)
    assert steps.send(None)[0] == "capacity"
    assert steps.send(floor)[0] == "acquire"
    assert steps.send(pacer.acquire(7, 1.0))[0] == "capacity"  # the gate holds the turn now
    with pytest.raises(ConnectionError):
        steps.throw(ConnectionError("server gone"))
    assert pacer.acquire(7, 0.0), "the pool's turn was not given back"
    pacer.release(7)


# ============================================================================ start times
STEP_S = 0.4  # a slow engine step (the bundled model's prefill on a busy machine)


def slow_steps(engine, monkeypatch, seconds: float = STEP_S) -> None:
    """Every engine step takes ``seconds`` more: a call to the engine made while a worker's step runs
    waits for it, so gates that reach the engine one after the other start their workers apart."""
    step = engine.core.step

    def slow():
        time.sleep(seconds)
        return step()

    monkeypatch.setattr(engine.core, "step", slow)


def start_spread(model, pool_id: int, pacer: SpawnPacer, n: int = 6) -> list[float]:
    started: list[float] = []
    out = fan_out(model, pacer, started=started).invoke({"tasks": [f"task {i}" for i in range(n)], "pool_id": pool_id})
    assert sorted(out["results"]) == [f"task {i}" for i in range(n)]
    first = min(started)
    return sorted(round(t - first, 3) for t in started)


def test_six_workers_without_a_floor_start_at_once(engine, monkeypatch):
    """No floor: nothing to pace, so the six gates admit at once and the six workers start within one
    engine step of each other, as they do without gates (the gates used to reach the engine one after
    the other, a step apart: starts 0.02 ... 1.45 s on the bundled model)."""
    model = OpencotiChatModel(engine=engine, temperature=0, max_tokens=4)
    client = model.polykv_client
    pool = client.create_pool(messages=[{"role": "system", "content": SYSTEM}])
    slow_steps(engine, monkeypatch)
    pacer = SpawnPacer()
    spread = start_spread(model, pool.pool_id, pacer)
    assert spread[-1] < STEP_S * 0.75, spread
    assert [e["decision"] for e in pacer.log] == ["spawn"] * 6, pacer.log
    client.release_pool(pool.pool_id)


def test_parallel_checks_of_a_recorded_pool_do_not_queue(engine, monkeypatch):
    """``ensure_pool`` on a pool the state records, from six branches while the engine is busy: each
    check waits for the step running then, all at once (they used to take a lock in turn: a step each)."""
    from opencoti.langgraph import ensure_pool, track_pool

    client = OpencotiChatModel(engine=engine).polykv_client
    system = [{"role": "system", "content": SYSTEM}]
    pool = client.create_pool(messages=system)
    state = {**track_pool(pool, messages=system), "pool_id": pool.pool_id}
    slow_steps(engine, monkeypatch)
    busy = engine.stream(engine.tokenize("busy"), params=SamplingParams.greedy(40, ignore_eos=True))
    runner = threading.Thread(target=lambda: [None for _ in busy])
    runner.start()
    time.sleep(STEP_S / 2)  # a step is running
    done: list[float] = []
    t0 = time.monotonic()

    def check():
        assert ensure_pool(client, state) == (pool.pool_id, {})
        done.append(time.monotonic() - t0)

    threads = [threading.Thread(target=check) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    busy.close()
    runner.join(30)
    assert len(done) == 6 and max(done) < 2 * STEP_S, sorted(done)
    client.release_pool(pool.pool_id)


def test_six_workers_far_above_the_floor_start_at_once(engine, monkeypatch):
    """A floor far below what six sessions get, measured: the first spawn opens a batch and the five
    other gates take their places without waiting for each other's sessions to reach the server,
    so the six start within one engine step (they used to start a step or more apart each)."""
    warm_forecast(engine, 6)
    model = OpencotiChatModel(engine=engine, temperature=0, max_tokens=4)
    client = model.polykv_client
    pool = client.create_pool(messages=[{"role": "system", "content": SYSTEM}])
    client.set_admission(pool.pool_id, target_tps_per_session=1.0, settle_tokens=1_000_000, settle_max_ms=20_000)
    assert client.capacity(pool.pool_id).tps_headroom_sessions >= 12
    slow_steps(engine, monkeypatch)
    pacer = SpawnPacer()
    spread = start_spread(model, pool.pool_id, pacer)
    spawns = [e for e in pacer.log if e["decision"] == "spawn"]
    assert len(spawns) == 6 and sum(e["batch"] for e in spawns) == 5, pacer.log
    assert spread[-1] < STEP_S * 0.75, spread
    # the next decision on its own report waits until the server has seen all six
    assert pacer.wait_seen(pool.pool_id, 10.0) and pacer.unseen(pool.pool_id) == 0
    client.release_pool(pool.pool_id)
