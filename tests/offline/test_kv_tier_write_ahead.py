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
    """Let the idle engine write ahead all it will (waiting for the disk when its queue is full), then
    wait for the disk."""
    while (again := eng.run_on_step_thread(eng.write_ahead.idle)) is not None:
        if again:
            flush(eng)
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


def _full_tier_and_a_new_idle_session(make_engine, path, ahead: bool):
    """A tier whose budget its files fill exactly, all of them copies written ahead (``ahead``) or all
    files a reclaim wrote; then a new idle session with KV to write (the idle engine writes it ahead
    at once if it can). The tier's counters before that session."""
    eng = make_engine(state_dir=str(path), **SMALL)
    agent_team(eng, turns=1, between=lambda turn, i: settle(eng))
    settle(eng)
    tier = eng.kv_tier
    for seg in tier.segments.values():
        seg.ahead = ahead
    tier.budget = tier.used_bytes
    before = dict(disk(eng), lru=next(iter(tier.segments)))
    eng.generate(toks(99, CTX), params=greedy(), session_id="late")
    settle(eng)
    return eng, tier, before


def test_a_copy_written_ahead_never_pushes_out_another(make_engine, tmp_path):
    eng, tier, before = _full_tier_and_a_new_idle_session(make_engine, tmp_path / "s", ahead=True)
    n, left = eng.run_on_step_thread(lambda: eng.core.polykv.write_ahead(tier, 64))
    assert (n, left) == (0, True)
    after = disk(eng)
    assert after["written_ahead_pages"] == before["written_ahead_pages"]
    assert after["evicted_segments"] == before["evicted_segments"] and tier.used_bytes <= tier.budget
    # the idle engine does not spin on it: it waits for the queue to drain at most, then for a request
    assert eng.run_on_step_thread(eng.write_ahead.idle) in (RETRY_S, None)
    flush(eng)
    assert eng.run_on_step_thread(eng.write_ahead.idle) is None


def test_a_copy_written_ahead_pushes_out_the_oldest_files_a_reclaim_wrote(make_engine, tmp_path):
    eng, tier, before = _full_tier_and_a_new_idle_session(make_engine, tmp_path / "s", ahead=False)
    after = disk(eng)
    assert after["written_ahead_pages"] > before["written_ahead_pages"]  # "late" went to disk ahead
    assert after["evicted_segments"] > before["evicted_segments"] and tier.used_bytes <= tier.budget
    assert before["lru"] not in tier.segments  # the least recently used file went first
    late = eng.core.polykv.sessions["late"].seq.page_keys
    assert all(tier.has(k) for k in late)


def test_a_full_disk_pauses_writing_ahead_instead_of_spinning(make_engine, tmp_path, monkeypatch):
    from opencoti.engine.persist import write_ahead

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("opencoti.engine.persist.tier_files.kvfile.write_kv", full)
    eng = make_engine(state_dir=str(tmp_path / "s"), **SMALL)
    out = agent_team(eng, turns=2, between=lambda turn, i: settle(eng))
    assert [a for a, _ in out] == [a for a, _ in agent_team(make_engine(), turns=2)]
    assert disk(eng)["write_errors"] > 0
    assert eng.run_on_step_thread(eng.write_ahead.idle) is None  # paused: no write tried again at once
    assert eng.write_ahead._paused_until > time.monotonic() + write_ahead.PAUSE_S / 2


def test_an_error_while_writing_ahead_is_logged_and_the_engine_serves_on(make_engine, tmp_path, caplog):
    eng = make_engine(state_dir=str(tmp_path / "s"), **SMALL)

    def broken(*args):
        raise RuntimeError("boom")

    eng.core.polykv.write_ahead = broken
    with caplog.at_level(logging.ERROR, logger="opencoti.engine.persist"):
        out = agent_team(eng, turns=2)
    assert [a for a, _ in out] == [a for a, _ in agent_team(make_engine(), turns=2)]
    assert "writing ahead failed" in caplog.text and "boom" in caplog.text


def test_between_steps_the_write_share_no_window_uses_writes_ahead(make_engine, tmp_path):
    eng = make_engine(state_dir=str(tmp_path / "s"), **SMALL)
    eng.write_ahead.idle = lambda: None  # only the steps' share writes ahead here
    fill, eng.step_pacer.filler = eng.step_pacer.filler, None
    agent_team(eng, turns=1, between=lambda turn, i: flush(eng))  # idle sessions, nothing written ahead
    assert disk(eng)["written_ahead_pages"] == 0 and eng.step_pacer.stats["fills"] == 0
    eng.step_pacer.filler = fill
    asked, real = [], eng.core.polykv.write_ahead
    eng.core.polykv.write_ahead = lambda tier, n, cache=True: asked.append(cache) or real(tier, n, cache)
    eng.generate(toks(7, 40), params=greedy(150), session_id="decoding")  # 150 steps, idle sessions beside it
    fills = eng.step_pacer.stats["fills"]
    assert fills > 0 and eng.step_pacer.stats["fill_s"] > 0
    assert disk(eng)["written_ahead_pages"] > 0
    assert asked and not any(asked)  # between steps, never the scan of the whole prefix cache


def test_the_pacer_gives_a_steps_unused_share_to_the_filler_and_charges_it(caplog):
    p = StepPacer(share=0.5)
    got: list[float] = []
    p.filler = lambda budget: (got.append(budget), time.sleep(0.003)) and True
    p.step_begin()  # no step yet: no credit, no call
    assert got == []
    p.step_end(0.004)  # lends 2 ms
    p.step_begin()
    assert got == [pytest.approx(0.002)] and p.stats["fills"] == 1 and p.stats["turns"] == 0
    assert p._credit <= -0.001  # it took >= 3 ms of the 2 ms lent: charged like a window, the rest owed
    p.step_end(0.002)  # 1 ms lent against the >= 1 ms owed: nothing to give
    p.step_begin()
    assert len(got) == 1
    p.step_end(0.1)  # the debt repaid (at most 50 ms is lent): the filler gets what is left
    p.step_begin()
    assert len(got) == 2 and 0 < got[1] <= 0.05

    def broken(budget):
        raise RuntimeError("boom")

    q = StepPacer(share=0.5)
    q.filler = broken
    q.step_end(0.01)
    with caplog.at_level(logging.ERROR, logger="opencoti.engine.persist"):
        q.step_begin()  # the step goes on
    assert "boom" in caplog.text and q.stats["fills"] == 1
    saving = StepPacer(share=0.5)  # a filler saving up: the credit does not lapse
    lent: list[float] = []
    saving.filler = lambda budget: lent.append(budget) and None
    saving.step_end(0.004)
    saving.step_begin()
    saving.step_end(0.004)
    saving.step_begin()
    assert lent[0] == pytest.approx(0.002) and lent[1] == pytest.approx(0.004, abs=1e-4)
    assert saving.stats["fills"] == 0
    idle = StepPacer(share=0.5)  # a filler with nothing to do: called, not counted
    idle.filler = lambda budget: False
    idle.step_end(0.01)
    idle.step_begin()
    assert idle.stats["fills"] == 0 and idle.stats["turns"] == 0
    unpaced = StepPacer(share=None)
    unpaced.filler = lambda budget: got.append(budget) or True
    unpaced.step_end(0.01)
    unpaced.step_begin()
    assert len(got) == 2  # unpaced: nothing runs before a step


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


def test_a_run_cut_short_by_the_page_limit_is_not_taken_for_all_of_it(make_engine, tmp_path):
    eng = make_engine(state_dir=str(tmp_path / "s"), kv_disk_write_ahead=False, **SMALL)
    eng.generate(toks(5, CTX), params=greedy(), session_id="a")
    s = eng.core.polykv.sessions["a"]
    runs, complete = eng.run_on_step_thread(lambda: eng.core.polykv.memory._session_run(s))
    chain = runs[0][0]
    assert complete and len(chain) > 5
    tier = eng.kv_tier
    assert eng.run_on_step_thread(lambda: tier.write_ahead(eng.kv, chain, None, 5)) == (5, False)  # the rest is left
    assert eng.run_on_step_thread(lambda: tier.write_ahead(eng.kv, chain, None, 1000)) == (len(chain) - 5, True)
    assert all(tier.has(e.key) for e in chain)
