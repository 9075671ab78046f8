"""The disk tier (engine/persist/tier.py): KV reclaimed from RAM is written to disk and read back
instead of recomputed; idle sessions leave RAM first; the reports say where each session's KV
lives; and every fault (a full disk, a vanished file, a corrupt file, a kill -9 during a write)
degrades to a recompute: logged, never wrong KV, never an error."""

from __future__ import annotations

import errno
import logging
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from opencoti.engine import SamplingParams
from opencoti.engine.persist import kvfile
from opencoti.engine.persist.tier import TIER_DIR
from opencoti.server import create_app

N_AGENTS, CTX, TURNS = 5, 96, 3
SMALL = dict(kv_budget_tokens=256)  # the agents' KV together is ~3x the RAM pages


def greedy(n: int = 5) -> SamplingParams:
    return SamplingParams.greedy(n, ignore_eos=True)


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 250) for _ in range(n)]


def agent_team(eng, turns: int = TURNS, between=None) -> list[tuple[list[int], int]]:
    """Agents taking turns in rotation, each turn its whole context again plus a tool result:
    [(answer ids, cached prompt tokens)] in order."""
    ctx = {i: toks(i, CTX) for i in range(N_AGENTS)}
    out = []
    for turn in range(turns):
        for i in range(N_AGENTS):
            if between is not None:
                between(turn, i)
            r = eng.generate(ctx[i], params=greedy(), session_id=f"agent-{i}")
            out.append((r.token_ids, r.cache_n))
            ctx[i] = ctx[i] + r.token_ids + toks(1000 + 10 * turn + i, 12)
    return out


def tier_files(state: Path) -> list[Path]:
    return sorted((state / TIER_DIR).glob("*.kv"))


def disk(eng) -> dict:
    return eng.stats()["kv_tiers"]["disk"]


def flush(eng) -> None:
    eng.run_on_step_thread(lambda: None)
    eng.kv_tier.flush()


def test_reclaimed_kv_comes_back_from_disk_with_the_answers_of_all_in_ram(make_engine, tmp_path):
    ram = agent_team(make_engine())  # 4096 tokens of KV: nothing is reclaimed
    off = agent_team(make_engine(**SMALL))  # no state directory: no tier, reclaimed KV is recomputed
    eng = make_engine(state_dir=str(tmp_path / "s"), **SMALL)
    tiered = agent_team(eng)
    assert [a for a, _ in tiered] == [a for a, _ in ram] == [a for a, _ in off]
    later = slice(N_AGENTS, None)  # turns after the first: each agent's context was reclaimed meanwhile
    assert all(n == 0 or n < CTX // 2 for _, n in off[later])  # recomputed
    assert [n for _, n in tiered[later]] == [n for _, n in ram[later]]  # all of it came back, partial last pages too
    d = disk(eng)
    assert d["enabled"] and d["spilled_pages"] > 0 and d["read_pages"] > 0 and d["faults"] == 0
    assert d["prefetched_segments"] > 0 and d["read_segments"] > 0 and d["prefetched_bytes"] == 0  # read ahead, all used
    assert d["promoted_pages"] == d["read_pages"] == eng.stats()["tier_read_pages"]
    assert 0 < d["used_bytes"] <= d["budget_bytes"]
    flush(eng)
    files = tier_files(tmp_path / "s")
    assert files and all(kvfile.verify(f) is None for f in files)  # the KV file format, checksummed
    head = kvfile.read_header(files[0])
    assert head["kv"]["model"] and head["tier"]["pages"] >= 1 and head["checksum"]


def test_the_tier_is_off_without_a_directory_or_with_a_budget_of_zero(make_engine, tmp_path):
    for eng in (make_engine(**SMALL), make_engine(state_dir=str(tmp_path / "z"), kv_disk_budget_mib=0, **SMALL)):
        agent_team(eng, turns=2)
        assert eng.kv_tier is None and disk(eng) == {"enabled": False, "used_bytes": 0, "pages": 0,
                                                     "promoted_pages": 0}
    assert not (tmp_path / "z" / TIER_DIR).exists()
    own = make_engine(kv_disk_dir=str(tmp_path / "own"), **SMALL)  # its own path, no state directory
    agent_team(own, turns=2)
    assert disk(own)["read_pages"] > 0


def test_the_budget_bounds_the_files_least_recently_used_go_first(make_engine, tmp_path):
    eng = make_engine(state_dir=str(tmp_path / "s"), kv_disk_budget_mib=0.05, **SMALL)  # ~50 KiB: a few segments
    out = agent_team(eng)
    flush(eng)
    d = disk(eng)
    assert d["used_bytes"] <= d["budget_bytes"] and d["evicted_segments"] > 0
    assert sum(f.stat().st_size for f in tier_files(tmp_path / "s")) <= d["budget_bytes"]
    assert [a for a, _ in out] == [a for a, _ in agent_team(make_engine())]


def test_the_reports_say_where_each_sessions_kv_lives(make_engine, tmp_path):
    eng = make_engine(state_dir=str(tmp_path / "s"), **SMALL)
    agent_team(eng, turns=1)
    rows = {s["session_id"]: s for s in eng.tps_snapshot()["sessions"]}  # what /slots and the dashboard show
    assert rows["agent-0"]["kv_location"] == "disk" and rows["agent-0"]["kv_disk_tokens"] > 0
    assert rows[f"agent-{N_AGENTS - 1}"]["kv_location"] == "ram" and rows[f"agent-{N_AGENTS - 1}"]["kv_ram_tokens"] > 0
    st = eng.pools()
    assert st["kv_tiers"]["disk"]["used_bytes"] > 0 and st["kv_tiers"]["ram"]["used_bytes"] > 0
    off = make_engine(**SMALL)
    agent_team(off, turns=1)
    rows = {s["session_id"]: s for s in off.tps_snapshot()["sessions"]}
    assert rows["agent-0"]["kv_location"] == "none"
    with TestClient(create_app(eng), raise_server_exceptions=False) as c:
        slots = {s["session_id"]: s for s in c.get("/slots").json()}
        assert slots["agent-0"]["kv_location"] == "disk"
        assert c.get("/polykv/pools").json()["kv_tiers"]["disk"]["pages"] > 0


def test_sessions_idle_longer_than_the_threshold_leave_ram_before_the_prefix_cache(make_engine, tmp_path):
    def run(idle_s: float) -> dict:
        eng = make_engine(state_dir=str(tmp_path / f"s{idle_s}"), kv_idle_spill_s=idle_s, kv_budget_tokens=160,
                          session_ttl_s=0)
        eng.generate(toks(1, 60), params=greedy(), session_id="waiting")  # an agent waiting on a tool
        eng.generate(toks(2, 60), params=greedy())  # a finished anonymous request: its pages are cache
        eng.generate(toks(3, 60), params=greedy())
        eng.generate(toks(4, 60), params=greedy(), session_id="new")  # needs pages: something leaves RAM
        return {s["session_id"]: s["kv_location"] for s in eng.tps_snapshot()["sessions"]}

    assert run(0.0)["waiting"] == "disk"  # idle past the threshold: it goes first
    assert run(3600.0)["waiting"] == "ram"  # idle for less: the prefix cache's pages go first


def _corrupt(files: list[Path]) -> None:
    for f in files:
        data = bytearray(f.read_bytes())
        data[kvfile.HEADER + 7] ^= 0xFF
        f.write_bytes(bytes(data))


def _vanish(files: list[Path]) -> None:
    for f in files:
        f.unlink()


def _swap(files: list[Path]) -> None:
    """Each file gets another one's content: right checksum, wrong KV."""
    blobs = [f.read_bytes() for f in files]
    for f, b in zip(files, blobs[1:] + blobs[:1]):
        f.write_bytes(b)


def test_corrupt_vanished_or_swapped_files_are_recomputed_logged_never_wrong(make_engine, tmp_path, caplog):
    ram = [a for a, _ in agent_team(make_engine())]
    for damage in (_corrupt, _vanish, _swap):
        state = tmp_path / damage.__name__
        eng = make_engine(state_dir=str(state), **SMALL)

        def between(turn, i, eng=eng, state=state, damage=damage):
            if turn >= 1 and i == 0:  # every file on disk now, before the turns that read them
                flush(eng)
                files = tier_files(state)
                if len(files) > 1 or damage is not _swap:
                    damage(files)

        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="opencoti.engine.persist"):
            out = agent_team(eng, between=between)
        assert [a for a, _ in out] == ram, damage.__name__
        assert disk(eng)["faults"] > 0, damage.__name__
        assert "recomputed" in caplog.text and "KV tier" in caplog.text
        eng.check_integrity()


def test_a_full_disk_loses_the_writes_not_the_answers(make_engine, tmp_path, monkeypatch, caplog):
    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("opencoti.engine.persist.tier_files.kvfile.write_kv", full)
    eng = make_engine(state_dir=str(tmp_path / "s"), **SMALL)
    with caplog.at_level(logging.WARNING, logger="opencoti.engine.persist"):
        out = agent_team(eng)
    assert [a for a, _ in out] == [a for a, _ in agent_team(make_engine())]
    d = disk(eng)
    assert d["write_errors"] > 0
    assert "No space left" in caplog.text
    flush(eng)
    assert not tier_files(tmp_path / "s") and not list((tmp_path / "s" / TIER_DIR).glob("*.tmp"))


def test_a_write_queue_that_is_full_drops_pages_instead_of_waiting(make_engine, tmp_path):
    eng = make_engine(state_dir=str(tmp_path / "s"), **SMALL)
    eng.kv_tier.max_pending = 0  # the I/O thread is always behind
    out = agent_team(eng)
    assert [a for a, _ in out] == [a for a, _ in agent_team(make_engine())]
    d = disk(eng)
    assert d["dropped_pages_queue_full"] > 0 and d["spilled_pages"] == 0 and d["read_pages"] == 0


def test_http_never_answers_5xx_when_the_tier_files_are_damaged(make_engine, tmp_path):
    eng = make_engine(state_dir=str(tmp_path / "s"), **SMALL)
    body = {"temperature": 0, "ignore_eos": True, "n_predict": 4}
    with TestClient(create_app(eng), raise_server_exceptions=False) as c:
        for i in range(N_AGENTS):
            assert c.post("/completion", json={"prompt": toks(i, CTX), "session_id": f"h{i}", **body}).status_code == 200
        flush(eng)
        files = tier_files(tmp_path / "s")
        _corrupt(files[::2])
        _vanish(files[1::2])
        for i in range(N_AGENTS):
            r = c.post("/completion", json={"prompt": toks(i, CTX) + [7, 8, 9], "session_id": f"h{i}", **body})
            assert r.status_code == 200, r.text


KILLED_WRITER = textwrap.dedent("""
    import os, random, signal, sys
    from opencoti.engine import Engine, EngineConfig, SamplingParams
    from opencoti.engine.persist import kvfile
    real = kvfile.write_kv
    def write_then_die(path, *a, **k):  # the process dies while a tier file is being written
        if "kv_tier" not in str(path):
            return real(path, *a, **k)
        open(str(path) + ".tmp", "wb").write(b"OPENCOTI-KV1\\n" + b"x" * 100)
        os.kill(os.getpid(), signal.SIGKILL)
    import opencoti.engine.persist.tier_files as tier_files
    tier_files.kvfile.write_kv = write_then_die
    eng = Engine(EngineConfig(model="tiny:llama", page_size=4, kv_budget_tokens=256, max_batch_tokens=64,
                              state_dir=sys.argv[1]))
    for i in range(5):
        r = random.Random(i)
        eng.generate([r.randint(1, 250) for _ in range(96)], params=SamplingParams.greedy(5, ignore_eos=True),
                     session_id=f"agent-{i}")
""")


def test_a_kill_9_during_a_write_leaves_nothing_that_loads(make_engine, tmp_path):
    state = tmp_path / "s"
    p = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(state)], capture_output=True, timeout=300)
    assert p.returncode == -9, p.stderr.decode()[-2000:]
    left = list((state / TIER_DIR).iterdir())
    assert any(f.name.endswith(".tmp") for f in left)  # what the kill left behind
    (state / TIER_DIR / "1.kv").write_bytes(b"OPENCOTI-KV1\n{}")  # and a file cut short, for good measure
    eng = make_engine(state_dir=str(state), **SMALL)
    assert not list((state / TIER_DIR).iterdir())  # the tier starts empty: nothing half-written is read
    assert [a for a, _ in agent_team(eng)] == [a for a, _ in agent_team(make_engine())]


def pooled_team(eng, turns: int = TURNS) -> list[tuple[list[int], int]]:
    """The agent team on a pool: a shared system prompt as a pool, each agent attached to it."""
    system = toks(99, 24)
    pool = eng.create_pool(tokens=system)
    ctx = {i: system + toks(i, CTX - len(system)) for i in range(N_AGENTS)}
    out = []
    for turn in range(turns):
        for i in range(N_AGENTS):
            r = eng.generate(ctx[i], params=greedy(), session_id=f"agent-{i}", pool_id=pool.pool_id)
            out.append((r.token_ids, r.cache_n))
            ctx[i] = ctx[i] + r.token_ids + toks(1000 + 10 * turn + i, 12)
    return out


def test_a_pooled_sessions_own_kv_comes_back_from_disk(make_engine, tmp_path):
    ram = pooled_team(make_engine())
    off = pooled_team(make_engine(**SMALL))
    eng = make_engine(state_dir=str(tmp_path / "s"), **SMALL)
    tiered = pooled_team(eng)
    assert [a for a, _ in tiered] == [a for a, _ in ram] == [a for a, _ in off]
    later = slice(N_AGENTS, None)
    assert all(n < CTX // 2 for _, n in off[later])  # about the pool's prefix only: the rest recomputed
    for (_, n_tier), (_, n_ram) in zip(tiered[later], ram[later]):
        assert n_tier >= n_ram - 2 * eng.kv.page_size
    assert disk(eng)["read_pages"] > 0
    rows = {s["session_id"]: s for s in eng.pools()["pools"][0]["sessions"]}
    assert {r["kv_location"] for r in rows.values()} <= {"ram", "disk"}


def test_an_evicted_pool_comes_back_from_disk(make_engine, tmp_path):
    def run(**kw):
        eng = make_engine(session_ttl_s=0, **kw)
        pool = eng.create_pool(tokens=toks(7, 120))
        first = eng.generate(toks(7, 120) + [5, 6], params=greedy(), pool_id=pool.pool_id).token_ids
        for i in range(4):  # other work that needs the pages: the idle pool is evicted
            eng.generate(toks(50 + i, 90), params=greedy())
        assert eng.pool(pool.pool_id).residency == "evicted"
        before = eng.stats()["tier_read_pages"]
        again = eng.generate(toks(7, 120) + [5, 6], params=greedy(), pool_id=pool.pool_id).token_ids
        return first, again, eng.stats()["tier_read_pages"] - before

    first, again, read = run(state_dir=str(tmp_path / "s"), kv_budget_tokens=200)
    assert first == again and read >= 120 // 4 - 2  # its pages came back instead of a prefill
    first_off, again_off, read_off = run(kv_budget_tokens=200)
    assert first_off == again_off == first and read_off == 0


# ---------------------------------------------------------------------------- the KV tables' side, no model
class MemoryTier:
    """A ``kv.tables.Tier`` in memory: what the tables hand out and take back."""

    def __init__(self):
        self.pages: dict[bytes, tuple] = {}  # key -> (k, v, tokens, parent key)
        self.chains: list[list[bytes]] = []
        self.tails: dict[bytes, tuple] = {}  # parent key -> (k, v, tokens): one tail per parent here

    def spill(self, kv, chains):
        for chain in chains:
            self.chains.append([e.key for e in chain])
            for e in chain:
                self.pages[e.key] = (kv.k_cache[:, e.page].clone(), kv.v_cache[:, e.page].clone(), e.tokens,
                                     e.parent.key)

    def spill_tails(self, kv, tails):
        for t in tails:
            n = len(t.tokens)
            self.tails[t.parent.key] = (kv.k_cache[:, t.page, :n].clone(), kv.v_cache[:, t.page, :n].clone(), t.tokens)

    def tail(self, parent_key, rest):
        held = self.tails.get(parent_key)
        n = 0
        while held is not None and n < min(len(held[2]), len(rest)) and held[2][n] == rest[n]:
            n += 1
        return (parent_key, n) if n else None

    def fetch_tail(self, key, kv):
        return self.tails.get(key)

    def has(self, key):
        return key in self.pages

    def prefetch(self, keys, kv):
        return 0

    def reading(self, keys):
        return False

    def fetch(self, keys, page_tokens, parent_key, kv):
        import torch

        got = []
        for key, toks_ in zip(keys, page_tokens):
            held = self.pages.get(key)
            if held is None or held[2] != tuple(toks_) or held[3] != parent_key:
                break
            got.append(held)
            parent_key = key
        return [(torch.stack([g[0] for g in got[:1]], 1), torch.stack([g[1] for g in got[:1]], 1)),
                (torch.stack([g[0] for g in got[1:]], 1), torch.stack([g[1] for g in got[1:]], 1))] if got else []


def test_evicted_chains_go_to_the_tier_root_first_and_come_back_with_their_kv():
    import torch

    from opencoti.engine.requests import SeqState
    from opencoti.engine.kv.pages import PagePool
    from opencoti.engine.kv.tables import KVTables

    kv = PagePool(num_layers=2, num_pages=6, page_size=4, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    tables = KVTables(kv, prefix_cache=True)
    tier = tables.tier = MemoryTier()
    tokens = list(range(1, 14))  # 3 full pages and one token
    seq = SeqState(tokens)
    assert tables.extend_reclaiming(seq, 12)
    for i, page in enumerate(seq.page_table):  # recognizable KV per page
        kv.k_cache[:, page] = float(i + 1)
        kv.v_cache[:, page] = -float(i + 1)
    tables.advance(seq, 12)
    keys = list(seq.page_keys)
    tables.drop(seq)  # its pages are cache now
    assert tables.evict_cache(3) == 3 and kv.num_free == 6
    assert tier.chains == [keys]  # one chain, root first (evicted leaves first)
    other = SeqState(list(range(100, 124)))  # the freed pages get other KV
    assert tables.extend_reclaiming(other, 24)
    kv.k_cache.zero_()
    tables.drop(other)
    assert tables.promote(tokens, b"", len(tokens) - 1, keys) == 3
    m = tables.match(tokens, b"", len(tokens) - 1, keys)
    assert len(m.pages) == 3
    for i, page in enumerate(m.pages):
        assert torch.equal(kv.k_cache[:, page], torch.full_like(kv.k_cache[:, page], float(i + 1)))
        assert torch.equal(kv.v_cache[:, page], torch.full_like(kv.v_cache[:, page], -float(i + 1)))
    tables.check_integrity([])
    assert tables.kv_location(SeqState(), keys) == {"kv_location": "ram", "kv_ram_tokens": 12, "kv_disk_tokens": 0}
    tables.evict_cache(1)  # the leaf goes again (DiskTier does not write a page it holds already)
    assert tier.chains == [keys, keys[-1:]]
    assert tables.kv_location(SeqState(), keys)["kv_location"] == "disk"


def test_an_evicted_tail_comes_back_as_a_tail_and_its_slots_are_copied_not_recomputed():
    import torch

    from opencoti.engine.requests import SeqState
    from opencoti.engine.kv.pages import PagePool
    from opencoti.engine.kv.tables import KVTables

    kv = PagePool(num_layers=2, num_pages=6, page_size=4, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    tables = KVTables(kv, prefix_cache=True)
    tier = tables.tier = MemoryTier()
    tokens = list(range(1, 12))  # 2 full pages and a tail of 3
    seq = SeqState(tokens)
    assert tables.extend_reclaiming(seq, 11)
    for i, page in enumerate(seq.page_table):
        kv.k_cache[:, page] = float(i + 1)
        kv.v_cache[:, page] = -float(i + 1)
    tables.advance(seq, 11)
    tables.cache_tail(seq)
    keys = list(seq.page_keys)
    tables.drop(seq)
    assert tables.evict_cache(3) == 3 and kv.num_free == 6  # the tail leaves first, then the chain
    assert tier.chains == [keys] and list(tier.tails) == [keys[-1]]
    other = SeqState(list(range(100, 124)))
    assert tables.extend_reclaiming(other, 24)
    kv.k_cache.zero_()
    tables.drop(other)
    turn = tokens + [7, 7, 7]  # the next turn: the old context and more
    assert tables.promote(turn, b"", len(turn) - 1, keys) == 3  # two pages and the tail
    m = tables.match(turn, b"", len(turn) - 1, keys)
    assert len(m.pages) == 2 and m.partial_tokens == 3 and m.partial_page is not None
    assert torch.equal(kv.k_cache[:, m.partial_page, :3], torch.full((2, 3, 1, 2), 3.0))
    assert torch.equal(kv.v_cache[:, m.partial_page, :3], torch.full((2, 3, 1, 2), -3.0))
    tables.check_integrity([])
    assert tables.promote(turn, b"", len(turn) - 1, keys) == 0  # all resident: nothing more comes back
    tables.evict_cache(6)  # all of it leaves again
    other_turn = tokens[:9] + [5, 5, 5]  # shares the tail's first token only: that one is copied
    assert tables.promote(other_turn, b"", len(other_turn) - 1, keys) == 3
    m = tables.match(other_turn, b"", len(other_turn) - 1, keys)
    assert len(m.pages) == 2 and m.partial_tokens == 1
    tables.evict_cache(6)
    tier.tails.clear()  # no tail kept: the pages come back, the rest is computed
    assert tables.promote(turn, b"", len(turn) - 1, keys) == 2
    assert tables.match(turn, b"", len(turn) - 1, keys).partial_tokens == 0


def test_the_step_loop_paces_the_tier_writes_between_its_steps(make_engine, tmp_path):
    """The engine's step loop drives the tier's pacer: the writes of an agent team take their turns (a
    window each) and every segment is written (``O_DIRECT`` where the filesystem allows it); after the
    loop goes idle nothing waits for a turn."""
    from opencoti.engine.persist.body_writer import BodySink

    eng = make_engine(state_dir=str(tmp_path / "s"), **SMALL)
    assert eng.step_pacer is eng.kv_tier.pacer and eng.step_pacer.share is not None
    agent_team(eng, turns=1)
    flush(eng)
    st = eng.kv_tier.status()
    assert st["spilled_segments"] > 0 and st["write_errors"] == 0
    assert eng.step_pacer.stats["turns"] >= st["spilled_segments"]  # (a segment: one turn a chunk)
    assert eng.step_pacer.stats["steps"] > 0  # the loop told it of its steps (else every turn would be free)
    probe = BodySink(tmp_path / "probe", 4096, direct=True)
    probe.close()
    assert st["direct_writes"] == (st["spilled_segments"] if probe.direct else 0)
    pacing = eng.stats()["kv_tiers"]["disk"]["pacing"]  # what a user sees
    assert pacing["share"] == 0.03 and pacing["turns"] >= st["spilled_segments"] and pacing["step_wait_s"] >= 0


def test_the_write_share_is_a_setting_and_0_writes_unpaced(make_engine, tmp_path):
    from opencoti.engine import EngineConfig
    from opencoti.engine.persist.pacer import DEFAULT_SHARE

    assert EngineConfig().kv_disk_write_share == DEFAULT_SHARE == 0.03
    assert make_engine(state_dir=str(tmp_path / "a"), kv_disk_write_share=0.1, **SMALL).step_pacer.share == 0.1
    eng = make_engine(state_dir=str(tmp_path / "b"), kv_disk_write_share=0, **SMALL)
    assert eng.step_pacer.share is None
    agent_team(eng, turns=1)
    flush(eng)
    assert eng.kv_tier.status()["spilled_segments"] > 0 and eng.step_pacer.stats["turns"] == 0  # (none counted)
    for bad in (-0.1, 1.5, "x", float("nan")):
        with pytest.raises(ValueError, match="kv_disk_write_share"):
            EngineConfig(kv_disk_write_share=bad)
