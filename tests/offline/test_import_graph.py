"""No import cycle between opencoti's modules, counting imports inside functions (deferred imports
hide a cycle from the interpreter, not from a reader). The graph is read from the source with
``ast``: every ``import`` / ``from ... import`` anywhere in a module (module level, functions,
``TYPE_CHECKING`` blocks), relative imports resolved against the module's package; ``from pkg import
name`` counts as an import of the submodule ``pkg.name`` when that is a module, else of ``pkg``. The
implicit import of a module's parent package is not an edge (every package's ``__init__`` would
otherwise form a cycle with its own submodules). Between packages, imports go one way (LAYERS)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def modules(root: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is_package) for every .py file under root/package."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts.pop()
        out[".".join(parts)] = (path, is_pkg)
    return out


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (anywhere in its body)."""
    mods = modules(root, package)

    def owner(name: str | None) -> str | None:  # the longest known module that `name` is or lies in
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, (path, is_pkg) in mods.items():
        here = name if is_pkg else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(filter(None, (owner(a.name) for a in node.names)))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[:len(here.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    deps.add(sub if sub in mods else owner(source))
        deps.discard(None)
        deps.discard(name)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def describe(graph: dict[str, set[str]], comp: list[str]) -> str:
    return "; ".join(f"{m} -> {', '.join(sorted(graph[m] & set(comp)))}" for m in comp)


def test_no_import_cycle_between_opencoti_modules():
    graph = import_graph(ROOT, "opencoti")
    assert len(graph) > 100 and graph["opencoti.langgraph.lazy"], "the walk found the package"
    found = cycles(graph)
    assert not found, "import cycles: " + " | ".join(describe(graph, c) for c in found)


# The packages in the order docs/architecture.md gives: each imports only packages of an earlier
# rank ("opencoti" is the top-level __init__, which imports nothing of ours).
LAYERS = [{"opencoti"}, {"engine"}, {"ops"}, {"client", "server"}, {"langgraph", "cluster"}, {"sim"}, {"demo"},
          {"cli"}, {"__main__"}]


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def upward_imports(graph: dict[str, set[str]], layers: list[set[str]]) -> list[str]:
    rank = {pkg: i for i, group in enumerate(layers) for pkg in group}
    bad = []
    for mod, deps in graph.items():
        for dep in deps:
            a, b = package_of(mod), package_of(dep)
            if a != b and not rank[b] < rank[a]:
                bad.append(f"{mod} -> {dep}")
    return sorted(bad)


def test_packages_import_only_earlier_layers():
    graph = import_graph(ROOT, "opencoti")
    assert {package_of(m) for m in graph} == set().union(*LAYERS), "every package has its place in LAYERS"
    assert upward_imports(graph, LAYERS) == []
    assert upward_imports({"opencoti.ops.x": {"opencoti.server.y"}, "opencoti.server.y": set()}, LAYERS) == [
        "opencoti.ops.x -> opencoti.server.y"]
    assert upward_imports({"opencoti.client.x": {"opencoti.server.y"}, "opencoti.server.y": set()}, LAYERS) == [
        "opencoti.client.x -> opencoti.server.y"]


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_walk_sees_function_level_and_relative_imports(tmp_path):
    """The checker itself: a cycle closed only by a deferred relative import inside a function is
    found; the same package without that import has none; `from . import mod` names the module."""
    _write(tmp_path, {
        "pkg/__init__.py": "from .a import A\n",
        "pkg/a.py": "from .sub import b\nA = 1\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/b.py": "def f():\n    from ..a import A\n    return A\n",
        "pkg/sub/c.py": "import pkg.sub.b as b\nfrom pkg import a\n",
    })
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.sub.b"}
    assert graph["pkg.sub.b"] == {"pkg.a"}
    assert graph["pkg.sub.c"] == {"pkg.sub.b", "pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b"]]
    (tmp_path / "pkg/sub/b.py").write_text("def f():\n    return 1\n")
    assert cycles(import_graph(tmp_path, "pkg")) == []
