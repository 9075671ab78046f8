"""`opencoti` command line: demo (the main job), serve, chat, bench."""

from __future__ import annotations

import argparse
import sys
import threading
import time


def _progress(msg: str) -> None:
    print(f"[opencoti] {msg}", file=sys.stderr, flush=True)


def cmd_demo(args) -> int:
    """Multi-session generation on the bundled model: several agents share one system-prompt pool,
    decode concurrently, and we print their answers and tokens/s."""
    from .engine import Engine, EngineConfig, SamplingParams

    t0 = time.perf_counter()
    eng = Engine(EngineConfig(model=args.model, page_size=16), progress=_progress)
    print(f"loaded {eng.model_name} in {time.perf_counter() - t0:.1f}s "
          f"(KV cache: {eng.kv.num_pages} pages x {eng.kv.page_size} tokens)")
    system = ("You are a helpful assistant in a team of agents. Answer in one or two short sentences. "
              "Be precise and factual.")
    root = eng.create_pool(messages=[{"role": "system", "content": system}])
    print(f"root pool {root.pool_id}: {root.prefix_len} tokens, {root.own_kv_bytes / 1024:.0f} KiB KV")
    questions = ["What is the capital of France?", "Name a primary color.", "What does a CPU do?",
                 "Why is the sky blue?", "What is 12 times 12?", "Who wrote Hamlet?",
                 "What is photosynthesis?", "What is the boiling point of water?"][: args.agents]
    results = [None] * len(questions)

    def agent(i: int) -> None:
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": questions[i]}]
        results[i] = eng.generate(messages=msgs, pool_id=root.pool_id, session_id=f"agent-{i}",
                                  params=SamplingParams(temperature=0.0 if args.seed is None else 0.7,
                                                        seed=args.seed, max_tokens=args.max_tokens))

    t1 = time.perf_counter()
    threads = [threading.Thread(target=agent, args=(i,)) for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t1
    total = 0
    for q, r in zip(questions, results):
        total += len(r.token_ids)
        tm = r.timings
        print(f"\n[{r.session_id}] Q: {q}\n  A: {r.text.strip()}\n  cache_n={tm['cache_n']} prompt_n={tm['prompt_n']} "
              f"generated={len(r.token_ids)} decode {tm['predicted_per_second']:.1f} tok/s")
    st = eng.pools()
    print(f"\n{len(questions)} agents, {total} tokens in {wall:.1f}s: aggregate {total / wall:.1f} tok/s")
    print(f"KV in use: {st['kv_bytes_used'] / 2**20:.1f} MiB ({st['kv_pages_used']} pages)")
    eng.check_integrity()
    eng.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="opencoti", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="multi-agent run on the bundled model")
    d.add_argument("--model", default=None, help="model (default: bundled SmolLM2-135M-Instruct)")
    d.add_argument("--agents", type=int, default=8)
    d.add_argument("--max-tokens", type=int, default=48)
    d.add_argument("--seed", type=int, default=None, help="sample with this seed (default: greedy)")
    d.set_defaults(fn=cmd_demo)
    sv = sub.add_parser("serve", help="HTTP server: llama.cpp/OpenAI-compatible API + /polykv control plane")
    from .server.serve import add_arguments as _serve_arguments
    _serve_arguments(sv)
    sv.set_defaults(fn=cmd_serve)
    b = sub.add_parser("bench", help="run a benchmark from benchmarks/")
    b.add_argument("name", help="benchmark name (engine, pools, all)")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(fn=cmd_bench)
    args = p.parse_args(argv)
    return args.fn(args)


def cmd_serve(args) -> int:
    from .server.serve import run
    return run(args)


def cmd_bench(args) -> int:
    import runpy
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "benchmarks"
    names = ["engine", "pools"] if args.name == "all" else [args.name]
    for name in names:
        path = root / f"bench_{name}.py"
        if not path.exists():
            print(f"unknown benchmark {name!r} (no {path})", file=sys.stderr)
            return 2
        sys.argv = [str(path), *args.rest]
        runpy.run_path(str(path), run_name="__main__")
    return 0
