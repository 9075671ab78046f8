"""llguidance itself, for the constraints (``constraints/__init__.py``): the library loaded on first
use, the bridge from an engine ``Tokenizer`` to llguidance's, and the step's batched mask
computation (llguidance's executor, which releases the GIL) and in-place masking of logit rows.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import numpy as np

from ..errors import InvalidRequestError

if TYPE_CHECKING:
    import torch


def load_llguidance():
    import llguidance  # imported on first use: unconstrained engines never load it

    return llguidance


# ============================================================================ tokenizer bridge
_tok_lock = threading.Lock()


def llg_tokenizer(tokenizer) -> Any:
    """The llguidance tokenizer for an engine ``Tokenizer`` (built once, cached on it; ~0.5 s for
    a 49k BPE vocabulary)."""
    cached = getattr(tokenizer, "_llg_tokenizer", None)
    if cached is not None:
        return cached
    with _tok_lock:
        cached = getattr(tokenizer, "_llg_tokenizer", None)
        if cached is None:
            cached = _build_llg_tokenizer(tokenizer)
            tokenizer._llg_tokenizer = cached
    return cached


def _build_llg_tokenizer(tokenizer) -> Any:
    llg = load_llguidance()
    eos = list(tokenizer.eos_token_ids)
    hf = getattr(tokenizer, "hf_tokenizer", None)
    if hf is not None:
        import llguidance.hf

        try:
            return llguidance.hf.from_tokenizer(hf, n_vocab=tokenizer.vocab_size, eos_token=eos)
        except ValueError as exc:
            raise InvalidRequestError(f"constrained decoding is not available for this tokenizer: {exc}") from None
    # the built-in byte tokenizer of the tiny test models: ids 0..255 are bytes, then specials
    specials = getattr(tokenizer, "SPECIALS", ())

    class _Bytes:
        eos_token_id = eos[0]
        bos_token_id = tokenizer.bos_token_id
        tokens = [bytes([i]) for i in range(256)] + [s.encode() for s in specials] + [
            f"<|reserved_{i}|>".encode() for i in range(256 + len(specials), tokenizer.vocab_size)]
        special_token_ids = sorted(tokenizer.special_token_ids)

        def __call__(self, s):
            return tokenizer.encode(s.decode("utf-8", "replace") if isinstance(s, bytes) else s)

    return llg.LLTokenizer(llg.TokenizerWrapper(_Bytes()), n_vocab=tokenizer.vocab_size, eos_token=eos)


# ============================================================================ masks
class MaskRow(Protocol):
    """A request's constraint as the batched mask computation sees it (``Constraint``): its matcher,
    its mask buffer (one int32 word per 32 tokens) and whether the mask is computed."""

    @property
    def active(self) -> bool: ...

    matcher: Any  # an llguidance LLMatcher
    mask: torch.Tensor
    mask_ready: bool


_executor_lock = threading.Lock()
_executor = None


def _mask_executor():
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = load_llguidance().LLExecutor(num_threads=2)
        return _executor


def compute_masks(constraints: Sequence[MaskRow]) -> None:
    """Fill ``c.mask`` for every active constraint (one batched call; releases the GIL)."""
    import torch
    todo = [c for c in constraints if c.active and not c.mask_ready]
    if not todo:
        return
    width = todo[0].mask.numel()
    out = torch.empty((len(todo), width), dtype=torch.int32)
    _mask_executor().unsafe_compute_mask_ptr([(c.matcher, i) for i, c in enumerate(todo)], out.data_ptr(),
                                             width * 4, len(todo))
    for i, c in enumerate(todo):
        c.mask.copy_(out[i])
        c.mask_ready = True


def apply_masks(logits: torch.Tensor, rows: list[int], masks: Sequence[torch.Tensor],
                fallback_ids: Sequence[int]) -> None:
    """Set the disallowed logits of ``rows`` to -inf in place. A row whose mask allows nothing
    (a matcher in an error state) may only end: it keeps just ``fallback_ids`` (the EOS ids)."""
    import torch
    vocab = logits.shape[1]
    bits = torch.stack(list(masks)).numpy().view(np.uint8)  # [R, W * 4], little-endian words
    # bit j of the mask is token j; ids past the tokenizer's vocabulary (padding) stay disallowed
    allowed = torch.from_numpy(np.unpackbits(bits, axis=1, count=vocab, bitorder="little")).view(torch.bool)
    empty = ~allowed.any(dim=1)
    if bool(empty.any()):
        for r in empty.nonzero().flatten().tolist():
            allowed[r, list(fallback_ids)] = True
    allowed = allowed.to(logits.device)
    if rows == list(range(logits.shape[0])):
        logits.masked_fill_(~allowed, float("-inf"))
        return
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    sub = logits.index_select(0, idx)
    sub.masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, idx, sub)
