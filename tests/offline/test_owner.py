"""Each piece of pool, session and sequence state has one writer (docs/architecture.md, "One owner
per concern"), found in the source with ``ast`` over every module of ``opencoti/``, no file exempt:

- pools, the tree, sessions and their attachments: ``PolyKV``, the package ``polykv/state/`` (split by
  concern: ``polykv.py``, ``base.py``, ``tree.py``, ``timers.py``, ``reclaim.py``, ``restore.py``);
  with them the sequence fields tied to a session: ``num_shared_tokens`` (what a session shares with
  its pool, set through ``PolyKV.adopt_seq`` / ``session_kv_loaded``);
- a sequence's page table and its prefix-index bookkeeping (``page_table``, ``num_cached``,
  ``num_borrowed_pages``, ``page_keys``, ``index_node``, ``cacheable``): ``KVTables``
  (``kv/tables.py``); ``salt_root`` is given when a sequence is made and never written after;
- a request's tokens (``seq.tokens``: the prompt, then each sampled token, a draft appended and rolled
  back): the core that runs the request (``core/core.py``, the draft rows ``core/speculative.py``; the
  simulator's core ``sim/engine.py``).

A write is an assignment (``=``, ``+=``, annotated, ``del``) to such a field, to an item of it
(``x.page_table[i] = ...``, ``del seq.tokens[n:]``), or a call of a mutator on it
(``pool.sessions.add``, ``tree.pools.pop``, ``seq.page_table.extend``...). A class sets its own
attributes in its own ``__init__`` (``self.x = ...``: a new object, not an existing pool's); that is
the only write allowed outside the owner, the data types' modules (``kv/pool.py``,
``requests.py``) included.

Names are matched by attribute name, so a field of the same name on another object (the prefix
index's ``last_access``, a cluster router's ``sessions`` dict) is listed in ``OTHER`` with what it is.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
POLYKV = "opencoti/engine/polykv/state/"
TABLES = "opencoti/engine/kv/tables.py"
REQUEST_RUNNERS = ("opencoti/engine/core/core.py", "opencoti/engine/core/speculative.py", "opencoti/sim/engine.py")

POOL_SESSION = {"residency", "pinned", "release_at", "grace_until", "cache_hits", "rematerializations", "tenant",
                "children", "parent", "label", "last_access", "last_access_wall", "pool_id", "anonymous", "job", "seq",
                "sessions", "pools", "released", "spilled_keys", "num_shared_tokens"}
PAGE_TABLE = {"page_table", "num_cached", "num_borrowed_pages", "page_keys", "index_node", "cacheable", "salt_root"}
# attribute -> the modules (a path, or a package ending in "/") that may write it
OWNERS: dict[str, tuple[str, ...]] = {
    **{name: (POLYKV,) for name in POOL_SESSION},
    **{name: (TABLES,) for name in PAGE_TABLE - {"salt_root"}},
    "salt_root": (),  # given to SeqState(...) only
    "tokens": REQUEST_RUNNERS,
}
MUTATORS = {"add", "discard", "remove", "pop", "popitem", "clear", "update", "append", "extend", "insert",
            "setdefault", "sort", "reverse", "__setitem__", "__delitem__"}

# Same-named attributes of other objects: (module, attribute) -> what they are.
OTHER: dict[tuple[str, str], str] = {
    ("opencoti/engine/kv/prefix_index.py", "last_access"): "the prefix index's own entries (LRU of cache pages)",
    ("opencoti/cluster/policy.py", "sessions"): "the cluster router's session -> replica map (an OrderedDict)",
    ("opencoti/engine/admission/controller.py", "pool_id"): "a request held by admission (Held): the pool it waits on",
    ("opencoti/engine/admission/controller.py", "tokens"): "the tokens an admission settle window counted",
    ("opencoti/engine/admission/state.py", "tokens"): "the same settle window's count, reset when it is extended",
    ("opencoti/engine/kv/prefix_index.py", "children"): "the prefix index's trie of cache pages",
    ("opencoti/langgraph/tools.py", "pools"): "a graph state's list of pool ids the agent created",
}


def _writes(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, attribute) of every write to an owned attribute, outside the ``self.x = ...`` of a
    class's own ``__init__``."""
    out: list[tuple[int, str]] = []

    def owned(node) -> tuple[str, bool] | None:
        """(attribute, whether it is the ``self.x`` itself) of a written target, when owned."""
        if isinstance(node, ast.Attribute) and node.attr in OWNERS:
            return node.attr, isinstance(node.value, ast.Name) and node.value.id == "self"
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr in OWNERS:
            return node.value.attr, False  # an item of it: a change of its contents, wherever it is
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
                hit = owned(sub)
                if hit is None:
                    continue
                name, is_self = hit
                if not (in_init and is_self and not isinstance(node, ast.AugAssign)):
                    out.append((sub.lineno, name))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
                and isinstance(node.func.value, ast.Attribute) and node.func.value.attr in OWNERS):
            out.append((node.lineno, node.func.value.attr))
        for child in ast.iter_child_nodes(node):
            visit(child, in_init)

    visit(tree, False)
    return out


def _may_write(rel: str, name: str) -> bool:
    return any(rel == o or (o.endswith("/") and rel.startswith(o)) for o in OWNERS[name]) or (rel, name) in OTHER


def _violations(root: Path) -> list[str]:
    found = []
    for path in sorted((root / "opencoti").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for line, name in _writes(ast.parse(path.read_text(), rel)):
            if not _may_write(rel, name):
                found.append(f"{rel}:{line} writes .{name}")
    return found


def test_each_field_is_written_only_by_its_owner():
    assert _violations(ROOT) == []


def test_no_file_is_exempt():
    """Every module is scanned; the owners are real modules, each writing what it owns."""
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "opencoti").rglob("*.py")}
    assert {"opencoti/engine/kv/pool.py", "opencoti/engine/requests.py"} <= files
    for owners in OWNERS.values():
        for o in owners:
            assert (o in files) if not o.endswith("/") else any(f.startswith(o) for f in files), o
    writes = {}
    for rel in files:
        writes[rel] = {n for _, n in _writes(ast.parse((ROOT / rel).read_text(), rel))}
    assert "num_shared_tokens" in set().union(*(w for r, w in writes.items() if r.startswith(POLYKV)))
    assert {"page_table", "num_cached", "cacheable"} <= writes[TABLES]
    assert "tokens" in writes["opencoti/engine/core/core.py"]


def test_every_other_entry_is_still_used():
    """An OTHER entry whose module no longer writes the name is stale."""
    for (rel, name), why in OTHER.items():
        names = {n for _, n in _writes(ast.parse((ROOT / rel).read_text(), rel))}
        assert name in names, f"stale entry {rel} .{name} ({why})"


def test_the_check_finds_each_kind_of_write(tmp_path):
    mod = tmp_path / "opencoti" / "engine" / "intruder.py"
    mod.parent.mkdir(parents=True)
    mod.write_text(
        "def f(pool, s, core, tree, seq):\n"
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
        "    seq.num_shared_tokens = 0\n"
        "    seq.page_table.extend([1])\n"
        "    seq.cacheable = False\n"
        "    seq.salt_root = b''\n"
        "    del seq.tokens[3:]\n"
        "class C:\n"
        "    def __init__(self):\n"
        "        self.sessions = {}  # its own attribute\n"
        "        self.num_cached = 0  # its own attribute\n"
        "    def g(self, s):\n"
        "        self.sessions[1] = s  # a write: it may be the owner's dict behind a property\n"
        "        s.seq = None\n")
    got = [v.split(":", 1)[1] for v in _violations(tmp_path)]
    assert got == ["2 writes .residency", "3 writes .pool_id", "4 writes .cache_hits", "5 writes .sessions",
                   "6 writes .sessions", "7 writes .sessions", "8 writes .pools", "9 writes .children",
                   "10 writes .job", "13 writes .num_shared_tokens", "14 writes .page_table",
                   "15 writes .cacheable", "16 writes .salt_root", "17 writes .tokens",
                   "23 writes .sessions", "24 writes .seq"]


def test_an_owner_may_write_what_it_owns(tmp_path):
    for rel, body in [("opencoti/engine/polykv/state/x.py", "def f(s):\n    s.seq.num_shared_tokens = 1\n"),
                      ("opencoti/engine/kv/tables.py", "def f(seq):\n    seq.page_table.append(1)\n"),
                      ("opencoti/engine/core/core.py", "def f(job):\n    job.seq.tokens.append(1)\n")]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(body)
    assert _violations(tmp_path) == []
    (tmp_path / "opencoti/engine/kv/tables.py").write_text("def f(s):\n    s.seq.num_shared_tokens = 1\n")
    assert _violations(tmp_path) == ["opencoti/engine/kv/tables.py:2 writes .num_shared_tokens"]
