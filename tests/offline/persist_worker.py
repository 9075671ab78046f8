"""A process that changes a persisted pool tree as fast as it can, for kill -9 tests.

    python persist_worker.py STATE_DIR SEED

Prints one JSON line per event, flushed: ``{"ready": ...}`` once the engine is up, then for each
operation ``{"intent": ...}`` before it starts and ``{"ack": ...}`` once the engine answered
(what a client would have been told). The test kills it at a random moment and checks the tree
that comes back.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from opencoti.engine import Engine, EngineConfig, OpencotiError, SamplingParams  # noqa: E402

CONFIG = dict(model="tiny:llama", page_size=4, kv_budget_tokens=2048, max_batch_tokens=64, max_pools=24,
              pool_grace_ttl_s=0.0)


def make_engine(state_dir: str) -> Engine:
    return Engine(EngineConfig(**CONFIG, state_dir=state_dir))


def out(**kw) -> None:
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


def main() -> None:
    state_dir, seed = sys.argv[1], int(sys.argv[2])
    rng = random.Random(seed)
    eng = make_engine(state_dir)
    tree = {p["pool_id"]: p for p in eng.pools()["pools"]}
    restored = eng.run_on_step_thread(
        lambda: {pid: [p.parent.pool_id if p.parent else None, p.branch_pos, list(p.tokens), p.pinned]
                 for pid, p in eng.core.tree.pools.items()})
    tokens = {pid: v[2] for pid, v in restored.items()}
    out(ready={str(k): v for k, v in restored.items()})

    def rand_tokens(n):
        return [rng.randrange(1, 250) for _ in range(n)]

    def children(pid):
        return [c for c, p in tree.items() if p["parent"] == pid]

    step = 0
    while True:
        step += 1
        r = rng.random()
        try:
            if len(tree) >= 20 or (r < 0.12 and tree):
                leaves = [pid for pid in tree if not children(pid)]
                pid = rng.choice(leaves)
                out(intent="release", pool_id=pid)
                eng.release_pool(pid)
                del tree[pid]
                out(ack="release", pool_id=pid)
            elif r < 0.4 or not tree:
                toks = rand_tokens(rng.randint(3, 40))
                out(intent="create", tokens=toks)
                info = eng.create_pool(tokens=toks, pinned=rng.random() < 0.2, label=f"r{step}")
                tree[info.pool_id] = info.as_dict()
                tokens[info.pool_id] = toks
                out(ack="create", pool_id=info.pool_id, parent=None, branch_pos=0, tokens=toks,
                    pinned=info.pinned, label=info.label)
            elif r < 0.8:
                parent = rng.choice(sorted(tree))
                pt = tokens[parent]
                d = len(pt) if rng.random() < 0.5 else rng.randint(0, len(pt))
                toks = pt[:d] + rand_tokens(rng.randint(1, 24))
                out(intent="fork", parent=parent, branch_pos=d, tokens=toks)
                info = eng.fork_pool(parent, branch_pos=d, tokens=toks, label=f"f{step}")
                tree[info.pool_id] = info.as_dict()
                tokens[info.pool_id] = toks
                out(ack="fork", pool_id=info.pool_id, parent=parent, branch_pos=d, tokens=toks,
                    pinned=False, label=info.label)
            elif r < 0.9:
                pid = rng.choice(sorted(tree))
                pin = not tree[pid]["pinned"]
                out(intent="pin", pool_id=pid, pinned=pin)
                info = eng.pin_pool(pid) if pin else eng.unpin_pool(pid)
                tree[pid] = info.as_dict()
                out(ack="pin", pool_id=pid, pinned=pin)
            else:
                pid = rng.choice(sorted(tree))
                sid = f"agent-{rng.randrange(4)}"
                prompt = tokens[pid] + rand_tokens(3)
                out(intent="generate", pool_id=pid, session_id=sid)
                res = eng.generate(prompt, pool_id=pid, session_id=sid, params=SamplingParams.greedy(3))
                out(ack="generate", pool_id=pid, session_id=sid, tokens=prompt + res.token_ids)
        except OpencotiError as e:  # e.g. a session busy or the KV full: the tree is unchanged
            out(error=str(e))


if __name__ == "__main__":
    main()
