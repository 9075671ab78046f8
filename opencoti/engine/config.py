"""EngineConfig and SamplingParams: validated on construction, with clear errors."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from .checks import is_int as _is_int, is_number as _is_number
from .errors import InvalidRequestError
from .speculation import MODES as SPECULATIVE_MODES

_MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16  # stop strings per request (the OpenAPI schema says the same)
KV_DTYPES = ("auto", "fp32", "fp16", "bf16", "q8")  # EngineConfig.kv_dtype


DEFAULT_KV_DISK_WRITE_SHARE = 0.03  # the disk tier's writes' share of the steps' time (persist/pacer.py)


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise InvalidRequestError(message)


class OutputConstraint:
    """The type of ``SamplingParams.constraint``: the base of ``constraints.ConstraintSpec``, its one
    subclass, declared in the engine's lowest layer so that the check of a request's parameters
    imports nothing above it."""

    __slots__ = ()


@dataclass
class SamplingParams:
    """How to pick tokens. Defaults are greedy-free sampling like llama.cpp's server.

    temperature: 0 means greedy (argmax); > 0 divides the logits.
    top_k: keep the k most likely tokens (0 or -1 = off).
    top_p: nucleus sampling, keep the smallest set with cumulative prob >= top_p (1.0 = off).
    min_p: drop tokens with prob < min_p * max prob (0 = off).
    seed: per-request seed; the same seed, prompt and params give the same tokens.
    max_tokens: tokens to generate at most (None = until EOS or the context is full).
    stop: strings that end generation (not included in the output text).
    stop_token_ids: extra token ids that end generation (besides the model's EOS).
    ignore_eos: keep generating past EOS.
    logprobs: number of top alternatives to report per token (None = no logprobs).
    logit_bias: token id -> bias added to its logit (-inf bans the token); applied before the filters.
    repeat_penalty: llama.cpp's repetition penalty for tokens in the penalty window (1 = off):
        positive logits are divided by it, negative ones multiplied.
    repeat_last_n: the penalty window in tokens (-1 = the whole context, 0 = penalties off).
    presence_penalty: subtracted once from the logit of every token in the window (0 = off).
    frequency_penalty: subtracted per occurrence of a token in the window (0 = off).
    penalty_scope: "context" (llama.cpp: the last repeat_last_n tokens of prompt + output) or
        "output" (OpenAI: the generated tokens only, the window still bounded by repeat_last_n).
    post_sampling_probs: report logprobs under the distribution after the sampling filters
        (llama.cpp's post_sampling_probs) instead of the raw model distribution.
    constraint: a ConstraintSpec (JSON Schema, grammar, regex, tool calls) the output must match.
    speculative_max: draft tokens verified per step at most (prompt-lookup speculative decoding,
        llama.cpp's ``speculative.n_max``): 0 = none, None = the engine's setting.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None
    max_tokens: int | None = 16
    stop: Sequence[str] = field(default_factory=tuple)
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_scope: str = "context"
    post_sampling_probs: bool = False
    constraint: Any = None
    speculative_max: int | None = None

    def __post_init__(self) -> None:
        _check(_is_number(self.temperature) and 0 <= self.temperature <= 100,
               f"temperature must be a number in [0, 100], got {self.temperature!r}")
        _check(_is_int(self.top_k) and -1 <= self.top_k <= 1_000_000,
               f"top_k must be an integer >= -1 (0 or -1 = off), got {self.top_k!r}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1,
               f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1,
               f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed < 2**64),
               f"seed must be an integer, got {self.seed!r}")
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
               f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        _check(isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) and s for s in self.stop),
               "stop must be a list of non-empty strings")
        _check(len(self.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        self.stop = tuple(self.stop)
        _check(isinstance(self.stop_token_ids, (list, tuple)) and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids must be a list of non-negative integers")
        self.stop_token_ids = tuple(self.stop_token_ids)
        _check(isinstance(self.ignore_eos, bool), "ignore_eos must be a boolean")
        _check(self.speculative_max is None or (_is_int(self.speculative_max) and 0 <= self.speculative_max <= 64),
               f"speculative_max must be an integer in [0, 64], got {self.speculative_max!r}")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= _MAX_TOP_LOGPROBS),
               f"logprobs must be an integer in [0, {_MAX_TOP_LOGPROBS}], got {self.logprobs!r}")
        self._check_logits_processing()

    def _check_logits_processing(self) -> None:
        bias = self.logit_bias if self.logit_bias is not None else {}
        _check(isinstance(bias, Mapping), "logit_bias must map token ids to biases")
        for tok, b in bias.items():
            _check(_is_int(tok) and tok >= 0, f"logit_bias keys must be non-negative token ids, got {tok!r}")
            _check(_is_number(b) or b == -math.inf,
                   f"logit_bias for token {tok} must be a finite number or -inf (ban), got {b!r}")
        self.logit_bias = dict(bias)
        _check(_is_number(self.repeat_penalty) and 0 < self.repeat_penalty <= 100,
               f"repeat_penalty must be a number in (0, 100], got {self.repeat_penalty!r}")
        _check(_is_int(self.repeat_last_n) and self.repeat_last_n >= -1,
               f"repeat_last_n must be an integer >= -1 (-1 = whole context, 0 = off), got {self.repeat_last_n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(_is_number(v) and -100 <= v <= 100, f"{name} must be a number in [-100, 100], got {v!r}")
        _check(self.penalty_scope in ("context", "output"),
               f"penalty_scope must be 'context' or 'output', got {self.penalty_scope!r}")
        _check(isinstance(self.post_sampling_probs, bool), "post_sampling_probs must be a boolean")
        _check(self.constraint is None or isinstance(self.constraint, OutputConstraint),
               "constraint must be a ConstraintSpec")

    @property
    def has_penalties(self) -> bool:
        return self.repeat_last_n != 0 and (
            self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @classmethod
    def greedy(cls, max_tokens: int | None = 16, **kw) -> "SamplingParams":
        return cls(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, max_tokens=max_tokens, **kw)


@dataclass
class EngineConfig:
    """Engine construction parameters.

    model: None / "default" = the bundled SmolLM2-135M-Instruct; a HF model directory; a .gguf
        path; or "tiny:<arch>" (random weights, for tests; arch in llama|mistral|qwen2|qwen3).
    dtype: "auto" (fp32 on CPU, bf16 on CUDA), "float32", "bfloat16", "float16".
    device: "auto" (cuda if available), "cpu", "cuda", "cuda:N".
    page_size: tokens per KV page.
    kv_budget_tokens / kv_budget_mib: KV capacity (give at most one; default 65536 tokens,
        capped by the model's context length x max_sessions).
    max_batch_tokens: tokens computed per step at most (prefill is chunked to fit).
    max_running: sessions decoding at once at most; the rest wait.
    max_pools: pool budget.
    max_context: context length per sequence (default: the model's).
    attention_backend: "auto" | "torch" | "flashinfer".
    cascade: shared-prefix attention "auto" | "on" | "off".
    num_threads: torch CPU threads (None = adapted at run time to the cores the engine gets).
    weights: projection weight format "auto" | "fp32" | "bf16" | "int8" | "int4"; auto = the fastest
        format that passes the accuracy gate on this machine (see engine/model/weights.py).
    kv_dtype: what the KV pages hold, "auto" | "fp32" | "fp16" | "bf16" | "q8" (auto: fp16 under fp32
        activations, else the activations' dtype; see ``engine.api.build.resolve_kv_dtype``). Attention reads
        16-bit and 8-bit pages and computes in fp32; a 16-bit cache holds twice the tokens of an fp32
        one in the same ``kv_budget_mib``, q8 (int8 values and an fp32 scale per head vector,
        ``attention/q8.py``) 3.76x for 64-dimension heads.
    pool_grace_ttl_s: seconds an interior pool stays pinned after its last descendant leaves.
    seed: default RNG seed for requests without one.
    pool_id_base: pool ids are pool_id_base+1, +2, ... (0: ids 1, 2, ...). A cluster gives each
        engine its own range so that ids stay unique across engines and say which one holds a pool.
    state_dir: where the pool tree, named sessions and id marks persist across restarts (None:
        nothing persists; see docs/persistence.md).
    session_kv_budget_mib: disk the named sessions' KV files may use in ``state_dir`` (the least
        recently written go first; 0: sessions come back without KV and recompute).
    kv_disk_budget_mib: disk the KV tier may use: pages reclaimed from RAM (sessions', pools' and the
        prefix cache's) are written there and read back instead of recomputed (docs/persistence.md).
        None (the default): on where a state directory or ``kv_disk_dir`` exists, with
        ``DEFAULT_KV_DISK_BUDGET_MIB`` capped at half the disk space free at start; 0: off (reclaimed
        KV is dropped and recomputed). It needs the prefix cache (the tier keeps its pages).
    kv_disk_dir: where the tier's files go (default: ``<state_dir>/kv_tier``; emptied at start).
    kv_disk_write_share: the tier's files go a 256 KiB window at a time; each window's checksum and
        copy run on the step thread before a step when the steps have lent the writer this share of
        their time (as fast as the disk goes while nothing computes), its ``O_DIRECT`` write beside the
        steps; 0: unpaced, the writer does everything beside the steps (on a CPU whose cores a step
        holds, the steps it overlaps stall). Default 0.03, measured (``persist/pacer.py``).
    kv_disk_write_ahead: while the engine is idle, and between steps within the tier's write share,
        idle sessions' KV is written to the tier while it stays in RAM when fewer than a quarter of the
        pages are free, so that the reclaim that takes it later frees its pages without copying them on
        the step thread (``persist/write_ahead.py``); only into the tier's free budget. False: pages are
        copied when reclaimed.
    kv_idle_spill_s: a session with no request in flight for longer than this leaves RAM before the
        prefix cache's pages and before sessions idle for less (which go before pools; running
        requests are preempted only after all of them).
    prefix_cache: share the KV of any cached prefix automatically (requests without a pool or a
        session id included); finished requests leave their full pages as evictable cache.
    session_ttl_s: an idle session nobody named (created without session_id) ends after this many
        seconds; its pages fall into the prefix cache.
    debug_checks: check the KV invariants each time the step loop goes idle (also on with the
        environment variable OPENCOTI_DEBUG_CHECKS=1).
    speculative: "ngram" (the default: prompt-lookup drafts verified in one step where the step
        cost model says they pay; outputs unchanged; see engine/core/speculative.py) or "off";
        speculative_max: draft tokens per step at most.
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    page_size: int = 16
    kv_budget_tokens: int | None = None
    kv_budget_mib: float | None = None
    max_batch_tokens: int = 512
    max_running: int = 64
    max_pools: int = 16
    max_context: int | None = None
    attention_backend: str = "auto"
    cascade: str = "auto"
    num_threads: int | None = None
    pool_grace_ttl_s: float = 30.0
    seed: int = 0
    cache_dir: str | None = None
    weights: str = "auto"
    kv_dtype: str = "auto"
    pool_id_base: int = 0
    debug_checks: bool = False
    state_dir: str | None = None
    session_kv_budget_mib: float = 1024.0
    kv_disk_budget_mib: float | None = None
    kv_disk_dir: str | None = None
    kv_idle_spill_s: float = 1.0
    kv_disk_write_share: float = DEFAULT_KV_DISK_WRITE_SHARE
    kv_disk_write_ahead: bool = True
    prefix_cache: bool = True
    session_ttl_s: float = 300.0
    speculative: str = "ngram"
    speculative_max: int = 8

    def __post_init__(self) -> None:
        _check(self.dtype in ("auto", "float32", "bfloat16", "float16"),
               f"dtype must be auto|float32|bfloat16|float16, got {self.dtype!r}")
        _check(isinstance(self.device, str) and (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")),
               f"device must be auto|cpu|cuda|cuda:N, got {self.device!r}")
        _check(_is_int(self.page_size) and 1 <= self.page_size <= 1024,
               f"page_size must be an integer in [1, 1024], got {self.page_size!r}")
        _check(self.kv_budget_tokens is None or self.kv_budget_mib is None,
               "give kv_budget_tokens or kv_budget_mib, not both")
        _check(self.kv_budget_tokens is None or (_is_int(self.kv_budget_tokens) and self.kv_budget_tokens >= self.page_size),
               f"kv_budget_tokens must be an integer >= page_size, got {self.kv_budget_tokens!r}")
        _check(self.kv_budget_mib is None or (_is_number(self.kv_budget_mib) and self.kv_budget_mib > 0),
               f"kv_budget_mib must be a positive number, got {self.kv_budget_mib!r}")
        _check(_is_int(self.max_batch_tokens) and self.max_batch_tokens >= 1,
               f"max_batch_tokens must be a positive integer, got {self.max_batch_tokens!r}")
        _check(_is_int(self.max_running) and self.max_running >= 1,
               f"max_running must be a positive integer, got {self.max_running!r}")
        _check(_is_int(self.max_pools) and self.max_pools >= 0,
               f"max_pools must be a non-negative integer, got {self.max_pools!r}")
        _check(self.max_context is None or (_is_int(self.max_context) and self.max_context >= 2),
               f"max_context must be an integer >= 2, got {self.max_context!r}")
        _check(self.attention_backend in ("auto", "torch", "flashinfer"),
               f"attention_backend must be auto|torch|flashinfer, got {self.attention_backend!r}")
        _check(self.cascade in ("auto", "on", "off"), f"cascade must be auto|on|off, got {self.cascade!r}")
        _check(self.num_threads is None or (_is_int(self.num_threads) and self.num_threads >= 1),
               f"num_threads must be a positive integer, got {self.num_threads!r}")
        _check(self.weights in ("auto", "fp32", "bf16", "int8", "int4"),
               f"weights must be auto|fp32|bf16|int8|int4, got {self.weights!r}")
        _check(isinstance(self.kv_dtype, str) and self.kv_dtype in KV_DTYPES,
               f"kv_dtype must be {'|'.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        _check(isinstance(self.debug_checks, bool), "debug_checks must be a boolean")
        _check(_is_number(self.session_kv_budget_mib) and self.session_kv_budget_mib >= 0,
               f"session_kv_budget_mib must be a number >= 0, got {self.session_kv_budget_mib!r}")
        _check(self.state_dir is None or (isinstance(self.state_dir, str) and self.state_dir.strip() != ""),
               f"state_dir must be a directory path or None, got {self.state_dir!r}")
        _check(_is_int(self.pool_id_base) and 0 <= self.pool_id_base < 2**53 - 2**32,
               f"pool_id_base must be an integer in [0, 2**53 - 2**32), got {self.pool_id_base!r}")
        _check(isinstance(self.prefix_cache, bool), "prefix_cache must be a boolean")
        _check(self.kv_disk_budget_mib is None or (_is_number(self.kv_disk_budget_mib) and self.kv_disk_budget_mib >= 0),
               f"kv_disk_budget_mib must be a number >= 0 or None (auto), got {self.kv_disk_budget_mib!r}")
        _check(self.kv_disk_dir is None or (isinstance(self.kv_disk_dir, str) and self.kv_disk_dir.strip() != ""),
               f"kv_disk_dir must be a directory path or None, got {self.kv_disk_dir!r}")
        _check(_is_number(self.kv_disk_write_share) and 0 <= self.kv_disk_write_share <= 1,
               f"kv_disk_write_share must be a number in [0, 1] (0: unpaced), got {self.kv_disk_write_share!r}")
        _check(isinstance(self.kv_disk_write_ahead, bool), "kv_disk_write_ahead must be a boolean")
        _check(_is_number(self.kv_idle_spill_s) and self.kv_idle_spill_s >= 0,
               f"kv_idle_spill_s must be a number >= 0, got {self.kv_idle_spill_s!r}")
        _check(self.speculative in SPECULATIVE_MODES, f"speculative must be ngram|off, got {self.speculative!r}")
        _check(_is_int(self.speculative_max) and 1 <= self.speculative_max <= 64,
               f"speculative_max must be an integer in [1, 64], got {self.speculative_max!r}")
        _check(_is_number(self.session_ttl_s) and self.session_ttl_s >= 0,
               f"session_ttl_s must be a number >= 0, got {self.session_ttl_s!r}")
        _check(_is_number(self.pool_grace_ttl_s) and self.pool_grace_ttl_s >= 0,
               f"pool_grace_ttl_s must be >= 0, got {self.pool_grace_ttl_s!r}")
