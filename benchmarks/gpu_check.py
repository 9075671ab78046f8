"""One-command GPU check of the FlashInfer backend (issue 10): correctness, then decode speed.

    python3 benchmarks/gpu_check.py [--out $OUT/gpu_check.json]        # CUDA + flashinfer-python
    .venv/bin/python benchmarks/gpu_check.py --dry-run                 # CPU: everything but the kernels

(A GPU machine without flashinfer: carry the bundle that benchmarks/gpu_bundle.py builds; its
docstring has the command.)

1. Kernels vs. the torch backend on the same inputs (bf16 K/V cache and q/k/v; the reference is
   the torch backend in fp32 on those same values): plain prefill (cached prefixes, chunks),
   plain decode, cascade on random pool trees (1-3 levels, sessions in no pool, decode and mixed
   batches; empty groups compacted), for page sizes 1 and 16. PASS when max |diff| <= --tol.
2. Engine: its start-up self-check of the backend against the torch backend on the model
   (``opencoti/engine/attention/selfcheck.py``, run afresh here, not a cached verdict) must pass;
   greedy: a session attached to a pool generates exactly the tokens of the same prompt
   without the pool (prefill chunks aligned so both compute the same K/V), with the backend
   that ``attention_backend="auto"`` selects on CUDA (it must be FlashInfer).
3. Decode tok/s for N sessions attached to one P-token pool (16-token suffix each), cascade on
   and off: only steps in which all N sessions decode count; per-session tok/s = 1 / median step
   time, aggregate = N x that; achieved bandwidth = (weight bytes + KV bytes read) / step time.
4. Optional (time permitting, ``--budget-s``): a dense tree through MultiLevelCascadeAttentionWrapper
   (FlashInfer picks its own kernel backend there: on Hopper another JIT module), the CUDA-core
   decode kernel (GQA group 4), and a probe of whether MultiLevelCascadeAttentionWrapper accepts
   empty groups (information only; last, since a bad launch could poison the CUDA context).

The model is random weights with SmolLM2-135M's shapes (the bundled GGUF is too big to carry to
a GPU machine; throughput depends on shapes only), or ``--model default`` for the bundled one.
``--dry-run`` runs on CPU with FlashInfer's kernels replaced by ``ReferenceKernels`` (torch),
small sizes, so the script itself is tested without a GPU. Exit status 0 iff nothing FAILed.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, describe_machine, log, machine_info, print_table, write_json  # noqa: E402

import torch  # noqa: E402

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
DRY_MODEL = dict(SMOLLM2_135M, vocab_size=320, intermediate_size=256, num_hidden_layers=2)


# ============================================================================ report
class Report:
    def __init__(self):
        self.checks: list[dict] = []
        self.data: dict = {}
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def add(self, name: str, status: str, detail: str = "", **values) -> None:
        self.checks.append({"name": name, "status": status, "detail": detail, "t": round(self.elapsed(), 1), **values})
        print(f"[{self.elapsed():6.1f}s] {status:<4}  {name}  {detail}", flush=True)

    def guard(self, name: str, fn, *a, **kw):
        """Run one section; an exception is a FAIL of that section, not the end of the script."""
        try:
            return fn(*a, **kw)
        except Exception as e:  # noqa: BLE001 - reported, the script goes on
            self.add(name, "FAIL", f"{type(e).__name__}: {e}")
            traceback.print_exc()
            return None

    @property
    def num_failed(self) -> int:
        return sum(c["status"] == "FAIL" for c in self.checks)

    def summary(self) -> str:
        counts = {s: sum(c["status"] == s for c in self.checks) for s in ("PASS", "FAIL", "SKIP", "INFO")}
        verdict = "PASS" if counts["FAIL"] == 0 and counts["PASS"] > 0 else "FAIL"
        lines = ["", "=" * 30 + " gpu_check summary " + "=" * 30]
        lines += [f"{c['status']:<4}  {c['name']}  {c['detail']}" for c in self.checks]
        lines.append(f"RESULT: {verdict} ({counts['PASS']} passed, {counts['FAIL']} failed, "
                     f"{counts['SKIP']} skipped, {counts['INFO']} info) in {self.elapsed():.0f} s")
        return "\n".join(lines)


# ============================================================================ backends
def make_backend(args, cascade: str, impl: str = "levels"):
    from opencoti.engine.attention.flashinfer_backend import FlashInferBackend

    if args.dry_run:
        from opencoti.engine.attention.flashinfer_reference import ReferenceKernels

        return FlashInferBackend(args.device, cascade=cascade, cascade_impl=impl, kernels=ReferenceKernels())
    return FlashInferBackend(args.device, cascade=cascade, cascade_impl=impl)


def install_backend(eng, backend) -> None:
    """Dry run only: put ``backend`` where the engine's step loop looks for it (it is idle now)."""
    runner = eng.core.runner  # the model runner executes each step's batch
    assert runner.backend is eng.backend
    eng.backend = runner.backend = backend


# ============================================================================ 1. kernels
def random_pool_tree_batch(rng: random.Random, kv, levels: int, num_seqs: int, *, prefill_every: int | None,
                           dense: bool = False):
    """Batch entries of sequences under a random pool tree of ``levels`` shared levels.

    Every 5th sequence is in no pool unless ``dense`` (then every sequence sits under a full-depth
    path, so every cascade level covers every sequence). Private suffixes have uneven lengths;
    every ``prefill_every``-th sequence computes a chunk of several tokens over its cache (None:
    all decode, one token each).
    """
    from opencoti.engine.attention.base import SeqBatchEntry

    ps = kv.page_size

    def node(depth):
        n = {"pages": kv.allocate(rng.randint(1, 4 if ps > 1 else 40)), "kids": []}
        if depth + 1 < levels:
            n["kids"] = [node(depth + 1) for _ in range(2 if dense else rng.randint(1, 2))]
        return n

    paths, leaves = [], []

    def walk(n, prefix):
        prefix = prefix + n["pages"]
        paths.append(prefix)
        if not n["kids"]:
            leaves.append(prefix)
        for k in n["kids"]:
            walk(k, prefix)

    if levels > 0:
        for r in ([node(0)] if dense else [node(0) for _ in range(rng.randint(1, 2))]):
            walk(r, [])
    entries = []
    for i in range(num_seqs):
        if levels == 0:
            shared = []
        elif dense:
            shared = leaves[i % len(leaves)]
        else:
            shared = rng.choice(paths) if i % 5 != 4 else []
        private = rng.randint(1, 3 * ps + 5) if levels else rng.randint(2, 6 * ps + 40)
        q_len = 1
        if prefill_every and i % prefill_every == 0 and private > 1:
            q_len = rng.randint(2, private)
        kv_len = len(shared) * ps + private
        table = list(shared) + kv.allocate(kv.pages_for(kv_len) - len(shared))
        entries.append(SeqBatchEntry(table, kv_len - q_len, q_len))
    return entries


def _attention_case(args, report: Report, name: str, entries, kv, *, cascade: str, impl: str = "levels",
                    expect_kind: str | None = None, expect_multilevel: bool = False, num_heads: int = 9) -> None:
    from opencoti.engine.attention.base import build_metadata
    from opencoti.engine.attention.flashinfer_backend import use_tensor_cores_for
    from opencoti.engine.attention.torch_backend import TorchAttentionBackend

    H, HKV, D = num_heads, kv.num_kv_heads, kv.head_dim  # default SmolLM2-135M's 9/3/64: the engine's kernels
    scale = D ** -0.5
    gen = torch.Generator(device="cpu").manual_seed(len(entries) * 7919 + kv.page_size)
    T = sum(e.num_new for e in entries)
    q = torch.randn(T, H, D, generator=gen).to(args.device, torch.bfloat16)
    k = torch.randn(T, HKV, D, generator=gen).to(args.device, torch.bfloat16)
    v = torch.randn(T, HKV, D, generator=gen).to(args.device, torch.bfloat16)
    kc, vc = kv.k_cache[0], kv.v_cache[0]  # bf16 [P, S, Hkv, D]
    ref = TorchAttentionBackend(cascade="off")
    meta = build_metadata(entries, kv.page_size, args.device)
    ref.plan(meta, num_heads=H, num_kv_heads=HKV, head_dim=D)
    o_ref = ref.forward(0, q.float(), k.float(), v.float(), kc.float(), vc.float(), meta, scale)
    meta = build_metadata(entries, kv.page_size, args.device)
    ref.plan(meta, num_heads=H, num_kv_heads=HKV, head_dim=D)
    o_bf16 = ref.forward(0, q, k, v, kc.clone(), vc.clone(), meta, scale)
    be = make_backend(args, cascade, impl)
    meta = build_metadata(entries, kv.page_size, args.device)
    be.plan(meta, num_heads=H, num_kv_heads=HKV, head_dim=D)
    kc2, vc2 = kc.clone(), vc.clone()
    o = be.forward(0, q, k, v, kc2, vc2, meta, scale)
    o2 = be.forward(1, q, k, v, kc2, vc2, meta, scale)  # a second layer reuses the step's plan
    if args.device.type == "cuda":
        torch.cuda.synchronize()
    state = meta.backend_state["flashinfer"]
    step = state["step"]
    diff = (o.float() - o_ref).abs().max().item()
    diff_torch = (o_bf16.float() - o_ref).abs().max().item()
    written = bool(torch.equal(kc2.view(-1, HKV, D)[meta.slot_mapping], k))
    problems = []
    if expect_kind and step.kind != expect_kind:
        problems.append(f"ran {step.kind}, expected {expect_kind}")
    if expect_multilevel and "multilevel" not in state:
        problems.append("did not run MultiLevelCascadeAttentionWrapper")
    if step.kind == "decode" and be._decode_tc != use_tensor_cores_for(H, HKV):
        problems.append(f"decode ran with use_tensor_cores={be._decode_tc}")
    if not torch.equal(o, o2):
        problems.append("second layer differs from the first on the same inputs")
    if not written:
        problems.append("new K not written to the cache")
    levels = len(step.levels) if step.kind == "cascade" else 0
    compacted = sum(lv.rows is not None for lv in step.levels)
    ok = diff <= args.tol and not problems
    tc = f" tensor_cores={be._decode_tc}" if step.kind == "decode" or (levels and step.levels[-1].is_decode) else ""
    detail = (f"max|diff| {diff:.2e} (tol {args.tol:g}; torch bf16 {diff_torch:.2e}) rows={T} seqs={len(entries)} "
              f"kind={step.kind} levels={levels} compacted={compacted}{tc}" + (f" | {'; '.join(problems)}" if problems else ""))
    report.add(name, "PASS" if ok else "FAIL", detail, max_abs_diff=diff, torch_bf16_diff=diff_torch)


def kernel_checks(args, report: Report) -> None:
    from opencoti.engine.kv.pages import PagePool

    for ps in args.page_sizes:
        for case in ("prefill", "decode", "cascade-decode", "cascade-mixed"):
            for levels in ((1, 2, 3) if case.startswith("cascade") else (0,)):
                rng = random.Random(1000 * ps + 10 * levels + len(case))
                num_pages = (8192 if ps == 1 else 1024) // (8 if args.dry_run else 1)
                kv = PagePool(num_layers=1, num_pages=num_pages, page_size=ps, num_kv_heads=3,
                              head_dim=64, dtype=torch.bfloat16, device=args.device)
                kv.k_cache.normal_()
                kv.v_cache.normal_()
                n = rng.randint(6, 12) if args.dry_run else rng.randint(12, 40)
                if case == "prefill":  # chunks over cached prefixes, no sharing
                    entries = random_pool_tree_batch(rng, kv, 0, n, prefill_every=1)
                    cascade, expect = "off", "prefill"
                elif case == "decode":  # over shared pages, read per sequence
                    entries = random_pool_tree_batch(rng, kv, 2, n, prefill_every=None)
                    cascade, expect = "off", "decode"
                else:
                    entries = random_pool_tree_batch(rng, kv, levels, n,
                                                     prefill_every=3 if case.endswith("mixed") else None)
                    cascade, expect = "on", "cascade"
                name = f"kernels/{case}" + (f" levels={levels}" if levels else "") + f" page_size={ps}"
                report.guard(name, _attention_case, args, report, name, entries, kv, cascade=cascade,
                             expect_kind=expect)


def multilevel_check(args, report: Report) -> None:
    from opencoti.engine.kv.pages import PagePool

    for ps in args.page_sizes:
        rng = random.Random(77 + ps)
        kv = PagePool(num_layers=1, num_pages=512 if args.dry_run else 4096, page_size=ps, num_kv_heads=3,
                      head_dim=64, dtype=torch.bfloat16, device=args.device)
        kv.k_cache.normal_()
        kv.v_cache.normal_()
        entries = random_pool_tree_batch(rng, kv, 2, 8 if args.dry_run else 24, prefill_every=3, dense=True)
        name = f"kernels/multilevel-wrapper dense levels=2 page_size={ps}"
        report.guard(name, _attention_case, args, report, name, entries, kv, cascade="on", impl="multilevel",
                     expect_kind="cascade", expect_multilevel=True)


def cuda_core_decode_check(args, report: Report) -> None:
    """GQA group 4 (e.g. Llama 3 8B's 32/8 heads): the CUDA-core decode kernel (another JIT module)."""
    from opencoti.engine.kv.pages import PagePool

    kv = PagePool(num_layers=1, num_pages=256 if args.dry_run else 1024, page_size=16, num_kv_heads=2, head_dim=64,
                  dtype=torch.bfloat16, device=args.device)
    kv.k_cache.normal_()
    kv.v_cache.normal_()
    entries = random_pool_tree_batch(random.Random(11), kv, 2, 8 if args.dry_run else 24, prefill_every=None)
    name = "kernels/decode cuda-cores (H=8 Hkv=2) page_size=16"
    report.guard(name, _attention_case, args, report, name, entries, kv, cascade="off", expect_kind="decode",
                 num_heads=8)


def empty_group_probe(args, report: Report) -> None:
    """Information: does MultiLevelCascadeAttentionWrapper accept empty groups (0 pages, last_page_len 0)?

    If it does, the plan's levels could go to it unchanged; our ``levels`` path compacts them away.
    (The reference kernels reject them, as FlashInfer documents 1 <= last_page_len <= page_size.)
    """
    from opencoti.engine.attention.base import build_metadata
    from opencoti.engine.attention.cascade import build_cascade_plan
    from opencoti.engine.attention.flashinfer_plan import PagedArrays, dfs_row_permutation
    from opencoti.engine.attention.torch_backend import TorchAttentionBackend
    from opencoti.engine.kv.pages import PagePool

    name = "probe/multilevel-wrapper with empty groups"
    ps, H, HKV, D = 16, 9, 3, 64
    kv = PagePool(num_layers=1, num_pages=256, page_size=ps, num_kv_heads=HKV, head_dim=D, dtype=torch.bfloat16,
                  device=args.device)
    kv.k_cache.normal_()
    kv.v_cache.normal_()
    entries = random_pool_tree_batch(random.Random(5), kv, 2, 10, prefill_every=None)
    meta = build_metadata(entries, ps, args.device)
    cplan = build_cascade_plan(meta.page_tables, meta.kv_lens, meta.qo_lens, ps)
    empties = sum(int((lv["kv_indptr"][1:] == lv["kv_indptr"][:-1]).sum()) for lv in cplan.levels[:-1])
    T = meta.num_tokens
    q = torch.randn(T, H, D, device=args.device, dtype=torch.bfloat16)
    zeros = torch.zeros(T, HKV, D, device=args.device)
    ref = TorchAttentionBackend(cascade="off")
    ref.plan(meta, num_heads=H, num_kv_heads=HKV, head_dim=D)
    o_ref = ref.forward(0, q.float(), zeros, zeros, kv.k_cache[0].float(), kv.v_cache[0].float(), meta, D ** -0.5)
    kv.k_cache[0].view(-1, HKV, D)[meta.slot_mapping] = 0  # the same new K/V as the reference wrote
    kv.v_cache[0].view(-1, HKV, D)[meta.slot_mapping] = 0
    perm, inv = dfs_row_permutation(cplan.order, meta.qo_lens)
    raw_levels = [PagedArrays(*(lv[f] for f in PagedArrays._fields)) for lv in cplan.levels]
    wrapper = make_backend(args, "on", "multilevel").kernels.multilevel(cplan.num_levels)
    try:
        wrapper.plan(raw_levels, num_heads=H, num_kv_heads=HKV, head_dim=D, page_size=ps, causal=True,
                     dtype=torch.bfloat16, scale=D ** -0.5)
        qp = q if perm is None else q[perm.to(args.device)]
        o = wrapper.run(qp, kv.k_cache[0], kv.v_cache[0])
        o = o if inv is None else o[inv.to(args.device)]
        if args.device.type == "cuda":
            torch.cuda.synchronize()
        diff = (o.float() - o_ref).abs().max().item()
        verdict = "yes" if diff <= args.tol else "no (wrong results)"
        report.add(name, "INFO", f"{verdict}: max|diff| {diff:.2e} with {empties} empty groups", max_abs_diff=diff)
    except Exception as e:  # noqa: BLE001 - this is what we want to learn
        report.add(name, "INFO", f"no ({empties} empty groups): {type(e).__name__}: {str(e)[:200]}")


# ============================================================================ 2-3. engine
def make_engine(args, report: Report):
    from opencoti.engine import Engine, EngineConfig
    from opencoti.engine.attention.flashinfer_backend import FlashInferBackend, FlashInferKernels
    from opencoti.engine.model.loader import tiny_model

    cfg = EngineConfig(model="tiny:llama", device=str(args.device), dtype="bfloat16", page_size=16,
                       kv_budget_tokens=args.pool + 48 * (64 + args.decode) + 4096, max_batch_tokens=256,
                       max_running=64, max_context=args.pool + 1024, cascade="on",
                       attention_backend="torch" if args.dry_run else "auto")
    loaded = None
    if args.model == "shape":
        t = time.perf_counter()
        loaded = tiny_model("llama", seed=0, dtype=torch.bfloat16, **(DRY_MODEL if args.dry_run else SMOLLM2_135M))
        log(f"random-weight model with {'reduced ' if args.dry_run else ''}SmolLM2-135M shapes built in "
            f"{time.perf_counter() - t:.1f} s")
    elif args.model == "default":
        cfg.model = None
    if not args.dry_run:  # the engine's start-up self-check against the torch backend: run it, not a cached verdict
        os.environ["OPENCOTI_ATTENTION_CHECK"] = "force"
    eng = Engine(cfg, loaded=loaded)
    check = eng.attention_check
    if args.dry_run:  # on CPU the engine checks nothing: run the same check on the stand-in backend
        from opencoti.engine.attention.selfcheck import verify

        backend, check = verify(make_backend(args, "on"), eng.model, page_size=cfg.page_size, cascade="on")
        install_backend(eng, backend)
    report.add("engine/attention self-check", "PASS" if check.get("status") == "passed" else "FAIL",
               f"{check.get('backend')} vs torch: max rel logit err {check.get('max_rel_err')} "
               f"(tolerance {check.get('tolerance')}){', ' + check['error'] if check.get('error') else ''}",
               attention_check=check)
    be = eng.backend
    ok = isinstance(be, FlashInferBackend) and (args.dry_run or isinstance(be.kernels, FlashInferKernels))
    d = eng.model.dims
    report.add("engine/backend selection", "PASS" if ok else "FAIL",
               f"attention_backend={'(dry run: installed)' if args.dry_run else 'auto'} -> {type(be).__name__} "
               f"kernels={getattr(be, 'kernels', None).__class__.__name__} "
               f"{getattr(getattr(be, 'kernels', None), 'version', '')}; model L={d.num_layers} H={d.num_heads} "
               f"Hkv={d.num_kv_heads} D={d.head_dim} {eng.dtype}")
    return eng if ok else None


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(3, min(vocab, 256) - 1) for _ in range(n)]


def greedy_check(args, report: Report, eng) -> None:
    from opencoti.engine import SamplingParams

    P = 512 if not args.dry_run else 256  # a multiple of max_batch_tokens and of the page size
    prefix = _tokens(P, eng.model.dims.vocab_size, 1)
    prompt = prefix + _tokens(16, eng.model.dims.vocab_size, 2)
    params = SamplingParams.greedy(args.greedy_tokens, ignore_eos=True)
    unpooled = eng.generate(prompt, session_id="gc-unpooled", params=params)
    eng.release_session("gc-unpooled")
    pool = eng.create_pool(tokens=prefix)
    pooled = eng.generate(prompt, session_id="gc-pooled", pool_id=pool.pool_id, params=params)
    eng.release_session("gc-pooled")
    eng.release_pool(pool.pool_id)
    same = pooled.token_ids == unpooled.token_ids
    attached = pooled.cache_n == P
    first_diff = next((i for i, (a, b) in enumerate(zip(pooled.token_ids, unpooled.token_ids)) if a != b), None)
    report.add("engine/greedy pooled == unpooled", "PASS" if same and attached else "FAIL",
               f"{len(pooled.token_ids)} tokens, pool prefix {P}, cache_n={pooled.cache_n}"
               + ("" if same else f", first difference at token {first_diff}"),
               pooled=pooled.token_ids, unpooled=unpooled.token_ids)


def _decode_run(eng, pool_id: int, prefix: list[int], n: int, decode: int, mode: str, tag: str) -> dict:
    from opencoti.engine import SamplingParams

    eng.backend.cascade = mode
    steps = []

    def on_event(kind, data):
        if kind == "step":
            st = data["stats"]
            if st.num_seqs == n and st.num_tokens == n:
                steps.append((st.total_s, eng.backend.last_used_cascade))

    eng.core.listeners.append(on_event)
    try:
        def start(i):
            return eng.stream(prefix + _tokens(16, 256, 100 + i), pool_id=pool_id, session_id=f"{tag}-{i}",
                              # no speculative drafts: the steps compared are one token per session
                              params=SamplingParams.greedy(decode, ignore_eos=True, speculative_max=0),
                              overcommit=True)

        with ThreadPoolExecutor(n) as ex:  # all requests reach the engine before its next step
            streams = list(ex.map(start, range(n)))
        tokens = []
        for s in streams:
            list(s)
            tokens.append(s.result.token_ids)
    finally:
        eng.core.listeners.remove(on_event)
    for i in range(n):
        eng.release_session(f"{tag}-{i}")
    steps = steps[1:] or steps  # the first full step still overlaps admission
    if not steps:
        raise RuntimeError(f"no step had all {n} sessions decoding")
    return {"steps": len(steps), "cascade_steps": sum(s[1] for s in steps),
            "step_s": statistics.median(s[0] for s in steps), "tokens": tokens}


def decode_bench(args, report: Report, eng) -> None:
    from opencoti.engine.kv.pages import PagePool

    d = eng.model.dims
    P = args.pool
    prefix = _tokens(P, d.vocab_size, 3)
    pool = eng.create_pool(tokens=prefix)
    bpt = PagePool.bytes_per_token(d.num_layers, d.num_kv_heads, d.head_dim, eng.dtype)
    weight_bytes = eng.model.weight_bytes
    rows, results = [], []
    for n in args.sessions:
        runs = {"on": [], "off": []}
        for r in range(args.repeats):
            for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
                runs[mode].append(_decode_run(eng, pool.pool_id, prefix, n, args.decode, mode, f"b{n}{mode}{r}"))
        ctx = P + 16 + args.decode / 2  # mean context during the counted steps
        row = {"sessions": n, "pool": P}
        for mode in ("off", "on"):
            step_s = statistics.median(x["step_s"] for x in runs[mode])
            kv_tokens = n * ctx if (mode == "off" or n < 2) else P + n * (ctx - P)
            row[f"step_ms_{mode}"] = 1e3 * step_s
            row[f"tps_session_{mode}"] = 1.0 / step_s
            row[f"tps_aggregate_{mode}"] = n / step_s
            row[f"gbps_{mode}"] = (weight_bytes + kv_tokens * bpt) / step_s / 1e9
            row[f"cascade_steps_{mode}"] = sum(x["cascade_steps"] for x in runs[mode])
            row[f"steps_{mode}"] = sum(x["steps"] for x in runs[mode])
        row["speedup"] = row["tps_aggregate_on"] / row["tps_aggregate_off"]
        same_tokens = sum(a == b for a, b in zip(runs["on"][0]["tokens"], runs["off"][0]["tokens"]))
        row["greedy_agreement_on_off"] = f"{same_tokens}/{n}"
        results.append(row)
        rows.append((f"N={n}", row["step_ms_off"], row["step_ms_on"], row["tps_aggregate_off"],
                     row["tps_aggregate_on"], row["speedup"], row["gbps_off"], row["gbps_on"]))
        used_ok = row["cascade_steps_off"] == 0 and (n < 2 or row["cascade_steps_on"] == row["steps_on"])
        report.add(f"bench/decode N={n} P={P}", "PASS" if used_ok else "FAIL",
                   f"agg tok/s off {row['tps_aggregate_off']:.0f} on {row['tps_aggregate_on']:.0f} "
                   f"(x{row['speedup']:.2f}); per-session {row['tps_session_off']:.0f}/{row['tps_session_on']:.0f}; "
                   f"GB/s {row['gbps_off']:.0f}/{row['gbps_on']:.0f}; cascade steps on {row['cascade_steps_on']}/"
                   f"{row['steps_on']}; greedy on==off {row['greedy_agreement_on_off']} sessions")
    eng.release_pool(pool.pool_id)
    print_table(["case", "step ms off", "step ms on", "agg tok/s off", "agg tok/s on", "on/off", "GB/s off", "GB/s on"],
                rows, title=f"Decode, {P}-token pool, cascade off vs on ({'DRY RUN: reference kernels' if args.dry_run else 'FlashInfer'})")
    report.data["decode"] = results
    report.data["weight_bytes"] = weight_bytes
    report.data["kv_bytes_per_token"] = bpt


# ============================================================================ main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU, torch reference kernels, small sizes")
    p.add_argument("--model", default="shape", choices=["shape", "default"],
                   help="shape: random weights, SmolLM2-135M shapes; default: the bundled model")
    p.add_argument("--pool", type=int, default=None, help="pool tokens for the decode benchmark (2048)")
    p.add_argument("--sessions", type=int, nargs="+", default=None, help="N values (1 8 32)")
    p.add_argument("--decode", type=int, default=None, help="decode tokens per session and run (32)")
    p.add_argument("--repeats", type=int, default=None, help="runs per (N, mode), alternating (2)")
    p.add_argument("--greedy-tokens", type=int, default=None, help="tokens of the greedy check (32)")
    p.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--tol", type=float, default=3e-2,
                   help="max |diff| vs the fp32 torch reference (bf16 rounding of outputs and of each merged level)")
    p.add_argument("--budget-s", type=float, default=360.0,
                   help="skip the optional section 4 when this many seconds have passed")
    p.add_argument("--multilevel", default="auto", choices=["auto", "on", "off"],
                   help="section 4 (MultiLevelCascadeAttentionWrapper, CUDA-core decode: each may JIT another module)")
    p.add_argument("--out", default=None, help=f"JSON path (default {RESULTS_DIR}/gpu_check[_dry].json)")
    args = p.parse_args(argv)
    big = not args.dry_run
    args.pool = args.pool or (2048 if big else 256)
    args.sessions = args.sessions or ([1, 8, 32] if big else [1, 4])
    args.decode = args.decode or (32 if big else 4)
    args.repeats = args.repeats or (2 if big else 1)
    args.greedy_tokens = args.greedy_tokens or (32 if big else 6)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    report = Report()
    if args.dry_run:
        args.device = torch.device("cpu")
        torch.manual_seed(0)
    else:
        if not torch.cuda.is_available():
            print("gpu_check: CUDA is not available (use --dry-run on a CPU machine)", file=sys.stderr)
            return 2
        args.device = torch.device("cuda")
    torch.manual_seed(0)
    info = machine_info()
    try:
        import flashinfer
        fi_version = getattr(flashinfer, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        fi_version = f"not importable ({type(e).__name__}: {e})"
    log(describe_machine(info) + f"; flashinfer {fi_version}")
    report.add("env", "INFO", f"{'DRY RUN (CPU, reference kernels)' if args.dry_run else info['cuda']}; "
                              f"torch {torch.__version__}; flashinfer {fi_version}")
    if not args.dry_run and fi_version.startswith("not importable"):
        report.add("env/flashinfer import", "FAIL", fi_version)
    else:
        report.guard("kernels", kernel_checks, args, report)
        eng = report.guard("engine", make_engine, args, report)
        if eng is not None:
            report.guard("engine/greedy pooled == unpooled", greedy_check, args, report, eng)
            report.guard("bench/decode", decode_bench, args, report, eng)
            eng.shutdown()
        if args.multilevel == "off" or (args.multilevel == "auto" and report.elapsed() > args.budget_s):
            report.add("kernels/multilevel-wrapper", "SKIP", f"--multilevel {args.multilevel}, {report.elapsed():.0f} s used")
        else:
            report.guard("kernels/multilevel-wrapper", multilevel_check, args, report)
            report.guard("kernels/decode cuda-cores", cuda_core_decode_check, args, report)
            report.guard("probe/multilevel-wrapper with empty groups", empty_group_probe, args, report)
    print(report.summary(), flush=True)
    out = args.out or str(RESULTS_DIR / f"gpu_check{'_dry' if args.dry_run else ''}.json")
    path = write_json("gpu_check", {"machine": info, "flashinfer": fi_version, "dry_run": args.dry_run,
                                    "args": {k: (str(v) if isinstance(v, torch.device) else v)
                                             for k, v in vars(args).items()},
                                    "checks": report.checks, **report.data}, out)
    print(f"results: {path}")
    return 1 if report.num_failed else 0


if __name__ == "__main__":
    sys.exit(main())
