"""PolyKV client: one interface, two transports.

    from opencoti.client import PolyKVClient, AsyncPolyKVClient
    client = PolyKVClient(base_url="http://127.0.0.1:8080", api_key="...")  # a remote `opencoti serve`
    client = PolyKVClient(engine=engine)                                    # an in-process Engine

Both transports speak the same operations with the same typed (pydantic) results and the same
exceptions (``opencoti.engine.errors``: ``PoolSaturatedError(retry_after)``, ``PoolContractError``,
``PoolNotFoundError``, ... plus the HTTP-only ``AuthenticationError``, ``APIConnectionError``,
``APITimeoutError`` and ``APIStatusError`` defined here). Chat requests are rendered the same way
on both (``opencoti.server.tools``: tool definitions injected into the system prompt when the
model's template ignores them, ``tool_choice`` by prefill, tool-call parsing), so a pool created
from messages + tools is a token-exact prefix of the chat requests that use them, whichever
transport made it.

Retries: requests refused with ``PoolSaturatedError`` (429) or a ``Retry-After``-carrying 503, and
HTTP connection failures, are retried up to ``max_retries`` times, waiting ``Retry-After`` when the
server (or engine) gives one, else an exponential backoff with jitter. A stream is never retried
once its first event has been yielded.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.parse
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterator, Sequence

import httpx
from pydantic import BaseModel, ConfigDict, Field

from .engine.errors import (CapacityError, ConflictError, ContextLengthError, EngineClosedError,
                            InvalidRequestError, NotFoundError, OpencotiError, PoolBusyError, PoolContractError,
                            PoolNotFoundError, PoolSaturatedError, SessionBusyError, SessionNotFoundError)

if TYPE_CHECKING:
    from .engine import Engine

__all__ = [
    "PolyKVClient", "AsyncPolyKVClient",
    "Pool", "PoolTree", "Capacity", "AdmissionPolicy", "SessionStatus", "TpsSnapshot", "CompactionResult",
    "GenerationInfo", "Usage", "ToolCall", "ChatChunk", "ChatCompletion", "Completion",
    "OpencotiError", "InvalidRequestError", "ContextLengthError", "NotFoundError", "PoolNotFoundError",
    "SessionNotFoundError", "ConflictError", "PoolContractError", "PoolBusyError", "SessionBusyError",
    "CapacityError", "PoolSaturatedError", "EngineClosedError", "AuthenticationError", "APIConnectionError",
    "APITimeoutError", "APIStatusError",
]


# ============================================================================ errors (HTTP-only kinds)
class AuthenticationError(OpencotiError):
    """The server refused the API key (HTTP 401)."""

    status_code = 401
    error_type = "authentication_error"


class APIConnectionError(OpencotiError):
    """The server could not be reached (connection refused, DNS, reset before an answer).

    ``retryable``: the request was certainly not sent (a connect error), so sending it again is safe."""

    status_code = 0
    error_type = "connection_error"

    def __init__(self, message: str, retryable: bool = False):
        super().__init__(message)
        self.retryable = retryable


class APITimeoutError(APIConnectionError):
    """The request timed out."""

    error_type = "timeout_error"


class APIStatusError(OpencotiError):
    """An HTTP error status with no more specific exception (e.g. 500, 413)."""

    def __init__(self, message: str, status_code: int, error_type: str = "server_error"):
        super().__init__(message)
        self.status_code = status_code
        self.error_type = error_type


# ============================================================================ typed results
class _Model(BaseModel):
    # Unknown fields are kept: the server may report more than this client knows about.
    model_config = ConfigDict(extra="allow", use_attribute_docstrings=True, populate_by_name=True)


class Pool(_Model):
    """A pool (spec §4.2): an immutable prefix ``[0, prefix_len)``, a node of the pool tree."""

    pool_id: int
    """The pool's id."""
    parent: int | None = None
    """The parent pool (None for a root)."""
    branch_pos: int = 0
    """D: where this pool branches off its parent (== parent.prefix_len for an extension)."""
    prefix_len: int = 0
    """L: the number of prefix tokens."""
    own_len: int = 0
    """Tokens this pool owns, ``[D, L)``."""
    own_kv_bytes: int = 0
    """KV bytes owned by this pool (its ``[D, L)`` range only)."""
    subtree_kv_bytes: int = 0
    """KV bytes of this pool, its descendants and their sessions' suffixes."""
    residency: str = "resident"
    """``resident`` | ``evicted`` | ``materializing``."""
    pinned: bool = False
    """Pinned pools are never evicted."""
    auto_pinned: bool = False
    """Interior pools are pinned while descendants are attached."""
    orphaned_pin: bool = False
    """Pinned with no sessions and no children: a leak hazard to sweep (spec §13.2)."""
    last_access_ts: float = 0.0
    """Wall-clock time of the last attach."""
    children: list[int] = Field(default_factory=list)
    """Child pool ids."""
    sessions: list[dict[str, Any]] = Field(default_factory=list)
    """Attached sessions: ``{session_id, suffix_n_tokens, marginal_kv_bytes, tps_ewma, state, ...}``."""
    label: str = ""
    """A free-form label given at creation."""
    subtree: list["Pool"] = Field(default_factory=list)
    """Descendant pools (filled by ``pool(id)`` only)."""


class PoolTree(_Model):
    """The whole pool tree (``GET /polykv/pools``)."""

    pools: list[Pool] = Field(default_factory=list)
    """Every pool, by id."""
    tree_depth: int = 0
    """Depth of the deepest pool."""
    kv_pages_used: int = 0
    """KV pages in use (pools + sessions)."""
    kv_pages_total: int = 0
    """KV pages in the cache."""

    def get(self, pool_id: int) -> Pool | None:
        """The pool with this id, or None."""
        return next((p for p in self.pools if p.pool_id == pool_id), None)


class Capacity(_Model):
    """Whether one more (new) session fits a pool now, and why (spec §4.4, §13.3, §14.2)."""

    pool_id: int | None = None
    """The pool asked about."""
    can_admit: bool
    """True when a new session fits (tps floor, KV headroom and context arms)."""
    reason: str = ""
    """Why (e.g. ``ok``, ``measurement settling``, ``projected mean tps below floor``)."""
    headroom_sessions: int | None = None
    """How many more sessions fit (None: unbounded by the tps arm and no KV limit known)."""
    mean_active_tps: float | None = None
    """Mean experienced decode tps of the active (non-warming) sessions."""
    projected_mean_tps_if_admitted: float | None = None
    """The projected mean tps with one more session."""
    target_tps_per_session: float | None = None
    """The pool's tps floor (None: no floor)."""
    kv_headroom_pct: float | None = None
    """Free KV as a percentage."""
    settling: bool = False
    """The pool is still absorbing its last admit: wait, don't shrink (spec §14.2)."""
    settle_remaining_ms: float = 0.0
    """Milliseconds until the settle window ends at the latest."""
    n_warming: int = 0
    """Sessions whose tps EWMA is still cold."""
    n_pool_sessions: int = 0
    """Sessions attached to the pool."""
    guaranteed: bool = False
    """Admitted by ``guarantee_min_sessions``."""
    compaction_pressure: float = 0.0
    """0..1: how close the pool's sessions are to the context / KV wall (compact before 1)."""
    context_ok: bool = True
    """The context arm: ``expected_tokens`` fit the context and the free KV."""


class AdmissionPolicy(_Model):
    """A pool's admission policy (spec §4.4, §14)."""

    target_tps_per_session: float | None = None
    """The floor on experienced decode tps (None: no floor)."""
    mode: str = "advisory"
    """``advisory`` (report only) or ``enforced`` (gate new sessions)."""
    on_saturation: str = "reject"
    """Enforced: ``reject`` (429), ``warn`` (admit with a warning) or ``queue`` (hold FIFO)."""
    guarantee_min_sessions: int = 1
    """Below this many sessions a new one is always admitted."""
    settle_tokens: int = 48
    """Tokens an admitted session decodes before the pool is settled."""
    settle_max_ms: float = 5000.0
    """The settle window's upper bound."""
    queue_timeout_ms: float = 30000.0
    """How long ``queue`` holds a request."""


class SessionStatus(_Model):
    """One session in the tps snapshot (spec §4.3, §13.3)."""

    session_id: str
    """The session's id."""
    pool_id: int | None = None
    """The pool it is attached to."""
    tps_ewma: float = 0.0
    """Experienced decode tokens/s (EWMA)."""
    ctx_used: int = 0
    """Tokens in its context."""
    ctx_total: int = 0
    """The context length."""
    ctx_headroom_tokens: int = 0
    """Tokens it can still grow by (context and free KV)."""
    compaction_pressure: float = 0.0
    """0..1: how close it is to the context / KV wall."""
    state: str = ""
    """``idle`` | ``prefill`` | ``decode`` | ..."""


class TpsSnapshot(_Model):
    """Live tps (``GET /polykv/tps?once=1``)."""

    ts: float = 0.0
    """Wall-clock time of the snapshot."""
    aggregate_tps: float = 0.0
    """System decode throughput."""
    mean_active_tps: float = 0.0
    """Mean experienced tps of the active, non-warming sessions."""
    n_warming: int = 0
    """Sessions whose tps EWMA is still cold."""
    compaction_pressure: float = 0.0
    """Engine-wide compaction pressure (KV occupancy, largest session share)."""
    sessions: list[SessionStatus] = Field(default_factory=list)
    """Every session."""

    def session(self, session_id: str) -> SessionStatus | None:
        """The row of one session, or None."""
        return next((s for s in self.sessions if s.session_id == session_id), None)


class CompactionResult(_Model):
    """The result of compaction by re-fork (spec §13.2)."""

    pool: Pool
    """The new pool the session moved to."""
    released_pools: list[int] = Field(default_factory=list)
    """Pools released because nothing else used them."""
    kv_pages_before: int = 0
    """KV pages in use before."""
    kv_pages_after: int = 0
    """KV pages in use after."""


class GenerationInfo(_Model):
    """What the server knows when it accepts a request (the ``x-*`` headers)."""

    session_id: str
    """The session the request ran in (made by the server when none was given)."""
    pool_id: int | None = None
    """The pool it attached to."""
    cached_prefix_tokens: int = 0
    """Prompt tokens reused from the pool / session cache (``cache_n``)."""
    sessions_remaining: int | None = None
    """Enforced pools: sessions that still fit (``X-Sessions-Remaining``)."""
    admission_warning: str | None = None
    """Admitted under ``on_saturation: warn``: the warning."""


class Usage(_Model):
    """Token counts of one request."""

    prompt_tokens: int = 0
    """Prompt tokens."""
    completion_tokens: int = 0
    """Generated tokens."""
    total_tokens: int = 0
    """prompt + completion."""
    cached_tokens: int = 0
    """Prompt tokens read from the KV cache."""


class ToolCall(_Model):
    """A complete tool call parsed from the model's output."""

    id: str
    """The call id."""
    name: str
    """The function name."""
    arguments: str
    """The arguments as JSON text (or the model's raw text when it wrote no JSON)."""
    index: int = 0
    """Position among the calls of the message."""

    def parsed_arguments(self) -> dict[str, Any] | None:
        """The arguments as a dict, or None when they are not a JSON object."""
        try:
            v = json.loads(self.arguments) if self.arguments.strip() else {}
        except ValueError:
            return None
        return v if isinstance(v, dict) else None


class ChatChunk(_Model):
    """One event of a chat stream: the first carries ``info``; content deltas; complete
    ``tool_calls`` (held back by the server until parsed); the last carries ``finish_reason``,
    ``usage`` and ``timings``."""

    content: str = ""
    """Text to append."""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    """Complete tool calls."""
    info: GenerationInfo | None = None
    """Set on the first event (and repeated on the last)."""
    finish_reason: str | None = None
    """``stop`` | ``length`` | ``tool_calls`` on the last event."""
    usage: Usage | None = None
    """On the last event."""
    timings: dict[str, Any] | None = None
    """llama.cpp-style timings (``predicted_per_second``, ``cache_n``, ...) on the last event."""
    model: str | None = None
    """The model that answered (on the last event)."""


class ChatCompletion(_Model):
    """A finished chat request."""

    content: str = ""
    """The assistant's text (without tool-call text)."""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    """Parsed tool calls."""
    finish_reason: str = "stop"
    """``stop`` | ``length`` | ``tool_calls``."""
    usage: Usage = Field(default_factory=Usage)
    """Token counts."""
    timings: dict[str, Any] = Field(default_factory=dict)
    """llama.cpp-style timings."""
    info: GenerationInfo
    """Session, pool, cached prefix tokens."""
    model: str | None = None
    """The model that answered."""


class Completion(_Model):
    """A finished raw-text completion."""

    text: str = ""
    """The generated text."""
    finish_reason: str = "stop"
    """``stop`` | ``length``."""
    usage: Usage = Field(default_factory=Usage)
    """Token counts."""
    timings: dict[str, Any] = Field(default_factory=dict)
    """llama.cpp-style timings."""
    info: GenerationInfo
    """Session, pool, cached prefix tokens."""


def aggregate_chat(chunks: Sequence[ChatChunk]) -> ChatCompletion:
    """Fold a chat stream into one ChatCompletion (pure; used by ``chat`` on both transports)."""
    content, calls, info, last = [], [], None, None
    for c in chunks:
        content.append(c.content)
        calls.extend(c.tool_calls)
        info = c.info or info
        if c.finish_reason is not None or c.usage is not None:
            last = c
    if info is None:
        raise APIStatusError("the chat stream ended without a start event", 502)
    return ChatCompletion(content="".join(content), tool_calls=calls,
                          finish_reason=(last.finish_reason if last and last.finish_reason else "stop"),
                          usage=(last.usage if last and last.usage else Usage()),
                          timings=(last.timings if last and last.timings else {}), info=info,
                          model=last.model if last else None)


# ============================================================================ HTTP error mapping
_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}


def error_from_response(status: int, body: Any, headers: Any = None, pool_id: int | None = None) -> OpencotiError:
    """Map an HTTP error (llama.cpp's ``{"error": {code, message, type}}``) to a typed exception.

    The 404 and 409 kinds share one ``type`` on the wire; the message tells them apart."""
    headers = headers or {}
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        message = str(err.get("message", "")) or f"HTTP {status}"
        etype = str(err.get("type", ""))
        status = int(err.get("code") or status)
    else:
        message = body if isinstance(body, str) and body else f"HTTP {status}"
        etype = ""
    low = message.lower()
    retry_after = _retry_after(headers.get("retry-after"))
    if status == 400:
        if etype == "exceed_context_size_error":
            return ContextLengthError(message)
        return InvalidRequestError(message)
    if status == 401:
        return AuthenticationError(message)
    if status == 404:
        if low.startswith("pool"):
            return PoolNotFoundError(message)
        if low.startswith("session"):
            return SessionNotFoundError(message)
        return NotFoundError(message)
    if status == 409:
        if "contract" in low or "differ" in low:
            return PoolContractError(message)
        if low.startswith("session"):
            return SessionBusyError(message)
        if low.startswith("pool"):
            return PoolBusyError(message)
        return ConflictError(message)
    if status == 429:
        return PoolSaturatedError(message, retry_after, pool_id=pool_id, reason=headers.get("x-admission-reason"))
    if status == 503:
        if "shutting down" in low or "shut down" in low:
            return EngineClosedError(message)
        return CapacityError(message, retry_after=retry_after)
    return APIStatusError(message, status, etype or "server_error")


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def _info_from_headers(headers: Any) -> GenerationInfo:
    def num(name: str) -> int | None:
        v = headers.get(name)
        try:
            return int(v) if v is not None else None
        except ValueError:
            return None

    return GenerationInfo(session_id=headers.get("x-session-id") or "", pool_id=num("x-pool-id"),
                          cached_prefix_tokens=num("x-cached-prefix-tokens") or 0,
                          sessions_remaining=num("x-sessions-remaining"),
                          admission_warning=headers.get("x-admission-warning"))


def _usage_from_openai(u: dict | None) -> Usage | None:
    if not u:
        return None
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Usage(prompt_tokens=u.get("prompt_tokens", 0), completion_tokens=u.get("completion_tokens", 0),
                 total_tokens=u.get("total_tokens", 0), cached_tokens=cached)


def _calls_from_openai(calls: list[dict] | None) -> list[ToolCall]:
    out = []
    for i, c in enumerate(calls or ()):
        fn = c.get("function") or {}
        out.append(ToolCall(id=c.get("id") or f"call_{i}", name=fn.get("name", ""),
                            arguments=fn.get("arguments") or "", index=c.get("index", i)))
    return out


class _ChatEventParser:
    """OpenAI ``chat.completion.chunk`` SSE events -> ChatChunk (pure; one per stream)."""

    def __init__(self, info: GenerationInfo, pool_id: int | None):
        self.info, self.pool_id = info, pool_id
        self.finish: str | None = None
        self.timings: dict | None = None
        self.model: str | None = None
        self.started = False

    def start(self) -> ChatChunk:
        self.started = True
        return ChatChunk(info=self.info)

    def feed(self, data: str) -> list[ChatChunk]:
        if data == "[DONE]":
            return [self.end(None)] if self.finish is not None else []
        ev = json.loads(data)
        if "error" in ev:
            raise error_from_response(int(ev["error"].get("code") or 500), ev, pool_id=self.pool_id)
        self.model = ev.get("model") or self.model
        out = []
        for ch in ev.get("choices") or ():
            delta = ch.get("delta") or {}
            text = delta.get("content") or ""
            calls = _calls_from_openai(delta.get("tool_calls"))
            if text or calls:
                out.append(ChatChunk(content=text, tool_calls=calls))
            if ch.get("finish_reason") is not None:
                self.finish = ch["finish_reason"]
                self.timings = ev.get("timings") or self.timings
        if ev.get("usage"):
            out.append(self.end(_usage_from_openai(ev["usage"])))
        return out

    def end(self, usage: Usage | None) -> ChatChunk:
        chunk = ChatChunk(info=self.info, finish_reason=self.finish or "stop", usage=usage or Usage(),
                          timings=self.timings or {}, model=self.model)
        self.finish = None  # emitted
        return chunk


def _sse_data(line: str) -> str | None:
    return line[5:].lstrip() if line.startswith("data:") else None


# ============================================================================ operations
def _quote(s: str) -> str:
    return urllib.parse.quote(str(s), safe="")


def _prefix_body(tokens, text, messages, tools, from_session, add_generation_prompt, extra: dict) -> dict:
    body: dict[str, Any] = {k: v for k, v in (("tokens", list(tokens) if tokens is not None else None),
                                               ("text", text), ("messages", messages), ("tools", tools),
                                               ("from_session", from_session)) if v is not None}
    if add_generation_prompt:
        body["add_generation_prompt"] = True
    body.update({k: v for k, v in extra.items() if v is not None})
    return body


def _http_route(op: str, a: dict) -> tuple[str, str, dict | None, dict | None]:
    """(method, path, json body, query) of an operation."""
    pid = a.get("pool_id")
    P = f"/polykv/pools/{pid}"
    table: dict[str, Callable[[], tuple]] = {
        "health": lambda: ("GET", "/health", None, None),
        "models": lambda: ("GET", "/v1/models", None, None),
        "props": lambda: ("GET", "/props", None, None),
        "tokenize": lambda: ("POST", "/tokenize", {"content": a["text"], "add_special": a["add_special"]}, None),
        "detokenize": lambda: ("POST", "/detokenize", {"tokens": list(a["tokens"])}, None),
        "apply_template": lambda: ("POST", "/apply-template", {"messages": a["messages"], "tools": a["tools"],
                                                               "add_generation_prompt": a["add_generation_prompt"]},
                                   None),
        "create_pool": lambda: ("POST", "/polykv/pools", a["body"], None),
        "fork_pool": lambda: ("POST", f"{P}/fork", a["body"], None),
        "pool": lambda: ("GET", P, None, None),
        "pools": lambda: ("GET", "/polykv/pools", None, None),
        "release_pool": lambda: ("DELETE", P, None, None),
        "pin_pool": lambda: ("POST", f"{P}/pin", None, None),
        "unpin_pool": lambda: ("POST", f"{P}/unpin", None, None),
        "evict_pool": lambda: ("POST", f"{P}/evict", None, None),
        "flush_pool": lambda: ("POST", f"{P}/flush", None, None),
        "admission": lambda: ("GET", f"{P}/admission", None, None),
        "set_admission": lambda: ("POST", f"{P}/admission", a["policy"], None),
        "capacity": lambda: ("GET", f"{P}/capacity", None,
                             {k: v for k, v in (("expected_tokens", a.get("expected_tokens")),
                                                ("session_id", a.get("session_id"))) if v is not None}),
        "events": lambda: ("GET", "/polykv/events", None,
                           {k: v for k, v in (("pool_id", pid), ("since", a.get("since"))) if v is not None}),
        "release_session": lambda: ("DELETE", f"/polykv/sessions/{_quote(a['session_id'])}", None, None),
        "compact_session": lambda: ("POST", f"/polykv/sessions/{_quote(a['session_id'])}/compact", a["body"], None),
        "tps": lambda: ("GET", "/polykv/tps", None, {"once": 1}),
        "integrity": lambda: ("GET", "/polykv/integrity", None, None),
        "complete": lambda: ("POST", "/completion", a["body"], None),
    }
    return table[op]()


class _EngineOps:
    """The operations on an in-process Engine, returning what the HTTP routes return."""

    def __init__(self, engine: "Engine"):
        self.engine = engine
        self._caps = None

    @property
    def caps(self):
        if self._caps is None:
            from .server.tools import TemplateCaps, probe_template_caps
            eng = self.engine
            self._caps = probe_template_caps(eng.apply_chat_template) if eng.tokenizer.chat_template \
                else TemplateCaps()
        return self._caps

    def render(self, messages, tools, add_generation_prompt: bool) -> str:
        from .server.tools import render_chat_prompt
        return render_chat_prompt(self.engine.apply_chat_template, self.caps, messages, tools,
                                  add_generation_prompt=add_generation_prompt)

    def prefix_tokens(self, body: dict) -> tuple[list[int] | None, str | None]:
        given = [k for k in ("tokens", "text", "messages", "from_session") if body.get(k) is not None]
        if len(given) != 1:
            raise InvalidRequestError("give exactly one of tokens / text / messages / from_session"
                                      + (f" (got {', '.join(given)})" if given else ""))
        if body.get("tools") is not None and body.get("messages") is None:
            raise InvalidRequestError("tools are rendered with messages; give messages too")
        if body.get("tokens") is not None:
            return list(body["tokens"]), None
        if body.get("text") is not None:
            if not body["text"]:
                raise InvalidRequestError("text must be a non-empty string")
            return self.engine.tokenize(body["text"]), None
        if body.get("messages") is not None:
            text = self.render(body["messages"], body.get("tools"), bool(body.get("add_generation_prompt")))
            return self.engine.tokenize(text), None
        return None, body["from_session"]

    def call(self, op: str, a: dict) -> Any:
        eng = self.engine
        pid = a.get("pool_id")
        if op == "health":
            if eng.is_closed:
                raise EngineClosedError("engine shut down")
            return {"status": "ok"}
        if op == "models":
            return {"object": "list", "data": [{"id": eng.model_name, "object": "model", "owned_by": "opencoti"}]}
        if op == "props":
            return {"model_path": eng.model_name, "n_ctx": eng.max_context}
        if op == "tokenize":
            return {"tokens": eng.tokenize(a["text"], add_special_tokens=a["add_special"])}
        if op == "detokenize":
            return {"content": eng.detokenize(list(a["tokens"])) if a["tokens"] else ""}
        if op == "apply_template":
            return {"prompt": self.render(a["messages"], a["tools"], a["add_generation_prompt"])}
        if op in ("create_pool", "fork_pool"):
            body = a["body"]
            tokens, from_session = self.prefix_tokens(body)
            kw = dict(tokens=tokens, from_session=from_session, pinned=body.get("pinned", False),
                      label=body.get("label", ""))
            if op == "create_pool":
                return eng.create_pool(**kw).as_dict()
            eng.pool(pid)
            return eng.fork_pool(pid, branch_pos=body.get("branch_pos"), **kw).as_dict()
        if op == "pool":
            root = eng.pool(pid).as_dict()
            tree = {p["pool_id"]: p for p in eng.pools()["pools"]}
            subtree, todo = [], list(root["children"])
            while todo:
                p = tree.get(todo.pop(0))
                if p is not None:
                    subtree.append(p)
                    todo.extend(p["children"])
            return {**root, "subtree": subtree}
        if op == "pools":
            return eng.pools()
        if op == "release_pool":
            eng.release_pool(pid)
            return {"pool_id": pid, "released": True}
        if op in ("pin_pool", "unpin_pool", "evict_pool"):
            return getattr(eng, op)(pid).as_dict()
        if op == "flush_pool":
            return {"pool_id": pid, "flushed_sessions": eng.flush_pool(pid)}
        if op == "admission":
            return eng.admission(pid)
        if op == "set_admission":
            return eng.set_admission(pid, **a["policy"])
        if op == "capacity":
            return eng.capacity(pid, expected_tokens=a.get("expected_tokens"), session_id=a.get("session_id"))
        if op == "events":
            return {"events": eng.admission_events(pid, a.get("since"))}
        if op == "release_session":
            eng.release_session(a["session_id"])
            return {"session_id": a["session_id"], "released": True}
        if op == "compact_session":
            body = dict(a["body"])
            tokens, _ = self.prefix_tokens(body)
            out = eng.compact_session(a["session_id"], body["ancestor_pool_id"], tokens=tokens,
                                      branch_pos=body.get("branch_pos"), release_old=body.get("release_old", True))
            return {**out, "pool": out["pool"].as_dict()}
        if op == "tps":
            return eng.tps_snapshot()
        if op == "integrity":
            eng.check_integrity()
            st = eng.pools()
            return {"ok": True, "kv_pages_used": st["kv_pages_used"], "kv_pages_total": st["kv_pages_total"]}
        if op == "complete":
            return self.complete(a["body"])
        raise ValueError(f"unknown operation {op!r}")

    # ---------------------------------------------------------------- generation
    def sampling(self, body: dict):
        from .engine import SamplingParams
        kw = {k: body[k] for k in ("temperature", "top_k", "top_p", "min_p") if body.get(k) is not None}
        if body.get("seed") not in (None, -1):
            kw["seed"] = body["seed"]
        if body.get("stop"):
            kw["stop"] = [body["stop"]] if isinstance(body["stop"], str) else list(body["stop"])
        max_tokens = body["n_predict"] if "n_predict" in body else body.get("max_tokens")
        return SamplingParams(max_tokens=None if max_tokens in (None, -1) else max_tokens,
                              ignore_eos=bool(body.get("ignore_eos", False)), **kw)

    def request_kwargs(self, body: dict) -> dict:
        return dict(session_id=body.get("session_id"), pool_id=body.get("pool_id"),
                    shared_prefix_n_tokens=body.get("shared_prefix_n_tokens"),
                    overcommit=bool(body.get("overcommit", False)))

    def prepare_chat(self, body: dict):
        from .engine.chat import normalize_tools
        from .server.tools import ToolStreamFilter, parse_tool_choice, tool_choice_prefill, tool_names
        tools = normalize_tools(body.get("tools"))
        choice = parse_tool_choice(body.get("tool_choice"), tools)
        text = self.render(body["messages"], tools, True)
        prefill = tool_choice_prefill(choice)
        tokens = self.engine.tokenize(text + prefill)
        return tokens, ToolStreamFilter(choice, tool_names(tools), prefill), self.sampling(body)

    def complete(self, body: dict) -> dict:
        prompt = body["prompt"]
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            prompt = self.engine.tokenize(prompt)
        r = self.engine.generate(list(prompt), params=self.sampling(body), **self.request_kwargs(body))
        return _completion_dict(r)


def _completion_dict(r) -> dict:
    """A GenerationResult in the shape of llama.cpp's /completion answer (the fields we read)."""
    stop_type = {"eos": "eos", "stop": "word", "length": "limit"}.get(r.stop_reason, "none")
    return {"content": r.text, "stop_type": stop_type, "tokens_predicted": len(r.token_ids),
            "tokens_evaluated": r.info.prompt_tokens, "tokens_cached": r.info.cached_prefix_tokens,
            "timings": r.timings, "session_id": r.info.session_id, "pool_id": r.info.pool_id,
            "truncated": r.truncated}


def _completion_from_dict(d: dict) -> Completion:
    finish = "length" if d.get("stop_type") == "limit" else "stop"
    n_in, n_out, cached = d.get("tokens_evaluated", 0), d.get("tokens_predicted", 0), d.get("tokens_cached", 0)
    return Completion(text=d.get("content", ""), finish_reason=finish, timings=d.get("timings") or {},
                      usage=Usage(prompt_tokens=n_in, completion_tokens=n_out, total_tokens=n_in + n_out,
                                  cached_tokens=cached),
                      info=GenerationInfo(session_id=d.get("session_id") or "", pool_id=d.get("pool_id"),
                                          cached_prefix_tokens=cached))


def _engine_chat_events(ops: _EngineOps, stream, filt, model: str, single_call: bool = False):
    """Shared pieces of the in-process chat stream: the start chunk and the end chunks."""
    info = stream.info
    gi = GenerationInfo(session_id=info.session_id, pool_id=info.pool_id,
                        cached_prefix_tokens=info.cached_prefix_tokens,
                        sessions_remaining=(info.admission or {}).get("sessions_remaining"),
                        admission_warning=(info.admission or {}).get("warning"))

    def end(result) -> list[ChatChunk]:
        content, calls = filt.finish()
        if single_call:
            calls = calls[:1]
        out = []
        if content:
            out.append(ChatChunk(content=content))
        tcalls = [ToolCall(id=c.id, name=c.name, arguments=c.arguments, index=i) for i, c in enumerate(calls)]
        if tcalls:
            out.append(ChatChunk(tool_calls=tcalls))
        finish = "tool_calls" if tcalls and result.stop_reason != "length" else _FINISH.get(result.stop_reason, "stop")
        n = len(result.token_ids)
        usage = Usage(prompt_tokens=info.prompt_tokens, completion_tokens=n, total_tokens=info.prompt_tokens + n,
                      cached_tokens=info.cached_prefix_tokens)
        out.append(ChatChunk(info=gi, finish_reason=finish, usage=usage, timings=result.timings, model=model))
        return out

    return ChatChunk(info=gi), end


def _chat_body(messages, tools, tool_choice, pool_id, session_id, overcommit, shared_prefix_n_tokens,
               parallel_tool_calls, sampling: dict) -> dict:
    body: dict[str, Any] = {"messages": messages}
    for k, v in (("tools", tools), ("tool_choice", tool_choice), ("pool_id", pool_id), ("session_id", session_id),
                 ("shared_prefix_n_tokens", shared_prefix_n_tokens), ("parallel_tool_calls", parallel_tool_calls)):
        if v is not None:
            body[k] = v
    if overcommit:
        body["overcommit"] = True
    body.update({k: v for k, v in sampling.items() if v is not None})
    return body


def _completion_body(prompt, pool_id, session_id, overcommit, shared_prefix_n_tokens, sampling: dict) -> dict:
    body = _chat_body(None, None, None, pool_id, session_id, overcommit, shared_prefix_n_tokens, None, sampling)
    del body["messages"]
    body["prompt"] = prompt if isinstance(prompt, str) else list(prompt)
    if "max_tokens" in body:
        body["n_predict"] = body.pop("max_tokens")
    return body


# ============================================================================ retry policy
_RETRYABLE = (PoolSaturatedError, CapacityError, APIConnectionError)


class _Retry:
    def __init__(self, max_retries: int, max_wait_s: float):
        self.max_retries, self.max_wait_s = max_retries, max_wait_s

    def delay(self, error: BaseException, attempt: int) -> float | None:
        """Seconds to wait before retry ``attempt`` (0-based), or None to give up."""
        if attempt >= self.max_retries or not isinstance(error, _RETRYABLE):
            return None
        if isinstance(error, APIConnectionError) and not error.retryable:
            return None  # a timeout or a broken connection: the request may have been applied
        if isinstance(error, CapacityError) and not isinstance(error, PoolSaturatedError) \
                and getattr(error, "retry_after", None) is None:
            return None  # a budget that waiting would not free (e.g. pool budget)
        ra = getattr(error, "retry_after", None)
        if ra is not None:
            return min(float(ra), self.max_wait_s)
        return min(0.5 * 2 ** attempt, 8.0, self.max_wait_s) * (0.75 + 0.5 * random.random())


def _checked_str(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{name} must be a non-empty string")
    return value


# ============================================================================ the clients
class _ClientBase:
    def __init__(self, engine: "Engine | None", base_url: str | None, api_key: str | None, timeout: float | None,
                 max_retries: int, max_retry_wait_s: float, http_client: Any):
        if engine is not None and (base_url is not None or http_client is not None):
            raise ValueError("give engine= (in-process) or base_url= (HTTP), not both")
        if engine is None and base_url is None and http_client is None:
            raise ValueError("give engine= (an in-process Engine) or base_url= (a running `opencoti serve`)")
        if not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be a non-negative integer, got {max_retries!r}")
        self.engine = engine
        self.retry = _Retry(max_retries, max_retry_wait_s)
        self.timeout = timeout
        self._ops = _EngineOps(engine) if engine is not None else None
        if engine is None:
            if base_url is None:
                base_url = str(http_client.base_url)
            self.base_url = base_url.rstrip("/")
            self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
            # a caller's http client keeps its own timeout settings
            self._timeout_kw = {"timeout": timeout} if http_client is None else {}
        else:
            self._timeout_kw = {}
            self.base_url = None
            self.headers = {}

    @property
    def is_http(self) -> bool:
        return self.engine is None

    def _url(self, path: str) -> str:
        return self.base_url + path

    def _map_http_error(self, r, pool_id=None) -> OpencotiError:
        try:
            body = r.json()
        except ValueError:
            body = r.text
        return error_from_response(r.status_code, body, r.headers, pool_id=pool_id)

    @staticmethod
    def _map_transport_error(e: Exception) -> OpencotiError:
        if isinstance(e, httpx.TimeoutException):
            return APITimeoutError(f"request timed out: {e}")
        return APIConnectionError(f"cannot reach the server: {e}", retryable=isinstance(e, httpx.ConnectError))


def _pool_args(tokens, text, messages, tools, from_session, add_generation_prompt, **extra) -> dict:
    return {"body": _prefix_body(tokens, text, messages, tools, from_session, add_generation_prompt, extra)}


def _sampling(temperature, max_tokens, top_p, top_k, min_p, seed, stop, ignore_eos) -> dict:
    return {"temperature": temperature, "max_tokens": max_tokens, "top_p": top_p, "top_k": top_k, "min_p": min_p,
            "seed": seed, "stop": list(stop) if stop else None, "ignore_eos": ignore_eos or None}


class PolyKVClient(_ClientBase):
    """Synchronous PolyKV client over HTTP (``base_url``) or an in-process ``engine``.

    ``http_client``: an ``httpx.Client`` to send requests with (e.g. Starlette's TestClient around
    the app); ``timeout``: seconds per HTTP request (None: no timeout); ``max_retries``: retries of
    refused (429 / 503 + Retry-After) or unsent requests; ``max_retry_wait_s``: the longest single
    wait between retries.
    """

    def __init__(self, base_url: str | None = None, *, engine: "Engine | None" = None, api_key: str | None = None,
                 timeout: float | None = 60.0, max_retries: int = 2, max_retry_wait_s: float = 30.0,
                 http_client: httpx.Client | None = None):
        super().__init__(engine, base_url, api_key, timeout, max_retries, max_retry_wait_s, http_client)
        self._owns_http = False
        self._http = http_client
        if self.is_http and self._http is None:
            self._http = httpx.Client(timeout=timeout)
            self._owns_http = True

    def close(self) -> None:
        """Close the HTTP connection pool (an in-process engine is not shut down)."""
        if self._owns_http and self._http is not None:
            self._http.close()

    def __enter__(self) -> "PolyKVClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- plumbing
    def _with_retries(self, fn: Callable[[], Any]) -> Any:
        attempt = 0
        while True:
            try:
                return fn()
            except OpencotiError as e:
                wait = self.retry.delay(e, attempt)
                if wait is None:
                    raise
                time.sleep(wait)
                attempt += 1

    def _once(self, op: str, a: dict) -> Any:
        if not self.is_http:
            return self._ops.call(op, a)
        method, path, body, params = _http_route(op, a)
        try:
            r = self._http.request(method, self._url(path), json=body, params=params, headers=self.headers,
                                   **self._timeout_kw)
        except httpx.TransportError as e:
            raise self._map_transport_error(e) from e
        if r.status_code >= 400:
            raise self._map_http_error(r, a.get("pool_id"))
        return r.json()

    def _call(self, op: str, **a) -> Any:
        return self._with_retries(lambda: self._once(op, a))

    # ---------------------------------------------------------------- model & tokens
    def health(self) -> dict:
        """``{"status": "ok"}`` when the model is loaded (raises CapacityError while it loads)."""
        return self._call("health")

    def model_name(self) -> str:
        """The id of the served model."""
        return self._call("models")["data"][0]["id"]

    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        """Token ids of ``text``."""
        return self._call("tokenize", text=text, add_special=add_special)["tokens"]

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Text of token ids."""
        return self._call("detokenize", tokens=list(tokens))["content"]

    def apply_template(self, messages: list[dict], tools: list[dict] | None = None,
                       add_generation_prompt: bool = True) -> str:
        """The exact prompt text a chat request with these messages (+ tools) renders."""
        return self._call("apply_template", messages=messages, tools=tools,
                          add_generation_prompt=add_generation_prompt)["prompt"]

    # ---------------------------------------------------------------- generation
    def chat_stream(self, messages: list[dict], *, tools: list[dict] | None = None, tool_choice: Any = None,
                    pool_id: int | None = None, session_id: str | None = None, overcommit: bool = False,
                    shared_prefix_n_tokens: int | None = None, parallel_tool_calls: bool | None = None,
                    temperature: float | None = None, max_tokens: int | None = None, top_p: float | None = None,
                    top_k: int | None = None, min_p: float | None = None, seed: int | None = None,
                    stop: Sequence[str] | None = None, ignore_eos: bool = False) -> Iterator[ChatChunk]:
        """Stream a chat completion (OpenAI messages / tools). The first chunk carries ``info``
        (session, pool, cached prefix tokens); the last ``finish_reason``, ``usage``, ``timings``.
        Closing the iterator early cancels the request."""
        body = _chat_body(messages, tools, tool_choice, pool_id, session_id, overcommit, shared_prefix_n_tokens,
                          parallel_tool_calls, _sampling(temperature, max_tokens, top_p, top_k, min_p, seed, stop,
                                                         ignore_eos))
        return self._chat_stream(body)

    def chat(self, messages: list[dict], **kw) -> ChatCompletion:
        """A chat completion (same arguments as ``chat_stream``)."""
        return aggregate_chat(list(self.chat_stream(messages, **kw)))

    def _chat_stream(self, body: dict) -> Iterator[ChatChunk]:
        attempt = 0
        while True:
            gen = self._chat_once(body)
            try:
                first = next(gen)
            except StopIteration:
                return
            except OpencotiError as e:
                wait = self.retry.delay(e, attempt)
                if wait is None:
                    raise
                time.sleep(wait)
                attempt += 1
                continue
            break
        try:
            yield first
            yield from gen
        finally:
            gen.close()

    def _chat_once(self, body: dict) -> Iterator[ChatChunk]:
        if not self.is_http:
            yield from self._engine_chat(body)
            return
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        try:
            with self._http.stream("POST", self._url("/v1/chat/completions"), json=body, headers=self.headers,
                                   **self._timeout_kw) as r:
                if r.status_code >= 400:
                    r.read()
                    raise self._map_http_error(r, body.get("pool_id"))
                parser = _ChatEventParser(_info_from_headers(r.headers), body.get("pool_id"))
                yield parser.start()
                for line in r.iter_lines():
                    data = _sse_data(line)
                    if data is not None:
                        yield from parser.feed(data)
        except httpx.TransportError as e:
            raise self._map_transport_error(e) from e

    def _engine_chat(self, body: dict) -> Iterator[ChatChunk]:
        ops = self._ops
        tokens, filt, params = ops.prepare_chat(body)
        stream = ops.engine.stream(tokens, params=params, **ops.request_kwargs(body))
        start, end = _engine_chat_events(ops, stream, filt, ops.engine.model_name,
                                         body.get("parallel_tool_calls") is False)
        try:
            yield start
            for d in stream:
                text = filt.feed(d.text)
                if text:
                    yield ChatChunk(content=text)
            yield from end(stream.result)
        finally:
            if stream.result is None:
                stream.close()

    def complete(self, prompt: str | Sequence[int], *, pool_id: int | None = None, session_id: str | None = None,
                 overcommit: bool = False, shared_prefix_n_tokens: int | None = None,
                 temperature: float | None = None, max_tokens: int | None = None, top_p: float | None = None,
                 top_k: int | None = None, min_p: float | None = None, seed: int | None = None,
                 stop: Sequence[str] | None = None, ignore_eos: bool = False) -> Completion:
        """A raw-text completion (llama.cpp ``/completion``) of a text or token-id prompt."""
        body = _completion_body(prompt, pool_id, session_id, overcommit, shared_prefix_n_tokens,
                                _sampling(temperature, max_tokens, top_p, top_k, min_p, seed, stop, ignore_eos))
        return _completion_from_dict(self._call("complete", body=body, pool_id=pool_id))

    # ---------------------------------------------------------------- pools
    def create_pool(self, *, tokens: Sequence[int] | None = None, text: str | None = None,
                    messages: list[dict] | None = None, tools: list[dict] | None = None,
                    from_session: str | None = None, add_generation_prompt: bool = False, pinned: bool = False,
                    label: str = "") -> Pool:
        """Create a root pool from exactly one of tokens / text / messages (+ tools) / from_session.
        Returns when its prefix is resident."""
        return Pool(**self._call("create_pool", **_pool_args(tokens, text, messages, tools, from_session,
                                                             add_generation_prompt, pinned=pinned or None,
                                                             label=label or None)))

    def fork_pool(self, parent_id: int, *, branch_pos: int | None = None, tokens: Sequence[int] | None = None,
                  text: str | None = None, messages: list[dict] | None = None, tools: list[dict] | None = None,
                  from_session: str | None = None, add_generation_prompt: bool = False, pinned: bool = False,
                  label: str = "") -> Pool:
        """Fork ``parent_id`` at ``branch_pos`` (default: the parent's length = extend). The prefix is
        the child's FULL prefix ``[0, L)``; its ``[0, D)`` must token-match the parent
        (else PoolContractError)."""
        return Pool(**self._call("fork_pool", pool_id=parent_id, **_pool_args(
            tokens, text, messages, tools, from_session, add_generation_prompt, branch_pos=branch_pos,
            pinned=pinned or None, label=label or None)))

    def pool(self, pool_id: int) -> Pool:
        """One pool with its ``subtree``."""
        return Pool(**self._call("pool", pool_id=pool_id))

    def pools(self) -> PoolTree:
        """The pool tree."""
        return PoolTree(**self._call("pools"))

    def release_pool(self, pool_id: int) -> None:
        """Release a pool (PoolBusyError while it has child pools: release leaves first)."""
        self._call("release_pool", pool_id=pool_id)

    def pin_pool(self, pool_id: int) -> Pool:
        """Pin: never evicted."""
        return Pool(**self._call("pin_pool", pool_id=pool_id))

    def unpin_pool(self, pool_id: int) -> Pool:
        """Unpin."""
        return Pool(**self._call("unpin_pool", pool_id=pool_id))

    def evict_pool(self, pool_id: int) -> Pool:
        """Drop the pool's KV now (it re-materializes on the next attach)."""
        return Pool(**self._call("evict_pool", pool_id=pool_id))

    def flush_pool(self, pool_id: int) -> int:
        """End the idle sessions attached to the pool; returns how many."""
        return self._call("flush_pool", pool_id=pool_id)["flushed_sessions"]

    # ---------------------------------------------------------------- admission & tps
    def admission(self, pool_id: int) -> AdmissionPolicy:
        """The pool's admission policy."""
        return AdmissionPolicy(**self._call("admission", pool_id=pool_id))

    def set_admission(self, pool_id: int, **policy: Any) -> AdmissionPolicy:
        """Set (merge) the pool's admission policy (``AdmissionPolicy`` fields)."""
        return AdmissionPolicy(**self._call("set_admission", pool_id=pool_id, policy=policy))

    def capacity(self, pool_id: int, expected_tokens: int | None = None, session_id: str | None = None) -> Capacity:
        """Whether one more (new) session fits the pool now, and why."""
        return Capacity(**self._call("capacity", pool_id=pool_id, expected_tokens=expected_tokens,
                                     session_id=session_id))

    def events(self, pool_id: int | None = None, since: float | None = None) -> list[dict]:
        """Recent admission events."""
        return self._call("events", pool_id=pool_id, since=since)["events"]

    def tps(self) -> TpsSnapshot:
        """A live tps snapshot (every session's tps, context headroom, compaction pressure)."""
        return TpsSnapshot(**self._call("tps"))

    def session_status(self, session_id: str) -> SessionStatus | None:
        """One session's row of the tps snapshot (None when it does not exist)."""
        return self.tps().session(_checked_str("session_id", session_id))

    # ---------------------------------------------------------------- sessions
    def release_session(self, session_id: str) -> None:
        """Release a session's KV (SessionNotFoundError when unknown)."""
        self._call("release_session", session_id=_checked_str("session_id", session_id))

    def compact_session(self, session_id: str, ancestor_pool_id: int, *, tokens: Sequence[int] | None = None,
                        text: str | None = None, messages: list[dict] | None = None, tools: list[dict] | None = None,
                        branch_pos: int | None = None, release_old: bool = True) -> CompactionResult:
        """Compaction by re-fork (spec §13.2): fork the stable ancestor with the compacted prefix,
        move the session onto it, release the old pool when nothing else uses it."""
        args = _pool_args(tokens, text, messages, tools, None, False, ancestor_pool_id=ancestor_pool_id,
                          branch_pos=branch_pos)
        args["body"]["release_old"] = release_old
        return CompactionResult(**self._call("compact_session", session_id=_checked_str("session_id", session_id),
                                             **args))

    def integrity(self) -> dict:
        """Run the engine's KV integrity check."""
        return self._call("integrity")


class AsyncPolyKVClient(_ClientBase):
    """Asynchronous PolyKV client: the same operations as ``PolyKVClient``, as coroutines.

    ``http_client``: an ``httpx.AsyncClient`` (e.g. with ``httpx.ASGITransport(app)``).
    """

    def __init__(self, base_url: str | None = None, *, engine: "Engine | None" = None, api_key: str | None = None,
                 timeout: float | None = 60.0, max_retries: int = 2, max_retry_wait_s: float = 30.0,
                 http_client: httpx.AsyncClient | None = None):
        super().__init__(engine, base_url, api_key, timeout, max_retries, max_retry_wait_s, http_client)
        self._owns_http = False
        self._http = http_client
        if self.is_http and self._http is None:
            self._http = httpx.AsyncClient(timeout=timeout)
            self._owns_http = True

    async def aclose(self) -> None:
        """Close the HTTP connection pool."""
        if self._owns_http and self._http is not None:
            await self._http.aclose()

    async def __aenter__(self) -> "AsyncPolyKVClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _once(self, op: str, a: dict) -> Any:
        if not self.is_http:
            return await asyncio.to_thread(self._ops.call, op, a)
        method, path, body, params = _http_route(op, a)
        try:
            r = await self._http.request(method, self._url(path), json=body, params=params, headers=self.headers,
                                         **self._timeout_kw)
        except httpx.TransportError as e:
            raise self._map_transport_error(e) from e
        if r.status_code >= 400:
            raise self._map_http_error(r, a.get("pool_id"))
        return r.json()

    async def _call(self, op: str, **a) -> Any:
        attempt = 0
        while True:
            try:
                return await self._once(op, a)
            except OpencotiError as e:
                wait = self.retry.delay(e, attempt)
                if wait is None:
                    raise
                await asyncio.sleep(wait)
                attempt += 1

    # ---------------------------------------------------------------- model & tokens
    async def health(self) -> dict:
        return await self._call("health")

    async def model_name(self) -> str:
        return (await self._call("models"))["data"][0]["id"]

    async def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        return (await self._call("tokenize", text=text, add_special=add_special))["tokens"]

    async def detokenize(self, tokens: Sequence[int]) -> str:
        return (await self._call("detokenize", tokens=list(tokens)))["content"]

    async def apply_template(self, messages: list[dict], tools: list[dict] | None = None,
                             add_generation_prompt: bool = True) -> str:
        return (await self._call("apply_template", messages=messages, tools=tools,
                                 add_generation_prompt=add_generation_prompt))["prompt"]

    # ---------------------------------------------------------------- generation
    def chat_stream(self, messages: list[dict], *, tools: list[dict] | None = None, tool_choice: Any = None,
                    pool_id: int | None = None, session_id: str | None = None, overcommit: bool = False,
                    shared_prefix_n_tokens: int | None = None, parallel_tool_calls: bool | None = None,
                    temperature: float | None = None, max_tokens: int | None = None, top_p: float | None = None,
                    top_k: int | None = None, min_p: float | None = None, seed: int | None = None,
                    stop: Sequence[str] | None = None, ignore_eos: bool = False) -> AsyncIterator[ChatChunk]:
        """Async iterator of chat chunks (see ``PolyKVClient.chat_stream``)."""
        body = _chat_body(messages, tools, tool_choice, pool_id, session_id, overcommit, shared_prefix_n_tokens,
                          parallel_tool_calls, _sampling(temperature, max_tokens, top_p, top_k, min_p, seed, stop,
                                                         ignore_eos))
        return self._chat_stream(body)

    async def chat(self, messages: list[dict], **kw) -> ChatCompletion:
        return aggregate_chat([c async for c in self.chat_stream(messages, **kw)])

    async def _chat_stream(self, body: dict) -> AsyncIterator[ChatChunk]:
        attempt = 0
        while True:
            gen = self._chat_once(body)
            try:
                first = await gen.__anext__()
            except StopAsyncIteration:
                return
            except OpencotiError as e:
                await gen.aclose()
                wait = self.retry.delay(e, attempt)
                if wait is None:
                    raise
                await asyncio.sleep(wait)
                attempt += 1
                continue
            break
        try:
            yield first
            async for c in gen:
                yield c
        finally:
            await gen.aclose()

    async def _chat_once(self, body: dict) -> AsyncIterator[ChatChunk]:
        if not self.is_http:
            async for c in self._engine_chat(body):
                yield c
            return
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        try:
            async with self._http.stream("POST", self._url("/v1/chat/completions"), json=body, headers=self.headers,
                                         **self._timeout_kw) as r:
                if r.status_code >= 400:
                    await r.aread()
                    raise self._map_http_error(r, body.get("pool_id"))
                parser = _ChatEventParser(_info_from_headers(r.headers), body.get("pool_id"))
                yield parser.start()
                async for line in r.aiter_lines():
                    data = _sse_data(line)
                    if data is not None:
                        for c in parser.feed(data):
                            yield c
        except httpx.TransportError as e:
            raise self._map_transport_error(e) from e

    async def _engine_chat(self, body: dict) -> AsyncIterator[ChatChunk]:
        ops = self._ops
        tokens, filt, params = await asyncio.to_thread(ops.prepare_chat, body)
        stream = await ops.engine.astream(tokens, params=params, **ops.request_kwargs(body))
        start, end = _engine_chat_events(ops, stream, filt, ops.engine.model_name,
                                         body.get("parallel_tool_calls") is False)
        try:
            yield start
            async for d in stream:
                text = filt.feed(d.text)
                if text:
                    yield ChatChunk(content=text)
            for c in end(stream.result):
                yield c
        finally:
            if stream.result is None:
                await stream.aclose()

    async def complete(self, prompt: str | Sequence[int], *, pool_id: int | None = None,
                       session_id: str | None = None, overcommit: bool = False,
                       shared_prefix_n_tokens: int | None = None, temperature: float | None = None,
                       max_tokens: int | None = None, top_p: float | None = None, top_k: int | None = None,
                       min_p: float | None = None, seed: int | None = None, stop: Sequence[str] | None = None,
                       ignore_eos: bool = False) -> Completion:
        body = _completion_body(prompt, pool_id, session_id, overcommit, shared_prefix_n_tokens,
                                _sampling(temperature, max_tokens, top_p, top_k, min_p, seed, stop, ignore_eos))
        return _completion_from_dict(await self._call("complete", body=body, pool_id=pool_id))

    # ---------------------------------------------------------------- pools
    async def create_pool(self, *, tokens: Sequence[int] | None = None, text: str | None = None,
                          messages: list[dict] | None = None, tools: list[dict] | None = None,
                          from_session: str | None = None, add_generation_prompt: bool = False,
                          pinned: bool = False, label: str = "") -> Pool:
        return Pool(**await self._call("create_pool", **_pool_args(tokens, text, messages, tools, from_session,
                                                                   add_generation_prompt, pinned=pinned or None,
                                                                   label=label or None)))

    async def fork_pool(self, parent_id: int, *, branch_pos: int | None = None, tokens: Sequence[int] | None = None,
                        text: str | None = None, messages: list[dict] | None = None,
                        tools: list[dict] | None = None, from_session: str | None = None,
                        add_generation_prompt: bool = False, pinned: bool = False, label: str = "") -> Pool:
        return Pool(**await self._call("fork_pool", pool_id=parent_id, **_pool_args(
            tokens, text, messages, tools, from_session, add_generation_prompt, branch_pos=branch_pos,
            pinned=pinned or None, label=label or None)))

    async def pool(self, pool_id: int) -> Pool:
        return Pool(**await self._call("pool", pool_id=pool_id))

    async def pools(self) -> PoolTree:
        return PoolTree(**await self._call("pools"))

    async def release_pool(self, pool_id: int) -> None:
        await self._call("release_pool", pool_id=pool_id)

    async def pin_pool(self, pool_id: int) -> Pool:
        return Pool(**await self._call("pin_pool", pool_id=pool_id))

    async def unpin_pool(self, pool_id: int) -> Pool:
        return Pool(**await self._call("unpin_pool", pool_id=pool_id))

    async def evict_pool(self, pool_id: int) -> Pool:
        return Pool(**await self._call("evict_pool", pool_id=pool_id))

    async def flush_pool(self, pool_id: int) -> int:
        return (await self._call("flush_pool", pool_id=pool_id))["flushed_sessions"]

    # ---------------------------------------------------------------- admission & tps
    async def admission(self, pool_id: int) -> AdmissionPolicy:
        return AdmissionPolicy(**await self._call("admission", pool_id=pool_id))

    async def set_admission(self, pool_id: int, **policy: Any) -> AdmissionPolicy:
        return AdmissionPolicy(**await self._call("set_admission", pool_id=pool_id, policy=policy))

    async def capacity(self, pool_id: int, expected_tokens: int | None = None,
                       session_id: str | None = None) -> Capacity:
        return Capacity(**await self._call("capacity", pool_id=pool_id, expected_tokens=expected_tokens,
                                           session_id=session_id))

    async def events(self, pool_id: int | None = None, since: float | None = None) -> list[dict]:
        return (await self._call("events", pool_id=pool_id, since=since))["events"]

    async def tps(self) -> TpsSnapshot:
        return TpsSnapshot(**await self._call("tps"))

    async def session_status(self, session_id: str) -> SessionStatus | None:
        return (await self.tps()).session(_checked_str("session_id", session_id))

    # ---------------------------------------------------------------- sessions
    async def release_session(self, session_id: str) -> None:
        await self._call("release_session", session_id=_checked_str("session_id", session_id))

    async def compact_session(self, session_id: str, ancestor_pool_id: int, *, tokens: Sequence[int] | None = None,
                              text: str | None = None, messages: list[dict] | None = None,
                              tools: list[dict] | None = None, branch_pos: int | None = None,
                              release_old: bool = True) -> CompactionResult:
        args = _pool_args(tokens, text, messages, tools, None, False, ancestor_pool_id=ancestor_pool_id,
                          branch_pos=branch_pos)
        args["body"]["release_old"] = release_old
        return CompactionResult(**await self._call("compact_session",
                                                   session_id=_checked_str("session_id", session_id), **args))

    async def integrity(self) -> dict:
        return await self._call("integrity")
