"""Writing idle sessions' KV ahead (``persist/write_ahead.py``): while the engine is idle, and between
steps within the tier's write share, the KV of idle sessions goes to the disk tier while it stays in RAM,
so that the reclaim that takes it later frees its pages without copying them on the step thread - with
the same answers, never evicting what only the disk holds, and only when a reclaim is near."""

from __future__ import annotations

import argparse
import logging
import time

import pytest

from opencoti.engine import EngineConfig
from opencoti.engine.persist.pacer import StepPacer
from opencoti.engine.persist.write_ahead import RETRY_S
from opencoti.server.serve import add_arguments
from test_kv_tier import CTX, SMALL, agent_team, disk, flush, greedy, toks


def settle(eng) -> None:
    """Let the idle engine write ahead all it will, then wait for the disk."""
    while eng.run_on_step_thread(eng.write_ahead.idle) == 0.0:
        pass
    flush(eng)


def reclaim_copies(d: dict) -> int:
    """Pages a reclaim copied on the step thread (every snapshot but those written ahead)."""
    return d["spilled_pages"] - d["written_ahead_pages"]


def test_idle_sessions_kv_is_written_ahead_and_reclaimed_without_a_copy(make_engine, tmp_path):
    ram = agent_team(make_engine())  # nothing is reclaimed
    off = make_engine(state_dir=str(tmp_path / "off"), kv_disk_write_ahead=False, **SMALL)
    copied = agent_team(off, between=lambda turn, i: flush(off))
    eng = make_engine(state_dir=str(tmp_path / "on"), **SMALL)
    cold: list[int] = []

    def between(turn: int, i: int) -> None:  # each turn after a tool wait: written ahead meanwhile
        settle(eng)
        if (turn, i) == (1, 0):
            cold.append(reclaim_copies(disk(eng)))

    ahead = agent_team(eng, between=between)
    assert [a for a, _ in ahead] == [a for a, _ in copied] == [a for a, _ in ram]
    assert [n for _, n in ahead] == [n for _, n in copied] == [n for _, n in ram]  # all of it came back
    d, d_off = disk(eng), disk(off)
    assert d_off["written_ahead_pages"] == 0 and reclaim_copies(d_off) > 0
    assert d["written_ahead_pages"] > 0 and d["reclaimed_held_pages"] > 0 and d["faults"] == 0
    # the first round's reclaims came before the pages were short at an idle moment (nothing written
    # ahead yet: PRESSURE); after it, every page a reclaim took was on disk already: none copied in a step
    assert reclaim_copies(d) == cold[0] < reclaim_copies(d_off) / 4
    eng.check_integrity()


def test_nothing_is_written_ahead_while_the_pages_are_not_short(make_engine, tmp_path):
    eng = make_engine(state_dir=str(tmp_path / "s"))  # 4096 tokens of KV: the team takes a fraction
    agent_team(eng, turns=2, between=lambda turn, i: settle(eng))
    assert disk(eng)["written_ahead_pages"] == 0 and disk(eng)["spilled_pages"] == 0


def test_writing_ahead_never_evicts_what_only_the_disk_holds(make_engine, tmp_path):
    eng = make_engine(state_dir=str(tmp_path / "s"), **SMALL)
    agent_team(eng, turns=1, between=lambda turn, i: settle(eng))
    settle(eng)
    tier = eng.kv_tier
    before = dict(disk(eng))
    assert before["used_bytes"] > 0
    tier.budget = tier.used_bytes  # full: a copy of RAM would have to evict a file
    eng.generate(toks(99, CTX), params=greedy(), session_id="late")  # a new idle session, with KV to write
    n, left = eng.run_on_step_thread(lambda: eng.core.polykv.write_ahead(tier, 64))
    assert (n, left) == (0, True)
    assert disk(eng)["written_ahead_pages"] == before["written_ahead_pages"]
    assert tier.used_bytes <= tier.budget
    # the idle engine looks again only while the queue may drain, then waits for the next request
    assert eng.run_on_step_thread(eng.write_ahead.idle) in (RETRY_S, None)
    flush(eng)
    assert eng.run_on_step_thread(eng.write_ahead.idle) is None


def test_between_steps_the_write_share_no_window_uses_writes_ahead(make_engine, tmp_path):
    eng = make_engine(state_dir=str(tmp_path / "s"), **SMALL)
    eng.write_ahead.idle = lambda: None  # only the steps' share writes ahead here
    fill, eng.step_pacer.filler = eng.step_pacer.filler, None
    agent_team(eng, turns=1, between=lambda turn, i: flush(eng))  # idle sessions, nothing written ahead
    assert disk(eng)["written_ahead_pages"] == 0 and eng.step_pacer.stats["fills"] == 0
    eng.step_pacer.filler = fill
    eng.generate(toks(7, 40), params=greedy(60), session_id="decoding")  # 60 steps, idle sessions beside it
    fills = eng.step_pacer.stats["fills"]
    assert fills > 0 and eng.step_pacer.stats["fill_s"] > 0
    assert disk(eng)["written_ahead_pages"] > 0


def test_the_pacer_gives_a_steps_unused_share_to_the_filler_and_charges_it(caplog):
    p = StepPacer(share=0.5)
    got: list[float] = []
    p.filler = lambda budget: (got.append(budget), time.sleep(0.003))
    p.step_begin()  # no step yet: no credit, no call
    assert got == []
    p.step_end(0.004)  # lends 2 ms
    p.step_begin()
    assert got == [pytest.approx(0.002)] and p.stats["fills"] == 1 and p.stats["turns"] == 0
    p.step_end(0.002)  # 1 ms lent against a ~3 ms debt: still owed, so no call
    p.step_begin()
    assert len(got) == 1

    def broken(budget):
        raise RuntimeError("boom")

    q = StepPacer(share=0.5)
    q.filler = broken
    q.step_end(0.01)
    with caplog.at_level(logging.ERROR, logger="opencoti.engine.persist"):
        q.step_begin()  # the step goes on
    assert "boom" in caplog.text and q.stats["fills"] == 1
    unpaced = StepPacer(share=None)
    unpaced.filler = lambda budget: got.append(budget)
    unpaced.step_end(0.01)
    unpaced.step_begin()
    assert len(got) == 1  # unpaced: nothing runs before a step


def test_write_ahead_is_a_setting_on_by_default(make_engine, tmp_path):
    assert EngineConfig().kv_disk_write_ahead is True
    eng = make_engine(state_dir=str(tmp_path / "a"), kv_disk_write_ahead=False, **SMALL)
    assert eng.write_ahead is None and eng.step_pacer.filler is None
    agent_team(eng, turns=2)
    assert disk(eng)["written_ahead_pages"] == 0
    assert make_engine(**SMALL).write_ahead is None  # no tier, nothing to write ahead to
    for bad in (1, "on", None):
        with pytest.raises(ValueError, match="kv_disk_write_ahead"):
            EngineConfig(kv_disk_write_ahead=bad)
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["--kv-disk-write-ahead", "off"]).kv_disk_write_ahead == "off"
    assert p.parse_args([]).kv_disk_write_ahead == "on"
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-disk-write-ahead", "maybe"])
