"""Engine: the thread-safe public API. One step-loop thread owns and mutates all engine state.

Callers (any thread, or asyncio) submit commands through a queue; the loop runs them between
steps, so requests join the running batch at the next step (continuous batching). Tokens stream
back through per-request queues.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Sequence as Seq

import torch

from ..admission import AdmissionController
from ..config import EngineConfig, SamplingParams
from ..core.core import EngineCore
from ..errors import EngineClosedError, InvalidRequestError
from ..observe.metrics import Metrics
from .build import build_parts, resolve_device, resolve_dtype
from .pool_api import PoolAPI
from ..polykv import status
from ..persist.sync import open_state
from ..persist.pacer import StepPacer
from ..persist.tier_open import open_tier
from ..persist.write_ahead import WriteAhead
from ..results import GenerationResult, PoolInfo
from .streams import AsyncTokenStream, TokenStream
from ..chat.tokenizer import first_bad_id

log = logging.getLogger("opencoti.engine")

_TRIM_EVERY_S = 2.0  # idle: the allocator's free memory goes back to the OS at most this often
_LOOP_TOKENS = 1 << 16  # astream: longer prompts of token ids are copied off the event loop


class Engine:
    """In-process inference engine. See ``EngineConfig`` for options.

    >>> eng = Engine.from_default()
    >>> eng.generate("Hello", params=SamplingParams.greedy(8)).text
    """

    def __init__(self, config: EngineConfig | None = None, *, progress: Callable[[str], None] | None = None,
                 loaded=None):
        self.config = config or EngineConfig()
        self.device = resolve_device(self.config.device)
        self.dtype = resolve_dtype(self.config.dtype, self.device)
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._debug_checks = self.config.debug_checks or os.environ.get("OPENCOTI_DEBUG_CHECKS", "") not in ("", "0")
        self._integrity_error: AssertionError | None = None  # first failure of an idle-time check
        self._trimmed_at = 0.0
        # All torch work — weight packing, KV allocation, every step — runs on the step thread, so
        # one OpenMP team serves the engine (measured: decode ~1.5x faster than building the
        # weights on the caller's thread and stepping on another).
        ready: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(ready, progress, loaded), name="opencoti-step",
                                        daemon=True)
        self._thread.start()
        try:
            ready.result()
        except BaseException:
            self._closed = True
            self._thread.join(timeout=30)
            raise

    def _run(self, ready: Future, progress, loaded) -> None:
        try:
            self._build(progress, loaded)
        except BaseException as e:  # noqa: BLE001 - handed to the constructor
            ready.set_exception(e)
            return
        ready.set_result(None)
        self._loop()

    def _build(self, progress, loaded) -> None:
        from ..model.weights import release_memory

        config = self.config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        t0 = time.perf_counter()
        parts = build_parts(config, self.device, self.dtype, progress=progress, loaded=loaded)
        self.loaded, self.model, self.kv, self.max_context = parts.loaded, parts.model, parts.kv, parts.max_context
        self.backend, self.attention_check = parts.backend, parts.attention_check
        max_ctx = self.max_context
        self.tokenizer = self.loaded.tokenizer
        self.core = EngineCore(config, model=self.model, tokenizer=self.tokenizer, backend=self.backend,
                               kv=self.kv, max_context=max_ctx, device=self.device)
        self.metrics = Metrics(self.core)  # per-session tps, counters (listens to the core)
        # prepare -> decide -> commit
        self.admission_controller = AdmissionController(self.core, self.post_to_step_thread, self.metrics)
        self.model_name = self.loaded.name
        # config.state_dir: restore the stored pools and sessions, keep in sync
        self.persister = open_state(self, admission=self.admission_controller)
        self.kv_tier = open_tier(self)  # reclaimed KV goes to disk and comes back (None: dropped, recomputed)
        # the step loop gives the tier's writes their turns between steps (no tier: nothing to pace)
        self.step_pacer = self.kv_tier.pacer if self.kv_tier is not None else StepPacer(share=None)
        if self.kv_tier is not None:
            self.step_pacer.share = config.kv_disk_write_share or None  # (0: unpaced)
        # idle sessions' KV written to the tier before a reclaim takes it (it then frees them copy-free)
        self.write_ahead = (WriteAhead(self.kv_tier, self.core.polykv, self.kv)
                            if self.kv_tier is not None and config.kv_disk_write_ahead else None)
        self.pool_api = PoolAPI(self.core, run=self.run_on_step_thread, tokenize=self.tokenize,
                                apply_chat_template=self.apply_chat_template, metrics=self.metrics,
                                page_bytes=self.kv.page_bytes)
        release_memory()  # what start-up built and dropped (candidate formats, the gate's reference, buffers)
        self.load_seconds = time.perf_counter() - t0

    @classmethod
    def from_default(cls, **overrides) -> "Engine":
        """The bundled SmolLM2-135M-Instruct with default settings (``overrides`` go to EngineConfig)."""
        progress = overrides.pop("progress", None)
        return cls(EngineConfig(**overrides), progress=progress)

    # ======================================================================== step loop
    def _loop(self) -> None:
        core = self.core
        pacer = self.step_pacer
        busy = False
        while True:
            if busy and not core.has_work:
                busy = False
                self._idle_check()
                if self._cmds.empty():  # a request already waiting goes first; trimmed at the next idle
                    self._trim_when_idle()
            core.polykv.expire_sessions()
            adm = self.admission_controller
            adm.tick()  # admission deadlines: settle windows that ran out, held requests to re-try
            release_at = core.polykv.release_due()  # pool releases deferred by the grace TTL
            try:  # block only when there is nothing to compute, and then only until the next deadline
                if core.has_work:
                    cmd = self._cmds.get_nowait()
                else:
                    pacer.idle()  # the disk tier writes freely while nothing computes
                    waits = [] if release_at is None else [release_at - time.monotonic()]
                    expiry = core.polykv.next_expiry()  # an idle anonymous session to end
                    if expiry is not None:
                        waits.append(expiry)
                    wake = adm.next_deadline()
                    if wake is not None:
                        waits.append(wake - adm.clock())
                    ahead = self.write_ahead.idle() if self.write_ahead is not None else None
                    if ahead is not None:  # more to write ahead: look again (a request that came goes first)
                        waits.append(ahead)
                    cmd = self._cmds.get(timeout=max(0.0, min(waits))) if waits else self._cmds.get()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                if cmd is _STOP:
                    self._drain_on_close()
                    return
                fn, args, kwargs, fut = cmd
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(self.persister.after(fn(*args, **kwargs)))  # durable before answered
                    except BaseException as e:  # noqa: BLE001 - handed to the caller
                        fut.set_exception(e)
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    cmd = None
            if core.has_work:
                busy = True
                pacer.step_begin()
                t0 = time.perf_counter()
                try:
                    stats = core.step()
                    for fn in core.listeners:
                        fn("step", {"stats": stats})
                except Exception as e:  # a bug or OOM in a step: fail the batch, keep serving
                    log.exception("engine step failed")
                    self.core.fail_all(e)
                finally:
                    pacer.step_end(time.perf_counter() - t0)

    def _trim_when_idle(self) -> None:
        """The loop went idle: give what the steps freed (prefill temporaries stay in the C heap:
        ~100 MiB after three 1,600-token prompts on the bundled model) back to the OS; malloc_trim
        takes ~8 ms there, so at most every ``_TRIM_EVERY_S`` seconds."""
        from ..model.weights import release_memory

        now = time.monotonic()
        if now - self._trimmed_at >= _TRIM_EVERY_S:
            self._trimmed_at = now
            release_memory(collect=False)

    def _idle_check(self) -> None:
        """Debug mode: check the KV invariants each time the step loop goes idle (O(pages))."""
        if not self._debug_checks or self._integrity_error is not None:
            return
        try:
            status.check_integrity(self.core.polykv)
        except AssertionError as e:
            log.exception("KV integrity check failed")
            self._integrity_error = e

    def _drain_on_close(self) -> None:
        self.core.fail_all(EngineClosedError("engine shut down"))
        self.admission_controller.close(EngineClosedError("engine shut down"))  # requests held by admission
        self.persister.close()
        self.step_pacer.idle()  # no step will run again: a write waiting for its turn goes on
        if self.kv_tier is not None:
            self.kv_tier.close()
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd is not _STOP:
                cmd[3].set_exception(EngineClosedError("engine shut down"))

    def post_to_step_thread(self, fn: Callable, *args, **kwargs) -> Future:
        """Run ``fn(*args, **kwargs)`` on the step thread, between steps (the only thread that may
        touch the core); a Future of its result, failed with EngineClosedError once shut down."""
        if self._closed:
            raise EngineClosedError("engine shut down")
        fut: Future = Future()
        self._cmds.put((fn, args, kwargs, fut))
        return fut

    def run_on_step_thread(self, fn: Callable, *args, **kwargs) -> Any:
        """``post_to_step_thread`` and wait for the result (raises what ``fn`` raised)."""
        return self.post_to_step_thread(fn, *args, **kwargs).result()

    def shutdown(self) -> None:
        """Stop the step loop; pending requests fail with EngineClosedError."""
        if self._closed:
            return
        self._closed = True
        self._cmds.put(_STOP)
        self._thread.join(timeout=30)

    close = shutdown

    @property
    def is_closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ======================================================================== pools and sessions (pools.py)
    def create_pool(self, *, tokens: Seq[int] | None = None, text: str | None = None,
                    messages: list[dict] | None = None, tools: list[dict] | None = None,
                    from_session: str | None = None, pinned: bool = False, label: str = "",
                    add_generation_prompt: bool = False, as_root: bool = False,
                    tenant: str | None = None) -> PoolInfo:
        """Create a root pool and materialize it (prefill only). Returns when it is resident.

        ``messages`` are rendered with the chat template (``add_generation_prompt`` False by
        default, so a later chat request that continues the conversation attaches to it).
        ``from_session`` of a session attached to a resident pool makes a child of that pool
        (zero-copy, branched at a page boundary) unless ``as_root`` (docs/polykv.md).
        """
        api = self.pool_api
        return api.create(api.tokens_of(tokens, text, messages, tools, add_generation_prompt),
                          from_session=from_session, pinned=pinned, label=label, as_root=as_root, tenant=tenant)

    def fork_pool(self, parent_id: int, *, branch_pos: int | None = None, tokens: Seq[int] | None = None,
                  text: str | None = None, messages: list[dict] | None = None, tools: list[dict] | None = None,
                  from_session: str | None = None, pinned: bool = False, label: str = "",
                  add_generation_prompt: bool = False, tenant: str | None = None) -> PoolInfo:
        """Fork ``parent_id`` at ``branch_pos`` D (default: the parent's L, i.e. extend).

        ``tokens`` (or text/messages) is the child's FULL prefix [0, L); ``tokens[0:D]`` must equal
        the parent's (else PoolContractError, nothing changes). The child computes only [D, L).
        """
        api = self.pool_api
        return api.fork(parent_id, branch_pos, api.tokens_of(tokens, text, messages, tools, add_generation_prompt),
                        from_session=from_session, pinned=pinned, label=label, tenant=tenant)

    def pool(self, pool_id: int) -> PoolInfo:
        return self.pool_api.info(pool_id)

    def pool_tokens(self, pool_id: int) -> list[int]:
        """A pool's whole token prefix ``[0, L)`` (PoolNotFoundError for an unknown id)."""
        return self.pool_api.tokens(pool_id)

    def pools(self) -> dict:
        """The pool tree (fields in docs/polykv.md), each session with its live ``tps_ewma``."""
        return self.pool_api.tree()

    def pin_pool(self, pool_id: int) -> PoolInfo:
        return self.pool_api.pin(pool_id, True)

    def unpin_pool(self, pool_id: int) -> PoolInfo:
        return self.pool_api.pin(pool_id, False)

    def evict_pool(self, pool_id: int) -> PoolInfo:
        return self.pool_api.evict(pool_id)

    def flush_pool(self, pool_id: int) -> int:
        """End the idle sessions attached to the pool; returns how many."""
        return self.pool_api.flush(pool_id)

    def release_pool(self, pool_id: int, *, immediate: bool = False, cascade_sessions: bool = False) -> list[str]:
        """Release a pool (leaves first). Within its grace TTL the release is deferred until the
        grace ends (the pool stays attachable meanwhile); ``immediate`` releases it now.
        ``cascade_sessions`` first ends the sessions that keep its KV (its own and those of its
        descendants, released ones included: ``held_by`` in the listing). Returns the ended session ids."""
        return self.pool_api.release(pool_id, immediate, cascade_sessions)

    def compact_session(self, session_id: str, ancestor_pool_id: int, *, tokens: Seq[int] | None = None,
                        text: str | None = None, messages: list[dict] | None = None,
                        branch_pos: int | None = None, release_old: bool = True) -> dict:
        """Compaction by re-fork: fork the stable ancestor with the compacted prefix
        (e.g. system + summary + recent tail), move the session onto it, release the pools it leaves
        behind that nothing else uses (at once). Returns the new pool, the released pool ids and the
        KV pages owned by pools and sessions before / after (pages only the prefix cache holds,
        reusable and evicted first, apart: ``kv_pages_cache_before`` / ``_after``)."""
        api = self.pool_api
        return api.compact(session_id, ancestor_pool_id, api.tokens_of(tokens, text, messages, None, False),
                           branch_pos, release_old)

    def release_session(self, session_id: str) -> None:
        """End a session: a request in flight is cancelled, its KV and its place in the tree go."""
        self.pool_api.release_session(session_id)

    # ======================================================================== tokens & chat
    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequestError("text must be a string")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def detokenize(self, token_ids: Seq[int]) -> str:
        ids = token_ids if type(token_ids) is list else list(token_ids)  # a long list is not copied
        if ids and first_bad_id(ids, self.core.vocab_size) is not None:
            self.core.limits.check_tokens(ids, "tokens")  # the exact check and its error
        return self.tokenizer.decode(ids)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True) -> str:
        from ..chat import render_chat
        return render_chat(self.tokenizer, messages, tools=tools, add_generation_prompt=add_generation_prompt)

    def _prompt_tokens(self, prompt, messages, tools) -> list[int]:
        if (prompt is None) == (messages is None):
            raise InvalidRequestError("give exactly one of prompt or messages")
        if messages is not None:
            return self.tokenize(self.apply_chat_template(messages, tools=tools))
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            return self.tokenize(prompt)
        if isinstance(prompt, (list, tuple)):
            return list(prompt)
        raise InvalidRequestError("prompt must be a string or a list of token ids")

    # ======================================================================== generation
    def _start(self, prompt, messages, tools, params, session_id, pool_id, shared_prefix_n_tokens,
               sink: Callable[[tuple], None], overcommit: bool = False, cache_salt: str | None = None):
        if isinstance(prompt, (list, tuple)) and len(prompt) > self.max_context:  # refused before any copy
            self.core.limits.check_fits(len(prompt), getattr(params, "max_tokens", None))  # or check of its ids
        tokens = self._prompt_tokens(prompt, messages, tools)
        params = params if params is not None else SamplingParams()
        return self.admission_controller.submit(tokens, params, sink, session_id=session_id, pool_id=pool_id,
                                      shared_prefix_n_tokens=shared_prefix_n_tokens, overcommit=overcommit,
                                      cache_salt=cache_salt)

    def stream(self, prompt: str | Seq[int] | None = None, *, messages: list[dict] | None = None,
               tools: list[dict] | None = None, params: SamplingParams | None = None, session_id: str | None = None,
               pool_id: int | None = None, shared_prefix_n_tokens: int | None = None,
               overcommit: bool = False, cache_salt: str | None = None) -> "TokenStream":
        """Start a request; iterate the result for TokenDelta events, then read ``.result``.

        ``pool_id`` attaches to a pool (the shared prefix P is found automatically, or validated when
        ``shared_prefix_n_tokens`` is given); ``session_id`` names the session whose KV outlives the
        request; ``overcommit`` bypasses an enforced admission floor. Any cached prefix is reused
        automatically (``EngineConfig.prefix_cache``); requests share cached KV only with requests
        of the same ``cache_salt``."""
        q: queue.SimpleQueue = queue.SimpleQueue()
        fut = self._start(prompt, messages, tools, params, session_id, pool_id, shared_prefix_n_tokens, q.put,
                          overcommit, cache_salt)
        job = fut.result()  # raises the validation error, if any
        return TokenStream(self, job, q)

    def generate(self, prompt: str | Seq[int] | None = None, **kw) -> GenerationResult:
        """Run a request to completion. Same arguments as ``stream``."""
        s = self.stream(prompt, **kw)
        for _ in s:
            pass
        assert s.result is not None  # a stream run to its end has its result (an error is raised)
        return s.result

    async def astream(self, prompt: str | Seq[int] | None = None, *, messages=None, tools=None, params=None,
                      session_id=None, pool_id=None, shared_prefix_n_tokens=None,
                      overcommit: bool = False, cache_salt: str | None = None) -> "AsyncTokenStream":
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def sink(ev: tuple) -> None:
            loop.call_soon_threadsafe(q.put_nowait, ev)

        args = (prompt, messages, tools, params, session_id, pool_id, shared_prefix_n_tokens, sink, overcommit,
                cache_salt)
        if isinstance(prompt, (list, tuple)) and len(prompt) > _LOOP_TOKENS:  # copying it would stall the loop
            fut = await asyncio.to_thread(self._start, *args)
        else:
            fut = self._start(*args)
        job = await asyncio.wrap_future(fut)
        return AsyncTokenStream(self, job, q)

    async def agenerate(self, prompt: str | Seq[int] | None = None, **kw) -> GenerationResult:
        s = await self.astream(prompt, **kw)
        async for _ in s:
            pass
        assert s.result is not None  # a stream run to its end has its result (an error is raised)
        return s.result

    def cancel(self, job) -> None:
        if not self._closed:
            self.post_to_step_thread(self.core.cancel, job)

    def check_integrity(self) -> None:
        """Assert the KV refcount and ownership invariants (runs on the step thread). In debug mode
        (``EngineConfig.debug_checks`` or OPENCOTI_DEBUG_CHECKS=1) the loop also checks them each
        time it goes idle; the first failure found there is raised here."""
        if self._integrity_error is not None:
            raise self._integrity_error
        self.run_on_step_thread(status.check_integrity, self.core.polykv)

    def check_kv_files(self, pool_ids: set[int] | None = None) -> dict:
        """Verify the checksums of the state directory's KV files (see ``Persister.check_kv_files``)."""
        return self.persister.check_kv_files(self.run_on_step_thread, pool_ids)

    def stats(self) -> dict:
        """Counters, KV pages, sessions, queue lengths and the prefix cache (pages, bytes, hit rate)."""
        core = self.core
        return self.run_on_step_thread(lambda: status.stats(core.polykv, core.counters, len(core.scheduler.running),
                                                            len(core.scheduler.waiting)))

    def weights_info(self) -> dict:
        """The projection weight format, the kernel per shape, weight bytes read per decode step, why
        the format was chosen (``auto``: estimates and accuracy-gate numbers) and, on CPU, the thread
        adapter's state."""
        return self.run_on_step_thread(lambda: {**self.model.weights_info, "choice": getattr(self.model, "weights_choice", None)})

    # ======================================================================== tps & admission
    def tps_snapshot(self) -> dict:
        """Live tps: ``{ts, aggregate_tps, mean_active_tps, n_warming, sessions: [{session_id,
        pool_id, tps_ewma, ctx_used, ctx_total, ctx_headroom_tokens, compaction_pressure, state}]}``."""
        return self.run_on_step_thread(self.metrics.snapshot)

    def tps_history(self, session_id: str | None = None, since: float | None = None) -> dict:
        """The sampled tps time series (engine-wide and per session; bounded), points with ts >= since."""
        return self.run_on_step_thread(self.metrics.history_view, session_id, since)

    def configure_tps(self, **settings) -> dict:
        """Change the tps windows (``metrics.TpsConfig`` fields, e.g. window_tokens=128, window_s=2.0)."""
        return self.run_on_step_thread(self.metrics.configure, **settings)

    def metrics_counters(self) -> dict:
        """Lifetime counters: engine totals and per pool (queries, prefix cache hits, tokens)."""
        return self.run_on_step_thread(self.metrics.counters)

    def prometheus_metrics(self) -> str:
        """Prometheus text exposition of the tps / pool gauges and counters (labels: pool only)."""
        return self.run_on_step_thread(self.metrics.prometheus)

    def set_admission(self, pool_id: int, **policy) -> dict:
        """Set (merge) the admission policy of a pool (docs/polykv.md): target_tps_per_session, mode,
        on_saturation, guarantee_min_sessions, settle_tokens, settle_max_ms, queue_timeout_ms."""
        return self.run_on_step_thread(self.admission_controller.set_policy, pool_id, **policy)

    def admission(self, pool_id: int) -> dict:
        """The admission policy of a pool (defaults when none was set)."""
        return self.run_on_step_thread(self.admission_controller.policy, pool_id)

    def capacity(self, pool_id: int, expected_tokens: int | None = None, session_id: str | None = None) -> dict:
        """Whether one more (new) session fits the pool now, and why (docs/polykv.md)."""
        return self.run_on_step_thread(self.admission_controller.capacity, pool_id, expected_tokens, session_id)

    def admission_events(self, pool_id: int | None = None, since: float | None = None) -> list[dict]:
        """Recent admission events (admit, settle_end, hold, rejected, warned, overcommit, guaranteed, policy)."""
        return self.run_on_step_thread(self.admission_controller.events_view, pool_id, since)


_STOP = object()
