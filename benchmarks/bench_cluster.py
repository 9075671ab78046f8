#!/usr/bin/env python
"""Cluster routing: prefix-cache hit rate and prefill work over 2 replicas, our router vs Ray
Serve's default power-of-two-choices router (needs the cluster extra: pip install -e '.[cluster]').

Workload: ``--agents`` (16) agents in ``--teams`` (4) teams; each team shares a system prompt of
about ``--system-words`` (720) words (about 1000 tokens, like the 1024-token prefix of
bench_pools); each agent runs ``--turns`` (3) chat turns of its own
conversation (the previous turns stay in the messages), ``--gen`` (8) greedy tokens per answer;
all agents run at once. Two replicas of the bundled model, ``--threads`` (1) CPU thread each, on a
local Ray instance (2 CPUs, no dashboard).

Runs (the same agents, one deployment each, in this order):

- ``opencoti``: our router; each team's system prompt is a pool created through the cluster (the
  four at once); agents attach with ``pool_id`` + ``session_id``.
- ``opencoti-nopool``: our router; the same requests without pools (``session_id`` only).
- ``pow2``: Ray Serve's default router with the ``session_id``-only requests (pool ids cannot be used
  there: a pool lives on one replica and the default router sends its requests to either).

Counted per run: prompt tokens of all requests and the tokens served from cache
(``x-cached-prefix-tokens``), hit rate = cached / prompt; prefill tokens computed = uncached prompt
tokens + the pools' own prefill; wall time of the agent phase (+ pool creation). Target: >= 95 %
of prompt tokens from cache with our router.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repository root on sys.path)
from common import check_mark, log, print_table, ratio, write_json  # noqa: E402

TOPICS = ["database migrations", "a payment service", "the search index", "mobile releases",
          "data retention", "incident response", "the billing API", "load testing"]


def system_prompt(team: int, words: int) -> str:
    base = (f"You are an agent of team {team}, which owns {TOPICS[team % len(TOPICS)]}. Work in small steps, "
            "say which file or service each step touches, check every result before reporting it, and keep "
            "answers short. Rule {i}: record decisions in the team log with the date and the owner. ")
    out, i = [], 0
    while sum(len(s.split()) for s in out) < words:
        out.append(base.replace("{i}", str(i)))
        i += 1
    return "".join(out)


def cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                return sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "sse4", "f16c", "vnni")))
    except OSError:
        pass
    return []


def run_mode(mode: str, args, port: int) -> dict:
    import httpx
    from ray import serve

    from opencoti.cluster.app import ClusterConfig, make_app

    router = "pow2" if mode == "pow2" else "opencoti"
    engine = {"kv_budget_tokens": args.kv_budget_tokens, "max_pools": 8, "num_threads": args.threads}
    cfg = ClusterConfig(replicas=2, cpus_per_replica=1, router=router, engine=engine)
    t0 = time.perf_counter()
    serve.run(make_app(cfg), name="opencoti", route_prefix="/")
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600)
    deploy_s = time.perf_counter() - t0
    log(f"{mode}: deployed in {deploy_s:.1f} s")

    systems = [system_prompt(t, args.system_words) for t in range(args.teams)]
    pools, pool_prefill, pool_replica = {}, 0, {}
    t_start = time.perf_counter()
    if mode == "opencoti":  # the teams' pools, created at once (the router spreads them)
        made = {}

        def create(t: int) -> None:
            made[t] = client.post("/polykv/pools", json={"messages": [{"role": "system", "content": systems[t]}]})

        creators = [threading.Thread(target=create, args=(t,)) for t in range(args.teams)]
        for th in creators:
            th.start()
        for th in creators:
            th.join()
        for t, r in sorted(made.items()):
            r.raise_for_status()
            pools[t] = r.json()["pool_id"]
            pool_prefill += r.json()["own_len"]
            pool_replica[t] = r.headers.get("x-opencoti-replica")
    stats = {"requests": 0, "prompt": 0, "cached": 0, "errors": [], "replica_of_team": {}}
    lock = threading.Lock()

    def agent(a: int) -> None:
        team = a % args.teams
        msgs = [{"role": "system", "content": systems[team]}]
        for turn in range(args.turns):
            msgs.append({"role": "user", "content": f"Agent {a}, step {turn}: what do you do next? One sentence."})
            body = {"messages": msgs, "max_tokens": args.gen, "temperature": 0, "session_id": f"agent-{mode}-{a}"}
            if team in pools:
                body["pool_id"] = pools[team]
            r = client.post("/v1/chat/completions", json=body)
            if r.status_code != 200:
                with lock:
                    stats["errors"].append(r.text[:200])
                return
            out = r.json()
            with lock:
                stats["requests"] += 1
                stats["prompt"] += out["usage"]["prompt_tokens"]
                stats["cached"] += int(r.headers["x-cached-prefix-tokens"])
                stats["replica_of_team"].setdefault(team, set()).add(r.headers.get("x-opencoti-replica"))
            msgs.append({"role": "assistant", "content": out["choices"][0]["message"]["content"] or ""})

    t_agents = time.perf_counter()
    threads = [threading.Thread(target=agent, args=(a,)) for a in range(args.agents)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    t_end = time.perf_counter()
    counters = None
    if router == "opencoti":
        counters = {r["tag"]: r["counters"] for r in client.get("/cluster/replicas").json()["replicas"]}
    client.close()
    serve.delete("opencoti")
    hit = ratio(stats["cached"], stats["prompt"])
    return {"mode": mode, "router": router, "deploy_s": deploy_s, "pools": len(pools), "pool_replica": pool_replica,
            "requests": stats["requests"], "errors": stats["errors"], "prompt_tokens": stats["prompt"],
            "cached_tokens": stats["cached"], "hit_rate": hit,
            "prefill_tokens": stats["prompt"] - stats["cached"] + pool_prefill, "pool_prefill_tokens": pool_prefill,
            "agents_wall_s": t_end - t_agents, "total_wall_s": t_end - t_start,
            "replicas_per_team": {t: sorted(v) for t, v in stats["replica_of_team"].items()},
            "engine_counters": counters}


def main() -> int:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--agents", type=int, default=16)
    p.add_argument("--teams", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--gen", type=int, default=8)
    p.add_argument("--system-words", type=int, default=720)
    p.add_argument("--kv-budget-tokens", type=int, default=16384)
    p.add_argument("--port", type=int, default=18431)
    p.add_argument("--modes", default="opencoti,opencoti-nopool,pow2")
    args = p.parse_args()
    if args.threads is None:
        args.threads = 1
    if args.quick:
        args.agents, args.turns, args.system_words = 8, 2, 200
    try:
        import ray
        from ray import serve
    except ImportError:
        print("bench_cluster: needs the cluster extra: pip install -e '.[cluster]'", file=sys.stderr)
        return 2
    from opencoti.cluster.serve import start_local_ray

    info = common.machine_info()
    info["cpu_flags"] = cpu_flags()
    start_local_ray(num_cpus=2, object_store_mib=128)
    results = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        for mode in args.modes.split(","):
            results.append(run_mode(mode, args, args.port))
            log(f"{mode}: {results[-1]['hit_rate']}")
    finally:
        serve.shutdown()
        ray.shutdown()
    print(common.describe_machine(info))
    print(f"cpu flags: {' '.join(info['cpu_flags'])}")
    rows = [[r["mode"], r["requests"], r["prompt_tokens"], r["cached_tokens"],
             f"{100 * r['hit_rate']:.1f} %" if r["hit_rate"] is not None else "-", r["prefill_tokens"],
             r["agents_wall_s"], r["total_wall_s"], len(r["errors"])] for r in results]
    print_table(["run", "requests", "prompt tok", "cached tok", "hit rate", "prefill tok", "agents s", "total s",
                 "errors"], rows, title=f"{args.agents} agents, {args.teams} pools/prompts, 2 replicas, "
                                        f"{args.turns} turns, {args.gen} tokens per answer")
    by = {r["mode"]: r for r in results}
    summary = {}
    if "opencoti" in by:
        hr = by["opencoti"]["hit_rate"]
        print(f"our router: {100 * (hr or 0):.1f} % of prompt tokens from cache (target >= 95 %): "
              f"{check_mark(hr, 0.95)}")
        summary["hit_rate_target_met"] = hr is not None and hr >= 0.95
        if "pow2" in by:
            summary["prefill_ratio_pow2_over_ours"] = ratio(by["pow2"]["prefill_tokens"], by["opencoti"]["prefill_tokens"])
            summary["wall_ratio_pow2_over_ours"] = ratio(by["pow2"]["total_wall_s"], by["opencoti"]["total_wall_s"])
            print(f"pow2 computes {summary['prefill_ratio_pow2_over_ours']:.2f}x the prefill tokens and takes "
                  f"{summary['wall_ratio_pow2_over_ours']:.2f}x the wall time of our router")
    path = write_json("cluster", {"machine": info, "args": vars(args), "results": results, "summary": summary},
                      args.out)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
