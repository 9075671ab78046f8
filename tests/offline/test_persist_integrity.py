"""The state directory never serves wrong KV and never hands an id out twice: KV files carry a
checksum checked on load (a corrupt file is recomputed, logged, reported by /polykv/integrity);
a state database that exists but is empty or unreadable stops the engine before anything is
deleted; the id high-water mark is kept beside the database too."""

from __future__ import annotations

import logging

import pytest

from opencoti.engine import SamplingParams
from opencoti.engine.persist import kvfile
from opencoti.ops import call
from opencoti.ops.context import Context

ROOT = list(range(10, 42))
EXT = ROOT + [5, 6, 7, 8, 9, 11]


def flip_middle(path) -> None:
    data = bytearray(path.read_bytes())
    mid = kvfile.HEADER + (len(data) - kvfile.HEADER) // 2
    for i in range(mid, mid + 64):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))  # the same size: only the checksum can tell


def test_a_corrupt_kv_file_is_recomputed_never_loaded(make_engine, tmp_path, caplog):
    state = tmp_path / "state"
    eng = make_engine(state_dir=str(state))
    root = eng.create_pool(tokens=ROOT)
    ext = eng.fork_pool(root.pool_id, tokens=EXT, pinned=True)
    prompt = EXT + [70, 71]
    before = eng.generate(prompt, pool_id=ext.pool_id, params=SamplingParams.greedy(6))
    eng.shutdown()
    path = state / "kv" / f"{ext.pool_id}.kv"
    assert kvfile.verify(path) is None
    flip_middle(path)
    assert "checksum does not match" in kvfile.verify(path)

    with caplog.at_level(logging.WARNING, logger="opencoti.engine.persist"):
        eng = make_engine(state_dir=str(state))
    assert f"the KV file of pool {ext.pool_id} is not used" in caplog.text
    assert eng.persister.stats["kv_loaded_pools"] == 1  # the root's file is fine
    assert eng.pool(ext.pool_id).residency == "evicted" and eng.pool(root.pool_id).residency == "resident"
    report = call(Context(eng), "integrity")
    assert report["ok"] and report["kv_files"]["rejected_at_load"] == [ext.pool_id]
    after = eng.generate(prompt, pool_id=ext.pool_id, params=SamplingParams.greedy(6))
    assert after.token_ids == before.token_ids and after.info.rematerialized_pools == [ext.pool_id]
    eng.persister.kv_writer.flush()
    assert kvfile.verify(path) is None  # written again from the recomputed pages
    eng.shutdown()
    eng = make_engine(state_dir=str(state))
    assert eng.persister.stats["kv_loaded_pools"] == 2


def test_integrity_reports_a_kv_file_corrupted_on_disk(make_engine, tmp_path):
    state = tmp_path / "state"
    eng = make_engine(state_dir=str(state))
    p = eng.create_pool(tokens=ROOT, pinned=True)
    ctx = Context(eng)
    eng.persister.kv_writer.flush()
    assert call(ctx, "integrity")["kv_files"] == {"checked": 1, "corrupt": [], "rejected_at_load": []}
    path = state / "kv" / f"{p.pool_id}.kv"
    flip_middle(path)
    report = call(ctx, "integrity")
    assert report["ok"] is False and report["kv_files"]["corrupt"] == [p.pool_id]
    eng.persister.kv_writer.flush()
    assert kvfile.verify(path) is None  # written again from the resident pages
    assert call(ctx, "integrity")["ok"] is True


def test_a_kv_file_without_a_checksum_is_not_loaded(make_engine, tmp_path):
    state = tmp_path / "state"
    eng = make_engine(state_dir=str(state))
    p = eng.create_pool(tokens=ROOT, pinned=True)
    eng.shutdown()
    path = state / "kv" / f"{p.pool_id}.kv"
    head = kvfile.read_header(path)
    del head["checksum"]
    raw = path.read_bytes()
    path.write_bytes((kvfile.MAGIC + __import__("json").dumps(head).encode() + b"\n").ljust(kvfile.HEADER, b"\0")
                     + raw[kvfile.HEADER:])
    assert "no checksum" in kvfile.verify(path)
    eng = make_engine(state_dir=str(state))
    assert eng.persister.stats["kv_loaded_pools"] == 0 and eng.pool(p.pool_id).residency == "evicted"


# ============================================================================ the database and the id mark
def _three_pools(make_engine, state) -> tuple[int, list[str]]:
    eng = make_engine(state_dir=str(state))
    ids = [eng.create_pool(tokens=ROOT, pinned=True).pool_id, eng.create_pool(tokens=[4, 5, 6]).pool_id]
    eng.release_pool(ids[1])
    ids.append(eng.create_pool(tokens=[7, 8, 9]).pool_id)
    eng.shutdown()
    return max(ids), sorted(f.name for f in (state / "kv").iterdir())


@pytest.mark.parametrize("damage", ["empty", "no tables", "garbage"])
def test_a_damaged_database_is_an_error_and_nothing_is_deleted(make_engine, tmp_path, damage):
    import sqlite3

    from opencoti.engine.persist.store import DB_NAME, StateDirError

    state = tmp_path / "state"
    _, kv_files = _three_pools(make_engine, state)
    db = state / DB_NAME
    for side in ("-wal", "-shm"):
        (state / (DB_NAME + side)).unlink(missing_ok=True)
    if damage == "empty":
        db.write_bytes(b"")
    elif damage == "no tables":
        db.unlink()
        sqlite3.connect(str(db)).execute("CREATE TABLE other (x)").connection.close()
    else:
        db.write_bytes(b"\x00garbage" * 1000)
    before = sorted(p.name for p in state.rglob("*"))
    with pytest.raises(StateDirError, match="empty|holds no opencoti state|cannot open the state database"):
        make_engine(state_dir=str(state))
    assert sorted(p.name for p in state.rglob("*")) == before  # the KV files and the mark are still there
    assert sorted(f.name for f in (state / "kv").iterdir()) == kv_files
    assert db.stat().st_size == (0 if damage == "empty" else db.stat().st_size)


def test_ids_never_come_back_even_when_the_database_is_lost(make_engine, tmp_path, caplog):
    from opencoti.engine.persist.store import DB_NAME, MARK_NAME

    state = tmp_path / "state"
    top, _ = _three_pools(make_engine, state)
    assert int((state / MARK_NAME).read_text()) == top + 1
    for name in (DB_NAME, DB_NAME + "-wal", DB_NAME + "-shm"):
        (state / name).unlink(missing_ok=True)
    with caplog.at_level(logging.WARNING, logger="opencoti.engine.persist"):
        eng = make_engine(state_dir=str(state))
    assert "the database was lost" in caplog.text
    assert eng.pools()["pools"] == []
    assert eng.create_pool(tokens=[1, 2, 3]).pool_id == top + 1  # never an id handed out before
    eng.shutdown()


def test_the_mark_file_wins_when_it_is_higher(make_engine, tmp_path):
    from opencoti.engine.persist.store import MARK_NAME, StateDirError

    state = tmp_path / "state"
    top, _ = _three_pools(make_engine, state)
    (state / MARK_NAME).write_text("40\n")  # e.g. the database restored from an older backup
    eng = make_engine(state_dir=str(state))
    assert eng.create_pool(tokens=[1, 2, 3]).pool_id == 40
    eng.shutdown()
    (state / MARK_NAME).write_text("x\n")
    with pytest.raises(StateDirError, match="id mark .* is damaged"):
        make_engine(state_dir=str(state))


def test_two_swapped_kv_files_are_named_with_why_and_listed_as_rejected(make_engine, tmp_path, caplog):
    """Issue 49 (7): the same engine, two KV files swapped: the log names each file and why (it holds
    the KV of the other pool), not "does not match this engine"; both pools are rejected_at_load."""
    state = tmp_path / "state"
    eng = make_engine(state_dir=str(state))
    a = eng.create_pool(tokens=ROOT, pinned=True).pool_id
    b = eng.create_pool(tokens=[t + 100 for t in ROOT], pinned=True).pool_id
    eng.shutdown()
    fa, fb = state / "kv" / f"{a}.kv", state / "kv" / f"{b}.kv"
    da, db = fa.read_bytes(), fb.read_bytes()
    fa.write_bytes(db)
    fb.write_bytes(da)
    with caplog.at_level(logging.WARNING, logger="opencoti.engine.persist"):
        eng = make_engine(state_dir=str(state))
    assert "does not match this engine" not in caplog.text
    for mine, theirs in ((a, b), (b, a)):
        assert (f"kv/{mine}.kv is not used: it holds the KV of other tokens than the pool's (another prefix) "
                f"(its header says it holds the KV of pool {theirs}: the file was swapped or renamed)") in caplog.text
    assert eng.persister.stats["kv_loaded_pools"] == 0
    report = call(Context(eng), "integrity")
    assert report["ok"] and sorted(report["kv_files"]["rejected_at_load"]) == sorted([a, b])


def test_a_kv_file_of_another_engine_says_what_differs():
    head = {"start": 0, "tokens": kvfile.tokens_digest(ROOT), "kv": {"model": "m", "weights": "int4", "kv_dtype": "q8"}}
    why = kvfile.mismatch(head, 0, ROOT, {"model": "m", "weights": "fp32", "kv_dtype": "q8"})
    assert why == "it was computed by weights 'int4' (this engine: 'fp32')"
    assert kvfile.mismatch(head, 0, ROOT, head["kv"]) is None
    assert "unreadable" in kvfile.mismatch(None, 0, ROOT, None)
