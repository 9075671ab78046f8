#!/usr/bin/env python
"""Cluster routing: prefix-cache hit rate and prefill work over 2 replicas, our router vs Ray
Serve's default power-of-two-choices router and Ray Serve's PrefixCacheAffinityRouter (needs the
cluster extra: pip install -e '.[cluster]').

Workload: ``--agents`` (16) agents in ``--teams`` (4) teams; each team shares a system prompt of
about ``--system-words`` (720) words (about 1000 tokens, like the 1024-token prefix of
bench_pools); each agent runs ``--turns`` (3) chat turns of its own
conversation (the previous turns stay in the messages), ``--gen`` (8) greedy tokens per answer;
all agents run at once. Two replicas of the bundled model, ``--threads`` (1) CPU thread each, on a
local Ray instance (2 CPUs, no dashboard).

Runs (the same agents, one deployment each; ``--rounds`` (3) rounds, the order of the runs rotated
by one each round, medians reported):

- ``opencoti``: our router; each team's system prompt is a pool created through the cluster (the
  four at once); agents attach with ``pool_id`` + ``session_id``.
- ``opencoti-nopool``: our router; the same requests without pools (``session_id`` only).
- ``pow2``: Ray Serve's default router with the ``session_id``-only requests (pool ids cannot be used
  there: a pool lives on one replica and the default router sends its requests to either).
- ``ray-prefix``: Ray Serve's own ``PrefixCacheAffinityRouter`` (``opencoti/cluster/ray_prefix.py``:
  Ray's class, reading the prompt from our forwarded requests), ``session_id``-only requests (it
  routes by prompt text; pool ids would reach either replica), the same imbalance / match
  thresholds as ours.

Counted per run: prompt tokens of all agent requests and the tokens served from cache
(``x-cached-prefix-tokens``); prefill tokens computed = uncached prompt tokens + the pools' own
prefill; hit rate = 1 - computed / prompt tokens (``hit_rate``: the pools' prefill counts as
computed, so every run has the same denominator, the agents' prompt tokens); wall time of the
agent phase (+ pool creation). Target: >= 95 % with our router.

Full run: .venv/bin/python benchmarks/bench_cluster.py   (quick: --quick)
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


def hit_rate(prompt_tokens: int, cached_tokens: int, pool_prefill_tokens: int = 0) -> float | None:
    """Share of the agents' prompt tokens that were not computed: 1 - (uncached prompt tokens + the
    pools' own prefill) / prompt tokens. A pool's prefill is computed work the agents' requests then
    find "in cache": counting it keeps the denominator the same for runs with and without pools."""
    if not prompt_tokens:
        return None
    return 1.0 - (prompt_tokens - cached_tokens + pool_prefill_tokens) / prompt_tokens


def run_mode(mode: str, args, port: int, rnd: int = 0) -> dict:
    import httpx
    from ray import serve

    from opencoti.cluster.app import ClusterConfig, make_app

    router = mode if mode in ("pow2", "ray-prefix") else "opencoti"
    engine = {"kv_budget_tokens": args.kv_budget_tokens, "max_pools": 8, "num_threads": args.threads,
              "weights": args.weights}
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
            body = {"messages": msgs, "max_tokens": args.gen, "temperature": 0, "session_id": f"agent-{mode}-{rnd}-{a}"}
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
    hit = hit_rate(stats["prompt"], stats["cached"], pool_prefill)
    return {"mode": mode, "round": rnd, "router": router, "deploy_s": deploy_s, "pools": len(pools), "pool_replica": pool_replica,
            "requests": stats["requests"], "errors": stats["errors"], "prompt_tokens": stats["prompt"],
            "cached_tokens": stats["cached"], "hit_rate": hit,
            "hit_rate_requests_only": ratio(stats["cached"], stats["prompt"]),
            "prefill_tokens": stats["prompt"] - stats["cached"] + pool_prefill, "pool_prefill_tokens": pool_prefill,
            "agents_wall_s": t_end - t_agents, "total_wall_s": t_end - t_start,
            "replicas_per_team": {t: sorted(v) for t, v in stats["replica_of_team"].items()},
            "engine_counters": counters}


MODES = ["opencoti", "opencoti-nopool", "pow2", "ray-prefix"]


def summarize_runs(results: list[dict]) -> dict:
    """Per mode: the median over rounds of the hit rate, prefill tokens and wall times."""
    import statistics

    out = {}
    for mode in dict.fromkeys(r["mode"] for r in results):
        rs = [r for r in results if r["mode"] == mode]

        def med(key):
            vals = [r[key] for r in rs if r.get(key) is not None]
            return statistics.median(vals) if vals else None

        out[mode] = {"rounds": len(rs), "hit_rate": med("hit_rate"), "hit_rate_min": min(
            (r["hit_rate"] for r in rs if r["hit_rate"] is not None), default=None),
            "hit_rate_max": max((r["hit_rate"] for r in rs if r["hit_rate"] is not None), default=None),
            "prompt_tokens": med("prompt_tokens"), "cached_tokens": med("cached_tokens"),
            "prefill_tokens": med("prefill_tokens"), "pool_prefill_tokens": med("pool_prefill_tokens"),
            "agents_wall_s": med("agents_wall_s"), "total_wall_s": med("total_wall_s"),
            "errors": sum(len(r["errors"]) for r in rs)}
    return out


def main() -> int:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--agents", type=int, default=16)
    p.add_argument("--teams", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--gen", type=int, default=8)
    p.add_argument("--system-words", type=int, default=720)
    p.add_argument("--kv-budget-tokens", type=int, default=16384)
    p.add_argument("--port", type=int, default=18431)
    p.add_argument("--rounds", type=int, default=3, help="rounds, the order of the runs rotated each round")
    p.add_argument("--modes", default=",".join(MODES))
    args = p.parse_args()
    if args.threads is None:
        args.threads = 1
    if args.quick:
        args.agents, args.turns, args.system_words = 8, 2, 200
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes) or args.rounds < 1:
        p.error(f"--modes: a comma-separated subset of {MODES}; --rounds >= 1")
    try:
        import ray
        from ray import serve
    except ImportError:
        print("bench_cluster: needs the cluster extra: pip install -e '.[cluster]'", file=sys.stderr)
        return 2
    from opencoti.cluster.serve import start_local_ray

    load_before = common.load_snapshot()
    info = common.machine_info()
    info["cpu_flags"] = cpu_flags()
    for attempt in range(3):  # Ray's node start gives up after 30 s, which a loaded 2-core machine can exceed
        try:
            start_local_ray(num_cpus=2, object_store_mib=128)
            break
        except Exception as e:  # noqa: BLE001
            log(f"starting Ray failed ({e}); attempt {attempt + 1}/3")
            ray.shutdown()
            if attempt == 2:
                raise
    results = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        for rnd in range(args.rounds):
            for mode in common.rotated(modes, rnd):
                results.append(run_mode(mode, args, args.port, rnd))
                write_json("cluster", {"machine": info, "load_before": load_before, "args": vars(args),
                                       "complete": False, "results": results}, args.out)  # so far
                log(f"round {rnd + 1}/{args.rounds}, {mode}: hit rate {results[-1]['hit_rate']}, "
                    f"load {common.load_snapshot()['loadavg']}")
    finally:
        serve.shutdown()
        ray.shutdown()
    print(common.describe_machine(info))
    print(f"cpu flags: {' '.join(info['cpu_flags'])}")
    rows = [[f"{r['mode']} (round {r['round'] + 1})", r["requests"], r["prompt_tokens"], r["cached_tokens"],
             r["pool_prefill_tokens"], f"{100 * r['hit_rate']:.1f} %" if r["hit_rate"] is not None else "-",
             r["prefill_tokens"], r["agents_wall_s"], r["total_wall_s"], len(r["errors"])] for r in results]
    print_table(["run", "requests", "prompt tok", "cached tok", "pool prefill tok", "hit rate", "prefill tok",
                 "agents s", "total s", "errors"], rows,
                title=f"{args.agents} agents, {args.teams} pools/prompts, 2 replicas, {args.turns} turns, "
                      f"{args.gen} tokens per answer; hit rate = 1 - (uncached + pool prefill) / prompt tokens")
    by = summarize_runs(results)
    print_table(["run (median over rounds)", "hit rate", "min", "max", "prefill tok", "agents s", "total s"],
                [[m, f"{100 * v['hit_rate']:.1f} %", f"{100 * v['hit_rate_min']:.1f} %",
                  f"{100 * v['hit_rate_max']:.1f} %", v["prefill_tokens"], v["agents_wall_s"], v["total_wall_s"]]
                 for m, v in by.items() if v["hit_rate"] is not None])
    summary: dict = {"per_mode": by}
    if "opencoti" in by:
        hr = by["opencoti"]["hit_rate"]
        print(f"our router: {100 * (hr or 0):.1f} % of prompt tokens not computed (median of {args.rounds}; "
              f"target >= 95 %): {check_mark(hr, 0.95)}")
        summary["hit_rate_target_met"] = hr is not None and hr >= 0.95
        for other in ("pow2", "ray-prefix", "opencoti-nopool"):
            if other in by:
                pr = ratio(by[other]["prefill_tokens"], by["opencoti"]["prefill_tokens"])
                wr = ratio(by[other]["total_wall_s"], by["opencoti"]["total_wall_s"])
                summary[f"prefill_ratio_{other}_over_ours"] = pr
                summary[f"wall_ratio_{other}_over_ours"] = wr
                print(f"{other} computes {pr:.2f}x the prefill tokens and takes {wr:.2f}x the wall time of our "
                      f"router with pools")
    payload = {"machine": info, "load_before": load_before, "machine_end": common.machine_info(), "complete": True,
               "args": vars(args), "definitions": {"hit_rate": hit_rate.__doc__, "order": common.rotated.__doc__},
               "ray_prefix_router": "ray.serve.llm.request_router.PrefixCacheAffinityRouter (ray "
                                    f"{ray.__version__}) via opencoti.cluster.ray_prefix.RayPrefixAffinityRouter: "
                                    "Ray's class, only reading the prompt text from the forwarded request's JSON body "
                                    "(our ingress passes a raw HTTP request dict, which Ray's own text extraction "
                                    "rejects with ValueError); thresholds imbalanced_threshold / match_rate_threshold "
                                    "= ours (4, 0.1)",
               "results": results, "summary": summary}
    path = write_json("cluster", payload, args.out)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
