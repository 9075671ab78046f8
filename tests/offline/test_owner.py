"""One writer of the pool and session state: ``PolyKV`` (``opencoti/engine/polykv/state.py``).

Read from the source with ``ast`` over every module of ``opencoti/``: an assignment (``=``, ``+=``,
annotated, ``del``) to a field of a pool or a session, a change of one of their collections
(``pool.sessions.add``, ``pool.children.append``, ``tree.pools[...] = ...``, ``.pop`` ...) is a write;
only the owner may make one. The data types themselves (``kv/pools.py``: ``Pool``, ``PoolTree``'s id
allocation and links; ``core/requests.py``: ``Session.__init__``) set their own fields, and so does any
class in its own ``__init__`` (``self.x = ...``: its own attribute, not a pool's); a change of a
collection is a write wherever it is, ``self.sessions[...]`` included.

Names are matched by attribute name, so a field of the same name on another object (the prefix
index's ``last_access``, a cluster router's ``sessions`` dict) is listed in ``OTHER`` with what it is.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OWNER = "opencoti/engine/polykv/state.py"
DATA_TYPES = {"opencoti/engine/kv/pools.py", "opencoti/engine/core/requests.py"}

# Pool fields and Session fields that only the owner assigns.
FIELDS = {"residency", "pinned", "release_at", "grace_until", "cache_hits", "rematerializations", "tenant",
          "children", "parent", "label", "last_access", "pool_id", "anonymous", "job", "seq", "sessions",
          "pools", "released"}
# Collections of pools and sessions whose contents only the owner changes.
COLLECTIONS = {"sessions", "children", "pools", "released"}
MUTATORS = {"add", "discard", "remove", "pop", "popitem", "clear", "update", "append", "extend", "insert",
            "setdefault", "__setitem__", "__delitem__"}

# Same-named attributes of other objects: (module, attribute) -> what they are.
OTHER: dict[tuple[str, str], str] = {
    ("opencoti/engine/kv/prefix_index.py", "last_access"): "the prefix index's own entries (LRU of cache pages)",
    ("opencoti/cluster/policy.py", "sessions"): "the cluster router's session -> replica map (an OrderedDict)",
    ("opencoti/engine/admission/controller.py", "pool_id"): "a request held by admission (Held): the pool it waits on",
    ("opencoti/engine/kv/prefix_index.py", "children"): "the prefix index's trie of cache pages",
    ("opencoti/langgraph/tools.py", "pools"): "a graph state's list of pool ids the agent created",
}


def _writes(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, attribute) of every write to a FIELDS attribute / COLLECTIONS content, outside the
    ``self.x = ...`` of a class's own ``__init__``."""
    out: list[tuple[int, str]] = []

    def attr_of(node) -> str | None:
        if isinstance(node, ast.Attribute):
            return node.attr
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute):
            return node.value.attr if node.value.attr in COLLECTIONS else None
        return None

    def visit(node, in_init: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_init = node.name == "__init__"
        targets: list = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for t in targets:
            for sub in ast.walk(t) if isinstance(t, ast.Tuple) else [t]:
                name = attr_of(sub)
                if name is None or (name not in FIELDS and not isinstance(sub, ast.Subscript)):
                    continue
                own = (in_init and isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                       and sub.value.id == "self")
                if not own:
                    out.append((sub.lineno, name))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
                and isinstance(node.func.value, ast.Attribute) and node.func.value.attr in COLLECTIONS):
            out.append((node.lineno, node.func.value.attr))
        for child in ast.iter_child_nodes(node):
            visit(child, in_init)

    visit(tree, False)
    return out


def _violations(root: Path) -> list[str]:
    found = []
    for path in sorted((root / "opencoti").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == OWNER or rel in DATA_TYPES:
            continue
        for line, name in _writes(ast.parse(path.read_text(), rel)):
            if (rel, name) not in OTHER:
                found.append(f"{rel}:{line} writes .{name}")
    return found


def test_only_polykv_writes_pool_and_session_state():
    assert _violations(ROOT) == []


def test_every_other_entry_is_still_used():
    """An OTHER entry whose module no longer writes the name is stale."""
    for (rel, name), why in OTHER.items():
        names = {n for _, n in _writes(ast.parse((ROOT / rel).read_text(), rel))}
        assert name in names, f"stale entry {rel} .{name} ({why})"


def test_the_check_finds_each_kind_of_write(tmp_path):
    mod = tmp_path / "opencoti" / "engine" / "intruder.py"
    mod.parent.mkdir(parents=True)
    mod.write_text(
        "def f(pool, s, core, tree):\n"
        "    pool.residency = 1\n"
        "    s.pool_id, x = 3, 4\n"
        "    pool.cache_hits += 1\n"
        "    pool.sessions.add('a')\n"
        "    core.sessions['a'] = s\n"
        "    del core.sessions['a']\n"
        "    tree.pools.pop(1)\n"
        "    pool.parent.children.append(pool)\n"
        "    s.job: object = None\n"
        "    n = len(pool.sessions)  # a read\n"
        "    y = pool.residency  # a read\n"
        "class C:\n"
        "    def __init__(self):\n"
        "        self.sessions = {}  # its own attribute\n"
        "    def g(self, s):\n"
        "        self.sessions[1] = s  # a write: it may be the owner's dict behind a property\n"
        "        s.seq = None\n")
    got = [v.split(":", 1)[1] for v in _violations(tmp_path)]
    assert got == ["2 writes .residency", "3 writes .pool_id", "4 writes .cache_hits", "5 writes .sessions",
                   "6 writes .sessions", "7 writes .sessions", "8 writes .pools", "9 writes .children",
                   "10 writes .job", "17 writes .sessions", "18 writes .seq"]
