"""Per-request sampler state and the logit processing that needs it.

``SamplerState`` is created with the request (``SamplerState.for_request``: validation happens
there, before the engine commits anything) and passed to ``Sampler.sample`` with its row. It holds
the grammar matcher (``constraints.Constraint``), the penalty window and the logit bias. Requests
that need none of these have no state and cost nothing.

Processing order (llama.cpp's chain): grammar mask -> logit_bias -> repetition / presence /
frequency penalties -> (the sampler's filters: top_k, top_p, min_p, temperature).

Penalties (llama.cpp's ``penalties`` sampler): for every token with c > 0 occurrences in the
window, ``logit = logit / repeat_penalty`` if positive else ``logit * repeat_penalty``, then
``logit -= c * frequency_penalty + presence_penalty``. The window is the last ``repeat_last_n``
tokens of prompt + output (``penalty_scope="context"``, llama.cpp's server, which feeds the prompt
to the sampler) or of the output only (``"output"``, OpenAI's definition).
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

import torch

from ..config import SamplingParams
from ..constraints import Constraint, apply_masks, compute_masks, llg_tokenizer
from ..errors import InvalidRequestError

__all__ = ["SamplerState", "process_logits"]


class SamplerState:
    """What the sampler remembers about one request between steps."""

    __slots__ = ("constraint", "counts", "window", "bias_ids", "bias_vals", "bans", "eos_ids", "num_accepted")

    def __init__(self, params: SamplingParams, prompt: Sequence[int], tokenizer, vocab_size: int):
        self.eos_ids = tuple(tokenizer.eos_token_ids)
        self.num_accepted = 0
        self.bias_ids: torch.Tensor | None = None
        self.bias_vals: torch.Tensor | None = None
        self.bans = False  # some bias is -inf: the row could be left with no allowed token
        if params.logit_bias:
            bad = [t for t in params.logit_bias if t >= vocab_size]
            if bad:
                raise InvalidRequestError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
            self.bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
            self.bias_vals = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
            self.bans = bool(torch.isneginf(self.bias_vals).any())
        self.counts: torch.Tensor | None = None
        self.window: deque[int] | None = None
        if params.has_penalties:
            n = params.repeat_last_n
            self.window = deque(maxlen=n if n > 0 else None)
            self.counts = torch.zeros(vocab_size, dtype=torch.float32)
            if params.penalty_scope == "context":
                for t in (prompt[-n:] if n > 0 else prompt):
                    self._push(t)
        self.constraint: Constraint | None = None
        if params.constraint is not None:
            self.constraint = Constraint(params.constraint, llg_tokenizer(tokenizer))

    @classmethod
    def for_request(cls, params: SamplingParams, prompt: Sequence[int], tokenizer,
                    vocab_size: int) -> "SamplerState | None":
        """The state a request needs, or None when it samples without any (the common case).
        Raises InvalidRequestError for what can only be checked against the model (token ids,
        a grammar the tokenizer cannot serve)."""
        if params.constraint is None and not params.logit_bias and not params.has_penalties:
            return None
        return cls(params, prompt, tokenizer, vocab_size)

    def _push(self, token: int) -> None:
        w, counts = self.window, self.counts
        assert w is not None and counts is not None  # penalties: both or neither
        if w.maxlen is not None and len(w) == w.maxlen:
            counts[w[0]] -= 1
        w.append(token)
        counts[token] += 1

    def accept(self, token: int) -> None:
        """The token sampled for this request (called by the sampler, once per step)."""
        self.num_accepted += 1
        if self.constraint is not None:
            self.constraint.advance(token)
        if self.window is not None:
            self._push(token)

    @property
    def constrained(self) -> bool:
        return self.constraint is not None and self.constraint.active

    @property
    def budget_closed(self) -> bool:
        """The token budget, not the model, ended the constrained output (it was closed to parse)."""
        return self.constraint is not None and self.constraint.closed_by_budget


def process_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                   states: Sequence[SamplerState | None]) -> None:
    """Apply masks, logit bias and penalties to ``logits`` [B, V] in place (rows with a state)."""
    vocab = logits.shape[1]
    device = logits.device
    present = [(i, s) for i, s in enumerate(states) if s is not None]
    cons = [(i, s, s.constraint) for i, s in present if s.constraint is not None and s.constraint.active]
    for i, st, c in cons:  # end or close the document within the budget (constraints/close.py)
        max_tokens = params[i].max_tokens
        c.budget(None if max_tokens is None else max_tokens - st.num_accepted)
    if cons:
        compute_masks([c for _, _, c in cons])
        eos = cons[0][1].eos_ids
        apply_masks(logits, [i for i, _, _ in cons], [c.mask for _, _, c in cons], eos)
    bias = [(i, s, s.bias_ids, s.bias_vals) for i, s in present if s.bias_ids is not None and s.bias_vals is not None]
    if bias:
        r = torch.cat([torch.full((len(b_ids),), i, dtype=torch.long) for i, _, b_ids, _ in bias])
        ids = torch.cat([b_ids for _, _, b_ids, _ in bias])
        vals = torch.cat([b_vals for _, _, _, b_vals in bias])
        ok = ids < vocab
        logits.index_put_((r[ok].to(device), ids[ok].to(device)), vals[ok].to(device), accumulate=True)
    pens = [(i, s.counts) for i, s in present if s.counts is not None]
    if pens:
        pen_rows = [i for i, _ in pens]
        idx = torch.tensor(pen_rows, dtype=torch.long, device=device)
        counts = torch.stack([c for _, c in pens]).to(device)  # [R, V]
        cols = torch.tensor([[params[i].repeat_penalty, params[i].frequency_penalty, params[i].presence_penalty]
                             for i in pen_rows], dtype=torch.float32, device=device)  # [R, 3]
        rep, freq, pres = cols[:, 0:1], cols[:, 1:2], cols[:, 2:3]
        sub = logits.index_select(0, idx)
        seen = counts > 0
        penalized = torch.where(sub > 0, sub / rep, sub * rep)
        penalized = penalized - counts * freq - seen.float() * pres
        logits.index_copy_(0, idx, torch.where(seen, penalized, sub))
    banning = [(i, st) for i, st, _, _ in bias if st.bans]
    if banning:
        # a row left with no finite logit (every allowed token banned) may only end
        idx = torch.tensor([i for i, _ in banning], dtype=torch.long, device=device)
        dead = torch.isneginf(logits.index_select(0, idx)).all(dim=1).tolist()
        for (row, st), d in zip(banning, dead):
            if d:
                logits[row, list(st.eos_ids)] = 0.0
