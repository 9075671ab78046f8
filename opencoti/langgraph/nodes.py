"""Graph nodes that act on live PolyKV state.

* ``CapacityGateNode``: reads the pool's capacity and routes to a spawn node or a hold node with
  ``Command(update=..., goto=...)``; can wait (poll with backoff, honouring ``settling``) or
  ``interrupt()`` until the pool has room. Its return annotation names both targets, so the
  drawn graph shows its edges.
* ``SpawnPacer``: spec §14.3 pacing shared by the gates of a fan-out: one spawn decision at a
  time per pool, never while the pool is settling, and the next decision only once the server has
  seen the previous spawn's session (so it judges a measurement that includes it).
* ``CompactionNode``: compaction by re-fork (spec §13.2) as a node / pre-model hook.
"""

from __future__ import annotations

import threading
import time
import uuid
from types import MethodType
from typing import Any, Callable, Literal, Sequence

from langchain_core.messages import (AIMessage, BaseMessage, HumanMessage, RemoveMessage, SystemMessage,
                                     ToolMessage)
from langgraph.constants import END
from langgraph.graph.message import REMOVE_ALL_MESSAGES
from langgraph.types import Command, interrupt

from ..client import AsyncPolyKVClient, Capacity, PolyKVClient, SessionNotFoundError
from .state import capacity_update


def _sync_client(client: Any) -> PolyKVClient:
    from .chat_model import OpencotiChatModel
    if isinstance(client, OpencotiChatModel):
        return client.polykv_client
    if isinstance(client, PolyKVClient):
        return client
    if isinstance(client, AsyncPolyKVClient):
        raise TypeError("these nodes need a sync PolyKVClient (LangGraph runs sync nodes in threads under ainvoke)")
    if hasattr(client, "capacity") and hasattr(client, "tps_snapshot"):
        return PolyKVClient(engine=client)
    raise TypeError(f"need a PolyKVClient, Engine or OpencotiChatModel, got {type(client).__name__}")


# ============================================================================ pacing
class SpawnPacer:
    """Serializes spawn decisions per pool (spec §14.3).

    A gate that uses a pacer takes the pool's turn, waits until the pool admits and is settled
    (no settle window open, no warming session), and on "spawn" keeps the turn until the server
    has seen the new session (attached, or an ``admit`` event for it) or
    ``claim_timeout_s`` passes; only then may the next gate decide. Share one pacer between the
    gates of a fan-out (it is thread-safe; LangGraph runs parallel branches in threads).
    """

    def __init__(self, claim_timeout_s: float = 10.0, claim_poll_s: float = 0.05):
        self.claim_timeout_s = claim_timeout_s
        self.claim_poll_s = claim_poll_s
        self._locks: dict[int, threading.Lock] = {}
        self._guard = threading.Lock()
        self.log: list[dict] = []
        """Every decision: ``{t, pool_id, decision, settling, n_warming, can_admit, reason}``."""

    def _lock(self, pool_id: int) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(pool_id, threading.Lock())

    def acquire(self, pool_id: int, timeout: float | None) -> bool:
        """Take the pool's turn (False on timeout)."""
        return self._lock(pool_id).acquire(timeout=-1 if timeout is None else max(timeout, 0.0))

    def release(self, pool_id: int) -> None:
        self._lock(pool_id).release()

    def record(self, pool_id: int, decision: str, cap: Capacity) -> None:
        with self._guard:
            self.log.append({"t": time.monotonic(), "pool_id": pool_id, "decision": decision,
                             "settling": cap.settling, "n_warming": cap.n_warming, "can_admit": cap.can_admit,
                             "reason": cap.reason})

    def claim(self, client: PolyKVClient, pool_id: int, session_id: str) -> None:
        """Keep the turn until the server knows ``session_id`` (in a watcher thread), then release it."""
        since = time.time() - 1.0

        def arrived() -> bool:
            # attached now, or admitted since the claim (a short request may be over already)
            if client.capacity(pool_id, session_id=session_id).known_session:
                return True
            return any(e.get("session_id") == session_id for e in client.events(pool_id, since=since))

        def watch():
            deadline = time.monotonic() + self.claim_timeout_s
            try:
                while time.monotonic() < deadline:
                    try:
                        if arrived():
                            return
                    except Exception:  # noqa: BLE001 - the pool went away: nothing to wait for
                        return
                    time.sleep(self.claim_poll_s)
            finally:
                self.release(pool_id)

        threading.Thread(target=watch, name=f"opencoti-pacer-{pool_id}", daemon=True).start()


# ============================================================================ capacity gate
HoldMode = Literal["route", "wait", "interrupt"]


class CapacityGateNode:
    """Route to ``spawn`` when the pool has room for one more session, else to ``hold``.

    ``CapacityGateNode(client, spawn="worker", hold="wait_a_bit")`` reads
    ``capacity(state["pool_id"])`` and returns ``Command(update={capacity_ok, headroom_sessions,
    mean_active_tps, reason, settling, compaction_pressure, session_id?}, goto=spawn | hold)``.

    on_hold: ``"route"`` goes to ``hold`` at once; ``"wait"`` polls (backoff from
        ``poll_interval_s`` to ``max_poll_interval_s``; while the pool is settling it sleeps until
        the settle window ends) for up to ``max_wait_s``, then goes to ``hold``; ``"interrupt"``
        calls ``interrupt(<capacity report>)`` and re-checks when resumed, until the pool admits.
    require_settled: besides ``can_admit``, wait for the pool to be settled (no settle window, no
        warming session) before spawning (spec §14.3; True by default).
    pool_id: a fixed pool (default: ``state[pool_key]``).
    expected_tokens: tokens a new session is expected to use (an int, or a function of the state),
        checked against the context and KV (the context arm).
    pacer: a ``SpawnPacer`` shared by the gates of a fan-out; on spawn the gate assigns
        ``state[session_key]`` (a new id when the state has none), which the spawned agent must
        use for its model calls, so the pacer can see it arrive.
    """

    def __init__(self, client: Any, *, spawn: str, hold: str = END, on_hold: HoldMode = "route",
                 pool_id: int | None = None, pool_key: str = "pool_id",
                 expected_tokens: int | Callable[[dict], int | None] | None = None, require_settled: bool = True,
                 max_wait_s: float = 60.0, poll_interval_s: float = 0.1, max_poll_interval_s: float = 2.0,
                 backoff: float = 1.6, pacer: SpawnPacer | None = None, session_key: str = "session_id",
                 session_prefix: str = "agent"):
        if on_hold not in ("route", "wait", "interrupt"):
            raise ValueError(f"on_hold must be route | wait | interrupt, got {on_hold!r}")
        self.client = _sync_client(client)
        self.spawn, self.hold, self.on_hold = spawn, hold, on_hold
        self.pool_id, self.pool_key = pool_id, pool_key
        self.expected_tokens = expected_tokens
        self.require_settled = require_settled
        self.max_wait_s, self.poll_interval_s = max_wait_s, poll_interval_s
        self.max_poll_interval_s, self.backoff = max_poll_interval_s, backoff
        self.pacer, self.session_key, self.session_prefix = pacer, session_key, session_prefix
        self.__name__ = f"capacity_gate_{spawn}"
        # The graph builder reads the return annotation of __call__ to draw the edges: give this
        # instance one naming its own two targets.
        targets = tuple(dict.fromkeys((spawn, hold)))

        def __call__(self_, state):
            return type(self_).__call__(self_, state)

        __call__.__annotations__ = {"state": dict, "return": Command[Literal[targets]]}
        self.__call__ = MethodType(__call__, self)

    # ---------------------------------------------------------------- decisions
    def admits(self, cap: Capacity) -> bool:
        """Spawn now? ``can_admit`` and, with ``require_settled``, no settle window / warming session."""
        if not cap.can_admit:
            return False
        if self.require_settled and not cap.guaranteed:
            return not cap.settling and cap.n_warming == 0
        return not cap.settling if self.require_settled else True

    def _pool(self, state: dict) -> int:
        pid = self.pool_id if self.pool_id is not None else state.get(self.pool_key)
        if pid is None:
            raise ValueError(f"CapacityGateNode: no pool (give pool_id= or set state[{self.pool_key!r}])")
        return pid

    def _expected(self, state: dict) -> int | None:
        e = self.expected_tokens
        return e(state) if callable(e) else e

    def check(self, state: dict) -> Capacity:
        """One capacity report for the state's pool."""
        return self.client.capacity(self._pool(state), expected_tokens=self._expected(state))

    def _sleep_for(self, cap: Capacity, attempt: int) -> float:
        if cap.settling and cap.settle_remaining_ms > 0:
            return min(cap.settle_remaining_ms / 1e3 + 0.01, self.max_poll_interval_s)
        return min(self.poll_interval_s * self.backoff ** attempt, self.max_poll_interval_s)

    def _wait(self, state: dict, deadline: float) -> tuple[Capacity, bool]:
        attempt = 0
        while True:
            cap = self.check(state)
            if self.admits(cap):
                return cap, True
            if self.on_hold != "wait" or time.monotonic() >= deadline:
                return cap, False
            if self.pacer is not None:
                self.pacer.record(self._pool(state), "wait", cap)
            time.sleep(max(0.0, min(self._sleep_for(cap, attempt), deadline - time.monotonic())))
            attempt += 1

    def decide(self, state: dict) -> tuple[Capacity, bool, dict]:
        """(report, spawn?, extra state update) — the gate without the routing."""
        pool_id = self._pool(state)
        deadline = time.monotonic() + (self.max_wait_s if self.on_hold == "wait" else 0.0)
        extra: dict = {}
        if self.pacer is None:
            cap, ok = self._wait(state, deadline)
            return cap, ok, extra
        if not self.pacer.acquire(pool_id, timeout=max(0.0, deadline - time.monotonic())
                                  if self.on_hold != "interrupt" else 0.0):
            cap = self.check(state)
            cap = cap.model_copy(update={"can_admit": False, "reason": "another spawn is being admitted"})
            self.pacer.record(pool_id, "hold", cap)
            return cap, False, extra
        try:
            cap, ok = self._wait(state, deadline)
        except BaseException:
            self.pacer.release(pool_id)
            raise
        self.pacer.record(pool_id, "spawn" if ok else "hold", cap)
        if not ok:
            self.pacer.release(pool_id)
            return cap, False, extra
        sid = state.get(self.session_key) or f"{self.session_prefix}-{uuid.uuid4().hex[:12]}"
        extra[self.session_key] = sid
        self.pacer.claim(self.client, pool_id, sid)
        return cap, True, extra

    def __call__(self, state: dict) -> Command:
        cap, ok, extra = self.decide(state)
        while not ok and self.on_hold == "interrupt":
            interrupt({"reason": cap.reason, "pool_id": cap.pool_id, "capacity": cap.model_dump(),
                       "message": "pool has no capacity for another session; resume to re-check"})
            cap, ok, extra = self.decide(state)
        return Command(update={**capacity_update(cap), **extra}, goto=self.spawn if ok else self.hold)


# ============================================================================ compaction
DEFAULT_SUMMARY_PROMPT = "Write a short summary of the conversation above, keeping every name and fact."


def _transcript(messages: Sequence[BaseMessage]) -> str:
    lines = []
    for m in messages:
        who = {"human": "User", "ai": "Assistant", "tool": "Tool", "system": "System"}.get(m.type, m.type)
        text = m.content if isinstance(m.content, str) else " ".join(
            b.get("text", "") if isinstance(b, dict) else str(b) for b in m.content)
        if isinstance(m, AIMessage) and m.tool_calls:
            text += " " + "; ".join(f"[called {c['name']}({c['args']})]" for c in m.tool_calls)
        lines.append(f"{who}: {text.strip()}")
    return "\n".join(lines)


class CompactionNode:
    """Compaction by re-fork (spec §13.2), usable as a node or as a pre-model hook.

    When the last answer's ``compaction_pressure`` (from the state, or the last AIMessage's
    ``response_metadata``) reaches ``pressure_threshold``, or its ``ctx_headroom_tokens`` falls
    to ``min_headroom_tokens``, or the state has ``compact_now``, the node:

    1. summarizes the messages between the leading system messages and the last ``keep_last``
       messages with ``model`` (one user turn: the transcript, then ``summary_prompt``;
       at most ``summary_max_tokens`` tokens);
    2. forks the stable ancestor pool (``state[root_key]`` or ``ancestor_pool_id``: system +
       ``tools`` at D_sys) with system + summary + recent tail; when the state has a session, it
       is moved onto the new pool (``compact_session``), else the new pool is forked directly;
    3. moves the graph's ``pool_id`` to the new pool and releases the old working subtree
       (children first; idle sessions on it are ended when ``flush_sessions``);
    4. replaces the messages (``RemoveMessage(REMOVE_ALL_MESSAGES)`` + the compacted list).

    Below the thresholds it returns ``{}``. The summary goes in as a user message that starts
    with ``summary_header``, so the stable prefix (system + tools) is unchanged.
    """

    def __init__(self, model: Any, *, client: Any = None, tools: Sequence[Any] | None = None,
                 ancestor_pool_id: int | None = None, pressure_threshold: float = 0.8,
                 min_headroom_tokens: int | None = None, keep_last: int = 4,
                 summary_prompt: str = DEFAULT_SUMMARY_PROMPT, summary_max_tokens: int = 256,
                 summary_header: str = "Summary of the conversation so far:", flush_sessions: bool = True,
                 messages_key: str = "messages", pool_key: str = "pool_id", root_key: str = "root_pool_id",
                 session_key: str = "session_id"):
        if keep_last < 0:
            raise ValueError("keep_last must be >= 0")
        self.model = model
        self.client = _sync_client(client if client is not None else model)
        self.tools = [_as_openai_tool(t) for t in tools] if tools else None
        self.ancestor_pool_id = ancestor_pool_id
        self.pressure_threshold, self.min_headroom_tokens = pressure_threshold, min_headroom_tokens
        self.keep_last, self.summary_prompt, self.summary_max_tokens = keep_last, summary_prompt, summary_max_tokens
        self.summary_header, self.flush_sessions = summary_header, flush_sessions
        self.messages_key, self.pool_key, self.root_key, self.session_key = (messages_key, pool_key, root_key,
                                                                              session_key)
        self.__name__ = "compaction"

    # ---------------------------------------------------------------- decisions
    def pressure(self, state: dict) -> tuple[float | None, int | None]:
        """(compaction_pressure, ctx_headroom_tokens) of the latest answer."""
        p, h = state.get("compaction_pressure"), state.get("ctx_headroom_tokens")
        for m in reversed(state.get(self.messages_key) or []):
            if isinstance(m, AIMessage) and m.response_metadata:
                md = m.response_metadata
                p = md.get("compaction_pressure") if p is None else p
                h = md.get("ctx_headroom_tokens") if h is None else h
                break
        return p, h

    def should_compact(self, state: dict) -> bool:
        if state.get("compact_now"):
            return True
        p, h = self.pressure(state)
        if p is not None and p >= self.pressure_threshold:
            return True
        return self.min_headroom_tokens is not None and h is not None and h <= self.min_headroom_tokens

    def split(self, messages: Sequence[BaseMessage]) -> tuple[list, list, list]:
        """(leading system messages, old messages to summarize, recent tail to keep)."""
        n_sys = 0
        while n_sys < len(messages) and isinstance(messages[n_sys], SystemMessage):
            n_sys += 1
        body = list(messages[n_sys:])
        cut = max(0, len(body) - self.keep_last)
        while 0 < cut < len(body) and isinstance(body[cut], ToolMessage):
            cut -= 1  # a tool result stays with the call that asked for it
        return list(messages[:n_sys]), body[:cut], body[cut:]

    # ---------------------------------------------------------------- the node
    def summarize(self, old: Sequence[BaseMessage]) -> str:
        # One user turn, the transcript first and the instruction last: small models tend to continue
        # a transcript that follows the instruction (or a system message) instead of summarizing it.
        prompt = f"Conversation:\n{_transcript(old)}\n\n{self.summary_prompt}"
        answer = self.model.invoke([HumanMessage(prompt)], max_tokens=self.summary_max_tokens, pool_id=None,
                                   session_id=None)
        return answer.text.strip() if hasattr(answer, "text") else str(answer.content).strip()

    def __call__(self, state: dict) -> dict:
        if not self.should_compact(state):
            return {}
        from .chat_model import convert_messages
        messages = list(state.get(self.messages_key) or [])
        system, old, recent = self.split(messages)
        if not old:
            return {"compact_now": False} if state.get("compact_now") else {}
        ancestor = state.get(self.root_key) if state.get(self.root_key) is not None else self.ancestor_pool_id
        if ancestor is None:
            raise ValueError(f"CompactionNode: no stable ancestor pool (set state[{self.root_key!r}] or "
                             "ancestor_pool_id=)")
        summary = HumanMessage(f"{self.summary_header}\n{self.summarize(old)}")
        compacted = system + [summary] + recent
        prefix = convert_messages(compacted)
        old_pool = state.get(self.pool_key)
        sid = state.get(self.session_key)
        new_pool = None
        if sid:
            try:
                res = self.client.compact_session(sid, ancestor, messages=prefix, tools=self.tools)
                new_pool = res.pool
            except SessionNotFoundError:
                new_pool = None
        if new_pool is None:
            new_pool = self.client.fork_pool(ancestor, messages=prefix, tools=self.tools, label="compacted")
        if old_pool is not None and old_pool not in (ancestor, new_pool.pool_id):
            self._release_subtree(old_pool)
        update = {self.messages_key: [RemoveMessage(id=REMOVE_ALL_MESSAGES)] + compacted,
                  self.pool_key: new_pool.pool_id, "compaction_pressure": 0.0,
                  "ctx_headroom_tokens": None}
        if state.get("compact_now"):
            update["compact_now"] = False
        return update

    def _release_subtree(self, pool_id: int) -> None:
        try:
            root = self.client.pool(pool_id)
        except Exception:  # noqa: BLE001 - already released by compact_session
            return
        for p in list(reversed(root.subtree)) + [root]:  # leaves first
            try:
                if self.flush_sessions:
                    self.client.flush_pool(p.pool_id)
                self.client.release_pool(p.pool_id)
            except Exception:  # noqa: BLE001 - gone already, or still used by someone else: leave it
                pass


def _as_openai_tool(t: Any) -> dict:
    from langchain_core.utils.function_calling import convert_to_openai_tool
    return convert_to_openai_tool(t)
