"""Page refcounts have one owner: no module but ``kv/tables.py`` (KVTables) and ``kv/pages.py``
(the allocator it drives) calls ``allocate`` / ``incref`` / ``decref`` / ``copy_page``; everyone
else asks KVTables (docs/architecture.md, "One owner per concern")."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE_CALLS = {"allocate", "incref", "decref", "copy_page"}
OWNERS = {"opencoti/engine/kv/tables.py", "opencoti/engine/kv/pages.py"}


def page_calls(root: Path, package: str = "opencoti") -> list[str]:
    found = []
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in OWNERS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in PAGE_CALLS:
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_only_kv_tables_changes_page_refcounts():
    assert page_calls(ROOT) == []


def test_the_scan_finds_a_page_call(tmp_path):
    (tmp_path / "opencoti/engine/persist").mkdir(parents=True)
    (tmp_path / "opencoti/engine/persist/x.py").write_text("def f(kv, seq):\n    seq.extend(kv.allocate(2))\n")
    assert page_calls(tmp_path) == ["opencoti/engine/persist/x.py:2: kv.allocate(2)"]
