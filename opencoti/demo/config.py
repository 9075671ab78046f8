"""``DemoConfig`` (what the demo runs) and ``DemoResult`` (what it returns)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class DemoConfig:
    """What the demo runs. ``floor=None`` picks the floor from the run (``floor_fraction`` of the
    lead agent's solo decode tps); ``server`` switches from an in-process engine to a running
    ``opencoti serve``."""

    agents: int = 6
    """Sub-agents fanned out on the task pool (>= 2: the first one is the coordinator)."""
    floor: float | None = None
    """Per-session tps floor (None: ``floor_fraction`` x the lead agent's measured solo tps)."""
    floor_fraction: float = 0.75
    max_tokens: int = 48
    """Tokens per answer at most."""
    seed: int | None = None
    """Sample with this seed (temperature 0.7); None: greedy."""
    out: str = "demo-report"
    """Folder the report is written to."""
    model: str | None = None
    """In-process model (None: the bundled SmolLM2-135M-Instruct)."""
    server: str | None = None
    """URL of a running ``opencoti serve`` (instead of an in-process engine)."""
    api_key: str | None = None
    nested_agents: int = 2
    review_agents: int = 2
    long_turns_after_compaction: int = 1
    long_max_turns: int = 10
    compact_after_turns: int = 4
    """The long-running agent's compaction threshold: the compaction pressure its context reaches after
    about this many turns (its pool prefix + turns x (max_tokens + 24) tokens, over the context length)."""
    max_context: int | None = None
    """In-process engine: context length per session (None: ``auto_max_context(max_tokens)``, small on
    purpose, so the long-running agent's context fills it visibly)."""
    kv_budget_tokens: int = 12288
    page_size: int = 16
    num_threads: int | None = None
    weights: str = "auto"
    """In-process engine: projection weight format (``EngineConfig.weights``)."""
    settle_tokens: int = 12
    settle_max_ms: float = 3000.0
    gate_wait_s: float = 15.0
    """A gate waits this long before routing to its hold node (which loops back to the gate)."""
    interval_s: float = 0.25
    """Sampling period of the recorder."""
    charts: bool = True
    cleanup: bool | None = None
    """Release the demo's sessions and pools at the end (default: over HTTP only)."""


@dataclass
class DemoResult:
    run: dict
    summary: dict
    paths: dict[str, Path]
    wall_s: float
    load_s: float = 0.0
    errors: list[str] = field(default_factory=list)




def auto_max_context(max_tokens: int) -> int:
    """The in-process demo's context length: room for the longest prompt of the scenario (the lead's
    gather, the long-running agent before compaction) plus its answer, rounded up to 256."""
    need = 1664 + 6 * max_tokens
    return max(2560, -(-need // 256) * 256)
