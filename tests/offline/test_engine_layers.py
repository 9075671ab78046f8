"""The engine's folders are layers: a module imports only from its own folder and from folders below
it (ENGINE_LAYERS, lowest first). The engine package's own modules (errors, config, results, checks,
paths) are the lowest; its ``__init__``, the facade that re-exports the Engine, stands above them all.
Every import between engine folders points down: UPWARD, the list of exceptions (each with what it
waits for), is empty, and the test fails on any upward import and on a listed one that is gone. The
graph is test_import_graph's (every import anywhere in a module, relative ones resolved)."""

from __future__ import annotations

from pathlib import Path

from test_import_graph import import_graph, modules

ROOT = Path(__file__).resolve().parents[2]

# lowest first; "" is the engine package's own modules (opencoti/engine/*.py)
ENGINE_LAYERS = ["", "native", "chat", "constraints", "sampling", "attention", "model", "kv", "polykv", "observe",
                 "admission", "core", "persist", "api"]

# module -> module imports that point up, and why they are still there (none: keep it so)
UPWARD: dict[str, str] = {}


def folder_of(module: str, mods: dict) -> str | None:
    """The engine folder a module is in ("" for the engine package's own modules), None outside it."""
    parts = module.split(".")
    if parts[:2] != ["opencoti", "engine"] or len(parts) == 2:  # (the package's __init__: the facade, on top)
        return None
    if len(parts) == 3:
        return parts[2] if mods[module][1] else ""
    return parts[2]


def upward(graph: dict[str, set[str]], mods: dict, layers: list[str]) -> set[str]:
    rank = {f: i for i, f in enumerate(layers)}
    out = set()
    for mod, deps in graph.items():
        a = folder_of(mod, mods)
        if a is None:
            continue
        for dep in deps:
            b = folder_of(dep, mods)
            if b is None or a == b:
                continue
            if rank[b] > rank[a]:
                out.add(f"{mod.removeprefix('opencoti.')} -> {dep.removeprefix('opencoti.')}")
    return out


def test_engine_folders_import_only_their_own_and_lower_layers():
    mods = modules(ROOT, "opencoti")
    graph = import_graph(ROOT, "opencoti")
    folders = {folder_of(m, mods) for m in mods} - {None}
    assert folders == set(ENGINE_LAYERS), f"every engine folder has its place in ENGINE_LAYERS: {folders ^ set(ENGINE_LAYERS)}"
    found = upward(graph, mods, ENGINE_LAYERS)
    assert sorted(found - set(UPWARD)) == [], "imports that point up a layer (move the module, or the name it needs)"
    assert sorted(set(UPWARD) - found) == [], "listed upward imports that are gone: take them off UPWARD"


def test_the_check_sees_an_upward_import():
    mods = {"opencoti.engine.kv": (None, True), "opencoti.engine.kv.a": (None, False),
            "opencoti.engine.api": (None, True), "opencoti.engine.api.b": (None, False),
            "opencoti.engine.errors": (None, False)}
    graph = {"opencoti.engine.kv.a": {"opencoti.engine.api.b", "opencoti.engine.errors"},
             "opencoti.engine.api.b": {"opencoti.engine.kv.a"}, "opencoti.engine.errors": set()}
    assert upward(graph, mods, ENGINE_LAYERS) == {"engine.kv.a -> engine.api.b"}


MAX_LINES = 500


def too_long(root: Path, limit: int = MAX_LINES) -> dict[str, int]:
    """Modules under ``root`` longer than ``limit`` lines (path -> lines)."""
    out = {}
    for p in sorted(root.rglob("*.py")):
        n = len(p.read_text(encoding="utf-8").splitlines())
        if n > limit:
            out[str(p.relative_to(root.parent))] = n
    return out


def test_no_module_is_longer_than_500_lines():
    """A module a reader takes in one sitting: split one that grows past this by concern."""
    assert too_long(ROOT / "opencoti") == {}


def test_the_length_check_sees_a_long_module(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "short.py").write_text("x = 1\n" * MAX_LINES)
    (pkg / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert too_long(pkg) == {"pkg/long.py": MAX_LINES + 1}
