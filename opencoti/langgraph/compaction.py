"""``CompactionNode``: compaction by re-fork (docs/polykv.md, "Compaction") as a node or a pre-model
hook, in sync and async graphs."""

from __future__ import annotations

from typing import Any, Generator, Sequence

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, RemoveMessage, SystemMessage, ToolMessage
from langchain_core.runnables import RunnableLambda
from langgraph.graph.message import REMOVE_ALL_MESSAGES
from langgraph.types import Overwrite

from ..client import SessionNotFoundError
from ._clients import client_pair
from .convert import convert_messages
from .pools import POOLS_KEY, aensure_pool, ensure_pool, pool_spec

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


def _as_openai_tool(t: Any) -> dict:
    from langchain_core.utils.function_calling import convert_to_openai_tool
    return convert_to_openai_tool(t)


class CompactionNode(RunnableLambda):
    """Compaction by re-fork, usable as a node or as a pre-model hook.

    When the last answer's ``compaction_pressure`` (from the state, or the last AIMessage's
    ``response_metadata``) reaches ``pressure_threshold``, or its ``ctx_headroom_tokens`` falls
    to ``min_headroom_tokens``, or the state has ``compact_now``, the node:

    1. summarizes the messages between the leading system messages and the last ``keep_last``
       messages with ``model`` (one user turn: the transcript, then ``summary_prompt``;
       at most ``summary_max_tokens`` tokens);
    2. forks the stable ancestor pool (``state[root_key]`` or ``ancestor_pool_id``: system +
       ``tools`` at D_sys; re-created from ``state["pools"]`` if it is gone) with system + summary
       + recent tail; when the state has a session, it is moved onto the new pool
       (``compact_session``), else the new pool is forked directly. ``tools``: those the
       ancestor was rendered with (default: the ones ``state["pools"]`` records for it);
    3. moves the graph's ``pool_id`` to the new pool (recorded in ``state["pools"]``) and releases
       the old working subtree (children first; idle sessions on it are ended when ``flush_sessions``);
    4. replaces the messages (``RemoveMessage(REMOVE_ALL_MESSAGES)`` + the compacted list).

    Below the thresholds it returns ``{}``. The summary goes in as a user message that starts
    with ``summary_header``, so the stable prefix (system + tools) is unchanged. ``model`` and
    ``client`` may be sync or async (an OpencotiChatModel has both).
    """

    def __init__(self, model: Any, *, client: Any = None, tools: Sequence[Any] | None = None,
                 ancestor_pool_id: int | None = None, pressure_threshold: float = 0.8,
                 min_headroom_tokens: int | None = None, keep_last: int = 4,
                 summary_prompt: str = DEFAULT_SUMMARY_PROMPT, summary_max_tokens: int = 256,
                 summary_header: str = "Summary of the conversation so far:", flush_sessions: bool = True,
                 messages_key: str = "messages", pool_key: str = "pool_id", root_key: str = "root_pool_id",
                 session_key: str = "session_id"):
        """A compaction node. ``model``: the chat model that writes the summary (sync or async);
        ``client``: the PolyKV client (default: the model's); the thresholds, ``keep_last``, the
        summary settings and the state keys are described in the class docstring."""
        if keep_last < 0:
            raise ValueError("keep_last must be >= 0")
        self.model = model
        self.clients = client_pair(client if client is not None else model)
        self.tools = [_as_openai_tool(t) for t in tools] if tools else None
        self.ancestor_pool_id = ancestor_pool_id
        self.pressure_threshold, self.min_headroom_tokens = pressure_threshold, min_headroom_tokens
        self.keep_last, self.summary_prompt, self.summary_max_tokens = keep_last, summary_prompt, summary_max_tokens
        self.summary_header, self.flush_sessions = summary_header, flush_sessions
        self.messages_key, self.pool_key, self.root_key, self.session_key = (messages_key, pool_key, root_key,
                                                                              session_key)
        super().__init__(self._run, afunc=self._arun, name="compaction")
        self.__name__ = "compaction"

    def __call__(self, state: dict) -> dict:
        return self._run(state)

    @property
    def client(self):
        """The sync client."""
        return self.clients.sync

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

    def _summary_request(self, old: Sequence[BaseMessage]) -> tuple[list, dict]:
        # One user turn, the transcript first and the instruction last: small models tend to continue
        # a transcript that follows the instruction (or a system message) instead of summarizing it.
        prompt = f"Conversation:\n{_transcript(old)}\n\n{self.summary_prompt}"
        return [HumanMessage(prompt)], {"max_tokens": self.summary_max_tokens, "pool_id": None, "session_id": None}

    @staticmethod
    def _text(answer: Any) -> str:
        return answer.text.strip() if hasattr(answer, "text") else str(answer.content).strip()

    def summarize(self, old: Sequence[BaseMessage]) -> str:
        msgs, kw = self._summary_request(old)
        return self._text(self.model.invoke(msgs, **kw))

    async def asummarize(self, old: Sequence[BaseMessage]) -> str:
        msgs, kw = self._summary_request(old)
        return self._text(await self.model.ainvoke(msgs, **kw))

    # ---------------------------------------------------------------- the node
    def _steps(self, state: dict, ancestor: int) -> Generator[tuple, Any, dict]:
        """The compaction as steps run by the sync or the async driver: ``("summarize", old)``,
        ``("compact", sid, ancestor, prefix, tools)`` (None when the session is gone),
        ``("fork", ancestor, prefix, tools)``, ``("release", pool_id)`` (-> released ids)."""
        messages = list(state.get(self.messages_key) or [])
        system, old, recent = self.split(messages)
        if not old:
            return {"compact_now": False} if state.get("compact_now") else {}
        summary = HumanMessage(f"{self.summary_header}\n{(yield ('summarize', old))}")
        compacted = system + [summary] + recent
        prefix = convert_messages(compacted)
        specs = state.get(POOLS_KEY) or {}
        tools = self.tools if self.tools is not None else (specs.get(str(ancestor)) or {}).get("tools")
        old_pool = state.get(self.pool_key)
        sid = state.get(self.session_key)
        new_pool = (yield ("compact", sid, ancestor, prefix, tools)) if sid else None
        if new_pool is None:
            new_pool = yield ("fork", ancestor, prefix, tools)
        released: list[int] = []
        if old_pool is not None and old_pool not in (ancestor, new_pool.pool_id):
            released = yield ("release", old_pool)
        spec = pool_spec(new_pool, messages=prefix, tools=tools)
        pools = {str(p): None for p in released}
        pools[str(new_pool.pool_id)] = spec
        update = {self.messages_key: [RemoveMessage(id=REMOVE_ALL_MESSAGES)] + compacted,
                  self.pool_key: new_pool.pool_id, "compaction_pressure": 0.0,
                  "ctx_headroom_tokens": Overwrite(None), POOLS_KEY: pools}
        if state.get("compact_now"):
            update["compact_now"] = False
        return update

    def _ancestor(self, state: dict) -> int:
        ancestor = state.get(self.root_key) if state.get(self.root_key) is not None else self.ancestor_pool_id
        if ancestor is None:
            raise ValueError(f"CompactionNode: no stable ancestor pool (set state[{self.root_key!r}] or "
                             "ancestor_pool_id=)")
        return ancestor

    def _run(self, state: dict) -> dict:
        if not self.should_compact(state):
            return {}
        c = self.clients.sync
        ancestor, moved = ensure_pool(c, state, self._ancestor(state))
        gen, result = self._steps({**state, **moved}, ancestor), None
        try:
            while True:
                step = gen.send(result)
                if step[0] == "summarize":
                    result = self.summarize(step[1])
                elif step[0] == "compact":
                    try:
                        result = c.compact_session(step[1], step[2], messages=step[3], tools=step[4]).pool
                    except SessionNotFoundError:
                        result = None
                elif step[0] == "fork":
                    result = c.fork_pool(step[1], messages=step[2], tools=step[3], label="compacted")
                else:
                    result = self._release_subtree(step[1])
        except StopIteration as stop:
            return _merge(moved, stop.value)

    async def _arun(self, state: dict) -> dict:
        if not self.should_compact(state):
            return {}
        c = self.clients.aio
        ancestor, moved = await aensure_pool(c, state, self._ancestor(state))
        gen, result = self._steps({**state, **moved}, ancestor), None
        try:
            while True:
                step = gen.send(result)
                if step[0] == "summarize":
                    result = await self.asummarize(step[1])
                elif step[0] == "compact":
                    try:
                        result = (await c.compact_session(step[1], step[2], messages=step[3], tools=step[4])).pool
                    except SessionNotFoundError:
                        result = None
                elif step[0] == "fork":
                    result = await c.fork_pool(step[1], messages=step[2], tools=step[3], label="compacted")
                else:
                    result = await self._arelease_subtree(step[1])
        except StopIteration as stop:
            return _merge(moved, stop.value)

    def _release_subtree(self, pool_id: int) -> list[int]:
        c = self.clients.sync
        try:
            root = c.pool(pool_id)
        except Exception:  # noqa: BLE001 - already released by compact_session
            return [pool_id]
        released = []
        for p in list(reversed(root.subtree)) + [root]:  # leaves first
            try:
                if self.flush_sessions:
                    c.flush_pool(p.pool_id)
                c.release_pool(p.pool_id, immediate=True)  # compaction frees the old subtree now
                released.append(p.pool_id)
            except Exception:  # noqa: BLE001 - gone already, or still used by someone else: leave it
                pass
        return released

    async def _arelease_subtree(self, pool_id: int) -> list[int]:
        c = self.clients.aio
        try:
            root = await c.pool(pool_id)
        except Exception:  # noqa: BLE001
            return [pool_id]
        released = []
        for p in list(reversed(root.subtree)) + [root]:
            try:
                if self.flush_sessions:
                    await c.flush_pool(p.pool_id)
                await c.release_pool(p.pool_id, immediate=True)
                released.append(p.pool_id)
            except Exception:  # noqa: BLE001
                pass
        return released


def _merge(moved: dict, update: dict) -> dict:
    if not update:
        return moved
    out = {**moved, **update}
    if POOLS_KEY in moved and POOLS_KEY in update:
        out[POOLS_KEY] = {**moved[POOLS_KEY], **update[POOLS_KEY]}
    return out
