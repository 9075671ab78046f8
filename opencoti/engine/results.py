"""Result and event types of the engine API (small, immutable-ish records)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestInfo:
    """Known as soon as a request is accepted (before its first token): what the server puts in headers."""

    request_id: str
    session_id: str
    pool_id: int | None
    cached_prefix_tokens: int  # cache_n: prompt tokens reused (pool and/or session cache)
    prompt_tokens: int
    rematerialized_pools: list[int] = field(default_factory=list)
    admission: dict | None = None  # the admission decision for requests to enforced pools
    session_tps: float | None = None  # the session's decode tps (tps_ewma) when accepted; None: never decoded


@dataclass
class TokenDelta:
    """One streamed step: the new token and the text it completed (may be empty)."""

    token_id: int
    text: str
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class PromptProgress:
    """Streamed only when asked for (``stream.report_progress()``): after each step that computed a
    chunk of the prompt, the prompt tokens in the cache (reused ones included), as llama.cpp's
    ``prompt_progress.processed``. The last one, before the first token, is the whole prompt."""

    processed: int


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stop_reason: str  # eos | stop | length | cancelled
    stopping_word: str
    truncated: bool  # generation ended because the context (or KV cache) was full
    timings: dict
    info: RequestInfo
    logprobs: list[TokenDelta] | None = None

    @property
    def session_id(self) -> str:
        return self.info.session_id

    @property
    def pool_id(self) -> int | None:
        return self.info.pool_id

    @property
    def cache_n(self) -> int:
        return self.info.cached_prefix_tokens


@dataclass
class PoolInfo:
    """A pool as the API reports it (fields in docs/polykv.md)."""

    pool_id: int
    parent: int | None
    branch_pos: int
    prefix_len: int
    own_len: int
    own_kv_bytes: int
    subtree_kv_bytes: int
    residency: str
    pinned: bool
    auto_pinned: bool
    orphaned_pin: bool
    last_access_ts: float
    children: list[int]
    sessions: list[dict[str, Any]]
    rematerialized: bool = False
    cache_hits: int = 0
    label: str = ""
    release_in_s: float | None = None  # a release deferred by the grace TTL: seconds until it takes effect
    # sessions of released descendants that keep this pool's KV (auto-pinned while they do):
    # {session_id, pool_id, state, expires_in_s}
    held_by: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict:
        return dict(self.__dict__)
