"""llama.cpp / OpenAI compatibility routes: /health, /v1/models, /props, /slots, /tokenize,
/detokenize, /apply-template, /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

from .. import __version__
from ..engine.admission import AdmissionPolicy
from .app import ServerState
from .errors import error_body
from .schemas import ApplyTemplateRequest, DetokenizeRequest, TokenizeRequest
from .tools import render_chat_prompt

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.server


@router.get("/health", tags=["llama.cpp"], summary="200 when the model is loaded, 503 while loading")
@router.get("/v1/health", include_in_schema=False)
def health(request: Request):
    state = _state(request)
    if state.is_ready:
        return {"status": "ok"}
    if state.load_error is not None:
        return JSONResponse(error_body(500, f"model failed to load: {state.load_error}", "model_load_error"),
                            status_code=500)
    if state.engine is not None:  # closed
        return JSONResponse(error_body(503, "the server is shutting down", "unavailable_error"), status_code=503)
    return JSONResponse(error_body(503, "Loading model", "unavailable_error"), status_code=503,
                        headers={"Retry-After": "5"})


@router.get("/v1/models", tags=["OpenAI"], summary="the one model served")
@router.get("/models", include_in_schema=False)
def models(request: Request):
    state = _state(request)
    eng = state.require_engine()
    return {"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": int(state.started), "owned_by": "opencoti",
        "meta": {"n_ctx_train": eng.max_context, "n_vocab": eng.tokenizer.vocab_size,
                 "page_size": eng.kv.page_size, "device": str(eng.device), "dtype": str(eng.dtype).replace("torch.", "")},
    }]}


@router.get("/props", tags=["llama.cpp"], summary="server properties, with the opencoti.polykv block")
def props(request: Request):
    state = _state(request)
    eng = state.require_engine()
    cfg = eng.config
    caps = state.caps()
    defaults = AdmissionPolicy()
    return {
        "default_generation_settings": {
            "n_ctx": eng.max_context,
            "params": {"n_predict": -1 if state.config.default_max_tokens is None else state.config.default_max_tokens,
                       "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "seed": -1},
        },
        "total_slots": cfg.max_running,
        "model_path": state.model_name,
        "model_alias": state.model_name,
        "chat_template": eng.tokenizer.chat_template or "",
        "modalities": {"vision": False, "audio": False},
        "build_info": f"opencoti {__version__}",
        "opencoti": {
            "version": __version__,
            "polykv": {
                "max_pools": cfg.max_pools,
                "page_size": eng.kv.page_size,
                "kv_pages_total": eng.kv.num_pages,
                "kv_budget_tokens": eng.kv.num_pages * eng.kv.page_size,
                "max_context": eng.max_context,
                "max_running": cfg.max_running,
                "floor_default": {"target_tps_per_session": defaults.target_tps_per_session},
                "admission_defaults": defaults.as_dict(),
                "pin_policy": {"interior_auto_pin": True, "grace_ttl_s": cfg.pool_grace_ttl_s,
                               "evict_order": "idle sessions first, then unpinned idle pools (LRU)"},
                "tps": eng.configure_tps(),
                "tps_stream_interval_ms": state.config.tps_interval_ms,
                "chat_template_tools": {"native_tools": caps.supports_tools,
                                        "native_tool_calls": caps.supports_tool_calls},
                "attention_backend": type(eng.backend).__name__,
            },
        },
    }


@router.get("/slots", tags=["llama.cpp"], summary="one entry per session (tps, context headroom)")
def slots(request: Request):
    eng = _state(request).require_engine()
    snap = eng.tps_snapshot()
    out = []
    for i, s in enumerate(snap["sessions"]):
        out.append({"id": i, "id_task": -1, "n_ctx": s["ctx_total"], "is_processing": s["state"] != "idle", **s})
    return out


@router.post("/tokenize", tags=["llama.cpp"])
def tokenize(request: Request, body: TokenizeRequest):
    state = _state(request)
    eng = state.require_engine()
    ids = eng.tokenize(body.content, add_special_tokens=body.add_special)
    if body.with_pieces:
        return {"tokens": [{"id": i, "piece": state.piece(i)} for i in ids]}
    return {"tokens": ids}


@router.post("/detokenize", tags=["llama.cpp"])
def detokenize(request: Request, body: DetokenizeRequest):
    eng = _state(request).require_engine()
    return {"content": eng.detokenize(body.tokens) if body.tokens else ""}


@router.post("/apply-template", tags=["llama.cpp"],
             summary="render chat messages (and tools) to the prompt text a chat request would use")
def apply_template(request: Request, body: ApplyTemplateRequest):
    state = _state(request)
    eng = state.require_engine()
    return {"prompt": render_chat_prompt(eng.apply_chat_template, state.caps(), body.messages, body.tools,
                                         add_generation_prompt=body.add_generation_prompt)}


@router.get("/metrics", tags=["llama.cpp"], summary="Prometheus text exposition",
            response_class=PlainTextResponse)
def metrics(request: Request):
    state = _state(request)
    return PlainTextResponse(state.metrics.render(state.engine if state.is_ready else None),
                             media_type=CONTENT_TYPE_LATEST)
