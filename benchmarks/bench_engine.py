#!/usr/bin/env python
"""Engine decode throughput vs transformers `generate`, measured in ONE run (issue 2).

Same model (the bundled SmolLM2-135M-Instruct, from the engine's converted HF directory), same
prompt token ids, greedy, a fixed number of new tokens (transformers: ``min_new_tokens`` =
``max_new_tokens``; opencoti: ``ignore_eos=True``), same dtype and torch threads.

Measured, each repeated ``--repeats`` times (rounds interleave the three modes, so drift in the
machine's load hits them alike) and reported as the median:

* transformers single-session decode tok/s: (N - 1) / (time of token N - time of token 1), token
  times taken by a streamer (llama.cpp's ``predicted_per_second`` definition: the first token
  belongs to the prefill).
* opencoti single-session decode tok/s: ``timings["predicted_per_second"]`` (same definition).
* whole-request tok/s for both: N / wall time of the whole call (prefill included).
* opencoti aggregate decode tok/s with C concurrent sessions (C threads released by a barrier,
  each streaming its own request): see AGGREGATE_DEFINITION.
* achieved weight bandwidth: bytes of weights read per decode step x decode steps per second.

Targets (issue 2): single-session decode >= 1.5x transformers; aggregate (8 sessions) >= 6x
transformers single-session.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repository root on sys.path)
from common import check_mark, fmt, log, now, print_table, ratio, summarize  # noqa: E402
from hf_fanout import _TokenClock, load_transformers  # noqa: E402,F401  (no opencoti import there)

AGGREGATE_DEFINITION = (
    "aggregate decode tok/s = tokens received in the window (T0, T1] / (T1 - T0), where "
    "T0 = the moment every one of the C sessions has received its first token (all prefills done) "
    "and T1 = the moment the last session received its last token; token times are taken by the "
    "client threads as tokens stream out. End-to-end aggregate = all generated tokens / "
    "(last token of any session - barrier release), prefill included.")

SINGLE_PROMPT = ("Write a long, detailed essay about the history of computing, from the abacus and "
                 "mechanical calculators to modern GPUs and cloud data centers.")
OTHER_PROMPTS = [
    "Explain in detail how a modern CPU executes instructions, including pipelining and caches.",
    "Write a long story about a lighthouse keeper who finds a message in a bottle one winter.",
    "Describe, step by step and in depth, how bread is made from wheat in a traditional bakery.",
    "Give a thorough overview of the water cycle and its importance for life on Earth.",
    "Write a detailed travel guide for a week in Japan, covering cities, food and culture.",
    "Explain the theory of evolution by natural selection with many examples from nature.",
    "Describe the history of the Roman Empire from its founding to its fall, in detail.",
    "Write a long, friendly letter to a new colleague explaining how our software team works.",
    "Explain how the internet works, from physical cables to web browsers, in great detail.",
]


def chat_tokens(engine, text: str) -> list[int]:
    return engine.tokenize(engine.apply_chat_template([{"role": "user", "content": text}]))


# ============================================================================ transformers
def hf_param_bytes(model) -> int:
    """Bytes of parameters (tied embedding/lm_head counted once: it is read once per step, as the
    lm_head; the embedding lookup reads one row). Comparable to the engine's weight_bytes."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def run_transformers(model, tokens: list[int], n: int) -> dict:
    import torch
    from transformers import GenerationConfig

    eos = model.config.eos_token_id
    eos = eos[0] if isinstance(eos, (list, tuple)) else eos
    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, num_beams=1,
                               eos_token_id=eos, pad_token_id=eos)
    input_ids = torch.tensor([tokens], dtype=torch.long)
    attention_mask = torch.ones_like(input_ids)
    clock = _TokenClock()
    t0 = now()
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=gen_cfg,
                             streamer=clock)
    wall = now() - t0
    generated = out[0, len(tokens):].tolist()
    times = clock.times[1:]
    if len(generated) != n or len(times) != n:
        raise RuntimeError(f"transformers generated {len(generated)} tokens ({len(times)} timed), wanted {n}")
    decode_s = times[-1] - times[0]
    return {"wall_s": wall, "tokens": n, "whole_tps": n / wall, "ttft_s": times[0] - t0,
            "decode_tps": (n - 1) / decode_s if decode_s > 0 else None, "token_ids": generated}


# ============================================================================ opencoti
def run_engine_single(engine, tokens: list[int], n: int, session_id: str) -> dict:
    from opencoti.engine import SamplingParams

    t0 = now()
    r = engine.generate(tokens, params=SamplingParams.greedy(n, ignore_eos=True), session_id=session_id)
    wall = now() - t0
    engine.release_session(session_id)
    if len(r.token_ids) != n:
        raise RuntimeError(f"engine generated {len(r.token_ids)} tokens, wanted {n} (stop: {r.stop_reason})")
    tm = r.timings
    return {"wall_s": wall, "tokens": n, "whole_tps": n / wall, "ttft_s": tm["prompt_ms"] / 1e3,
            "decode_tps": tm["predicted_per_second"] or None, "cache_n": tm["cache_n"], "token_ids": r.token_ids}


def run_engine_concurrent(engine, prompts: list[list[int]], n: int, tag: str) -> dict:
    from opencoti.engine import SamplingParams

    c = len(prompts)
    barrier = threading.Barrier(c + 1)
    times: list[list[float]] = [[] for _ in range(c)]
    results: list = [None] * c
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            barrier.wait()
            s = engine.stream(prompts[i], params=SamplingParams.greedy(n, ignore_eos=True),
                              session_id=f"{tag}-{i}")
            for _ in s:
                times[i].append(now())
            results[i] = s.result
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(c)]
    for t in threads:
        t.start()
    barrier.wait()
    t_release = now()
    for t in threads:
        t.join()
    for i in range(c):
        try:
            engine.release_session(f"{tag}-{i}")
        except Exception:  # noqa: BLE001 - the request failed before its session existed
            pass
    if errors:
        raise RuntimeError(f"{len(errors)} concurrent request(s) failed: {errors[0]!r}") from errors[0]
    for i, ts in enumerate(times):
        if len(ts) != n:
            raise RuntimeError(f"concurrent session {i} got {len(ts)} tokens, wanted {n}")
    t0 = max(ts[0] for ts in times)   # every session has its first token: all prefills are done
    t1 = max(ts[-1] for ts in times)  # the last token of the last session
    in_window = sum(1 for ts in times for t in ts if t0 < t <= t1)
    overlap = t0 < min(ts[-1] for ts in times)  # all C sessions really decoded together
    total = c * n
    return {
        "sessions": c,
        "window_s": t1 - t0,
        "window_tokens": in_window,
        "aggregate_decode_tps": in_window / (t1 - t0) if t1 > t0 else None,
        "end_to_end_s": t1 - t_release,
        "end_to_end_tps": total / (t1 - t_release),
        "first_token_spread_s": t0 - min(ts[0] for ts in times),
        "all_decoding_together": overlap,
        "per_session_decode_tps": [r.timings["predicted_per_second"] for r in results],
        "token_ids": [r.token_ids for r in results],
    }


def same_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ============================================================================ main
def main(argv: list[str] | None = None) -> int:
    p = common.base_parser(__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    p.add_argument("--repeats", type=int, default=3, help="repeats of each measurement (median reported)")
    p.add_argument("--concurrency", type=int, default=8, help="sessions decoding together")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens = min(args.tokens, 32)
        args.repeats = 1
    if args.tokens < 2:
        p.error("--tokens must be >= 2 (decode rate needs a token after the first)")
    if args.concurrency < 1 or args.concurrency > 1 + len(OTHER_PROMPTS) or args.repeats < 1:
        p.error(f"--repeats must be >= 1 and --concurrency in [1, {1 + len(OTHER_PROMPTS)}]")
    common.set_threads(args.threads)

    import torch

    t_start = now()
    machine = common.machine_info()
    log(f"machine: {common.describe_machine(machine)}")
    engine = common.make_engine(args)
    weight_bytes = engine.model.weight_bytes
    model_dir = engine.loaded.model_dir
    log(f"engine loaded in {engine.load_seconds:.1f}s ({engine.model_name}, {engine.dtype}, {engine.device}); "
        f"transformers from {model_dir}")
    # transformers runs on the engine's step thread (the engine is idle meanwhile): one OpenMP team
    # serves both, as in two separate processes. Run on the main thread instead, its OpenMP team
    # and the step thread's compete for the 2 cores and slow the engine's decode ~1.5x (measured).
    hf = engine.run_on_step_thread(load_transformers, model_dir, args.dtype)
    hf_bytes = hf_param_bytes(hf)
    log(f"torch threads: {torch.get_num_threads()}")

    single = chat_tokens(engine, SINGLE_PROMPT)
    prompts = [single] + [chat_tokens(engine, t) for t in OTHER_PROMPTS[: args.concurrency - 1]]
    n = args.tokens

    log("warm-up")
    engine.run_on_step_thread(run_transformers, hf, single, 8)
    run_engine_single(engine, single, 8, "warmup")
    run_engine_concurrent(engine, prompts, 8, "warmup-c")

    hf_runs, eng_runs, conc_runs = [], [], []
    for r in range(args.repeats):
        log(f"round {r + 1}/{args.repeats}: transformers")
        hf_runs.append(engine.run_on_step_thread(run_transformers, hf, single, n))
        log(f"round {r + 1}/{args.repeats}: opencoti single session")
        eng_runs.append(run_engine_single(engine, single, n, f"single-{r}"))
        log(f"round {r + 1}/{args.repeats}: opencoti {args.concurrency} concurrent sessions")
        conc_runs.append(run_engine_concurrent(engine, prompts, n, f"conc-{r}"))
    engine.check_integrity()
    pages_left = engine.stats()["kv_pages_used"]

    hf_dec = summarize([x["decode_tps"] for x in hf_runs if x["decode_tps"]])
    hf_whole = summarize([x["whole_tps"] for x in hf_runs])
    hf_ttft = summarize([x["ttft_s"] for x in hf_runs])
    en_dec = summarize([x["decode_tps"] for x in eng_runs if x["decode_tps"]])
    en_whole = summarize([x["whole_tps"] for x in eng_runs])
    en_ttft = summarize([x["ttft_s"] for x in eng_runs])
    ag_dec = summarize([x["aggregate_decode_tps"] for x in conc_runs if x["aggregate_decode_tps"]])
    ag_e2e = summarize([x["end_to_end_tps"] for x in conc_runs])
    ag_per = summarize([v for x in conc_runs for v in x["per_session_decode_tps"]])

    base = hf_dec["median"]
    base_whole = hf_whole["median"]
    gbs = lambda nbytes, steps_per_s: nbytes * steps_per_s / 1e9 if steps_per_s else None  # noqa: E731
    c = args.concurrency
    ratio_single = ratio(en_dec["median"], base)
    ratio_agg = ratio(ag_dec["median"], base)

    # greedy agreement (informational): fp32 should agree; transformers' min_new_tokens masks EOS
    # where we generate it (ignore_eos), so compare up to our first EOS.
    eos_ids = set(getattr(engine.tokenizer, "eos_token_ids", None) or [])
    ours = eng_runs[0]["token_ids"]
    cut = next((i for i, t in enumerate(ours) if t in eos_ids), len(ours))
    agree_hf = same_prefix_len(ours, hf_runs[0]["token_ids"])
    agree_batch = same_prefix_len(ours, conc_runs[0]["token_ids"][0])

    print(f"\nopencoti engine benchmark: {engine.model_name}, dtype {args.dtype}, weights {engine.model.weights}, "
          f"device {engine.device}, "
          f"greedy, prompt {len(single)} tokens, {n} new tokens, median of {args.repeats}")
    print(f"machine: {common.describe_machine(machine)}")
    rows = [
        ["transformers generate, 1 session", base, base_whole, hf_ttft["median"] * 1e3, gbs(hf_bytes, base), 1.0,
         ratio(base_whole, base_whole)],
        ["opencoti, 1 session", en_dec["median"], en_whole["median"], en_ttft["median"] * 1e3,
         gbs(weight_bytes, en_dec["median"]), ratio_single, ratio(en_whole["median"], base_whole)],
        [f"opencoti, {c} sessions (aggregate)", ag_dec["median"], ag_e2e["median"], None,
         gbs(weight_bytes, ag_dec["median"] / c if ag_dec["median"] else None), ratio_agg,
         ratio(ag_e2e["median"], base_whole)],
    ]
    print_table(["mode", "decode tok/s", "whole-req tok/s", "TTFT ms", "weight GB/s", "decode x HF",
                 "whole x HF"], rows)
    print(f"\n  {c}-session per-session decode tok/s (median over sessions and repeats): {fmt(ag_per['median'])}")
    print(f"  weight bytes per decode step: opencoti {weight_bytes / 1e6:.1f} MB, transformers params "
          f"{hf_bytes / 1e6:.1f} MB; GB/s = bytes x decode steps/s ({c}-session steps/s = aggregate / {c})")
    print(f"  definitions: decode tok/s = (N-1) / (t_token_N - t_token_1); whole-request tok/s = N / call "
          f"wall time;\n  {AGGREGATE_DEFINITION}")
    print(f"  greedy check: opencoti vs transformers agree on {agree_hf}/{n} tokens (opencoti's first EOS at "
          f"{cut if cut < len(ours) else 'none'}); single vs batched session agree on {agree_batch}/{n}")
    if not all(x["all_decoding_together"] for x in conc_runs):
        print("  WARNING: in some repeat the sessions did not all decode together (a session finished before "
              "another had its first token); the aggregate is not meaningful there")
    print(f"\n  target single-session decode >= 1.5x transformers: {fmt(ratio_single)}x  "
          f"{check_mark(ratio_single, 1.5)}")
    print(f"  target {c}-session aggregate decode >= 6x transformers single-session: {fmt(ratio_agg)}x  "
          f"{check_mark(ratio_agg, 6.0)}" + ("" if c == 8 else "  (target is defined for 8 sessions)"))

    def strip(runs):
        return [{k: v for k, v in x.items() if k != "token_ids"} for x in runs]

    payload = {
        "config": {"model": engine.model_name, "model_dir": model_dir, "dtype": args.dtype,
                   "weights": engine.model.weights_info,
                   "device": str(engine.device), "prompt_tokens": len(single), "new_tokens": n,
                   "repeats": args.repeats, "concurrency": c, "quick": args.quick,
                   "page_size": engine.kv.page_size},
        "machine": machine,
        "definitions": {
            "decode_tps": "(N-1) / (time of token N - time of token 1); opencoti: timings.predicted_per_second; "
                          "transformers: token times from a streamer",
            "whole_tps": "N / wall time of the whole generate call (prefill included)",
            "aggregate_decode_tps": AGGREGATE_DEFINITION,
            "weight_gbps": "weight bytes read per decode step x decode steps/s (aggregate: steps/s = tok/s / C)",
        },
        "weight_bytes": {"opencoti": weight_bytes, "transformers": hf_bytes},
        "summary": {
            "transformers_decode_tps": hf_dec, "transformers_whole_tps": hf_whole, "transformers_ttft_s": hf_ttft,
            "opencoti_decode_tps": en_dec, "opencoti_whole_tps": en_whole, "opencoti_ttft_s": en_ttft,
            "opencoti_aggregate_decode_tps": ag_dec, "opencoti_aggregate_end_to_end_tps": ag_e2e,
            "opencoti_concurrent_per_session_decode_tps": ag_per,
            "transformers_weight_gbps": gbs(hf_bytes, base),
            "opencoti_weight_gbps": gbs(weight_bytes, en_dec["median"]),
            "opencoti_aggregate_weight_gbps": gbs(weight_bytes, ag_dec["median"] / c if ag_dec["median"] else None),
            "ratio_single_decode_vs_transformers": ratio_single,
            "ratio_single_whole_vs_transformers": ratio(en_whole["median"], base_whole),
            "ratio_aggregate_decode_vs_transformers_single": ratio_agg,
            "target_single_1_5x": ratio_single is not None and ratio_single >= 1.5,
            "target_aggregate_6x": ratio_agg is not None and ratio_agg >= 6.0,
            "greedy_agree_with_transformers_tokens": agree_hf,
            "greedy_agree_single_vs_batched_tokens": agree_batch,
            "kv_pages_left_after_release": pages_left,
        },
        "runs": {"transformers": strip(hf_runs), "opencoti_single": strip(eng_runs),
                 "opencoti_concurrent": strip(conc_runs)},
        "total_seconds": now() - t_start,
        "loadavg_end": common.machine_info()["loadavg"],
    }
    path = common.write_json("engine", payload, args.out)
    print(f"\nwrote {path} ({now() - t_start:.0f}s total)")
    engine.shutdown()
    return 0


if __name__ == "__main__":
    _rc = main()
    if _rc:  # no SystemExit on success: `opencoti bench all` runs the next benchmark in this process
        sys.exit(_rc)
