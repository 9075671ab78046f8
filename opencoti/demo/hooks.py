"""How the scenario reports to the recorder: a LangChain callback that logs every chat-model call
(``RequestLog``) and a ``CapacityGateNode`` that logs each change of its verdict (``RecordedGate``)."""

from __future__ import annotations

import threading
import time
from typing import Any

from langchain_core.callbacks import BaseCallbackHandler

from ..langgraph import CapacityGateNode
from .recorder import Recorder


# ============================================================================ request log
class RequestLog(BaseCallbackHandler):
    """Records every chat-model call of the graph (including the compaction summary made inside
    ``CompactionNode``) from its ``response_metadata`` / ``usage_metadata``."""

    def __init__(self, recorder: Recorder):
        self.recorder = recorder
        self._runs: dict[Any, dict] = {}
        self._lock = threading.Lock()

    def on_chat_model_start(self, serialized, messages, *, run_id, parent_run_id=None, tags=None, metadata=None,
                            **kwargs) -> None:
        inv = kwargs.get("invocation_params") or {}
        md = metadata or {}
        with self._lock:
            self._runs[run_id] = {"t_start": time.time(), "session_id": inv.get("session_id"),
                                  "pool_id": inv.get("pool_id"), "agent": md.get("demo_agent"),
                                  "role": md.get("demo_role") or md.get("langgraph_node")}

    def on_llm_end(self, response, *, run_id, **kwargs) -> None:
        with self._lock:
            start = self._runs.pop(run_id, {})
        try:
            msg = response.generations[0][0].message
        except (IndexError, AttributeError):
            return
        md = msg.response_metadata or {}
        usage = msg.usage_metadata or {}
        timings = md.get("timings") or {}
        cached = (usage.get("input_token_details") or {}).get("cache_read")
        role = start.get("role") or ""
        self.recorder.request({
            "agent": start.get("agent") or ("summary" if role == "compact" else md.get("session_id") or role),
            "role": "summary" if role == "compact" else role,
            "session_id": md.get("session_id"), "pool_id": md.get("pool_id"),
            "prompt_tokens": usage.get("input_tokens"), "completion_tokens": usage.get("output_tokens"),
            "cached_tokens": cached if cached is not None else md.get("cached_prefix_tokens"),
            "ttft_ms": timings.get("prompt_ms"), "prefill_tokens": timings.get("prompt_n"),
            "decode_tps": timings.get("predicted_per_second"), "session_tps": md.get("session_tps"),
            "compaction_pressure": md.get("compaction_pressure"), "finish_reason": md.get("finish_reason"),
            "t_start": start.get("t_start"), "t_end": time.time(), "text": text_of(msg)[:400]})

    def on_llm_error(self, error, *, run_id, **kwargs) -> None:
        with self._lock:
            start = self._runs.pop(run_id, {})
        self.recorder.note(f"model call of {start.get('agent') or start.get('role')} failed: {error}")


def text_of(msg: Any) -> str:
    c = getattr(msg, "content", msg)
    if isinstance(c, str):
        return c
    return "".join(b.get("text", "") if isinstance(b, dict) else str(b) for b in c or ())


# ============================================================================ gate with a record
class RecordedGate(CapacityGateNode):
    """``CapacityGateNode`` that also writes each change of its verdict to the recorder."""

    def __init__(self, *args, recorder: Recorder, last: dict, **kw):
        super().__init__(*args, **kw)
        self.recorder = recorder
        self.last = last  # agent -> its latest capacity report (shared by the scenario's gates)

    def check(self, state: dict):
        cap = super().check(state)
        name = state.get("agent") or "?"
        prev = self.last.get(name)
        self.last[name] = cap
        if not self.admits(cap) and (prev is None or _why(prev) != _why(cap) or self.admits(prev)):
            self.recorder.decision(name, cap.pool_id, "wait", {**cap.model_dump(), "reason": _why(cap)})
        return cap


def _why(cap) -> str:
    """Why a gate does not spawn now: the capacity reason, or what ``require_settled`` waits for."""
    if not cap.can_admit:
        return cap.reason
    if cap.settling:
        return "measurement settling"
    if cap.n_warming:
        return "a session is warming up (no tps sample yet)"
    return cap.reason
