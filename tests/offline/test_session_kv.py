"""Named sessions' KV survives a restart (``state_dir``): the next turn reads the session's own
cache instead of recomputing it, within the disk budget of ``session_kv_budget_mib``."""

from __future__ import annotations

from pathlib import Path

import pytest

from opencoti.engine import EngineConfig, InvalidRequestError, SamplingParams
from opencoti.engine.persist.session_kv import file_name

SYSTEM = list(range(10, 30))  # 20 tokens: a pool prefix
TURN1 = SYSTEM + [40 + i for i in range(30)]


def settle(eng) -> None:
    """Until the state directory has caught up: one command through the step thread (the sync
    runs after it), then the background writer's queue."""
    eng.run_on_step_thread(lambda: None)
    eng.persister.kv_writer.flush()


def kv_files(state: Path) -> set[str]:
    d = state / "session_kv"
    return {f.name for f in d.iterdir()} if d.is_dir() else set()


def turn(eng, tokens, sid, pool_id=None, n=6):
    return eng.generate(tokens, session_id=sid, pool_id=pool_id, params=SamplingParams.greedy(n, ignore_eos=True))


def test_session_kv_comes_back_after_a_restart(make_engine, tmp_path):
    state = tmp_path / "state"
    eng = make_engine(state_dir=str(state))
    pool = eng.create_pool(tokens=SYSTEM, label="system")
    first = turn(eng, TURN1, "thread-1", pool.pool_id)
    settle(eng)
    assert kv_files(state) == {file_name("thread-1")}
    eng.shutdown()

    turn2 = TURN1 + list(first.token_ids) + [70, 71, 72, 73]
    reference = turn(make_engine(), turn2, "ref")  # what the second turn computes from scratch

    eng = make_engine(state_dir=str(state))
    assert eng.persister.stats["kv_loaded_sessions"] == 1
    second = turn(eng, turn2, "thread-1")
    cached = len(TURN1) + len(first.token_ids) - 1  # every token with KV at the end of turn 1
    assert second.info.cached_prefix_tokens == cached > pool_len(eng, pool.pool_id)
    assert second.info.rematerialized_pools == []  # the pool was not needed: the session had it all
    assert second.token_ids == reference.token_ids  # the same KV as recomputing it
    eng.check_integrity()
    eng.release_session("thread-1")
    settle(eng)
    assert kv_files(state) == set()  # a released session's file goes with it
    eng.shutdown()


def pool_len(eng, pool_id) -> int:
    return eng.pool(pool_id).prefix_len


def test_without_budget_or_a_matching_file_the_session_recomputes(make_engine, tmp_path):
    state = tmp_path / "state"
    eng = make_engine(state_dir=str(state), session_kv_budget_mib=0)
    first = turn(eng, TURN1, "t")
    settle(eng)
    assert kv_files(state) == set()
    eng.shutdown()
    eng = make_engine(state_dir=str(state))
    assert eng.persister.stats["kv_loaded_sessions"] == 0
    assert turn(eng, TURN1 + list(first.token_ids), "t").info.cached_prefix_tokens == 0
    settle(eng)
    assert kv_files(state) == {file_name("t")}
    eng.shutdown()
    # another weight format computes other KV: the file is not loaded, and removed
    eng = make_engine(state_dir=str(state), weights="int8")
    assert eng.persister.stats["kv_loaded_sessions"] == 0
    settle(eng)
    assert kv_files(state) == set()
    eng.shutdown()
    with pytest.raises(InvalidRequestError, match="session_kv_budget_mib"):
        EngineConfig(session_kv_budget_mib=-1)


def test_the_disk_budget_keeps_the_most_recent_sessions(make_engine, tmp_path):
    state = tmp_path / "state"
    probe = make_engine()
    per_token = probe.kv.page_bytes // probe.kv.page_size
    probe.shutdown()
    one = 4096 + per_token * (len(TURN1) + 5)  # a session file after one turn
    budget_mib = 2.5 * one / 2**20  # room for two such files
    eng = make_engine(state_dir=str(state), session_kv_budget_mib=budget_mib)
    for sid in ("a", "b", "c"):
        turn(eng, TURN1, sid)
    settle(eng)
    assert kv_files(state) == {file_name("b"), file_name("c")}  # the least recently written went first
    assert sum(f.stat().st_size for f in (state / "session_kv").iterdir()) <= budget_mib * 2**20
    turn(eng, TURN1 + [1, 2, 3] * 40, "big")  # larger than the whole budget: not written
    settle(eng)
    assert file_name("big") not in kv_files(state)
    eng.shutdown()
    eng = make_engine(state_dir=str(state), session_kv_budget_mib=budget_mib)
    assert eng.persister.stats["kv_loaded_sessions"] == 2
    eng.check_integrity()
    eng.shutdown()
