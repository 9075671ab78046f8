"""``Limits``: the checks every request and pool operation makes against the model and the KV cache
(token ids in the vocabulary, a context that fits, a usable session id). Read-only; shared by the
core (requests), the pool state (``polykv``) and the persister (restored contexts)."""

from __future__ import annotations

from typing import Protocol

from .errors import ContextLengthError, InvalidRequestError

MAX_SESSION_ID = 128


class PageGeometry(Protocol):
    """What the checks read of the KV cache (``kv.pages.PagePool``): its size in pages and tokens."""

    @property
    def num_pages(self) -> int: ...

    @property
    def page_size(self) -> int: ...

    def pages_for(self, num_tokens: int) -> int: ...


class Limits:
    def __init__(self, *, vocab_size: int, max_context: int, kv: PageGeometry):
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.kv = kv

    def check_tokens(self, tokens, what: str = "prompt") -> list[int]:
        """The token ids as a list; InvalidRequestError when empty or outside the vocabulary."""
        if not isinstance(tokens, (list, tuple)) or not tokens:
            raise InvalidRequestError(f"{what} is empty")
        out = []
        for t in tokens:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise InvalidRequestError(f"{what} contains token id {t!r} outside the vocabulary [0, {self.vocab_size})")
            out.append(t)
        return out

    def capacity_tokens(self) -> int:
        return self.kv.num_pages * self.kv.page_size

    def check_fits(self, n_tokens: int, max_tokens: int | None, what: str = "prompt") -> None:
        """ContextLengthError unless ``n_tokens`` + ``max_tokens`` fit the context and the KV cache."""
        total = n_tokens + (max_tokens or 0)
        if total > self.max_context:
            raise ContextLengthError(
                f"{what} ({n_tokens} tokens) + max_tokens ({max_tokens or 0}) = {total} exceeds the context "
                f"length {self.max_context}", n_prompt_tokens=n_tokens, n_ctx=self.max_context,
                max_tokens=max_tokens or 0)
        if self.kv.pages_for(total - 1) > self.kv.num_pages:  # the last sampled token never needs KV
            raise ContextLengthError(
                f"{what} ({n_tokens} tokens) + max_tokens ({max_tokens or 0}) does not fit the KV cache "
                f"({self.capacity_tokens()} tokens)", n_prompt_tokens=n_tokens,
                n_ctx=min(self.max_context, self.capacity_tokens()), max_tokens=max_tokens or 0)

    def fits(self, n_tokens: int, max_tokens: int | None) -> bool:
        try:
            self.check_fits(n_tokens, max_tokens)
        except ContextLengthError:
            return False
        return True

    @staticmethod
    def check_session_id(session_id) -> None:
        """InvalidRequestError unless ``session_id`` is a usable session id."""
        if not isinstance(session_id, str) or not session_id or len(session_id) > MAX_SESSION_ID:
            raise InvalidRequestError(f"session_id must be a non-empty string of at most {MAX_SESSION_ID} characters")
