"""Sequences (KV-holding token runs), sessions (leaves of the pool tree) and jobs (work to compute)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence as Seq

from .config import SamplingParams
from .results import RequestInfo

if TYPE_CHECKING:
    import torch


class IndexNode(Protocol):
    """A sequence's place in the prefix index (``kv.prefix_index.Entry``, which only ``KVTables``
    reads and writes): declared here so that the lowest layer imports nothing above it."""

    @property
    def page(self) -> int | None: ...


class SeqState:
    """Tokens plus the page table holding their KV.

    ``tokens[:num_cached]`` have KV in the pages ``page_table``. The first ``num_borrowed_pages``
    pages are read-only pages shared from a pool (never written by this sequence); the rest are
    owned by whoever owns the sequence (a session or a pool).
    """

    __slots__ = ("tokens", "page_table", "num_cached", "num_borrowed_pages", "num_shared_tokens", "salt_root",
                 "page_keys", "index_node", "cacheable")

    def __init__(self, tokens: list[int] | None = None, salt_root: bytes = b""):
        self.tokens: list[int] = list(tokens or [])
        self.page_table: list[int] = []
        self.num_cached = 0
        self.num_borrowed_pages = 0
        self.num_shared_tokens = 0  # leading tokens shared with the session's pool (for reporting)
        # prefix index bookkeeping (KVTables): the chained keys of its full pages walked so far, the
        # index entry of the last one, and whether its pages may enter the index at all
        self.salt_root = salt_root
        self.page_keys: list[bytes] = []
        self.index_node: IndexNode | None = None  # (an Entry)
        self.cacheable = True

    @property
    def owned_pages(self) -> list[int]:
        return self.page_table[self.num_borrowed_pages:]

    @property
    def cached_tokens(self) -> list[int]:
        return self.tokens[: self.num_cached]


class SessionState(str, enum.Enum):
    IDLE = "idle"  # no request; its KV stays cached
    WAITING = "waiting"  # request queued, not yet computing
    PREFILL = "prefill"
    DECODE = "decode"


class Session:
    """A leaf: one agent's private continuation, optionally attached to a pool."""

    def __init__(self, session_id: str, anonymous: bool = False):
        self.session_id = session_id
        self.anonymous = anonymous  # nobody named it: it expires when idle for session_ttl_s
        self.pool_id: int | None = None
        self.tenant: str | None = None  # the owning tenant's name, kept with the session's saved record
        self.seq = SeqState()
        self.job: "Job | None" = None
        self.last_access = time.monotonic()  # (a pool's is wall-clock: Pool.last_access_wall)
        self.created = time.monotonic()
        # the prefix-index keys of the pages its KV was in when memory pressure took them (PolyKV.reclaim):
        # where they are now (RAM cache, disk tier, nowhere) is where its KV is
        self.spilled_keys: list[bytes] = []
        self.written_ahead: tuple | None = None  # (Reclaim.write_ahead) its KV as of this mark is on disk too

    @property
    def state(self) -> SessionState:
        if self.job is None:
            return SessionState.IDLE
        return self.job.state

    @property
    def is_idle(self) -> bool:
        return self.job is None


@dataclass
class Timings:
    """llama.cpp-style timings of one request."""

    prompt_n: int = 0  # prompt tokens computed (excludes cached)
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    cache_n: int = 0  # prompt tokens reused from cache (pool or session)
    draft_n: int = 0  # speculative draft tokens proposed (llama.cpp's names)
    draft_n_accepted: int = 0

    def as_dict(self) -> dict:
        return {
            "prompt_n": self.prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": self.prompt_ms / self.prompt_n if self.prompt_n else 0.0,
            "prompt_per_second": 1e3 * self.prompt_n / self.prompt_ms if self.prompt_ms > 0 else 0.0,
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            # the rates use the n - 1 intervals between generated tokens (the first token's time is
            # part of the prompt's): decode speed, not skewed by one token on short answers
            "predicted_per_token_ms": self.predicted_ms / (self.predicted_n - 1) if self.predicted_n > 1 else 0.0,
            "predicted_per_second": (1e3 * (self.predicted_n - 1) / self.predicted_ms
                                     if self.predicted_ms > 0 and self.predicted_n > 1 else 0.0),
            "cache_n": self.cache_n,
            **({"draft_n": self.draft_n, "draft_n_accepted": self.draft_n_accepted} if self.draft_n else {}),
        }


@dataclass(kw_only=True)
class Work:
    """What the scheduler needs of any job: compute ``seq.tokens[num_cached:]`` into the cache."""

    seq: SeqState
    wait_for: list = field(default_factory=list)  # pools that must be resident before starting
    state: SessionState = SessionState.WAITING
    started: bool = False
    admit_seq: int = 0  # order of admission into the running set (preemption picks the newest)
    num_preemptions: int = 0
    t_start: float = 0.0  # when it last started (0: never)

    @property
    def num_remaining(self) -> int:
        return len(self.seq.tokens) - self.seq.num_cached


@dataclass(kw_only=True)
class Job(Work):
    """A generation request: prefill its prompt, then sample and decode until it finishes."""

    params: SamplingParams
    emit: Callable[[Any], None]
    session: Session | None = None
    # how it starts (EngineCore.try_start): from its session's own cache (else its pool), reusing
    # ``start_prefix`` tokens of it as planned at commit
    start_from_own: bool = False
    start_prefix: int = 0
    announced: bool = False  # the client was told it started ("started")
    prompt_len: int = 0
    max_context: int = 0
    generated: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None  # its sampling's own (a seed given)
    text_out: Any = None  # sampling.text.TextOutput: its text, detokenized, stop strings matched
    text: str = ""
    logprobs: list = field(default_factory=list)
    timings: Timings = field(default_factory=Timings)
    t_first_token: float = 0.0
    t_last_token: float = 0.0
    finish_reason: str | None = None
    stopping_word: str = ""
    truncated: bool = False
    info: RequestInfo | None = None
    sampler_state: Any = None  # SamplerState: constraint matcher, penalty window, logit bias
    prompt_keys: list[bytes] = field(default_factory=list)  # prefix-index keys of the prompt's full pages
    tier_keys: list[bytes] = field(default_factory=list)  # of those, the pages on disk it waits to be read ahead
    draft_state: Any = None  # speculative.DraftState (None: no speculative decoding)
    draft: list[int] = field(default_factory=list)  # draft tokens appended to seq.tokens for this step


@dataclass(kw_only=True)
class MaterializeJob(Work):
    """Computes a pool's prefix into its own pages (prefill only, no sampling), then ``on_done``
    is called with the Pool, or with an exception when it fails."""

    pool: Any
    on_done: Callable[[Any], None]


class SeqView(Protocol):
    """A pool's or a session's sequence, read only: its tokens and the page table holding their KV."""

    @property
    def tokens(self) -> Seq[int]: ...

    @property
    def page_table(self) -> Seq[int]: ...

    @property
    def num_cached(self) -> int: ...

    @property
    def num_borrowed_pages(self) -> int: ...

    @property
    def num_shared_tokens(self) -> int: ...

    @property
    def owned_pages(self) -> Seq[int]: ...

    @property
    def cached_tokens(self) -> Seq[int]: ...
