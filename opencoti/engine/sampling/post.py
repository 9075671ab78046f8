"""llama.cpp's ``post_sampling_probs``: probabilities after the sampling chain.

The reported distribution is the one the token was drawn from: the logits after the grammar
mask, logit bias and penalties, filtered by top_k -> top_p -> min_p (the same definitions as the
sampler: top_p over the top-k survivors when top_k is set, else over the whole vocabulary; min_p
relative to the most likely token), then tempered and renormalized over the survivors. A greedy
row's distribution is all on the chosen token. Only the tokens that survive are listed.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..config import SamplingParams

__all__ = ["post_sampling_logprobs", "post_sampling_distribution"]


def post_sampling_distribution(logits: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, probabilities) of the surviving candidates of one row [V], most likely first."""
    vocab = logits.shape[0]
    if p.is_greedy:
        return logits.argmax().reshape(1), torch.ones(1, dtype=torch.float64)
    vals, ids = torch.sort(logits.double(), descending=True)
    k = p.top_k if 0 < p.top_k < vocab else vocab
    cand, cand_ids = vals[:k], ids[:k]
    norm = torch.logsumexp(cand if k < vocab else vals, dim=0)
    probs = torch.exp(cand - norm)
    cum_before = torch.cumsum(probs, dim=0) - probs
    keep = cum_before < (p.top_p if p.top_p < 1.0 else math.inf)
    if p.min_p > 0:
        keep &= cand >= cand[0] + math.log(p.min_p)
    keep[0] = True
    n = int(keep.sum())  # both filters are monotone along the sorted list: a prefix survives
    weights = torch.exp((cand[:n] - cand[0]) / p.temperature)
    return cand_ids[:n], weights / weights.sum()


def post_sampling_logprobs(logits: torch.Tensor, params: Sequence[SamplingParams], token_ids: torch.Tensor,
                           logprobs: list, top_logprobs: list) -> None:
    """Overwrite, for rows with ``post_sampling_probs``, the chosen token's logprob and the top
    alternatives with their post-sampling values (log of the probability)."""
    chosen = token_ids.tolist()
    for i, p in enumerate(params):
        if not p.post_sampling_probs or p.logprobs is None:
            continue
        ids, probs = post_sampling_distribution(logits[i], p)
        ids_l, probs_l = ids.tolist(), probs.tolist()
        pos = {t: j for j, t in enumerate(ids_l)}.get(chosen[i])
        logprobs[i] = math.log(probs_l[pos]) if pos is not None and probs_l[pos] > 0 else -1e30
        n = p.logprobs or 0
        top_logprobs[i] = [(t, math.log(q)) for t, q in zip(ids_l[:n], probs_l[:n]) if q > 0]
