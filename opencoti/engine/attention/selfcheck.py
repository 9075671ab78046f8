"""A start-up self-check of an attention backend against the torch backend, on the real model.

On a CUDA device, an attention backend other than torch (FlashInfer) is trusted only after it
has computed a few real engine steps of the engine's own model -- prefill in chunks over a cached
prefix, a sequence reading another's pages (a pool), batched decode with and without
shared-prefix attention -- and given the same logits as the torch backend on the same device, the
same weights and the same token ids (the torch backend's greedy tokens are fed to both, so the two
never drift apart). A backend that fails, or raises, is replaced by the torch backend with a
warning. On CPU the torch backend is the reference itself: nothing is checked.

Tolerance. Per logits row, ``max |candidate - reference| / max |reference|``. Two correct kernels
differ by rounding (bf16 keeps an 8-bit mantissa, machine epsilon 2^-7), and how far that moves
the logits depends on the model (its depth, the size of its logits) and the device, so the check
measures it: a third run is the torch backend with every attention output value scaled by
``1 + u``, ``u`` uniform in +-epsilon (:class:`_Rounded`), and a step's tolerance is
:data:`NOISE_FACTOR` (2) times the largest error that run has shown so far, but never less than
:data:`FLOOR` (bf16 0.02, fp16 0.003, fp32 1e-4). A misused kernel API (a wrong page table, KV
layout, causal offset or GQA head mapping) changes the attention output by its own size, about
2^7 times that rounding. Measured on CPU in bf16 (``scripts/selfcheck_margin.py``, output in
``scripts/selfcheck_margin.json``): FlashInfer's wrappers over torch stand-in kernels (correct,
rounding differently) stay well under the tolerance, a softmax scale 10 % off exceeds it. The
candidate's greedy token must also be one the reference ranks within the tolerance of its best.

The verdict is cached in ``<cache>/attention_check.json`` per device (name, compute capability),
versions (torch, flashinfer, opencoti), model fingerprint, dtype, page size and backend, so the
check runs once per installation and model. ``OPENCOTI_ATTENTION_CHECK=force`` runs it again;
``OPENCOTI_ATTENTION_CHECK=0`` skips it (the backend is used unchecked, and the verdict says so).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
import time
from typing import Any
from pathlib import Path

import torch

from .base import SeqBatchEntry, build_metadata
from ..paths import cache_root

log = logging.getLogger("opencoti.attention")

FLOOR = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-4}  # the least tolerance per dtype
NOISE_FACTOR = 2
METRIC = "max |candidate - reference| / max |reference| per logits row"
CACHE_FILE = "attention_check.json"
DECODE_STEPS = 4
# three sequences: A (prefilled in two chunks), B (short), C (reads A's first pages, as a pool member)
PROMPT_A, CHUNK_A, PROMPT_B, SHARED_C, SUFFIX_C = 45, 24, 7, 32, 5


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} (sm_{cap[0]}{cap[1]})"
    return device.type


def model_fingerprint(model, name: str = "") -> str:
    """Name, dimensions, weight format, dtype and a sample of the embedding table of ``model``."""
    h = hashlib.sha256(f"{name}|{model.dims}|{model.weights}|{model.dtype}".encode())
    emb = model.embed
    sample = torch.cat([emb[:4].flatten(), emb[-4:].flatten()]).float().cpu()
    h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]


def cache_key(candidate, model, device: torch.device, page_size: int, model_name: str = "") -> str:
    from ... import __version__

    fi = _version("flashinfer-python") or _version("flashinfer")
    return (f"{device_name(device)} | torch {torch.__version__} | flashinfer {fi} | opencoti {__version__} | "
            f"model {model_fingerprint(model, model_name)} | {str(model.dtype).replace('torch.', '')} | "
            f"page {page_size} | {type(candidate).__name__}")


class _Run:
    """One backend's own paged cache, and the steps of the check computed with it."""

    def __init__(self, backend, model, num_pages: int, page_size: int):
        d = model.dims
        shape = (d.num_layers, num_pages, page_size, d.num_kv_heads, d.head_dim)
        self.backend, self.model, self.page_size = backend, model, page_size
        self.k = torch.zeros(shape, dtype=model.dtype, device=model.device)
        self.v = torch.zeros(shape, dtype=model.dtype, device=model.device)

    def step(self, entries: list[SeqBatchEntry], ids: list[int]) -> torch.Tensor:
        dev = self.model.device
        meta = build_metadata(entries, self.page_size, dev)
        rows = torch.arange(len(ids), device=dev)
        return self.model._forward(torch.tensor(ids, dtype=torch.int64, device=dev), meta, self.k, self.v,
                                   self.backend, rows)


def _steps(model, page_size: int, seed: int):
    """The check's steps: ``(name, [(sequence, entry)], token ids, cascade)``. A decode step's ids are
    None: each sequence's greedy token from the reference's last row of it. ``cascade``: the
    candidate's mode for the step (None: as configured)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.dims.vocab_size

    def toks(n):
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    next_page = [1]  # page 0 left unused, as in the engine

    def table(n_tokens):
        n = -(-n_tokens // page_size)
        next_page[0] += n
        return list(range(next_page[0] - n, next_page[0]))

    shared = (SHARED_C // page_size) * page_size  # C reads A's first pages, whole pages only
    a_ids, b_ids = toks(PROMPT_A), toks(PROMPT_B)
    c_ids = a_ids[:shared] + toks(SUFFIX_C)
    ta = table(PROMPT_A + DECODE_STEPS)
    tb = table(PROMPT_B + DECODE_STEPS)
    tc = ta[:shared // page_size] + table(len(c_ids) - shared + DECODE_STEPS)
    Step = tuple[str, list[tuple[str, SeqBatchEntry]], "list[int] | None", "str | None"]
    steps: list[Step] = [("prefill A (chunk 1)", [("A", SeqBatchEntry(ta, 0, CHUNK_A))], a_ids[:CHUNK_A], None),
             ("prefill A (chunk 2, cached prefix) + B", [("A", SeqBatchEntry(ta, CHUNK_A, PROMPT_A - CHUNK_A)),
                                                         ("B", SeqBatchEntry(tb, 0, PROMPT_B))],
              a_ids[CHUNK_A:] + b_ids, None),
             ("prefill C over A's pages", [("C", SeqBatchEntry(tc, shared, len(c_ids) - shared))], c_ids[shared:],
              None)]
    lens = {"A": PROMPT_A, "B": PROMPT_B, "C": len(c_ids)}
    for i in range(DECODE_STEPS):
        mode = "on" if i % 2 else None  # every other decode step with shared-prefix attention forced on
        steps.append((f"decode {i + 1} (A, B, C)" + (", cascade" if mode else ""),
                      [(s, SeqBatchEntry(t, lens[s], 1)) for s, t in (("A", ta), ("B", tb), ("C", tc))], None, mode))
        lens = {s: n + 1 for s, n in lens.items()}
    return steps, next_page[0]


class _Rounded:
    """The reference backend with its attention output rounded differently: each value scaled by
    ``1 + u``, ``u`` uniform in +-(the dtype's machine epsilon) -- what a correct kernel that rounds
    or accumulates in another order may do. The logits it gives measure the model's noise floor."""

    name = "torch (rounded)"

    def __init__(self, backend, dtype: torch.dtype, device: torch.device, seed: int):
        self.backend, self.eps = backend, torch.finfo(dtype).eps
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def plan(self, meta, **kw) -> None:
        self.backend.plan(meta, **kw)

    def forward(self, layer, q, k, v, k_cache, v_cache, meta, scale):
        out = self.backend.forward(layer, q, k, v, k_cache, v_cache, meta, scale)
        u = torch.rand(out.shape, generator=self.gen, device=out.device, dtype=torch.float32) * 2 - 1
        return (out.float() * (1 + self.eps * u)).to(out.dtype)


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((got - ref).abs().amax(dim=-1) / ref.abs().amax(dim=-1).clamp_min(1e-6)).max())


def check_backend(candidate, reference, model, *, page_size: int = 16, seed: int = 0) -> dict:
    """Run the check's steps with ``candidate``, ``reference`` and the reference with its attention
    output rounded differently (:class:`_Rounded`), each over its own paged cache, on ``model``'s
    device; returns the verdict (``passed``, ``max_rel_err``, ``tolerance``, ``steps``, ``error``).
    A step's tolerance is ``max(FLOOR, NOISE_FACTOR x the rounded reference's error so far)``. An
    exception raised by the candidate is a failed verdict, not an error here."""
    floor = FLOOR.get(model.dtype, FLOOR[torch.bfloat16])
    verdict: dict[str, Any] = {
        "backend": getattr(candidate, "name", type(candidate).__name__), "implementation": type(candidate).__name__,
               "reference": getattr(reference, "name", type(reference).__name__), "device": device_name(model.device),
               "dtype": str(model.dtype).replace("torch.", ""), "page_size": page_size, "metric": METRIC,
               "rule": f"max(floor {floor}, {NOISE_FACTOR} x the error of the torch backend rounded differently)",
               "passed": False, "max_rel_err": None, "tolerance": None, "noise": None, "steps": [], "error": None}
    t0 = time.perf_counter()
    steps, num_pages = _steps(model, page_size, seed)
    runs = [_Run(b, model, num_pages, page_size)
            for b in (reference, _Rounded(reference, model.dtype, model.device, seed), candidate)]
    cascade0 = getattr(candidate, "cascade", None)
    worst, noise, tol = 0.0, 0.0, floor
    greedy: dict[str, int] = {}
    try:
        for name, seqs, ids, mode in steps:
            entries = [e for _, e in seqs]
            if ids is None:
                ids = [greedy[s] for s, _ in seqs]
            ref, rounded = runs[0].step(entries, ids), runs[1].step(entries, ids)
            noise = max(noise, _rel_err(rounded, ref))
            tol = max(floor, NOISE_FACTOR * noise)
            if mode is not None and cascade0 not in (None, "off"):
                candidate.cascade = mode
            try:
                got = runs[2].step(entries, ids)
            finally:
                if cascade0 is not None:
                    candidate.cascade = cascade0
            if got is None or got.shape != ref.shape or not torch.isfinite(got).all():
                raise ValueError(f"{name}: the backend gave {'no' if got is None else 'non-finite or misshaped'} logits")
            err = _rel_err(got, ref)
            # the candidate's greedy token must be one the reference ranks within the tolerance of its best
            chosen = ref.gather(1, got.argmax(dim=-1, keepdim=True)).squeeze(1)
            greedy_ok = bool(((ref.amax(dim=-1) - chosen) <= tol * ref.abs().amax(dim=-1)).all())
            verdict["steps"].append({"step": name, "rows": int(ref.shape[0]), "max_rel_err": round(err, 6),
                                     "noise": round(noise, 6), "tolerance": round(tol, 6), "greedy_ok": greedy_ok})
            worst = max(worst, err)
            if err > tol or not greedy_ok:
                raise ValueError(f"{name}: logits differ from the torch backend's by {err:.4f} of the row's largest "
                                 f"(tolerance {tol:.4f})" + ("" if greedy_ok else "; a different greedy token"))
            end = -1
            for s, e in seqs:  # each sequence's next token: the reference's greedy choice at its last row
                end += e.num_new
                greedy[s] = int(ref[end].argmax())
        verdict["passed"] = True
    except Exception as e:  # noqa: BLE001 - a backend that raises fails the check
        verdict["error"] = f"{type(e).__name__}: {e}"
    verdict.update(max_rel_err=round(worst, 6), noise=round(noise, 6), tolerance=round(tol, 6),
                   seconds=round(time.perf_counter() - t0, 3))
    return verdict


def needs_check(backend, device: torch.device) -> bool:
    """Production rule: only a backend other than torch, on CUDA (on CPU torch is the reference itself)."""
    return torch.device(device).type == "cuda" and getattr(backend, "name", None) != "torch"


def checked_backend(backend, model, device: torch.device, *, page_size: int, cascade: str = "auto",
                    cache_dir=None, model_name: str = "") -> tuple[object, dict]:
    """The backend the engine should use, and the self-check's verdict (see the module docstring)."""
    if not needs_check(backend, device):
        why = ("the torch backend is the reference" if getattr(backend, "name", None) == "torch"
               else f"checked only on CUDA (this engine runs on {torch.device(device).type})")
        return backend, {"status": "not needed", "backend": getattr(backend, "name", None), "detail": why}
    try:
        cache_file = cache_root(cache_dir) / CACHE_FILE
    except Exception:  # noqa: BLE001 - no usable cache dir: check at every start
        cache_file = None
    return verify(backend, model, page_size=page_size, cascade=cascade, cache_file=cache_file, model_name=model_name)


def verify(candidate, model, *, page_size: int = 16, cascade: str = "auto", cache_file: Path | None = None,
           model_name: str = "", reference=None) -> tuple[object, dict]:
    """Check ``candidate`` against the torch backend on ``model``'s device (or reuse the cached
    verdict); returns ``(backend to use, verdict)``: the candidate when it passed, else a torch
    backend with ``cascade``, after a warning. Works on any device (the engine calls it on CUDA only)."""
    from .torch_backend import TorchAttentionBackend

    mode = os.environ.get("OPENCOTI_ATTENTION_CHECK", "1").strip().lower()
    name = getattr(candidate, "name", type(candidate).__name__)
    if mode in ("0", "off", "false", "no"):
        log.warning("attention backend %s: self-check skipped (OPENCOTI_ATTENTION_CHECK=%s); its output is "
                    "not verified on this device", name, mode)
        return candidate, {"status": "skipped", "backend": name, "detail": "OPENCOTI_ATTENTION_CHECK=0"}
    key = cache_key(candidate, model, model.device, page_size, model_name)
    cache = _load(cache_file)
    found = cache.get(key) if mode != "force" else None
    cached = isinstance(found, dict) and "passed" in found
    verdict: dict[str, Any]
    if isinstance(found, dict) and cached:
        verdict = found
    else:
        log.info("attention backend %s: checking it against the torch backend on %s", name, device_name(model.device))
        ref = reference if reference is not None else TorchAttentionBackend(cascade="off")
        verdict = check_backend(candidate, ref, model, page_size=page_size)
        verdict["checked_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        _save(cache_file, key, verdict)
    verdict = {**verdict, "key": key, "cached": cached,
               "status": "passed" if verdict["passed"] else "failed"}
    if verdict["passed"]:
        log.info("attention backend %s: self-check passed (max relative logit error %s, tolerance %s%s)", name,
                 verdict["max_rel_err"], verdict["tolerance"], ", cached" if cached else "")
        verdict["active_backend"] = name
        return candidate, verdict
    why = verdict["error"] or "failed"
    log.warning("attention backend %s FAILED its self-check against the torch backend on %s: %s -- using the torch "
                "backend instead (slower, correct). Verdict cached in %s; OPENCOTI_ATTENTION_CHECK=force checks "
                "again.", name, verdict["device"], why, cache_file)
    verdict["active_backend"] = "torch"
    return TorchAttentionBackend(cascade=cascade), verdict


def _load(cache_file: Path | None) -> dict:
    if cache_file is None:
        return {}
    try:
        data = json.loads(Path(cache_file).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _save(cache_file: Path | None, key: str, verdict: dict) -> None:
    if cache_file is None:
        return
    cache_file = Path(cache_file)
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        data = _load(cache_file)
        data[key] = verdict
        fd, tmp = tempfile.mkstemp(prefix=".attention-check-", dir=cache_file.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.chmod(tmp, 0o644)
        os.replace(tmp, cache_file)
    except OSError as e:  # a read-only cache is not an error: the check runs again next time
        log.warning("could not write the attention self-check cache %s: %s", cache_file, e)
