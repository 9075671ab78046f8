"""Choosing and building the weight format of the forward pass (``EngineConfig.weights``).

* ``fp32`` | ``bf16`` | ``int8`` | ``int4``: that format for every projection (q/k/v, o,
  gate/up, down, lm_head); embeddings and norms stay in the activation dtype. Each projection
  shape gets the fastest kernel of the format on this machine (``autotune.py``).
* ``auto``: the fastest format that passes the accuracy gate, by real steps of the real model
  (``choose.py``). Models whose projection weights are under ``AUTO_MIN_BYTES`` in fp32 stay fp32
  (they sit in cache: nothing to gain). Otherwise each quantized format is checked against an fp32
  reference on :data:`GATE_TEXT` (it passes when it keeps perplexity within 3 % of fp32 and agrees
  with fp32's greedy top-1 on >= 95 % of the positions, both with the projections run on the whole
  text at once, as a prefill does, and one row at a time, as decode steps do); fp32 and the formats that pass run real
  decode and prefill steps, and the cheapest reference agent turn wins. Gate results and the
  choice are cached per machine, model and kernels (next to the kernel timings), so later loads
  build only the chosen format.

The output projection (the largest GEMM of a step) of a quantized format takes 16-bit weights
when they are measured faster for its shape than 8-bit ones (:func:`head_format`), else int8.

GGUF sources: Q4_0 / Q4_1 / Q4_K tensors become int4 directly from their blocks (exact, no
float round trip); other types and HF checkpoints are quantized from the float weights at load. A
Q8_0 input embedding is looked up in its own blocks (``embedding.py``: the same rows as the float
table, a quarter of its bytes), shared by every format built.
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import logging
import math
import time
from pathlib import Path

import torch

from . import kernels
from .autotune import Autotuner
from .embedding import gguf_embedding
from .gate_text import GATE_TEXT
from .gguf_memory import GGUF_MEMORY_FACTOR, own_format  # noqa: F401 - re-exported (weights.own_format)
from .gguf_memory import (available_mb, gguf_candidates, head_16bit_fits, memory_against_file, own_summary,
                          projection_sources, resident_mb)
from .gguf_weights import GGUFWeight, gguf_format
from .llama import LlamaForward, ModelDims, default_head_format
from .threads import ThreadAdapter
from ..paths import cache_root

log = logging.getLogger("opencoti.engine")

WEIGHT_FORMATS = ("auto",) + kernels.FORMATS
AUTO_MIN_BYTES = 64 << 20
GATE_TOKENS = 256
GATE_KL_MAX = 0.03  # nats per position (about the old 3 % perplexity tolerance)
GATE_TOP1_MIN = 0.95
GATE_CLEAR_MARGIN = 0.1  # reference top-1 minus top-2 probability for a position's greedy token to count
# the gate's fp32 reference is built only when its weights take at most this share of available memory
GATE_REFERENCE_SHARE = 0.25


def check_format(weights: str) -> str:
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {'|'.join(WEIGHT_FORMATS)}, got {weights!r}")
    return weights


def release_memory(collect: bool = True) -> bool:
    """Collect garbage (``collect``) and hand the C allocator's free memory back to the OS (glibc's
    ``malloc_trim``). Start-up frees more than it keeps: ``auto`` builds every candidate format
    and the accuracy gate's fp32 reference, and times each on its own paged cache; the allocator
    keeps the freed heap resident (1.1 GiB of the bundled model's first start on a 2-core EPYC)
    unless asked. True when memory was given back."""
    if collect:
        gc.collect()
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS, Windows): nothing to ask
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))


def gate_metrics(ref_logits: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor, top1_positions: int) -> dict:
    """What a weight format changes in the next-token distributions of ``ids`` (teacher forcing), against
    ``ref_logits``: the mean KL divergence ``KL(ref || format)`` in nats (every position, weighted by
    probability: near-ties cannot flip it), perplexity of both and their ratio, and the share of the
    first ``top1_positions`` positions where the greedy token is the same, counted only where the
    reference's top-1 probability beats its second by at least :data:`GATE_CLEAR_MARGIN` (a near tie is
    a coin toss for any format, the file's own included). Passes with KL <= :data:`GATE_KL_MAX` and
    clear-margin agreement >= :data:`GATE_TOP1_MIN`."""
    F = torch.nn.functional
    targets = ids[1:].to(ref_logits.device)
    ref, cand = ref_logits.float(), logits.float().to(ref_logits.device)
    ppl_ref = math.exp(F.cross_entropy(ref[:-1], targets).item())
    ppl = math.exp(F.cross_entropy(cand[:-1], targets).item())
    ref_lp, cand_lp = F.log_softmax(ref, -1), F.log_softmax(cand, -1)
    kl = (ref_lp.exp() * (ref_lp - cand_lp)).sum(-1).mean().item()
    n = min(top1_positions, cand.shape[0])
    top2 = ref_lp[:n].exp().topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) >= GATE_CLEAR_MARGIN
    same = ref[:n].argmax(-1) == cand[:n].argmax(-1)
    agree_clear = same[clear].float().mean().item() if bool(clear.any()) else 1.0
    return {"kl": kl, "ppl_fp32": ppl_ref, "ppl": ppl, "ppl_ratio": ppl / ppl_ref,
            "top1_agreement": same.float().mean().item(), "top1_agreement_clear": agree_clear,
            "clear_positions": int(clear.sum()), "tokens": int(ids.shape[0]), "top1_positions": n,
            "passed": kl <= GATE_KL_MAX and agree_clear >= GATE_TOP1_MIN}


def _cache_file(cache_dir) -> Path | None:
    try:
        return cache_root(cache_dir) / "autotune.json"
    except Exception:  # noqa: BLE001 - no usable cache dir: measure every time
        return None


def build_forward(loaded, *, weights: str = "auto", dtype: torch.dtype, device, max_positions: int,
                  cache_dir=None, progress=None, adapt_threads: bool = True,
                  saved_kv: dict[str, int] | None = None) -> LlamaForward:
    """The forward pass of ``loaded`` (a ``LoadedModel``) with projection weights in ``weights``.

    ``adapt_threads``: on CPU, a ``ThreadAdapter`` picks the torch thread count around each step
    (pass False when the thread count was set explicitly). ``saved_kv``: how many KV files of a state
    directory each weight format computed (``auto`` keeps that format rather than measuring again
    after a disturbed measurement, so the files stay loadable). The result's ``weights_info`` says
    what was chosen and why."""
    check_format(weights)
    say = progress or (lambda _msg: None)
    device = torch.device(device)
    threads = ThreadAdapter() if adapt_threads and device.type == "cpu" else None
    tuner = Autotuner(device, dtype, _cache_file(cache_dir))
    hf, state = loaded.hf_config, loaded.state_dict
    gguf_path = getattr(loaded, "source_gguf", None)
    embed_src = state["model.embed_tokens.weight"]
    # a GGUF's embedding stays in the file's own blocks (rows decoded when looked up), shared by every format built
    embedding = gguf_embedding(embed_src, dtype, device) if isinstance(embed_src, GGUFWeight) else None

    chooser = kernel_chooser(tuner, hf, device, dtype)
    head_src = projection_sources(loaded)[-1]  # the output head's weight (lm_head, or the tied embedding)

    def own_head(fmt: str) -> bool:
        return fmt == "int4" and isinstance(head_src, GGUFWeight) and gguf_format([head_src], "int4", device) == "int4"

    def make(fmt: str) -> LlamaForward:
        # a GGUF head that int4 serves from the file's own blocks (4-bit, or Q6_K as stored) is not timed
        head = "int4" if own_head(fmt) else head_format(tuner, fmt, hf)
        if head == "bf16" and gguf_path is not None and not head_16bit_fits(loaded, fmt):
            head = default_head_format(fmt)  # faster, but a 16-bit head would take the model past the file's size
        return LlamaForward(hf, state, dtype=dtype, device=device, max_positions=max_positions, weights=fmt,
                            choose_kernel=chooser, threads=threads, head_format=head, embedding=embedding)

    choice: dict = {"requested": weights}
    if weights != "auto":
        say(f"preparing {weights} weights")
        model = make(weights)
        choice["reason"] = "requested"
    else:
        model = _auto(loaded, make, tuner, device, say, choice, saved_kv or {})
    tuner.save()
    if gguf_path is not None:
        memory_against_file(model, loaded, choice, say)
    model.weights_choice = choice
    info = model.weights_info
    msg = (f"weights: {model.weights} ({choice['reason']}); {info['weight_bytes'] / 1e6:.1f} MB per step; "
           f"kernels {', '.join(f'{s}={k}' for s, k in info['kernels'].items())}")
    log.info(msg)
    say(msg)
    return model


def head_format(tuner: Autotuner, fmt: str, hf) -> str:
    """The output projection's format for projections in ``fmt``. A quantized format keeps the head
    in 8 bits by default (an int4 head fails the accuracy gate), but where 16-bit weights (``bf16``:
    FBGEMM's fp16 GEMM on CPUs without a bf16 GEMM) are measured faster for the head's shape, it
    takes those: as accurate as fp32 for the largest single GEMM of a step. On SmolLM2 (49152x576)
    on a 2-core AVX2 EPYC: fp16 10.1 / 25.1 ms at batch 1 / 8 vs int8 16.3 / 45.5 (1 thread)."""
    base = default_head_format(fmt)
    if fmt not in ("int8", "int4"):
        return base
    d = ModelDims.from_hf_config(hf)
    n, k = d.vocab_size, d.hidden_size
    cost = {}
    for f in (base, "bf16"):
        try:
            timings = tuner.timings(f, n, k)
            name = tuner.choose(f, n, k)
        except (RuntimeError, ValueError):
            continue
        if name in timings:
            cost[f] = _head_cost(timings[name])
    return min(cost, key=lambda f: cost[f]) if len(cost) == 2 else base


def _head_cost(timings: list[float]) -> float:
    """The output projection runs on the rows that need logits only (one per sequence even in a
    prefill step): its decode-sized timings count, not the prefill chunk's."""
    return sum(timings[:2])


def _projection_shapes(hf) -> list[tuple[int, int]]:
    d = ModelDims.from_hf_config(hf)
    q, kv = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
    per_layer = [(q + 2 * kv, d.hidden_size), (d.hidden_size, q), (2 * d.intermediate_size, d.hidden_size),
                 (d.hidden_size, d.intermediate_size)]
    return per_layer * d.num_layers + [(d.vocab_size, d.hidden_size)]


def kernel_chooser(tuner: Autotuner, hf, device, dtype: torch.dtype):
    """``choose_kernel(fmt, n, k)`` for a model's projections: the tuner's per-shape choice, except that
    where every layer's projections can run native kernels in one fused decode call (CPU, fp32
    activations, no q/k norm: ``fused.prepare``), the layer shapes prefer the native kernel while it is
    within ``autotune.PREFER_MARGIN`` of the fastest (measured: on this project's AVX-512 box
    torch's int4 kernel won the per-shape sum by ~8 % on three shapes, all prefill, which took the
    whole decode step off the fused path). The rest of what the fused step needs (the torch attention
    backend with native kernels, a plain plan rather than a cascade one, a KV dtype the kernels read)
    is decided per step, not here: where it is missing the preference costs up to the margin on the
    layer shapes for no gain."""
    d = ModelDims.from_hf_config(hf)
    fused = torch.device(device).type == "cpu" and dtype == torch.float32 and not d.qk_norm
    layer_shapes = set(_projection_shapes(hf)[:4])
    prefer = {"int4": "native_q4", "int8": "native_q8"}

    def choose_kernel(fmt: str, n: int, k: int) -> str:
        p = prefer.get(fmt) if fused and (n, k) in layer_shapes else None
        return tuner.choose(fmt, n, k, prefer=p)
    return choose_kernel


def _kernel_signature(tuner: Autotuner, fmt: str, counts: dict, hf, chooser) -> str:
    return ",".join(chooser(fmt, n, k) for n, k in counts) + f" head={head_format(tuner, fmt, hf)}"


def _rounded(m: dict) -> dict:
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in m.items()}


def _gate(fmt: str, entry: str, tuner: Autotuner, make, reference) -> tuple[dict, "LlamaForward | None"]:
    """The accuracy gate's result for ``fmt`` (cached per machine, model and kernels) and, when it
    passes, the model in that format."""
    m = tuner.remembered(entry)
    if m is not None:
        return {**m, "cached": True}, (make(fmt) if m["passed"] else None)
    ref_logits, ids = reference()
    model = make(fmt)
    m = _rounded(gate_metrics(ref_logits, model.dense_logits(ids), ids, GATE_TOKENS))
    # the same text through the projections one row at a time: the kernels decode steps use
    dec = _rounded(gate_metrics(ref_logits, model.dense_logits(ids, rows_per_call=1), ids, GATE_TOKENS))
    m["decode_path"] = {k: dec[k] for k in ("kl", "top1_agreement_clear", "passed")}
    m["passed"] = m["passed"] and dec["passed"]
    tuner.remember(entry, m)
    return m, (model if m["passed"] else None)


def _auto(loaded, make, tuner: Autotuner, device, say, choice: dict, saved_kv: dict[str, int]) -> LlamaForward:
    """See ``choose.py``: every format that passes the accuracy gate runs real steps; the cheapest
    reference agent turn wins; the choice is kept per machine unless it was measured under load."""
    from .. import native
    from . import choose
    from .threads import usable_cpus

    hf = loaded.hf_config
    shapes = _projection_shapes(hf)
    fp32_bytes = sum(n * k * 4 for n, k in shapes)
    if fp32_bytes < AUTO_MIN_BYTES and getattr(loaded, "source_gguf", None) is None:  # a GGUF keeps its precision
        choice["reason"] = f"auto: {fp32_bytes / 2**20:.1f} MiB of fp32 projection weights stay in cache"
        return make("fp32")
    counts = {s: shapes.count(s) for s in sorted(set(shapes))}
    sigs = {}
    chooser = kernel_chooser(tuner, hf, device, tuner.act_dtype)  # the one make() uses
    own: str | None = None
    formats: tuple[str, ...] = kernels.FORMATS
    if getattr(loaded, "source_gguf", None) is not None:  # only the formats that fit the file's size are timed
        own, formats = gguf_candidates(loaded, device, choice, say)
        if len(formats) == 1:  # nothing to choose between: no kernel signatures, no timing of other formats
            choice["reason"] = (f"auto: {own}, the file's own precision (" + own_summary(choice) + "); the only "
                                f"format whose weights fit in {GGUF_MEMORY_FACTOR}x the file's size")
            return make(own)
    say("auto weights: choosing the kernels of each format (cached per machine) ...")
    for f in formats:  # a format no kernel here serves (e.g. int4 on some torch builds) is left out
        try:
            sigs[f] = _kernel_signature(tuner, f, counts, hf, chooser)
        except (RuntimeError, ValueError) as exc:
            log.info("auto weights: %s is not available here: %s", f, exc)
    if own is not None:
        if not sigs:
            raise RuntimeError(f"no kernel here serves the formats that fit {loaded.source_gguf} ({', '.join(formats)})")
        if len(sigs) == 1:
            fmt = next(iter(sigs))
            choice["reason"] = (f"auto: {fmt}, the file's own precision (" + own_summary(choice) + "); the only "
                                f"format whose weights fit in {GGUF_MEMORY_FACTOR}x the file's size")
            return make(fmt)
    fingerprint = _fingerprint(loaded)
    threads = torch.get_num_threads() if device.type == "cpu" else 0
    sig_hash = hashlib.sha256(repr(sorted(sigs.items())).encode()).hexdigest()[:12]
    key = f"choice {fingerprint} threads={threads} native={native.build_id()} kernels={sig_hash}"
    choice["weighting"] = choose.WEIGHTING
    kept = tuner.remembered(key)
    if kept is not None and kept.get("kept") and kept.get("disturbed"):
        # kept after MAX_ATTEMPTS disturbed measurements: used for RETRY_AFTER starts, then measured again
        kept["starts"] = kept.get("starts", 0) + 1
        if kept["starts"] > choose.RETRY_AFTER:
            kept = {**kept, "kept": False, "attempts": 0}
        tuner.remember(key, kept)
    if kept is not None and kept.get("kept"):
        fmt = kept["format"]
        choice.update(measured=kept.get("measured", {}), gate=kept.get("gate", {}), cached=True,
                      reason=f"auto: {fmt} ran the reference agent turn fastest of the formats passing the "
                             f"accuracy gate (measured on this machine earlier, cached)")
        return make(fmt)
    saved = max(saved_kv, key=lambda f: saved_kv[f]) if saved_kv else None
    if saved in sigs and (kept is None or saved == kept.get("format") or not kept.get("kept")):
        # a restart over saved KV (pinned pools, named sessions) that no quiet measurement contradicts:
        # switching formats would make every file unloadable (recomputed on first use)
        say(f"auto weights: using {saved}, the format of the {saved_kv[saved]} saved KV file(s) in the state directory")
        choice.update(measured=(kept or {}).get("measured", {}), gate=(kept or {}).get("gate", {}), cached=True,
                      saved_kv_files=saved_kv[saved],
                      reason=f"auto: {saved}, the weight format that computed the {saved_kv[saved]} KV file(s) saved "
                             "in the state directory (a measured choice would make them unloadable; "
                             "pass --weights to choose otherwise)")
        return make(saved)
    if kept is not None and kept.get("format") in sigs and (busy := choose.busy_now(usable_cpus())) is not None:
        # measured under load before and the machine is busy now too: a restart (after a crash, say)
        # uses the earlier choice at once, which also keeps KV files saved under it valid
        fmt = kept["format"]
        say(f"auto weights: other processes use {busy:.2f} cores; using {fmt}, measured earlier under load")
        choice.update(measured=kept.get("measured", {}), gate=kept.get("gate", {}), cached=True,
                      disturbed=kept.get("disturbed"), other_processes_cores=round(busy, 2),
                      reason=f"auto: {fmt}, measured earlier under load; other processes use {busy:.2f} cores now, "
                             "so it is measured again at a quieter start")
        return make(fmt)
    if kept is not None:
        say(f"auto weights: the last measurement was disturbed ({kept.get('disturbed')}); measuring again")
    ref_state: dict = {}

    reference_mb = resident_mb(loaded, "fp32") if own is not None else 0.0
    reference_ok = own is None or reference_mb <= GATE_REFERENCE_SHARE * available_mb()

    def reference():
        if not ref_state:
            say("auto weights: building the fp32 reference for the accuracy gate ...")
            ref_state["model"] = make("fp32")
            ids = torch.tensor(loaded.tokenizer.encode(GATE_TEXT)[:min(GATE_TOKENS, ref_state["model"].max_positions)],
                               dtype=torch.long)
            ref_state["ids"], ref_state["logits"] = ids, ref_state["model"].dense_logits(ids)
        return ref_state["logits"], ref_state["ids"]

    gate: dict = {}
    models: dict = {}
    for fmt in kernels.FORMATS:
        if fmt == "fp32" or fmt not in sigs:
            continue
        if fmt == own and not reference_ok:  # the file's own blocks need no gate for the weights
            gate[fmt] = {"passed": True, "exempt": "the file's own blocks; the fp32 reference "
                         f"({reference_mb:.0f} MB) does not fit in {GATE_REFERENCE_SHARE:.0%} of available memory"}
            models[fmt] = make(fmt)
            continue
        if not reference_ok:
            gate[fmt] = {"passed": False, "reason": f"not checked: the fp32 reference ({reference_mb:.0f} MB) does not "
                         f"fit in {GATE_REFERENCE_SHARE:.0%} of available memory"}
            continue
        gate[fmt], model = _gate(fmt, f"gate2 {fingerprint} {fmt} {sigs[fmt]} native={native.build_id()}", tuner,
                                 make, reference)
        if fmt == own and not gate[fmt]["passed"]:  # reported, not held against the file's own blocks
            gate[fmt] = {**gate[fmt], "passed": True, "exempt": "the file's own blocks"}
            model = model or make(fmt)
        if model is None:
            say(f"auto weights: {fmt} fails the accuracy gate (KL {gate[fmt]['kl']:.4f} nats, "
                f"top-1 {gate[fmt]['top1_agreement_clear']:.1%} where the reference is clear)")
        else:
            models[fmt] = model
    if "fp32" in sigs:
        models["fp32"] = ref_state.pop("model", None) or make("fp32")
    ref_state.clear()
    release_memory()
    choice["gate"] = gate
    say(f"auto weights: timing real decode and prefill steps of {', '.join(models)} ...")
    cpu0, t0 = choose.cpu_seconds(), time.perf_counter()
    times = choose.time_steps(models)
    others = choose.others_load(cpu0, choose.cpu_seconds(), time.perf_counter() - t0)
    fmt = choose.decide(times, {f: g["passed"] for f, g in gate.items()})
    why = choose.disturbed(times, others, usable_cpus())
    measured = {f: t.as_dict() for f, t in times.items()}
    attempts = (kept or {}).get("attempts", 0) + 1
    keep = why is None or attempts >= choose.MAX_ATTEMPTS  # a machine that is never quiet: keep the last one
    tuner.remember(key, {"format": fmt, "measured": measured, "gate": gate, "kept": keep, "disturbed": why,
                         "attempts": attempts, "other_processes_cores": round(others, 2)})
    choice.update(measured=measured, other_processes_cores=round(others, 2))
    if why is not None:
        choice["disturbed"] = why
        log.warning("auto weights: measured under load (%s); using %s, %s", why, fmt,
                    "kept after %d disturbed measurements" % attempts if keep else "measuring again at the next start")
    g = gate.get(fmt)
    acc = (f" (KL {g['kl']:.4f} nats vs fp32, top-1 agreement {g['top1_agreement_clear']:.1%} where fp32 is "
           "clear)" if g and "kl" in g else "")
    choice["reason"] = (f"auto: {fmt} ran the reference agent turn fastest ({times[fmt].cost() * 1e3:.1f} ms; "
                        f"decode {1 / times[fmt].decode_1:.0f} tok/s alone) of the formats passing the accuracy "
                        f"gate{acc}")
    chosen = models.pop(fmt)
    models.clear()
    return chosen


def _fingerprint(loaded) -> str:
    """Identifies a model's weights for cached gate results and choices: its config, a sample of its
    embeddings and of every projection of its first layer (two quantizations of one model share
    embeddings, not projections), and whether int4 comes from a GGUF's own blocks. Not its name: the
    same GGUF served as ``--model file.gguf`` and as the bundled model (two names) is one model and
    gets one choice."""
    h = hashlib.sha256(loaded.hf_config.to_json_string(use_diff=False).encode())
    h.update(b"gguf2" if getattr(loaded, "source_gguf", None) is not None else b"dir")
    state = loaded.state_dict
    names = ["model.embed_tokens.weight"] + sorted(n for n in state if n.startswith("model.layers.0.")
                                                     and n.endswith("proj.weight"))
    for name in names:
        h.update(name.encode())
        t = state[name]
        if isinstance(t, GGUFWeight):
            h.update(f"{t.type_name}".encode() + t.sample())
        else:
            h.update(t.reshape(-1)[:4096].float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]
