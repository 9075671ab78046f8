"""State directory: the pool tree, named sessions and id marks survive a restart; ids are never reused."""

from __future__ import annotations

import sqlite3

import numpy as np
import pytest

from opencoti.engine import EngineConfig, InvalidRequestError, PoolNotFoundError, SamplingParams
from opencoti.engine.persist.store import PoolRecord, SessionRecord, StateDirError, StateStore

ROOT = list(range(10, 42))  # 32 tokens: 8 pages of 4
EXT = ROOT + [5, 6, 7, 8, 9, 11]  # extends ROOT
BRANCH = ROOT[:18] + [1, 2, 3, 4, 5]  # branches ROOT at 18 (inside a page)


def pools_by_id(eng) -> dict:
    return {p["pool_id"]: p for p in eng.pools()["pools"]}


def tokens_of(eng, pid) -> list[int]:
    return eng.run_on_step_thread(lambda: list(eng.core.tree.pools[pid].tokens))


# ============================================================================ the store alone
def test_store_round_trip_lock_and_identity(tmp_path):
    st = StateStore(tmp_path, identity={"model": "m", "vocab_size": 10})
    with st.transaction():
        st.put_pool(PoolRecord(pool_id=3, parent=None, branch_pos=0, tokens=[1, 2, 3], label="x", pinned=True,
                               tenant="alice", admission={"mode": "enforce"}))
        st.put_pool(PoolRecord(pool_id=5, parent=3, branch_pos=2, tokens=[1, 2, 9]))
        st.put_session(SessionRecord("agent", [1, 2, 9, 4], pool_id=5, tenant="alice"))
    with pytest.raises(StateDirError, match="in use by another process"):
        StateStore(tmp_path, identity={"model": "m", "vocab_size": 10})
    with pytest.raises(RuntimeError):  # a failed transaction leaves nothing behind
        with st.transaction():
            st.delete_pool(5)
            raise RuntimeError("boom")
    st.close()
    st = StateStore(tmp_path, identity={"model": "m", "vocab_size": 10})
    snap = st.load()
    assert [p.pool_id for p in snap.pools] == [3, 5] and snap.next_pool_id == 6
    assert snap.pools[0].tokens == [1, 2, 3] and snap.pools[0].admission == {"mode": "enforce"}
    assert snap.pools[0].tenant == "alice" and snap.pools[0].pinned and snap.pools[1].parent == 3
    assert snap.sessions[0].tokens == [1, 2, 9, 4] and snap.sessions[0].pool_id == 5
    with st.transaction():
        st.reserve_pool_ids(4)  # the mark never moves down
    assert st.next_pool_id() == 6
    st.close()
    with pytest.raises(StateDirError, match="another model"):
        StateStore(tmp_path, identity={"model": "other", "vocab_size": 10})


# ============================================================================ restart
def test_default_engine_is_ephemeral(make_engine, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    eng = make_engine()
    assert eng.config.state_dir is None and not eng.persister.enabled
    eng.create_pool(tokens=[1, 2, 3])
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(InvalidRequestError, match="state_dir"):
        EngineConfig(state_dir="")


def test_restart_restores_tree_sessions_and_never_reuses_ids(make_engine, tmp_path):
    state = str(tmp_path / "state")
    eng = make_engine(state_dir=state)
    root = eng.create_pool(tokens=ROOT, label="system")
    ext = eng.fork_pool(root.pool_id, tokens=EXT, label="tools")
    br = eng.fork_pool(root.pool_id, branch_pos=18, tokens=BRANCH)
    gone = eng.create_pool(tokens=[7, 7, 7])
    eng.release_pool(gone.pool_id)
    eng.set_admission(root.pool_id, target_tps_per_session=2.5, mode="enforced")
    prompt = BRANCH + [60, 61, 62]
    before = eng.generate(prompt, pool_id=br.pool_id, session_id="agent-1", params=SamplingParams.greedy(6))
    eng.generate([3, 4, 5], params=SamplingParams.greedy(2))  # an anonymous session: not kept
    eng.check_integrity()
    eng.shutdown()

    eng = make_engine(state_dir=state, session_kv_budget_mib=0)  # the session without its KV file: it recomputes
    st = eng.persister.stats
    assert st["pools"] == 3 and st["sessions"] == 1 and st["skipped_pools"] == []
    pools = pools_by_id(eng)
    assert sorted(pools) == [root.pool_id, ext.pool_id, br.pool_id]
    assert pools[ext.pool_id]["parent"] == root.pool_id and pools[br.pool_id]["branch_pos"] == 18
    assert pools[root.pool_id]["label"] == "system" and pools[ext.pool_id]["label"] == "tools"
    assert {p["residency"] for p in pools.values()} == {"evicted"}
    assert tokens_of(eng, ext.pool_id) == EXT and tokens_of(eng, br.pool_id) == BRANCH
    assert [s["session_id"] for s in pools[br.pool_id]["sessions"]] == ["agent-1"]
    adm = eng.admission(root.pool_id)
    assert adm["target_tps_per_session"] == 2.5 and adm["mode"] == "enforced"
    with pytest.raises(PoolNotFoundError):  # a stale id stays a 404 ...
        eng.pool(gone.pool_id)
    new = eng.create_pool(tokens=[8, 8, 8])
    assert new.pool_id > gone.pool_id  # ... and is never handed out again
    after = eng.generate(prompt, pool_id=br.pool_id, session_id="agent-1", params=SamplingParams.greedy(6))
    assert after.token_ids == before.token_ids  # re-materialized on first use, same KV
    assert after.info.rematerialized_pools == [root.pool_id, br.pool_id]
    eng.check_integrity()
    eng.release_session("agent-1")
    eng.release_pool(ext.pool_id)
    eng.shutdown()

    eng = make_engine(state_dir=state)
    pools = pools_by_id(eng)
    assert sorted(pools) == [root.pool_id, br.pool_id, new.pool_id]
    assert pools[br.pool_id]["sessions"] == []
    assert eng.create_pool(tokens=[9, 9]).pool_id == new.pool_id + 1


def test_pinned_pools_come_back_resident_from_their_kv_files(make_engine, tmp_path):
    state = tmp_path / "state"
    eng = make_engine(state_dir=str(state))
    root = eng.create_pool(tokens=ROOT)
    ext = eng.fork_pool(root.pool_id, tokens=EXT, pinned=True)  # keeps its parent resident too
    other = eng.create_pool(tokens=[4, 5, 6, 7, 8])
    prompt = EXT + [70, 71]
    before = eng.generate(prompt, pool_id=ext.pool_id, params=SamplingParams.greedy(6))
    eng.shutdown()
    assert sorted(f.name for f in (state / "kv").iterdir()) == [f"{root.pool_id}.kv", f"{ext.pool_id}.kv"]

    eng = make_engine(state_dir=str(state))
    assert eng.persister.stats["kv_loaded_pools"] == 2
    pools = pools_by_id(eng)
    assert pools[root.pool_id]["residency"] == "resident" and pools[ext.pool_id]["residency"] == "resident"
    assert pools[other.pool_id]["residency"] == "evicted"
    after = eng.generate(prompt, pool_id=ext.pool_id, params=SamplingParams.greedy(6))
    assert after.token_ids == before.token_ids and after.info.rematerialized_pools == []
    assert after.info.cached_prefix_tokens == len(EXT)
    eng.check_integrity()
    eng.unpin_pool(ext.pool_id)
    eng.shutdown()
    assert list((state / "kv").iterdir()) == []  # unpinned: the files go

    eng = make_engine(state_dir=str(state))
    assert {p["residency"] for p in eng.pools()["pools"]} == {"evicted"}


def test_a_kv_file_of_other_tokens_is_not_loaded(make_engine, tmp_path):
    state = tmp_path / "state"
    eng = make_engine(state_dir=str(state))
    a = eng.create_pool(tokens=ROOT, pinned=True)
    b = eng.create_pool(tokens=BRANCH, pinned=True)
    eng.shutdown()
    kv = state / "kv"
    (kv / f"{a.pool_id}.kv").rename(kv / "tmp")  # swap the files: headers name other tokens
    (kv / f"{b.pool_id}.kv").rename(kv / f"{a.pool_id}.kv")
    (kv / "tmp").rename(kv / f"{b.pool_id}.kv")
    eng = make_engine(state_dir=str(state))
    assert eng.persister.stats["kv_loaded_pools"] == 0
    assert {p["residency"] for p in eng.pools()["pools"]} == {"evicted"}
    r = eng.generate(ROOT + [1], pool_id=a.pool_id, params=SamplingParams.greedy(2))
    assert r.info.rematerialized_pools == [a.pool_id]


def test_state_dir_errors(make_engine, tmp_path):
    state = str(tmp_path / "state")
    eng = make_engine(state_dir=state)
    with pytest.raises(StateDirError, match="in use"):  # two engines never share one directory
        make_engine(state_dir=state)
    eng.create_pool(tokens=ROOT)
    eng.shutdown()
    with pytest.raises(StateDirError, match="another model"):
        make_engine(state_dir=state, model="tiny:qwen2")
    (tmp_path / "file").write_text("x")
    with pytest.raises(StateDirError, match="cannot create"):
        make_engine(state_dir=str(tmp_path / "file" / "state"))


def test_rows_that_do_not_fit_are_skipped_not_lost(make_engine, tmp_path):
    state = tmp_path / "state"
    eng = make_engine(state_dir=str(state))
    root = eng.create_pool(tokens=ROOT)
    child = eng.fork_pool(root.pool_id, tokens=EXT)
    eng.shutdown()
    db = sqlite3.connect(state / "state.sqlite3")  # damage the root's tokens behind the engine's back
    db.execute("UPDATE pools SET tokens = ? WHERE pool_id = ?", (bytes(4 * 3), root.pool_id))
    db.commit()
    db.close()
    eng = make_engine(state_dir=str(state))
    assert eng.persister.stats["skipped_pools"] == [child.pool_id]  # no longer extends its parent
    assert sorted(pools_by_id(eng)) == [root.pool_id]
    assert eng.create_pool(tokens=[1, 2]).pool_id == child.pool_id + 1
    eng.check_integrity()


def test_owner_survives_a_restart(make_engine, tmp_path):
    from opencoti.engine.api.tenancy import TenantEngine

    state = str(tmp_path / "state")
    eng = make_engine(state_dir=state)
    alice = TenantEngine(eng, "alice")
    pa = alice.create_pool(tokens=ROOT)
    alice.generate(ROOT + [3], pool_id=pa.pool_id, session_id="s1", params=SamplingParams.greedy(2))
    eng.shutdown()
    eng = make_engine(state_dir=state)
    alice, bob = TenantEngine(eng, "alice"), TenantEngine(eng, "bob")
    assert [p["pool_id"] for p in alice.pools()["pools"]] == [pa.pool_id]
    assert bob.pools()["pools"] == []
    with pytest.raises(PoolNotFoundError):
        bob.pool(pa.pool_id)
    assert [s["session_id"] for s in alice.pool(pa.pool_id).sessions] == ["s1"]


# ============================================================================ slot files
def test_slot_save_restore_erase(make_engine, tmp_path):
    from opencoti.engine import SessionNotFoundError
    from opencoti.engine.persist.slots import SlotsNotSupportedError, erase_session, restore_session, save_session
    from opencoti.engine.api.tenancy import TenantEngine

    eng = make_engine(state_dir=str(tmp_path / "state"))
    pool = eng.create_pool(tokens=ROOT)
    prompt = ROOT + [50, 51, 52]
    first = eng.generate(prompt, pool_id=pool.pool_id, session_id="a", params=SamplingParams.greedy(5))
    out = save_session(eng, "a", "a.bin")
    n = out["n_saved"]
    assert n == len(prompt) + 4 and out["n_written"] > 0  # the last sampled token has no KV yet
    for bad in ("../x", "", "a/b", ".hidden", "x" * 200):
        with pytest.raises(InvalidRequestError, match="Invalid filename"):
            save_session(eng, "a", bad)
    with pytest.raises(SessionNotFoundError):
        save_session(eng, "nobody", "n.bin")
    # restore into a new session: its whole context comes from the file, nothing recomputed
    assert restore_session(eng, "b", "a.bin")["n_restored"] == n
    cont = prompt + first.token_ids + [60]
    rb = eng.generate(cont, session_id="b", params=SamplingParams.greedy(4))
    assert rb.info.cached_prefix_tokens == n
    ra = eng.generate(cont, session_id="a", params=SamplingParams.greedy(4))
    assert ra.token_ids == rb.token_ids
    eng.check_integrity()
    assert erase_session(eng, "b")["n_erased"] == len(cont) + 4
    # (a salt of its own: the prompt is still in the prefix cache, through session a)
    rb2 = eng.generate(cont, session_id="b", params=SamplingParams.greedy(4), cache_salt="erased")
    assert rb2.info.cached_prefix_tokens == 0 and rb2.token_ids == ra.token_ids
    with pytest.raises(InvalidRequestError, match="no slot file"):
        restore_session(eng, "b", "missing.bin")
    (tmp_path / "state" / "slots" / "junk.bin").write_bytes(b"junk")
    with pytest.raises(InvalidRequestError, match="not a slot file"):
        restore_session(eng, "b", "junk.bin")
    # tenants: their own session names, no way to another's session
    alice, bob = TenantEngine(eng, "alice"), TenantEngine(eng, "bob")
    with pytest.raises(InvalidRequestError, match="no slot file"):  # a tenant has its own file names
        restore_session(alice, "a", "a.bin")
    alice.generate(prompt, session_id="a", params=SamplingParams.greedy(2))
    m = save_session(alice, "a", "a.bin")["n_saved"]
    assert restore_session(alice, "a2", "a.bin")["n_restored"] == m
    assert (tmp_path / "state" / "slots" / "alice" / "a.bin").exists()
    with pytest.raises(SessionNotFoundError) as e:
        save_session(bob, "a", "bob.bin")
    assert "alice" not in str(e.value)
    with pytest.raises(InvalidRequestError, match="no slot file"):
        restore_session(bob, "a", "a.bin")
    eng.check_integrity()
    plain = make_engine()
    plain.generate([1, 2, 3], session_id="a", params=SamplingParams.greedy(1))
    with pytest.raises(SlotsNotSupportedError, match="--state-dir"):
        save_session(plain, "a", "a.bin")


def test_a_pool_pinned_while_evicted_gets_its_kv_file_once_resident(make_engine, tmp_path):
    state = tmp_path / "state"
    eng = make_engine(state_dir=str(state))
    p = eng.create_pool(tokens=ROOT)
    eng.evict_pool(p.pool_id)
    eng.pin_pool(p.pool_id)
    eng.persister.kv_writer.flush()
    assert list((state / "kv").iterdir()) == []
    eng.generate(ROOT + [1], pool_id=p.pool_id, params=SamplingParams.greedy(1))  # re-materializes
    eng.persister.kv_writer.flush()
    assert [f.name for f in (state / "kv").iterdir()] == [f"{p.pool_id}.kv"]
    eng.shutdown()
    eng = make_engine(state_dir=str(state))
    assert eng.pool(p.pool_id).residency == "resident"


def test_kv_files_are_keyed_by_the_weight_format(make_engine, tmp_path):
    """The same tokens give other KV under other weights: a pinned pool's KV file saved with int4
    projections is never loaded into an fp32 engine (it is recomputed, then saved again for fp32);
    a slot file is refused with a clear error."""
    from opencoti.engine.persist import kvfile
    from opencoti.engine.persist.slots import restore_session, save_session

    state = tmp_path / "state"
    prompt = ROOT + [70, 71]
    q = make_engine(state_dir=str(state), weights="int4")
    p = q.create_pool(tokens=ROOT, pinned=True)
    q.generate(prompt, session_id="s", params=SamplingParams.greedy(3))
    save_session(q, "s", "s.bin")
    q.shutdown()
    path = state / "kv" / f"{p.pool_id}.kv"
    head = kvfile.read_header(path)
    kv_dtype = str(q.kv.dtype).removeprefix("torch.")  # the default's
    assert head["kv"]["weights"] == "int4" and head["kv"]["kv_dtype"] == head["dtype"] == kv_dtype
    word = np.dtype(kv_dtype).newbyteorder("<")
    int4_kv = np.fromfile(path, dtype=word, offset=kvfile.HEADER)

    ref = make_engine(weights="fp32")  # what an fp32 engine computes for the pool
    want = ref.generate(prompt, params=SamplingParams.greedy(6)).token_ids
    ref.shutdown()

    eng = make_engine(state_dir=str(state), weights="fp32")
    assert eng.persister.stats["kv_loaded_pools"] == 0  # the int4 KV is not loaded ...
    assert eng.pool(p.pool_id).residency == "evicted" and not path.exists()  # ... and the file is dropped
    with pytest.raises(InvalidRequestError, match="int4 weights.*fp32 weights.*cannot be restored"):
        restore_session(eng, "t", "s.bin")
    r = eng.generate(prompt, pool_id=p.pool_id, params=SamplingParams.greedy(6))
    assert r.info.rematerialized_pools == [p.pool_id] and r.token_ids == want  # recomputed with fp32
    eng.persister.kv_writer.flush()
    assert kvfile.read_header(path)["kv"]["weights"] == "fp32"  # saved again, for fp32
    fp32_kv = np.fromfile(path, dtype=word, offset=kvfile.HEADER)
    assert fp32_kv.shape == int4_kv.shape and not np.allclose(fp32_kv, int4_kv, atol=1e-3)  # it would be wrong
    eng.shutdown()

    eng = make_engine(state_dir=str(state), weights="fp32", page_size=8)  # same weights, another page size
    assert eng.persister.stats["kv_loaded_pools"] == 1 and eng.pool(p.pool_id).residency == "resident"
    r = eng.generate(prompt, pool_id=p.pool_id, params=SamplingParams.greedy(6))
    assert r.info.rematerialized_pools == [] and r.token_ids == want
    eng.shutdown()

    eng = make_engine(state_dir=str(state), weights="fp32", dtype="bfloat16")  # another KV dtype
    assert eng.persister.stats["kv_loaded_pools"] == 0 and eng.pool(p.pool_id).residency == "evicted"


def test_a_stored_pool_whose_id_is_taken_is_skipped_not_half_restored(make_engine, tmp_path, caplog):
    """Restoring over a tree that already holds the stored ids (a store of duplicates would do the
    same): every such pool is skipped with the reason, nothing is left half-restored."""
    eng = make_engine(state_dir=str(tmp_path / "state"))
    root = eng.create_pool(tokens=ROOT, label="system")
    eng.fork_pool(root.pool_id, tokens=EXT, label="tools")
    before = eng.pools()
    with caplog.at_level("WARNING", logger="opencoti.engine.persist"):
        stats = eng.run_on_step_thread(eng.persister.restore)
    assert stats["pools"] == 0 and stats["skipped_pools"] == [root.pool_id, root.pool_id + 1]
    assert "is taken already" in caplog.text
    assert [p["pool_id"] for p in eng.pools()["pools"]] == [p["pool_id"] for p in before["pools"]]
    eng.check_integrity()
