"""`opencoti demo`: a multi-agent LangGraph run that shows pools, admission and compaction working.

    config.py    DemoConfig / DemoResult
    script.py    the fixed content: prompts, parts of the work, the review group's tools
    scenario.py  the LangGraph graph (root pool, extend, fan-out under a floor, nested fork, COW branch,
                 compaction by re-fork, gather)
    hooks.py     what reports to the recorder: the model-call log and the recording capacity gate
    recorder.py  samples the engine (tps, pool tree, admission events) and keeps the run's log
    live.py      the rich live view, or plain log lines when stdout is not a terminal
    report.py    the markdown report and the PNG charts, every figure computed from the recording
    runner.py    run_demo(): engine or --server, the graph, the recorder, the view, the report
"""

from .config import DemoConfig, DemoResult
from .runner import run_demo

__all__ = ["DemoConfig", "DemoResult", "run_demo"]
