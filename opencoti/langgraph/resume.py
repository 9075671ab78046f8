"""Resuming graphs whose capacity gates hold with ``on_hold="interrupt"``.

A fan-out of gated workers can stop with several interrupts pending at once (one per held gate);
LangGraph then needs a resume value *per interrupt id* (``Command(resume=True)`` is refused with
"you must specify the interrupt id"). ``resume_command`` builds that command, and
``invoke_until_done`` / ``ainvoke_until_done`` loop until no interrupt is left::

    out = invoke_until_done(graph, {"tasks": [...], "pool_id": pool_id}, config)

Each round waits as long as the held gates' reports say the pool needs (a settle window's rest),
within ``max_wait_s``, before resuming them; the gates then check the pool again.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from langgraph.types import Command

__all__ = ["pending_interrupts", "resume_command", "resume_delay", "invoke_until_done", "ainvoke_until_done"]


def pending_interrupts(result: Any) -> list:
    """The interrupts an ``invoke`` result is waiting on (``result["__interrupt__"]``; [] when none)."""
    if not isinstance(result, dict):
        return []
    return list(result.get("__interrupt__") or ())


def resume_command(result: Any, value: Any = True) -> Command | None:
    """``Command(resume={interrupt id: value, ...})`` for every pending interrupt of ``result``
    (None when nothing is pending)."""
    pending = pending_interrupts(result)
    if not pending:
        return None
    return Command(resume={i.id: value for i in pending})


def resume_delay(result: Any, min_wait_s: float = 0.05, max_wait_s: float = 2.0) -> float:
    """Seconds to wait before resuming: the longest settle window left among the held gates'
    capacity reports, within [min_wait_s, max_wait_s]."""
    waits = [0.0]
    for i in pending_interrupts(result):
        cap = i.value.get("capacity") if isinstance(i.value, dict) else None
        if isinstance(cap, dict):
            waits.append(float(cap.get("settle_remaining_ms") or 0.0) / 1e3)
    return min(max(max(waits), min_wait_s), max_wait_s)


def _rounds_error(max_rounds: int, result: Any) -> RuntimeError:
    reasons = sorted({str(i.value.get("reason")) for i in pending_interrupts(result) if isinstance(i.value, dict)})
    return RuntimeError(f"still interrupted after {max_rounds} resumes (reasons: {', '.join(reasons) or '?'})")


def invoke_until_done(graph: Any, graph_input: Any, config: dict, *, value: Any = True, max_rounds: int = 100,
                      min_wait_s: float = 0.05, max_wait_s: float = 2.0) -> Any:
    """``graph.invoke(graph_input, config)``, then resume every pending interrupt with ``value``
    (waiting ``resume_delay`` between rounds) until none is left; returns the last result. The
    graph needs a checkpointer and ``config`` a thread id. Raises RuntimeError after ``max_rounds``."""
    result = graph.invoke(graph_input, config)
    for _ in range(max_rounds):
        cmd = resume_command(result, value)
        if cmd is None:
            return result
        time.sleep(resume_delay(result, min_wait_s, max_wait_s))
        result = graph.invoke(cmd, config)
    if resume_command(result) is None:
        return result
    raise _rounds_error(max_rounds, result)


async def ainvoke_until_done(graph: Any, graph_input: Any, config: dict, *, value: Any = True, max_rounds: int = 100,
                             min_wait_s: float = 0.05, max_wait_s: float = 2.0) -> Any:
    """``invoke_until_done`` for async graphs (``ainvoke``)."""
    result = await graph.ainvoke(graph_input, config)
    for _ in range(max_rounds):
        cmd = resume_command(result, value)
        if cmd is None:
            return result
        await asyncio.sleep(resume_delay(result, min_wait_s, max_wait_s))
        result = await graph.ainvoke(cmd, config)
    if resume_command(result) is None:
        return result
    raise _rounds_error(max_rounds, result)
