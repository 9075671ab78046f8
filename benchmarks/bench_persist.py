#!/usr/bin/env python
"""Persistence: bring a pool's KV back after a restart by recomputing it vs loading it from disk.

For each prefix length N (``--lengths``), a root pool of N tokens of real text is created on the
bundled model. Recompute = the wall time of re-materializing the evicted pool (what a restart does
on first use without KV files: prefill of N tokens). Load = reading the pool's KV file (written by
``opencoti.engine.persist.kvfile.save_kv``) into freshly allocated pages; "cold" drops the file from
the page cache first (``posix_fadvise(DONTNEED)``), "warm" reads it from the page cache. The loaded
KV is checked bit-exact against the computed one. Median of ``--repeats``; ratios = recompute / load.
Also reports the save time and the file size.

Restart (``--restart-pools``, default 16): that many pools of ``--restart-tokens`` (512) tokens, a
quarter of them pinned, and one named session per pool, then the engine is shut down and built
again on the same state directory; reports the restore time (reading the database, rebuilding
the tree, loading the pinned pools' KV files) and the whole engine start with and without state.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repository root on sys.path)
from common import fmt, log, now, print_table, ratio, summarize  # noqa: E402

TEXT = ("The pool tree keeps shared prefixes of many agents resident once. Each pool owns the KV of "
        "its own token range and borrows the rest from its parent by page reference counts. ") * 400


def main() -> int:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--lengths", default="256,1024,2048", help="prefix lengths in tokens")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--restart-pools", type=int, default=16)
    p.add_argument("--restart-tokens", type=int, default=512)
    args = p.parse_args()
    common.set_threads(args.threads)
    import torch

    from opencoti.engine.persist import kvfile

    lengths = [int(x) for x in args.lengths.split(",")]
    if args.quick:
        lengths, args.repeats = lengths[:1], 1
    # prefix_cache off: an evicted pool's pages must not come back from the prefix cache (a real recompute)
    eng = common.make_engine(args, kv_budget_tokens=max(lengths) * 3 + 64, max_batch_tokens=512, prefix_cache=False)
    core, kv = eng.core, eng.kv
    text_tokens = eng.tokenize(TEXT)
    rows, results = [], []
    tmp = Path(tempfile.mkdtemp(prefix="opencoti-bench-persist-"))
    try:
        for n in lengths:
            toks = text_tokens[:n]
            info = eng.create_pool(tokens=toks)
            pid = info.pool_id
            path = tmp / f"{pid}.kv"
            pool = eng.run_on_step_thread(core.tree.get, pid)
            ref_k = eng.run_on_step_thread(lambda: kv.k_cache[:, pool.seq.page_table].clone())
            save_s, nbytes = [], 0
            rec_s, warm_s, cold_s = [], [], []
            for _ in range(args.repeats):
                t0 = now()
                nbytes = eng.run_on_step_thread(kvfile.save_kv, path, kv, pool.seq.page_table, 0, n, toks)
                save_s.append(now() - t0)
                # recompute: evict, then re-materialize through an attach (what first use does)
                eng.evict_pool(pid)
                t0 = now()
                eng.fork_pool(pid, branch_pos=n, tokens=toks + [toks[-1]], label="probe")
                rec_s.append(now() - t0)
                probe = [c for c in eng.pool(pid).children][0]
                eng.release_pool(probe)
                for kind, bucket in (("cold", cold_s), ("warm", warm_s)):
                    if kind == "cold":
                        fd = os.open(path, os.O_RDONLY)
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                        os.close(fd)

                    def load():
                        if kv.num_free < kv.pages_for(n):
                            core.polykv.reclaim(kv.pages_for(n) - kv.num_free)
                        table = kv.allocate(kv.pages_for(n))
                        t0 = now()
                        ok = kvfile.load_kv(path, kv, table, 0, n, toks)
                        dt = now() - t0
                        full, part = divmod(n, kv.page_size)
                        same = ok and torch.equal(kv.k_cache[:, table[:full]], ref_k[:, :full])
                        if part:
                            same = same and torch.equal(kv.k_cache[:, table[full], :part], ref_k[:, full, :part])
                        kv.decref(table)
                        return dt, same

                    dt, same = eng.run_on_step_thread(load)
                    if not same:
                        raise SystemExit(f"loaded KV differs from the computed KV (n={n})")
                    bucket.append(dt)
            r = {"tokens": n, "file_bytes": nbytes, "save_s": summarize(save_s), "recompute_s": summarize(rec_s),
                 "load_cold_s": summarize(cold_s), "load_warm_s": summarize(warm_s)}
            r["speedup_cold"] = ratio(r["recompute_s"]["median"], r["load_cold_s"]["median"])
            r["speedup_warm"] = ratio(r["recompute_s"]["median"], r["load_warm_s"]["median"])
            results.append(r)
            rows.append([n, f"{nbytes / 2**20:.1f}", r["save_s"]["median"] * 1e3, r["recompute_s"]["median"] * 1e3,
                         r["load_cold_s"]["median"] * 1e3, r["load_warm_s"]["median"] * 1e3,
                         f"{fmt(r['speedup_cold'])}x", f"{fmt(r['speedup_warm'])}x"])
            eng.release_pool(pid)
            log(f"n={n} done")
    finally:
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
        eng.shutdown()
    restart = measure_restart(args, text_tokens)
    machine = common.machine_info()
    print(f"\nmachine: {common.describe_machine(machine)}")
    print_table(["tokens", "file MiB", "save ms", "recompute ms", "load cold ms", "load warm ms",
                 "recompute/cold", "recompute/warm"], rows,
                title=f"pool KV after a restart: recompute vs load from disk ({args.dtype})")
    print_table(["pools", "pinned", "sessions", "restore s", "KV loaded", "start with state s", "start without s"],
                [[restart["pools"], restart["pinned"], restart["sessions"], restart["restore_s"],
                  restart["kv_loaded_pools"], restart["start_with_state_s"], restart["start_without_state_s"]]],
                title="restart")
    common.write_json("persist", {"machine": machine, "args": vars(args), "results": results, "restart": restart},
                      args.out)
    return 0


def measure_restart(args, text_tokens) -> dict:
    from opencoti.engine import SamplingParams

    n, length = args.restart_pools, args.restart_tokens
    if args.quick:
        n, length = 4, 64
    state = tempfile.mkdtemp(prefix="opencoti-bench-state-")
    cfg = dict(kv_budget_tokens=n * (length + 64) + 256, max_pools=n + 4, state_dir=state)
    eng = common.make_engine(args, **cfg)
    pinned = 0
    for i in range(n):
        toks = [text_tokens[i]] + text_tokens[:length - 1]  # distinct first token: no shared prefixes
        pin = i % 4 == 0
        pinned += pin
        info = eng.create_pool(tokens=toks, pinned=pin)
        eng.generate(toks + [text_tokens[-1]], pool_id=info.pool_id, session_id=f"agent-{i}",
                     params=SamplingParams.greedy(1))
    eng.persister.kv_writer.flush()
    eng.shutdown()
    t0 = now()
    eng = common.make_engine(args, **cfg)
    with_state = now() - t0
    stats = dict(eng.persister.stats)
    eng.shutdown()
    t0 = now()
    eng = common.make_engine(args, **{**cfg, "state_dir": None})
    without = now() - t0
    eng.shutdown()
    import shutil
    shutil.rmtree(state, ignore_errors=True)
    return {"pools": stats["pools"], "pinned": pinned, "sessions": stats["sessions"],
            "restore_s": stats["seconds"], "kv_loaded_pools": stats["kv_loaded_pools"],
            "start_with_state_s": with_state, "start_without_state_s": without}


if __name__ == "__main__":
    sys.exit(main())
