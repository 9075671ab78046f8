"""Token selection for one engine step, plus the streaming helpers around it.

- `Sampler`: batched greedy / temperature / top-k / top-p / min-p sampling with per-request
  generators and optional logprobs.
- `make_generator`: the per-request `torch.Generator` (seeded, or derived from a process counter).
- `StopStringMatcher`: incremental stop-string detection for streamed text.
- `IncrementalDetokenizer`: token-by-token text with UTF-8 hold-back and an O(1) decode window.

Filter order (llama.cpp's default chain): top_k -> top_p -> min_p -> temperature -> draw.
The filters see the model's distribution at temperature 1 (top_p on the distribution
renormalized over the top-k survivors, like llama.cpp and vLLM; min_p relative to the most
likely token); temperature only reshapes the distribution over the surviving tokens.
"""

from __future__ import annotations

import itertools
import math
import threading
from typing import Callable, NamedTuple, Sequence

import torch

from ..config import SamplingParams
from .post import post_sampling_logprobs
from .state import SamplerState, process_logits
from .text import IncrementalDetokenizer, StopStringMatcher

__all__ = [
    "SampleOutput",
    "Sampler",
    "SamplerState",
    "make_generator",
    "StopStringMatcher",
    "IncrementalDetokenizer",
]

# Candidate widths tried, in order, for rows without top_k but with top_p < 1: the nucleus is
# usually small, so a partial topk finds it exactly without sorting the whole vocabulary; the
# full sort is the last resort. Each row's ladder depends only on that row, which keeps seeded
# rows reproducible whatever else is in the batch.
_PROBE_WIDTHS = (256, 1024, 4096)

_CPU_ROW_CHUNK = 16

_MASK64 = (1 << 64) - 1
_seed_counter = itertools.count(1)
_seed_lock = threading.Lock()


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def make_generator(seed: int | None, default_seed: int) -> torch.Generator:
    """A CPU generator for one request.

    seed: the request's seed (same seed -> same draws). None derives a fresh seed from
        `default_seed` and a process-level counter, so unseeded requests differ from each other
        while a process started with the same `default_seed` replays the same sequence of seeds.
    """
    if seed is None:
        with _seed_lock:
            n = next(_seed_counter)
        seed = _splitmix64((default_seed & _MASK64) ^ _splitmix64(n))
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)  # accepts [-2**63, 2**64), negatives wrap
    return gen


class SampleOutput(NamedTuple):
    """Result of one `Sampler.sample` call, one entry per row."""

    token_ids: list[int]
    # logprob of the chosen token under the raw model distribution (log_softmax of the
    # unmodified logits); None when no row asked for logprobs.
    logprobs: list[float] | None
    # per row, the top-n (token_id, logprob) alternatives, most likely first, when
    # params[i].logprobs is set (n = params[i].logprobs), else []; None when no row asked.
    top_logprobs: list[list[tuple[int, float]]] | None


class Sampler:
    """Batched token selection for one engine step.

    Greedy rows are one vectorized argmax. Sampled rows are grouped by the width of the sorted
    candidate list they need (top_k if set, else a probe ladder, else the whole vocabulary);
    each group is processed in one set of tensor ops with per-row parameter tensors. Every row
    draws exactly one uniform from its own generator and picks a token by inverse CDF over its
    candidates, so a seeded row's tokens depend only on its own logits and parameters.
    """

    def __init__(self, seed: int = 0):
        # used by sampled rows given no generator
        self._fallback_generator = make_generator(seed, seed)

    def sample(
        self,
        logits: torch.Tensor,  # [B, V]
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        states: Sequence[SamplerState | None] | None = None,
    ) -> SampleOutput:
        """One token per row. ``states``: per-row ``SamplerState`` (constraint, penalties, bias) or
        None; each state is advanced with its row's token."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
        num_rows, vocab_size = logits.shape
        if len(params) != num_rows or len(generators) != num_rows:
            raise ValueError(
                f"got {num_rows} logit rows, {len(params)} params and {len(generators)} generators")
        if num_rows == 0:
            return SampleOutput([], None, None)
        if logits.dtype != torch.float32:
            logits = logits.float()
        raw = logits  # logprobs are reported under the model's distribution
        if states is not None and len(states) != num_rows:
            raise ValueError(f"got {num_rows} logit rows and {len(states)} sampler states")
        active = states if states is not None and any(s is not None for s in states) else None
        if active is not None:
            logits = logits.clone()
            process_logits(logits, params, active)
        device = logits.device
        token_ids = torch.empty(num_rows, dtype=torch.long, device=device)  # [B]

        greedy_rows: list[int] = []
        # top_k -> rows (top_k < V): each group is one topk of that width
        sorted_groups: dict[int, list[int]] = {}
        probe_rows: list[int] = []
        unsorted_rows: list[int] = []
        uniforms: dict[int, float] = {}
        for i, p in enumerate(params):
            if p.is_greedy:
                greedy_rows.append(i)
                continue
            gen = generators[i] if generators[i] is not None else self._fallback_generator
            uniforms[i] = torch.rand(1, generator=gen, dtype=torch.float64).item()
            if 0 < p.top_k < vocab_size:
                sorted_groups.setdefault(p.top_k, []).append(i)
            elif p.top_p < 1.0:
                probe_rows.append(i)
            else:
                unsorted_rows.append(i)

        if greedy_rows:
            rows = _index(greedy_rows, device)
            token_ids[rows] = logits.index_select(0, rows).argmax(dim=-1)

        for width, rows_list in sorted_groups.items():
            rows = _index(rows_list, device)
            token_ids[rows] = self._sample_sorted(
                logits.index_select(0, rows), width, [params[i] for i in rows_list],
                [uniforms[i] for i in rows_list], full_norm=False)[0]

        # Whole-vocabulary passes: on CPU, a few rows at a time stay in cache (every op is
        # row-wise, so the chunking changes no result).
        chunk = _CPU_ROW_CHUNK if device.type == "cpu" else max(len(logits), 1)
        for start in range(0, len(probe_rows), chunk):
            part = probe_rows[start:start + chunk]
            self._sample_probe(logits, part, params, uniforms, token_ids)
        for start in range(0, len(unsorted_rows), chunk):
            part = unsorted_rows[start:start + chunk]
            rows = _index(part, device)
            token_ids[rows] = self._sample_unsorted(
                logits.index_select(0, rows), [params[i] for i in part], [uniforms[i] for i in part])

        if active is not None:
            chosen = token_ids.tolist()
            for st, tok in zip(active, chosen):
                if st is not None:
                    st.accept(tok)
        if not any(p.logprobs is not None for p in params):
            return SampleOutput(token_ids.tolist(), None, None)
        out = self._with_logprobs(raw, params, token_ids)
        if any(p.post_sampling_probs and p.logprobs is not None for p in params) \
                and out.logprobs is not None and out.top_logprobs is not None:  # (always, with logprobs)
            post_sampling_logprobs(logits, params, token_ids, out.logprobs, out.top_logprobs)
        return out

    # -- sampled paths ------------------------------------------------------------------------

    def _sample_probe(
        self,
        logits: torch.Tensor,  # [B, V]
        pending: list[int],
        params: Sequence[SamplingParams],
        uniforms: dict[int, float],
        token_ids: torch.Tensor,  # [B], written for `pending`
    ) -> None:
        """Rows without top_k but with top_p: widen the candidate list until the nucleus fits."""
        device, vocab_size = logits.device, logits.shape[1]
        for width in (*(w for w in _PROBE_WIDTHS if w < vocab_size), vocab_size):
            if not pending:
                return
            rows = _index(pending, device)
            chosen, fits = self._sample_sorted(
                logits.index_select(0, rows), width, [params[i] for i in pending],
                [uniforms[i] for i in pending], full_norm=True)
            fits_list = fits.tolist()
            done = [j for j, ok in enumerate(fits_list) if ok]
            if done:
                done_t = _index(done, device)
                token_ids[rows.index_select(0, done_t)] = chosen.index_select(0, done_t)
            pending = [pending[j] for j, ok in enumerate(fits_list) if not ok]

    @staticmethod
    def _sample_sorted(
        logits: torch.Tensor,  # [N, V]
        width: int,
        params: Sequence[SamplingParams],
        uniforms: Sequence[float],
        full_norm: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample from the `width` most likely tokens of each row.

        full_norm: top_p is measured against the whole-vocabulary distribution (rows without
            top_k); else against the distribution renormalized over the `width` candidates.
        Returns (token ids [N], fits [N] bool): fits is False where the row's kept set may
        extend past `width` (only possible when full_norm and width < V); such rows' tokens are
        meaningless and the caller retries them wider.
        """
        num_rows, vocab_size = logits.shape
        device = logits.device
        if width >= vocab_size:
            cand_logits, cand_ids = torch.sort(logits, dim=-1, descending=True)  # [N, V]
            width = vocab_size
        else:
            cand_logits, cand_ids = torch.topk(logits, width, dim=-1, sorted=True)  # [N, W]
        top_p, log_min_p, temperature = _param_columns(params, device)  # [N, 1] each

        if full_norm:
            norm = torch.logsumexp(logits, dim=-1, keepdim=True)  # [N, 1]
        else:
            norm = torch.logsumexp(cand_logits, dim=-1, keepdim=True)  # [N, 1]
        probs = torch.exp(cand_logits - norm)  # [N, W]
        cum = torch.cumsum(probs, dim=-1)  # [N, W]
        cum_before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)  # [N, W]
        keep = cum_before < top_p  # [N, W]
        keep &= cand_logits >= cand_logits[:, :1] + log_min_p
        keep[:, 0] = True

        if full_norm and width < vocab_size:
            fits = ~keep[:, -1]  # both filters are monotone along the sorted list
        else:
            fits = torch.ones(num_rows, dtype=torch.bool, device=device)

        weights = torch.exp((cand_logits - cand_logits[:, :1]) / temperature)  # [N, W]
        weights = torch.where(keep, weights, torch.zeros_like(weights))
        pick = _inverse_cdf(weights, uniforms)  # [N]
        return cand_ids.gather(1, pick[:, None]).squeeze(1), fits

    @staticmethod
    def _sample_unsorted(
        logits: torch.Tensor,  # [N, V]
        params: Sequence[SamplingParams],
        uniforms: Sequence[float],
    ) -> torch.Tensor:
        """Rows with neither top_k nor top_p: min_p + temperature need no sort."""
        _, log_min_p, temperature = _param_columns(params, logits.device)  # [N, 1] each
        max_logits = logits.max(dim=-1, keepdim=True).values  # [N, 1]
        weights = torch.exp((logits - max_logits) / temperature)  # [N, V]
        keep = logits >= max_logits + log_min_p  # [N, V]
        weights = torch.where(keep, weights, torch.zeros_like(weights))
        return _inverse_cdf(weights, uniforms)

    # -- logprobs -----------------------------------------------------------------------------

    @staticmethod
    def _with_logprobs(
        logits: torch.Tensor,  # [B, V]
        params: Sequence[SamplingParams],
        token_ids: torch.Tensor,  # [B]
    ) -> SampleOutput:
        norm = torch.logsumexp(logits, dim=-1)  # [B]
        chosen = logits.gather(1, token_ids[:, None]).squeeze(1) - norm  # [B]
        top_n = {i: p.logprobs for i, p in enumerate(params) if p.logprobs}
        top_rows = list(top_n)
        top_logprobs: list[list[tuple[int, float]]] = [[] for _ in params]
        if top_rows:
            num_top = max(top_n.values())
            rows = _index(top_rows, logits.device)
            top_vals, top_ids = torch.topk(logits.index_select(0, rows), num_top, dim=-1)  # [R, n]
            top_vals = top_vals - norm.index_select(0, rows)[:, None]
            for r, (ids, vals) in zip(top_rows, zip(top_ids.tolist(), top_vals.tolist())):
                n = params[r].logprobs
                top_logprobs[r] = list(zip(ids[:n], vals[:n]))
        return SampleOutput(token_ids.tolist(), chosen.tolist(), top_logprobs)


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _param_columns(params: Sequence[SamplingParams], device: torch.device):
    """Per-row (top_p, log(min_p), temperature) as [N, 1] float32 tensors.

    top_p >= 1 becomes +inf so rounding in the cumulative sum never drops a tail token.
    """
    cols = torch.tensor(
        [[p.top_p if p.top_p < 1.0 else math.inf,
          math.log(p.min_p) if p.min_p > 0 else -math.inf,
          p.temperature] for p in params],
        dtype=torch.float32,
    ).to(device)  # [N, 3]
    return cols[:, 0:1], cols[:, 1:2], cols[:, 2:3]


def _inverse_cdf(weights: torch.Tensor, uniforms: Sequence[float]) -> torch.Tensor:
    """Column index per row drawn proportionally to `weights` [N, W] (>= 0, some > 0).

    Wide rows go in two levels (pick a block of _BLOCK columns by its sum, then a column inside
    it), which avoids a float64 cumulative sum over the whole vocabulary. Every op is row-wise,
    so a row's pick does not depend on the other rows.
    """
    num_rows, width = weights.shape
    u = torch.tensor(uniforms, dtype=torch.float64).to(weights.device)[:, None]  # [N, 1]
    if width <= 4 * _BLOCK:
        return _pick(weights.double(), u)[0]
    pad = -width % _BLOCK
    if pad:
        weights = torch.nn.functional.pad(weights, (0, pad))
    blocks = weights.view(num_rows, -1, _BLOCK)  # [N, W / BS, BS]
    block, frac = _pick(blocks.sum(dim=-1).double(), u)  # [N], [N, 1]
    inner = blocks.gather(1, block[:, None, None].expand(num_rows, 1, _BLOCK)).squeeze(1)  # [N, BS]
    pick = block * _BLOCK + _pick(inner.double(), frac)[0]
    return pick.clamp_(max=width - 1)


_BLOCK = 256


def _pick(weights: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse CDF on float64 `weights` [N, W] with uniforms `u` [N, 1] in [0, 1).

    Returns (index [N], where the target fell inside the picked entry, as a fraction in [0, 1)
    [N, 1]): the fraction is a fresh uniform for a second-level pick.
    """
    cdf = torch.cumsum(weights, dim=-1)  # [N, W]
    total = cdf[:, -1:]  # [N, 1]
    # u < 1, but u * total can round up to total; stay strictly below it.
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    # first entry with cdf > target: its weight is > 0, so a masked entry is never picked
    idx = torch.searchsorted(cdf, target, right=True).clamp_(max=weights.shape[-1] - 1)  # [N, 1]
    upper = cdf.gather(1, idx)
    lower = upper - weights.gather(1, idx)
    frac = ((target - lower) / (upper - lower)).clamp_(0.0, 1.0)
    frac = torch.minimum(frac, torch.nextafter(torch.ones_like(frac), torch.zeros_like(frac)))
    return idx.squeeze(1), frac
