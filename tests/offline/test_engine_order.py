"""Inside the engine, imports go down one order of modules (docs/architecture.md, "Layers").

The graph is ``test_import_graph.import_graph``: every import anywhere in a module (functions and
``TYPE_CHECKING`` blocks included). A module may import modules of its own level or below; the
engine's data types and checks (``DATA``) may be imported from every level, and themselves import
only data types or the two lowest levels. What goes up instead is a dependency the lower part
declares (a Protocol or a callable) and is given at construction: the scheduler's ``SchedulerHooks``,
the tables' ``Reclaimer``, ``PolyKV``'s ``enqueue``, admission's ``PostToStepThread``, listeners and
per-request callbacks; no import is needed for those, so none is allowed.
"""

from __future__ import annotations

from test_import_graph import ROOT, import_graph

PREFIX = "opencoti.engine."

# Top to bottom. An entry names a module or a package (the longest entry that matches wins).
LEVELS: list[list[str]] = [
    ["__init__", "api"],  # the Engine facade and its API
    ["admission", "admission.controller", "observe.metrics", "persist"],  # beside the core, reading its view
    ["core.core"],  # EngineCore: prepare -> commit -> step -> apply -> finish
    ["core.scheduler", "core.runner", "polykv.prefix", "polykv.status"],
    ["polykv.state"],  # PolyKV, the one owner of pools and sessions
    ["kv.tables"],  # KVTables, the one owner of page tables and refcounts
    ["kv.prefix_index", "kv.pages", "kv.gate"],
    ["model", "attention", "sampling", "constraints", "chat", "native", "attention.q8", "admission.capacity",
     "admission.forecast", "admission.policy", "admission.state", "observe.tps"],
]
# Data types and checks every level uses (and packages' empty __init__ files).
DATA = {"requests", "limits", "speculation", "core.speculative", "kv.pool", "polykv.view", "admission.decide",
        "config", "errors", "results", "checks", "paths", "kv", "core", "polykv", "observe"}


def _rel(module: str) -> str | None:
    if module == "opencoti.engine":
        return "__init__"
    return module[len(PREFIX):] if module.startswith(PREFIX) else None


def level(name: str) -> int | None:
    best, found = "", None
    for i, group in enumerate(LEVELS):
        for entry in group:
            if (name == entry or name.startswith(entry + ".")) and len(entry) > len(best):
                best, found = entry, i
    return found


def violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, deps in sorted(graph.items()):
        a = _rel(module)
        if a is None:
            continue
        if a not in DATA and level(a) is None:
            bad.append(f"{a} has no place in LEVELS or DATA")
            continue
        for dep in sorted(deps):
            b = _rel(dep)
            if b is None or b in DATA:
                continue
            lb = level(b)
            if lb is None:
                bad.append(f"{b} has no place in LEVELS or DATA")
            elif a in DATA:
                if lb < len(LEVELS) - 2:
                    bad.append(f"data module {a} imports {b} (level {lb})")
            elif lb < level(a):  # type: ignore[operator]
                bad.append(f"{a} (level {level(a)}) imports {b} (level {lb}): up")
    return bad


def test_the_engine_imports_down_its_order_of_modules():
    assert violations(import_graph(ROOT, "opencoti")) == []


def test_the_check_finds_an_import_up():
    e = "opencoti.engine."
    graph = {e + "kv.tables": {e + "polykv.state", e + "requests"},  # up, then data: allowed
             e + "requests": {e + "core.core"},  # a data type importing the core
             e + "core.scheduler": {e + "kv.tables", e + "core.runner"},  # down and beside: allowed
             e + "polykv.newthing": set()}  # a module nobody placed
    assert violations(graph) == ["kv.tables (level 5) imports polykv.state (level 4): up",
                                 "polykv.newthing has no place in LEVELS or DATA",
                                 "data module requests imports core.core (level 2)"]
