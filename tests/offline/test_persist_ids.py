"""Pool ids never come back, whichever part of a state directory is lost (issue 49): the id
high-water mark is the highest of every source (the database's mark and tables, the mark file, the
pool ids the KV file names and the session KV files name); it is written back before anything is
removed, and every file removed at a restart is logged with its reason."""

from __future__ import annotations

import logging

from opencoti.engine import SamplingParams
from opencoti.engine.persist.files import pool_ids_in_files
from opencoti.engine.persist.session_kv import file_name
from opencoti.engine.persist.store import DB_NAME, MARK_NAME, StateStore

ROOT = list(range(10, 42))
LOGGER = "opencoti.engine.persist"


def lose(state, *names: str) -> None:
    for name in names:
        for side in ("", "-wal", "-shm") if name == DB_NAME else ("",):
            (state / (name + side)).unlink(missing_ok=True)


def one_pinned_pool(make_engine, state) -> int:
    eng = make_engine(state_dir=str(state))
    pid = eng.create_pool(tokens=ROOT, pinned=True).pool_id
    eng.shutdown()
    assert (state / "kv" / f"{pid}.kv").exists()
    return pid


def messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_database_and_mark_lost_but_a_kv_file_names_the_pool(make_engine, tmp_path, caplog):
    state = tmp_path / "state"
    pid = one_pinned_pool(make_engine, state)
    lose(state, DB_NAME, MARK_NAME)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        eng = make_engine(state_dir=str(state))
    log = messages(caplog)
    lost = next(i for i, m in enumerate(log) if "the database was lost" in m)
    assert f"kv/{pid}.kv: {pid}" in log[lost] and f"pool ids continue from {pid + 1}" in log[lost]
    removed = next(i for i, m in enumerate(log) if f"removing kv/{pid}.kv" in m)
    assert lost < removed and "not in the state database" in log[removed]  # understood first, then removed
    assert int((state / MARK_NAME).read_text()) == pid + 1  # the mark was written back
    assert not (state / "kv" / f"{pid}.kv").exists()
    assert eng.create_pool(tokens=[1, 2, 3]).pool_id == pid + 1  # never the id of the lost pool
    eng.shutdown()


def test_only_the_database_lost_keeps_ids_and_logs_each_removal(make_engine, tmp_path, caplog):
    state = tmp_path / "state"
    pid = one_pinned_pool(make_engine, state)
    lose(state, DB_NAME)
    (state / "kv" / "99.kv.tmp").write_bytes(b"half")  # a write the crash cut
    (state / "kv" / "notes.kv").write_bytes(b"?")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        eng = make_engine(state_dir=str(state))
    log = "\n".join(messages(caplog))
    assert f"removing kv/{pid}.kv: pool {pid} is not in the state database" in log
    assert "removing kv/99.kv.tmp: a half-written KV file of pool 99" in log
    assert "removing kv/notes.kv: not a KV file of a pool" in log
    assert sorted(f.name for f in (state / "kv").iterdir()) == []
    assert eng.create_pool(tokens=[1, 2, 3]).pool_id == 100  # above the half-written file's id too
    eng.shutdown()


def test_kv_files_above_an_older_database_raise_the_mark(make_engine, tmp_path, caplog):
    state = tmp_path / "state"
    pid = one_pinned_pool(make_engine, state)
    lose(state, MARK_NAME)
    (state / "kv" / f"{pid}.kv").rename(state / "kv" / "7.kv")  # e.g. the database restored from a backup
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        eng = make_engine(state_dir=str(state))
    log = "\n".join(messages(caplog))
    assert "kv/7.kv: 7" in log and "pool ids continue from 8" in log and "removing kv/7.kv" in log
    assert eng.create_pool(tokens=[1, 2, 3]).pool_id == 8
    eng.shutdown()


def test_session_kv_files_name_their_pool(make_engine, tmp_path, caplog):
    state = tmp_path / "state"
    eng = make_engine(state_dir=str(state))
    pools = [eng.create_pool(tokens=ROOT[:8 + i]).pool_id for i in range(3)]
    eng.generate(ROOT + [50, 51], session_id="thread-1", pool_id=pools[-1],
                 params=SamplingParams.greedy(2, ignore_eos=True))
    eng.run_on_step_thread(lambda: None)
    eng.persister.kv_writer.flush()
    name = f"session_kv/{file_name('thread-1')}"
    assert pool_ids_in_files(state) == {name: pools[-1]}
    eng.shutdown()
    lose(state, DB_NAME, MARK_NAME)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        eng = make_engine(state_dir=str(state))
    log = "\n".join(messages(caplog))
    assert f"{name}: {pools[-1]}" in log and "removing the session KV file" in log and "no stored session" in log
    assert eng.create_pool(tokens=[1, 2, 3]).pool_id == pools[-1] + 1
    eng.shutdown()


def test_the_store_alone_takes_the_highest_source(tmp_path):
    state = tmp_path / "state"
    (state / "kv").mkdir(parents=True)
    (state / "kv" / "12.kv").write_bytes(b"")
    st = StateStore(state)
    assert st.next_pool_id() == 13 and int((state / MARK_NAME).read_text()) == 13
    st.close()
    (state / MARK_NAME).write_text("40\n")
    st = StateStore(state)
    assert st.next_pool_id() == 40  # the mark file wins when it is higher
    st.close()
