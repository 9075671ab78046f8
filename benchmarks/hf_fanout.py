#!/usr/bin/env python
"""The transformers side of the shared-prefix fan-out (bench_fanout.py), in a process of its own.

This module never imports opencoti: importing opencoti sets OpenMP wait settings
(``GOMP_SPINCOUNT``) before torch loads, and the transformers baselines must run under their own
defaults. bench_fanout.py runs each baseline measurement as
``python benchmarks/hf_fanout.py JOB.json OUT.json`` with ``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT``
removed from the environment (``baseline_env``); the job names the system, the model directory,
the token ids and the number of generated tokens; the process loads the model, warms up once on
a small prompt, measures once and writes the run's metrics (the same ``finish_run`` as ours).
bench_engine.py takes ``load_transformers`` and ``_TokenClock`` from here too.
"""

from __future__ import annotations

import copy
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

# set by opencoti (or a user) for our engine; the baselines run with OpenMP's own defaults
OPENMP_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def now() -> float:
    return time.perf_counter()


def baseline_env(env: dict | None = None) -> dict:
    """``env`` (default: this process's) without the OpenMP wait settings."""
    env = dict(os.environ if env is None else env)
    for k in OPENMP_WAIT_VARS:
        env.pop(k, None)
    return env


# ============================================================================ timing helpers
def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [a, b] intervals."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100])."""
    vals = sorted(values)
    if len(vals) == 1:
        return vals[0]
    pos = (len(vals) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def finish_run(system: str, P: int, N: int, G: int, first: list[float], last: list[float],
               token_ids: list[list[int]], peak_kv: int, extra: dict) -> dict:
    """Metrics of one run from per-session first/last token times (seconds since t0)."""
    decode = [(G - 1) / (b - a) if b > a else None for a, b in zip(first, last)]
    decode_time = union_length(list(zip(first, last)))
    return {
        "system": system, "prefix": P, "sessions": N, "gen": G,
        "wall_s": max(last),
        "ttft_p50_s": percentile(first, 50), "ttft_p95_s": percentile(first, 95),
        "ttft_s": first, "last_token_s": last,
        "per_session_decode_tps": statistics.median(d for d in decode if d is not None) if any(decode) else None,
        "per_session_decode_tps_all": decode,
        "aggregate_decode_tps": N * (G - 1) / decode_time if decode_time > 0 else None,
        "end_to_end_tps": N * G / max(last),
        "peak_kv_bytes": peak_kv,
        "generated": [len(t) for t in token_ids],
        "token_ids": token_ids,
        "loadavg": os.getloadavg(),
        **extra,
    }


class _TokenClock:
    """A transformers streamer that only records when each put() happens.

    generate() puts the prompt once before the first forward, then each new token as it is
    sampled, so times[1:] are the arrival times of generated tokens 1..N."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:  # noqa: ARG002 - only the timing matters
        self.times.append(now())

    def end(self) -> None:
        pass


def load_transformers(model_dir, dtype_name: str):
    import torch
    import transformers

    from opencoti.engine.model.loader import transformers_reference

    transformers.utils.logging.set_verbosity_error()
    return transformers_reference(model_dir, getattr(torch, dtype_name))  # a GGUF's directory: from the file


# ============================================================================ transformers
def cache_bytes(cache) -> int:
    """Bytes of the key and value tensors of a DynamicCache."""
    if cache is None:
        return 0
    n = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if t is not None:
                n += t.numel() * t.element_size()
    return n


def hf_gen_config(model, G: int):
    from transformers import GenerationConfig

    eos = model.config.eos_token_id
    eos = eos[0] if isinstance(eos, (list, tuple)) else eos
    return GenerationConfig(do_sample=False, max_new_tokens=G, min_new_tokens=G, num_beams=1,
                            eos_token_id=eos, pad_token_id=eos, return_dict_in_generate=True)


def cache_kwarg(model) -> str:
    """transformers 5.x renamed ``past_key_values`` to ``cache`` (the old name still works, with a warning)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def hf_generate(model, ids_2d, G: int, past=None):
    """One generate() call; returns (token ids per row, time of each generated step, the cache)."""
    import torch

    input_ids = torch.tensor(ids_2d, dtype=torch.long)
    clock = _TokenClock()
    kw = {cache_kwarg(model): past} if past is not None else {}
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                             generation_config=hf_gen_config(model, G), streamer=clock, **kw)
    gen = out.sequences[:, input_ids.shape[1]:].tolist()
    times = clock.times[1:]  # the first put() is the prompt
    if any(len(g) != G for g in gen) or len(times) != G:
        raise RuntimeError(f"transformers generated {[len(g) for g in gen]} tokens ({len(times)} timed), wanted {G}")
    cache = getattr(out, "cache", None)
    return gen, times, cache if cache is not None else getattr(out, "past_key_values", None)


def run_hf_recompute(model, prefix, suffixes, G: int) -> dict:
    N, P = len(suffixes), len(prefix)
    caches, first, last, ids = [], [], [], []
    t0 = now()
    for s in suffixes:
        gen, times, cache = hf_generate(model, [prefix + s], G)
        caches.append(cache)  # the session keeps its cache
        first.append(times[0] - t0)
        last.append(times[-1] - t0)
        ids.append(gen[0])
    peak = sum(cache_bytes(c) for c in caches)
    return finish_run("hf-recompute", P, N, G, first, last, ids, peak,
                      {"attn_implementation": model.config._attn_implementation})


def run_hf_copy(model, prefix, suffixes, G: int) -> dict:
    """transformers' documented prompt reuse: the prefix into a DynamicCache once, then per
    session ``copy.deepcopy`` of it and ``generate(past_key_values=copy)`` on prefix + suffix."""
    import torch
    from transformers import DynamicCache

    N, P = len(suffixes), len(prefix)
    caches, first, last, ids = [], [], [], []
    peak = 0
    t0 = now()
    template = DynamicCache()
    with torch.inference_mode():
        model(input_ids=torch.tensor([prefix], dtype=torch.long), use_cache=True, **{cache_kwarg(model): template})
    t_template = now() - t0
    for i, s in enumerate(suffixes):
        cache = copy.deepcopy(template)
        if i == N - 1:
            template = None  # nothing needs it any more
        gen, times, cache = hf_generate(model, [prefix + s], G, past=cache)
        caches.append(cache)
        peak = max(peak, cache_bytes(template) + sum(cache_bytes(c) for c in caches))
        first.append(times[0] - t0)
        last.append(times[-1] - t0)
        ids.append(gen[0])
    return finish_run("hf-copy", P, N, G, first, last, ids, peak, {"prefix_cache_s": t_template})


def run_hf_batch(model, prefix, suffixes, G: int) -> dict:
    N, P = len(suffixes), len(prefix)
    t0 = now()
    gen, times, cache = hf_generate(model, [prefix + s for s in suffixes], G)
    first = [times[0] - t0] * N
    last = [times[-1] - t0] * N
    return finish_run("hf-batch", P, N, G, first, last, gen, cache_bytes(cache), {})


def run_hf_cb(model, prefix, suffixes, G: int) -> dict:
    """``generate_batch`` as transformers implements it (continuous_batching_context_manager +
    add_requests + get_result), with the cache's blocks in use polled between results."""
    import torch
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints
    except ImportError:  # other layouts: generate_batch builds the same hints
        WorkloadHints = None  # noqa: N806

    N, P = len(suffixes), len(prefix)
    Q = len(suffixes[0])
    page = 256
    cbc = ContinuousBatchingConfig(page_size=page, num_blocks=-(-N * (P + Q + G) // page) + 2, max_batch_tokens=512)
    gcfg = GenerationConfig(do_sample=False, max_new_tokens=G, eos_token_id=-1, pad_token_id=0)
    inputs = [prefix + s for s in suffixes]
    hints = WorkloadHints(max_prompt_length=P + Q, max_generated_length=G, num_requests=N) if WorkloadHints else None
    results: dict = {}
    peak_used = 0
    cache_total = None
    prefix_hits: list[int] = []
    with torch.no_grad():
        t0 = now()
        with model.continuous_batching_context_manager(generation_config=gcfg, continuous_batching_config=cbc,
                                                       block=True, timeout=5, workload_hints=hints) as manager:
            attn_impl = model.config._attn_implementation  # what CB switched the model to
            probe = CBStepProbe(model)
            try:
                ids = manager.add_requests(inputs=inputs, max_new_tokens=G, record_timestamps=True)
                cache = manager.batch_processor.cache if manager.batch_processor is not None else None
                while len(results) < N:
                    r = manager.get_result(timeout=0.01)
                    bp = manager.batch_processor
                    if bp is not None:
                        cache = bp.cache
                        total = cache.num_sectors * cache.bytes_per_sector
                        cache_total = total
                        peak_used = max(peak_used, int(round((1 - cache.compute_free_capacity(relative=True)) * total)))
                    if r is not None and r.is_finished():
                        results[r.request_id] = r
                    elif r is None and not manager.is_running():
                        raise RuntimeError("transformers continuous batching stopped before finishing")
                t_end = now()
            finally:
                probe.remove()
        if cache is not None:
            prefix_hits = list(getattr(cache, "_bench_prefix_hits", []))
    outs = [results[i] for i in ids]
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"transformers continuous batching failed: {errors[0]}")
    first = [o.timestamps[0] - t0 for o in outs]
    last = [o.timestamps[-1] - t0 for o in outs]
    gen = [list(o.generated_tokens) for o in outs]
    if any(len(g) != G for g in gen):
        raise RuntimeError(f"transformers continuous batching generated {[len(g) for g in gen]} tokens, wanted {G}")
    return finish_run("hf-cb", P, N, G, first, last, gen, peak_used,
                      {"cache_allocated_bytes": cache_total, "cb_prefix_hit_tokens": prefix_hits,
                       "attn_implementation": attn_impl, "cb_decode": probe.decode_summary(N),
                       "call_s": t_end - t0, "cb_config": {"page_size": page, "num_blocks": cbc.num_blocks,
                                                             "max_batch_tokens": 512}})


class CBStepProbe:
    """Times transformers CB's generation steps and the attention calls inside them (the attention
    function the model resolves per call, under the key CB switched it to), and keeps the shapes of
    each step's last attention call. Two perf_counter calls per layer: negligible."""

    def __init__(self, model):
        from transformers.generation.continuous_batching import continuous_api as ca
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.steps: list[tuple[float, float, tuple | None]] = []  # (step s, attention s, (q shape, k shape))
        self._attn_s, self._shapes = 0.0, None
        self._cls, self._fns = ca.ContinuousBatchProcessor, ALL_ATTENTION_FUNCTIONS
        self._key = model.config._attn_implementation
        self._orig_step, self._orig_attn = self._cls._generation_step, self._fns[self._key]
        probe = self

        def step(bp, m):
            probe._attn_s, probe._shapes = 0.0, None
            t = time.perf_counter()
            r = probe._orig_step(bp, m)
            probe.steps.append((time.perf_counter() - t, probe._attn_s, probe._shapes))
            return r

        def attention(module, query, key, value, attention_mask, *a, **kw):
            t = time.perf_counter()
            r = probe._orig_attn(module, query, key, value, attention_mask, *a, **kw)
            probe._attn_s += time.perf_counter() - t
            probe._shapes = (tuple(query.shape), tuple(key.shape))
            return r

        self._cls._generation_step = step
        self._fns[self._key] = attention

    def remove(self) -> None:
        self._cls._generation_step = self._orig_step
        self._fns[self._key] = self._orig_attn

    def decode_summary(self, n: int) -> dict:
        """Steps whose query holds exactly n tokens (all n sessions decoding), the first one excluded."""
        dec = [x for x in self.steps if x[2] is not None and x[2][0][-2] == n][1:]
        if not dec:
            return {"decode_steps": 0}
        return {"decode_steps": len(dec), "step_ms_median": 1e3 * statistics.median(x[0] for x in dec),
                "attention_ms_median": 1e3 * statistics.median(x[1] for x in dec),
                "attention_shapes_q_k": dec[-1][2], "steps": len(self.steps)}


def instrument_cb_prefix_hits() -> None:
    """Record how many prompt tokens each CB request found in the shared cache (informational)."""
    try:
        from transformers.generation.continuous_batching import cache as cb_cache
    except ImportError:
        return
    cls = cb_cache.PagedAttentionCache
    if getattr(cls, "_bench_wrapped", False):
        return
    orig = cls.search_prefix_match

    def search_prefix_match(self, request_id, prompt_ids):
        n = orig(self, request_id, prompt_ids)
        self.__dict__.setdefault("_bench_prefix_hits", []).append(int(n))
        return n

    cls.search_prefix_match = search_prefix_match
    cls._bench_wrapped = True


# ============================================================================ the worker process
RUNNERS = {"hf-recompute": run_hf_recompute, "hf-copy": run_hf_copy, "hf-batch": run_hf_batch, "hf-cb": run_hf_cb}


def run_job(job: dict) -> dict:
    """Load the model, warm the system up once on ``job["warm"]`` (prefix, suffixes), measure once."""
    import torch

    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    model = load_transformers(job["model_dir"], job["dtype"])
    if job["system"] == "hf-cb":
        instrument_cb_prefix_hits()
    run = RUNNERS[job["system"]]
    warm = job.get("warm")
    if warm:
        run(model, warm["prefix"], warm["suffixes"], job["gen"])
    r = run(model, job["prefix"], job["suffixes"], job["gen"])
    r["process"] = {"pid": os.getpid(), "torch_threads": torch.get_num_threads(),
                    "openmp_env": {k: os.environ.get(k) for k in OPENMP_WAIT_VARS}, "dtype": job["dtype"]}
    return r


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: hf_fanout.py JOB.json OUT.json", file=sys.stderr)
        return 2
    job = json.loads(Path(argv[0]).read_text())
    Path(argv[1]).write_text(json.dumps(run_job(job), default=repr))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
