"""``opencoti state prune``: pools nobody released leave the state directory; pinned pools, pools
with a stored session and their ancestors stay; ids are never handed out again."""

from __future__ import annotations

import json

import pytest

from opencoti.cli import main
from opencoti.engine import SamplingParams
from opencoti.engine.persist.prune import prune
from opencoti.engine.persist.store import StateDirError

ROOT = list(range(10, 30))


def test_prune_removes_stale_unpinned_pools(make_engine, tmp_path, capsys):
    state = tmp_path / "state"
    eng = make_engine(state_dir=str(state))
    root = eng.create_pool(tokens=ROOT, label="system")
    pinned = eng.fork_pool(root.pool_id, tokens=ROOT + [1, 2, 3], pinned=True)
    used = eng.fork_pool(root.pool_id, tokens=ROOT + [4, 5, 6])
    stale = eng.fork_pool(root.pool_id, tokens=ROOT + [7, 8, 9])
    stale_child = eng.fork_pool(stale.pool_id, tokens=ROOT + [7, 8, 9, 9, 9])
    lone = eng.create_pool(tokens=[3, 3, 3, 3])
    eng.generate(ROOT + [4, 5, 6, 1], pool_id=used.pool_id, session_id="agent", params=SamplingParams.greedy(2))
    eng.run_on_step_thread(lambda: None)
    with pytest.raises(StateDirError, match="in use"):  # not while the engine holds the directory
        prune(state, older_than_s=0)
    eng.shutdown()

    assert prune(state, older_than_s=3600)["pools_removed"] == []  # all younger than an hour
    dry = prune(state, older_than_s=0, dry_run=True)
    assert dry["pools_removed"] == sorted([stale.pool_id, stale_child.pool_id, lone.pool_id])
    assert main(["state", "prune", "--state-dir", str(state), "--older-than", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pools_removed"] == dry["pools_removed"]
    assert out["pools_kept"] == sorted([root.pool_id, pinned.pool_id, used.pool_id])

    eng = make_engine(state_dir=str(state))
    assert sorted(p["pool_id"] for p in eng.pools()["pools"]) == out["pools_kept"]
    assert eng.create_pool(tokens=[5, 5]).pool_id > lone.pool_id  # ids are never reused
    eng.shutdown()
    with pytest.raises(ValueError):
        prune(state, older_than_s=-1)


def test_the_agent_example_binds_only_the_tools_it_needs():
    """Every bound tool's schema is in every prompt: the example agent binds its two tools, not the
    six pool tools as well."""
    import ast
    from pathlib import Path

    src = (Path(__file__).resolve().parents[2] / "examples" / "agent.py").read_text()
    assign = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Assign)
                  and any(getattr(t, "id", None) == "TOOLS" for t in n.targets))
    assert [e.id for e in assign.value.elts] == ["get_weather", "add"]
