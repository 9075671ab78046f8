"""docs/langgraph.md's fan-out example (``CapacityGateNode`` and spawn pacing), run as written over
the tiny engine: every worker's prompt starts with the pool's messages, so each reads the whole pool
from the cache (issue 50, 7: the example's workers sent the task alone and reused only the
template's first tokens)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import docblocks  # noqa: E402

from opencoti.client import PolyKVClient  # noqa: E402
from opencoti.langgraph import OpencotiChatModel  # noqa: E402


def _fanout_block() -> str:
    blocks = [b for b in docblocks.parse(docblocks.ROOT / "docs" / "langgraph.md")
              if b.lang == "python" and "pacer = SpawnPacer()" in b.code]
    assert len(blocks) == 1
    return blocks[0].code


def test_the_fanout_example_reuses_the_whole_pool(engine, monkeypatch):
    system_text = "You are a terse research assistant."
    # a module of its own, as the doc's script is: the state classes' annotations resolve in it
    mod = types.ModuleType("docs_langgraph_fanout")
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    mod.__dict__.update({"engine": engine, "c": PolyKVClient(engine=engine), "SYSTEM": system_text,
                         "system": [{"role": "system", "content": system_text}],
                         "model": OpencotiChatModel(engine=engine, temperature=0, max_tokens=48)})
    exec(compile(_fanout_block(), "docs/langgraph.md (fan-out)", "exec"), mod.__dict__)
    out = mod.out
    assert len(out["results"]) == 2
    assert all(whole for _, whole in out["results"]), out["results"]  # cache_read >= the pool's prefix_len
