"""The operations table: every non-streaming operation of the API, once.

Each ``Operation`` names its HTTP method and path, its inputs (path parameters, a query model, a
body model: the validation), the engine call (``run``) and its result's documented shape. The HTTP
server registers one route per row (``opencoti.server.routes_ops``); the client's HTTP transport
builds requests from the same rows and its in-process transport calls ``call`` - so both
transports validate, run and answer identically. Generation (``complete``, ``chat``) and the live
tps stream have rows too (the HTTP client needs their paths), but their HTTP routes are written
by hand because they stream.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

from pydantic import BaseModel

from .. import __version__
from ..engine.chat import render_chat, template_caps
from ..engine.errors import InvalidRequestError, OpencotiError, PoolNotFoundError
from ..engine.persist.slots import slot_number
from . import results as R
from .context import Context
from .generation import run_completion
from .prefix import prefix_tokens
from .schemas import (AdmissionRequest, ApplyTemplateRequest, CapacityQuery, ChatCompletionRequest, CompactRequest,
                      CompletionRequest, CreatePoolRequest, DetokenizeRequest, EventsQuery, ForkPoolRequest,
                      ReleasePoolQuery, TokenizeRequest, TpsHistoryQuery)
from .validation import validate_json, validate_query

PATH_PARAMS = {"pool_id": int, "session_id": str}


class IntegrityCheckError(OpencotiError):
    """The KV integrity check found a broken invariant (HTTP 500)."""


@dataclass(frozen=True)
class Operation:
    name: str
    method: str
    path: str
    run: Callable[..., Any] | None  # run(ctx, **path_params, query=..., body=...); None: streaming only
    body: type[BaseModel] | None = None
    query: type[BaseModel] | None = None
    result: type[BaseModel] | None = None
    summary: str = ""
    tags: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()  # more paths for the same route (hidden from the schema)
    blocking: bool = True  # the engine call blocks: run it in a worker thread
    route: bool = True  # False: the HTTP route is written by hand (it streams)
    errors: tuple[int, ...] = (400, 503)  # statuses it may answer besides 200 (documented)
    query_fixed: dict = field(default_factory=dict)  # query the HTTP client always sends

    @property
    def path_params(self) -> list[str]:
        return re.findall(r"{(\w+)}", self.path)


# ============================================================================ runs
def _health(ctx: Context) -> dict:
    ctx.require_open()
    return {"status": "ok"}


def _models(ctx: Context) -> dict:
    eng = ctx.engine
    return {"object": "list", "data": [{
        "id": ctx.model_name, "object": "model", "created": int(ctx.started), "owned_by": "opencoti",
        "aliases": sorted({ctx.model_name, eng.model_name}),  # the names requests may use for this model
        # n_ctx: the most tokens one request (prompt + answer) may use: the context, or the KV cache if smaller
        "meta": {"n_ctx_train": eng.max_context, "n_ctx": min(eng.max_context, eng.kv.num_pages * eng.kv.page_size),
                 "n_vocab": eng.tokenizer.vocab_size, "page_size": eng.kv.page_size,
                 "device": str(eng.device), "dtype": str(eng.dtype).replace("torch.", "")},
    }]}


def model_path(eng) -> str:
    """Where the served model was loaded from: the GGUF file or model directory (the bundled model's
    GGUF for the default), or the spec of a test model."""
    from ..engine.model.loader import BUNDLED_NAME, bundled_gguf_path

    spec, loaded = eng.config.model, eng.loaded
    if spec in (None, "default") and loaded.name == BUNDLED_NAME:
        return str(bundled_gguf_path())
    if spec is not None and spec != "default":
        return str(spec)
    return str(loaded.model_dir or loaded.name)  # a model handed to the engine directly


def _props(ctx: Context) -> dict:
    from ..engine.admission import AdmissionPolicy

    eng = ctx.engine
    cfg = eng.config
    caps = template_caps(eng.tokenizer)
    defaults = AdmissionPolicy()
    n_predict = -1 if ctx.default_max_tokens is None else ctx.default_max_tokens
    return {
        "default_generation_settings": {
            "n_ctx": eng.max_context,
            "params": {"n_predict": n_predict, "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
                       "seed": cfg.seed},  # the default seed (--seed; drawn at start for -1)
        },
        "total_slots": cfg.max_running, "model_path": model_path(eng), "model_alias": ctx.model_name,
        "chat_template": eng.tokenizer.chat_template or "", "modalities": {"vision": False, "audio": False},
        "build_info": f"opencoti {__version__}",
        "opencoti": {"version": __version__, "weights": eng.weights_info(), "polykv": {
            "max_pools": cfg.max_pools, "page_size": eng.kv.page_size, "kv_pages_total": eng.kv.num_pages,
            "kv_budget_tokens": eng.kv.num_pages * eng.kv.page_size, "max_context": eng.max_context,
            "kv_dtype": eng.kv.dtype_name, "kv_bytes_per_token": eng.kv.page_bytes // eng.kv.page_size,
            # reserved (the cap) vs resident vs used KV bytes: docs/http-api.md, sizing the KV cache
            "kv_memory": eng.kv.memory(),
            "max_running": cfg.max_running,
            "floor_default": {"target_tps_per_session": defaults.target_tps_per_session},
            "admission_defaults": defaults.as_dict(),
            "pin_policy": {"interior_auto_pin": True, "grace_ttl_s": cfg.pool_grace_ttl_s,
                           "evict_order": f"sessions idle for more than {cfg.kv_idle_spill_s:g} s (kv_idle_spill_s), "
                                          "then the prefix cache (LRU, leaves first), then the other idle sessions, "
                                          "then unpinned idle pools (LRU); evicted pages go to the disk tier when "
                                          "there is one (kv_tiers)"},
            "kv_tiers": eng.stats()["kv_tiers"],  # bytes in RAM and on disk (docs/persistence.md, KV tiers)
            "prefix_cache": {"session_ttl_s": cfg.session_ttl_s, **eng.stats()["prefix_cache"]},
            "tps": eng.configure_tps(), "tps_stream_interval_ms": ctx.tps_interval_ms,
            "chat_template_tools": {"native_tools": caps.supports_tools, "native_tool_calls": caps.supports_tool_calls},
            "attention_backend": type(eng.backend).__name__,
            "attention_check": eng.attention_check,  # the backend's start-up self-check against torch
        }},
    }


def _slots(ctx: Context) -> list:
    snap = ctx.engine.tps_snapshot()
    # llama.cpp's slot id: N for the session named "N" (id_slot N, /slots/N), -1 for other names
    return [{"id": slot_number(s["session_id"]), "id_task": -1, "n_ctx": s["ctx_total"],
             "is_processing": s["state"] != "idle", **s} for s in snap["sessions"]]


def _tokenize(ctx: Context, body: TokenizeRequest) -> dict:
    ids = ctx.engine.tokenize(body.content, add_special_tokens=body.add_special)
    if body.with_pieces:
        return {"tokens": [{"id": i, "piece": ctx.piece(i)} for i in ids]}
    return {"tokens": ids}


def _detokenize(ctx: Context, body: DetokenizeRequest) -> dict:
    return {"content": ctx.engine.detokenize(body.tokens) if body.tokens else ""}


def _apply_template(ctx: Context, body: ApplyTemplateRequest) -> dict:
    return {"prompt": render_chat(ctx.engine.tokenizer, body.messages, body.tools, body.add_generation_prompt)}


def _create_pool(ctx: Context, body: CreatePoolRequest) -> dict:
    tokens, from_session = prefix_tokens(ctx, body, body.from_session, body.add_generation_prompt)
    return ctx.engine.create_pool(tokens=tokens, from_session=from_session, pinned=body.pinned,
                                  label=body.label, as_root=body.as_root).as_dict()


def _fork_pool(ctx: Context, pool_id: int, body: ForkPoolRequest) -> dict:
    eng = ctx.engine
    eng.pool(pool_id)  # 404 before any tokenizing
    tokens, from_session = prefix_tokens(ctx, body, body.from_session, body.add_generation_prompt)
    return eng.fork_pool(pool_id, branch_pos=body.branch_pos, tokens=tokens, from_session=from_session,
                         pinned=body.pinned, label=body.label).as_dict()


def _pool(ctx: Context, pool_id: int) -> dict:
    eng = ctx.engine
    root = eng.pool(pool_id).as_dict()
    tree = {p["pool_id"]: p for p in eng.pools()["pools"]}
    subtree, todo = [], list(root["children"])
    while todo:
        p = tree.get(todo.pop(0))
        if p is not None:
            subtree.append(p)
            todo.extend(p["children"])
    return {**root, "subtree": subtree}


def _release_pool(ctx: Context, pool_id: int, query: ReleasePoolQuery) -> dict:
    eng = ctx.engine
    ended = None
    if query.cascade == "sessions":
        ended = {"ended_sessions": eng.release_pool(pool_id, immediate=query.immediate, cascade_sessions=True)}
    else:
        eng.release_pool(pool_id, immediate=query.immediate)
    try:  # deferred by the grace TTL: the pool lives on (attachable) until release_in_s
        release_in_s = eng.pool(pool_id).release_in_s
    except PoolNotFoundError:
        release_in_s = None  # released now
    return {"pool_id": pool_id, "released": True, "release_in_s": release_in_s, **(ended or {})}


def _flush_pool(ctx: Context, pool_id: int) -> dict:
    return {"pool_id": pool_id, "flushed_sessions": ctx.engine.flush_pool(pool_id)}


def _set_admission(ctx: Context, pool_id: int, body: AdmissionRequest) -> dict:
    policy = body.model_dump(exclude_unset=True)
    policy = {k: v for k, v in policy.items() if v is not None or k == "target_tps_per_session"}
    return ctx.engine.set_admission(pool_id, **policy)


def _release_session(ctx: Context, session_id: str) -> dict:
    ctx.engine.release_session(session_id)
    return {"session_id": session_id, "released": True}


def _compact_session(ctx: Context, session_id: str, body: CompactRequest) -> dict:
    tokens, _ = prefix_tokens(ctx, body)
    out = ctx.engine.compact_session(session_id, body.ancestor_pool_id, tokens=tokens, branch_pos=body.branch_pos,
                                     release_old=body.release_old)
    return {**out, "pool": out["pool"].as_dict()}


def _integrity(ctx: Context) -> dict:
    eng = ctx.engine
    try:
        eng.check_integrity()
    except AssertionError as e:
        raise IntegrityCheckError(f"integrity check failed: {e}") from None
    files = eng.check_kv_files()  # a corrupt file is reported, dropped and written again
    st = eng.pools()
    return {"ok": not files["corrupt"], "kv_pages_used": st["kv_pages_used"], "kv_pages_total": st["kv_pages_total"],
            "kv_files": files}


def _pool_info(method: str) -> Callable[[Context, int], dict]:
    return lambda ctx, pool_id: getattr(ctx.engine, method)(pool_id).as_dict()


# ============================================================================ the table
_L, _O, _P = ("llama.cpp",), ("OpenAI",), ("PolyKV",)
_POOL = (400, 404, 503)
_POOL_CONFLICT = (400, 404, 409, 503)
_ROWS = [
    Operation("health", "GET", "/health", _health, summary="200 when the model is loaded, 503 while loading",
              tags=_L, aliases=("/v1/health",), blocking=False, errors=(500, 503)),
    Operation("models", "GET", "/v1/models", _models, summary="the one model served", tags=_O, aliases=("/models",),
              blocking=False),
    Operation("props", "GET", "/props", _props, summary="server properties, with the opencoti.polykv block", tags=_L),
    Operation("slots", "GET", "/slots", _slots, summary="one entry per session (tps, context headroom)", tags=_L),
    Operation("tokenize", "POST", "/tokenize", _tokenize, body=TokenizeRequest, tags=_L, summary="text -> token ids"),
    Operation("detokenize", "POST", "/detokenize", _detokenize, body=DetokenizeRequest, tags=_L,
              summary="token ids -> text"),
    Operation("apply_template", "POST", "/apply-template", _apply_template, body=ApplyTemplateRequest, tags=_L,
              summary="render chat messages (and tools) to the prompt text a chat request would use"),
    Operation("complete", "POST", "/completion", run_completion, body=CompletionRequest, route=False,
              errors=(400, 404, 409, 429, 503)),
    Operation("chat", "POST", "/v1/chat/completions", None, body=ChatCompletionRequest, route=False,
              errors=(400, 404, 409, 429, 503)),
    Operation("create_pool", "POST", "/polykv/pools", _create_pool, body=CreatePoolRequest, result=R.Pool, tags=_P,
              summary="create a root pool (prefill only; returns when resident)", errors=_POOL_CONFLICT),
    Operation("pools", "GET", "/polykv/pools", lambda ctx: ctx.engine.pools(), result=R.PoolTree, tags=_P,
              summary="the pool tree with sessions, KV bytes by ownership"),
    Operation("pool", "GET", "/polykv/pools/{pool_id}", _pool, result=R.Pool, tags=_P,
              summary="one pool and its subtree", errors=_POOL),
    Operation("release_pool", "DELETE", "/polykv/pools/{pool_id}", _release_pool, query=ReleasePoolQuery, tags=_P,
              summary="release a pool (409 while it has child pools; deferred within its grace TTL unless "
                      "immediate)", errors=_POOL_CONFLICT),
    Operation("fork_pool", "POST", "/polykv/pools/{pool_id}/fork", _fork_pool, body=ForkPoolRequest, result=R.Pool,
              tags=_P, summary="fork: extend (branch_pos == L) or COW branch (branch_pos < L)",
              errors=_POOL_CONFLICT),
    Operation("pin_pool", "POST", "/polykv/pools/{pool_id}/pin", _pool_info("pin_pool"), result=R.Pool, tags=_P,
              summary="pin: never evicted", errors=_POOL),
    Operation("unpin_pool", "POST", "/polykv/pools/{pool_id}/unpin", _pool_info("unpin_pool"), result=R.Pool,
              tags=_P, summary="unpin", errors=_POOL),
    Operation("evict_pool", "POST", "/polykv/pools/{pool_id}/evict", _pool_info("evict_pool"), result=R.Pool,
              tags=_P, summary="drop the pool's KV now (it re-materializes on next use)", errors=_POOL_CONFLICT),
    Operation("flush_pool", "POST", "/polykv/pools/{pool_id}/flush", _flush_pool, tags=_P,
              summary="end the idle sessions attached to the pool", errors=_POOL),
    Operation("admission", "GET", "/polykv/pools/{pool_id}/admission", lambda ctx, pool_id: ctx.engine.admission(
        pool_id), result=R.AdmissionPolicy, tags=_P, summary="the pool's admission policy", errors=_POOL),
    Operation("set_admission", "POST", "/polykv/pools/{pool_id}/admission", _set_admission, body=AdmissionRequest,
              result=R.AdmissionPolicy, tags=_P, summary="set (merge) the pool's admission policy", errors=_POOL),
    Operation("capacity", "GET", "/polykv/pools/{pool_id}/capacity",
              lambda ctx, pool_id, query: ctx.engine.capacity(pool_id, expected_tokens=query.expected_tokens,
                                                              session_id=query.session_id),
              query=CapacityQuery, result=R.Capacity, tags=_P,
              summary="can one more (new) session be admitted, and why", errors=_POOL),
    Operation("events", "GET", "/polykv/events",
              lambda ctx, query: {"events": ctx.engine.admission_events(query.pool_id, query.since)},
              query=EventsQuery, tags=_P, summary="recent admission events"),
    Operation("release_session", "DELETE", "/polykv/sessions/{session_id}", _release_session, tags=_P,
              summary="release a session and its KV", errors=(400, 404, 409, 503)),
    Operation("compact_session", "POST", "/polykv/sessions/{session_id}/compact", _compact_session,
              body=CompactRequest, result=R.CompactionResult, tags=_P,
              summary="compaction by re-fork of a stable ancestor (docs/polykv.md)", errors=_POOL_CONFLICT),
    Operation("tps", "GET", "/polykv/tps", lambda ctx: ctx.engine.tps_snapshot(), result=R.TpsSnapshot, tags=_P,
              route=False, query_fixed={"once": 1}),
    Operation("tps_history", "GET", "/polykv/tps/history",
              lambda ctx, query: ctx.engine.tps_history(query.session_id, query.since), query=TpsHistoryQuery,
              tags=_P, summary="the sampled tps time series"),
    Operation("integrity", "GET", "/polykv/integrity", _integrity, tags=_P,
              summary="run the KV integrity check (refcounts, ownership, the checksums of the KV files on disk)",
              errors=(500, 503)),
]
OPERATIONS: dict[str, Operation] = {op.name: op for op in _ROWS}


def call(ctx: Context, name: str, path: dict | None = None, query: dict | None = None, body: Any = None) -> Any:
    """Run operation ``name`` in-process: validate its inputs as the HTTP route does, then run it."""
    op = OPERATIONS[name]
    if op.run is None:
        raise ValueError(f"operation {name!r} only streams")
    ctx.require_open()
    kw: dict[str, Any] = {}
    for p in op.path_params:
        value = (path or {}).get(p)
        want = PATH_PARAMS[p]
        if isinstance(value, bool) or not isinstance(value, want) or (want is str and not value):
            raise InvalidRequestError(f"{p} must be {'an integer' if want is int else 'a non-empty string'}, "
                                      f"got {value!r}")
        kw[p] = value
    if op.query is not None:
        kw["query"] = validate_query(op.query, query)
    if op.body is not None:
        kw["body"] = validate_json(op.body, body)
    return op.run(ctx, **kw)
