"""``PolyKVClient``: the synchronous shell over a transport (HTTP or in-process)."""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, Unpack

import httpx

from ..engine.errors import OpencotiError
from ..ops.results import (AdmissionPolicy, Capacity, ChatChunk, ChatCompletion, CompactionResult, Completion, Pool,
                           PoolTree, SessionStatus, TpsSnapshot)
from .base import ClientBase
from .calls import ChatArgs, CompletionArgs, chat_request, checked_str, completion_request, prefix_body, release_query
from .events import aggregate_chat, completion_from_dict
from .transport import HttpTransport, InProcessTransport

if TYPE_CHECKING:
    from ..engine import Engine


class PolyKVClient(ClientBase):
    """Synchronous PolyKV client over HTTP (``base_url``) or an in-process ``engine``.

    ``http_client``: an ``httpx.Client`` to send requests with (e.g. Starlette's TestClient around
    the app); ``timeout``: seconds per HTTP request (None: no timeout); ``max_retries``: retries of
    refused (429 / 503 + Retry-After) or unsent requests; ``max_retry_wait_s``: the longest single
    wait between retries.
    """

    def __init__(self, base_url: str | None = None, *, engine: "Engine | None" = None, api_key: str | None = None,
                 timeout: float | None = 60.0, max_retries: int = 2, max_retry_wait_s: float = 30.0,
                 http_client: httpx.Client | None = None):
        super().__init__(engine, base_url, api_key, timeout, max_retries, max_retry_wait_s, http_client,
                         HttpTransport, InProcessTransport)

    def close(self) -> None:
        """Close the HTTP connection pool (an in-process engine is not shut down)."""
        if self.is_http:
            self.transport.close()

    def __enter__(self) -> "PolyKVClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- plumbing
    def _with_retries(self, fn: Callable[[], Any]) -> Any:
        for attempt in itertools.count():
            try:
                return fn()
            except OpencotiError as e:
                time.sleep(self.retry.wait_or_raise(e, attempt))

    def _call(self, name: str, path: dict | None = None, query: dict | None = None, body: Any = None) -> Any:
        return self._with_retries(lambda: self.transport.call(name, path, query, body))

    def _stream(self, body: dict) -> Iterator[ChatChunk]:
        opened = self._with_retries(lambda: _opened(self.transport.chat(body)))
        if opened is None:
            return
        gen, first = opened
        try:
            yield first
            yield from gen
        finally:
            gen.close()

    # ---------------------------------------------------------------- model & tokens
    def health(self) -> dict:
        """``{"status": "ok"}`` when the model is loaded (raises CapacityError while it loads)."""
        return self._call("health")

    def model_name(self) -> str:
        """The id of the served model."""
        return self._call("models")["data"][0]["id"]

    def model_info(self, *, timeout: float | None = None) -> dict:
        """The served model's entry of ``GET /v1/models``: ``id`` and ``meta`` (``n_ctx``: the most
        tokens one request, prompt and answer, may use; ``n_ctx_train``, ``n_vocab``, ...).
        ``timeout``: seconds for one try, without retries (None: the client's timeout and retries)."""
        if timeout is None or not self.is_http:
            return self._call("models")["data"][0]
        # one try; a caller's http client keeps its own timeout settings
        return self.transport.call("models", timeout=timeout if self._owns_http else None)["data"][0]

    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        """Token ids of ``text``."""
        return self._call("tokenize", body={"content": text, "add_special": add_special})["tokens"]

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Text of token ids."""
        return self._call("detokenize", body={"tokens": list(tokens)})["content"]

    def apply_template(self, messages: list[dict], tools: list[dict] | None = None,
                       add_generation_prompt: bool = True) -> str:
        """The exact prompt text a chat request with these messages (+ tools) renders."""
        return self._call("apply_template", body={"messages": messages, "tools": tools,
                                                  "add_generation_prompt": add_generation_prompt})["prompt"]

    # ---------------------------------------------------------------- generation
    def chat_stream(self, messages: list[dict], **kw: Unpack[ChatArgs]) -> Iterator[ChatChunk]:
        """Stream a chat completion (OpenAI messages / tools; keyword arguments: ``calls.ChatArgs``:
        ``tools``, ``tool_choice``, ``pool_id``, ``session_id``, ``overcommit``,
        ``shared_prefix_n_tokens``, ``parallel_tool_calls``, ``temperature``, ``max_tokens``,
        ``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop``, ``ignore_eos``, ``extra_body``). The first
        chunk carries ``info`` (session, pool, cached prefix tokens); the last ``finish_reason``,
        ``usage``, ``timings``. Closing the iterator early cancels the request. ``extra_body``: more
        request fields (any field of ``POST /v1/chat/completions``, e.g. penalties), sent as given."""
        return self._stream(chat_request(messages, kw))

    def chat(self, messages: list[dict], **kw: Unpack[ChatArgs]) -> ChatCompletion:
        """A chat completion (same arguments as ``chat_stream``)."""
        return aggregate_chat(list(self.chat_stream(messages, **kw)))

    def complete(self, prompt: str | Sequence[int], **kw: Unpack[CompletionArgs]) -> Completion:
        """A raw-text completion (llama.cpp ``/completion``) of a text or token-id prompt (keyword
        arguments: ``calls.CompletionArgs``, ``chat_stream``'s but the tools)."""
        return completion_from_dict(self._call("complete", body=completion_request(prompt, kw)))

    # ---------------------------------------------------------------- pools
    def create_pool(self, *, tokens: Sequence[int] | None = None, text: str | None = None,
                    messages: list[dict] | None = None, tools: list[dict] | None = None,
                    from_session: str | None = None, add_generation_prompt: bool = False, pinned: bool = False,
                    label: str = "", as_root: bool = False) -> Pool:
        """Create a root pool from exactly one of tokens / text / messages (+ tools) / from_session.
        Returns when its prefix is resident. ``from_session`` of a session attached to a pool makes
        a zero-copy child of that pool (branched at a page boundary) unless ``as_root``: then a
        root, its borrowed prefix computed again (docs/polykv.md)."""
        return Pool(**self._call("create_pool", body=prefix_body(
            tokens, text, messages, tools, from_session, add_generation_prompt, pinned=pinned or None,
            label=label or None, as_root=as_root or None)))

    def fork_pool(self, parent_id: int, *, branch_pos: int | None = None, tokens: Sequence[int] | None = None,
                  text: str | None = None, messages: list[dict] | None = None, tools: list[dict] | None = None,
                  from_session: str | None = None, add_generation_prompt: bool = False, pinned: bool = False,
                  label: str = "") -> Pool:
        """Fork ``parent_id`` at ``branch_pos`` (default: the parent's length = extend). The prefix is
        the child's FULL prefix ``[0, L)``; its ``[0, D)`` must token-match the parent
        (else PoolContractError)."""
        return Pool(**self._call("fork_pool", {"pool_id": parent_id}, body=prefix_body(
            tokens, text, messages, tools, from_session, add_generation_prompt, branch_pos=branch_pos,
            pinned=pinned or None, label=label or None)))

    def pool(self, pool_id: int) -> Pool:
        """One pool with its ``subtree``."""
        return Pool(**self._call("pool", {"pool_id": pool_id}))

    def pools(self) -> PoolTree:
        """The pool tree."""
        return PoolTree(**self._call("pools"))

    def release_pool(self, pool_id: int, *, immediate: bool = False, cascade_sessions: bool = False) -> list[str]:
        """Release a pool (PoolBusyError while it has child pools: release leaves first). Within the
        pool's grace TTL the release is deferred (the pool stays attachable until then);
        ``immediate`` releases it now; ``cascade_sessions`` first ends the idle sessions that keep its KV
        (``DELETE ...?cascade=sessions``). Returns the ids of the sessions it ended."""
        got = self._call("release_pool", {"pool_id": pool_id}, release_query(immediate, cascade_sessions))
        return list((got or {}).get("ended_sessions") or []) if isinstance(got, dict) else []

    def pin_pool(self, pool_id: int) -> Pool:
        """Pin: never evicted."""
        return Pool(**self._call("pin_pool", {"pool_id": pool_id}))

    def unpin_pool(self, pool_id: int) -> Pool:
        """Unpin."""
        return Pool(**self._call("unpin_pool", {"pool_id": pool_id}))

    def evict_pool(self, pool_id: int) -> Pool:
        """Drop the pool's KV now (it re-materializes on the next attach)."""
        return Pool(**self._call("evict_pool", {"pool_id": pool_id}))

    def flush_pool(self, pool_id: int) -> int:
        """End the idle sessions attached to the pool; returns how many."""
        return self._call("flush_pool", {"pool_id": pool_id})["flushed_sessions"]

    # ---------------------------------------------------------------- admission & tps
    def admission(self, pool_id: int) -> AdmissionPolicy:
        """The pool's admission policy."""
        return AdmissionPolicy(**self._call("admission", {"pool_id": pool_id}))

    def set_admission(self, pool_id: int, **policy: Any) -> AdmissionPolicy:
        """Set (merge) the pool's admission policy (``AdmissionPolicy`` fields)."""
        return AdmissionPolicy(**self._call("set_admission", {"pool_id": pool_id}, body=policy))

    def capacity(self, pool_id: int, expected_tokens: int | None = None, session_id: str | None = None) -> Capacity:
        """Whether one more (new) session fits the pool now, and why."""
        return Capacity(**self._call("capacity", {"pool_id": pool_id},
                                     {"expected_tokens": expected_tokens, "session_id": session_id}))

    def events(self, pool_id: int | None = None, since: float | None = None) -> list[dict]:
        """Recent admission events."""
        return self._call("events", query={"pool_id": pool_id, "since": since})["events"]

    def tps(self) -> TpsSnapshot:
        """A live tps snapshot (every session's tps, context headroom, compaction pressure)."""
        return TpsSnapshot(**self._call("tps"))

    def session_status(self, session_id: str) -> SessionStatus | None:
        """One session's row of the tps snapshot (None when it does not exist)."""
        return self.tps().session(checked_str("session_id", session_id))

    # ---------------------------------------------------------------- sessions
    def release_session(self, session_id: str) -> None:
        """Release a session's KV (SessionNotFoundError when unknown)."""
        self._call("release_session", {"session_id": checked_str("session_id", session_id)})

    def compact_session(self, session_id: str, ancestor_pool_id: int, *, tokens: Sequence[int] | None = None,
                        text: str | None = None, messages: list[dict] | None = None, tools: list[dict] | None = None,
                        branch_pos: int | None = None, release_old: bool = True) -> CompactionResult:
        """Compaction by re-fork: fork the stable ancestor with the compacted prefix, move the
        session onto it, release the old pool when nothing else uses it (docs/polykv.md)."""
        body = prefix_body(tokens, text, messages, tools, None, False, ancestor_pool_id=ancestor_pool_id,
                           branch_pos=branch_pos, release_old=release_old)
        return CompactionResult(**self._call("compact_session", {"session_id": checked_str("session_id", session_id)},
                                             body=body))

    def integrity(self) -> dict:
        """Run the engine's KV integrity check."""
        return self._call("integrity")


def _opened(gen: Iterator[ChatChunk]) -> tuple[Iterator[ChatChunk], ChatChunk] | None:
    """The stream with its first chunk (a refusal raises here, before anything is yielded); None when empty."""
    try:
        return gen, next(gen)
    except StopIteration:
        return None
