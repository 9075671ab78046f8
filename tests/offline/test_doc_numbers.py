"""Every measured number in the docs is tied to the file it comes from.

A number with a unit of measure (``1.24x``, ``93.5 tok/s``, ``0.62 ms``, ``47 %``, ``851.8 MiB``, ``2 s``,
ranges such as ``1.42–2.26x``) in a paragraph of a covered page must be found in a file that the paragraph
names in a ``<!-- from: path, path#key -->`` marker: a committed result (``benchmarks/results/...json``, or
the part of it under ``#key``, a dotted path: any number in it, as written or rounded, or as a per cent of a
fraction, milliseconds of seconds or seconds of milliseconds) or the code or config that sets it (a
default: ``opencoti/engine/persist/pacer.py``). A table's marker follows it, in
the paragraph after. Generated blocks are checked by ``report.py --check`` and code by the docs' own
tests. Against the whole set of results (``test_benchmarks_page``), a number is tied to its file here, so
one that matches some other result by chance no longer passes.

Covered pages: ``PAGES`` (``docs/benchmarks.md``'s prose too; its generated tables are ``report.py``'s). Not
covered yet: ``docs/benchmarks-log.md``, the log of earlier runs.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import report  # noqa: E402

PAGES = ["README.md", "docs/persistence.md", "docs/architecture.md", "docs/polykv.md", "docs/cluster.md",
         "docs/dashboard.md", "docs/http-api.md", "docs/speculative.md", "docs/models.md", "docs/langgraph.md",
         "docs/benchmarks.md"]

NUM = r"\d+(?:[.,]\d+)*"
UNIT = re.compile(rf"(?<![\w.\-/])({NUM})(?:\s*[–-]\s*({NUM}))?\s*(x\b|×|tok/s|ms\b|%|MiB\b|GiB\b|MB\b|GB\b|KB\b|"
                  r"KiB\b|s\b)")
FROM = re.compile(r"<!--\s*from:\s*(.*?)\s*-->", re.S)
NUMBER = re.compile(rf"(?<![\w\-/])-?{NUM}(?:[eE]-?\d+)?")


def forms(x: float) -> set[str]:
    """How a value can be written: as is and rounded to 0-5 places, as a per cent (of a fraction), in
    milli-units (of seconds) and in whole units (of milliseconds)."""
    out: set[str] = set()
    if x != x or x in (float("inf"), float("-inf")):
        return out
    for v in (x, x * 100, x * 1000, x / 1000):
        out.update(f"{v:.{d}f}" for d in range(6))
        if v == int(v):
            out.add(str(int(v)))
    return out


def file_numbers(path: Path, key: str = "") -> set[str]:
    """The numbers ``path`` holds (a JSON file: under ``key``, a dotted path of keys and list indices)."""
    text = path.read_text(encoding="utf-8")
    out: set[str] = set()
    if path.suffix == ".json":
        def walk(x):
            if isinstance(x, bool):
                return
            if isinstance(x, (int, float)):
                out.update(forms(float(x)))
            elif isinstance(x, dict):
                for k, v in x.items():
                    walk_text(str(k))
                    walk(v)
            elif isinstance(x, list):
                for v in x:
                    walk(v)
            elif isinstance(x, str):
                walk_text(x)

        def walk_text(s: str):
            for n in NUMBER.findall(s):
                try:
                    out.update(forms(float(n.replace(",", ""))))
                except ValueError:
                    pass

        node = json.loads(text)
        for part in filter(None, key.split(".")):
            node = node[int(part)] if isinstance(node, list) else node[part]
        walk(node)
    else:
        for n in NUMBER.findall(text):
            try:
                out.update(forms(float(n.replace(",", "").replace("_", ""))))
            except ValueError:
                pass
    return out


def paragraphs(page: str):
    """(the paragraph's sources, its measured numbers) for each paragraph of the page's own text."""
    text = report.BLOCK.sub("", page)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    for para in re.split(r"\n[ \t]*\n", text):
        sources = [s.strip() for m in FROM.finditer(para) for s in m.group(1).split(",") if s.strip()]
        body = re.sub(r"<!--.*?-->", "", para, flags=re.S)
        body = re.sub(r"`[^`]*`", "", body)
        nums = [n.replace(",", "") for m in UNIT.finditer(body) for n in (m.group(1), m.group(2)) if n]
        yield para, sources, nums


def unsourced(page_text: str, root: Path = ROOT) -> list[str]:
    """What is wrong on a page: a measured number with no marker, a marker naming no file, a number its
    files do not hold."""
    problems = []
    cache: dict[str, set[str]] = {}
    for para, sources, nums in paragraphs(page_text):
        if not nums:
            continue
        first = para.strip().splitlines()[0][:70]
        if not sources:
            problems.append(f"no <!-- from: --> for {nums} in: {first!r}")
            continue
        known: set[str] = set()
        for s in sources:
            name, _, key = s.partition("#")
            p = root / name
            if not p.is_file():
                problems.append(f"marker names {s!r}, which is no file")
                continue
            if s not in cache:
                try:
                    cache[s] = file_numbers(p, key)
                except (KeyError, IndexError, ValueError, TypeError):
                    problems.append(f"marker names {s!r}: no such key in the file")
                    continue
            known |= cache[s]
        missing = [n for n in nums if n not in known and n.rstrip("0").rstrip(".") not in known]
        if missing:
            problems.append(f"{missing} not in {sources}: {first!r}")
    return problems


@pytest.mark.parametrize("page", PAGES)
def test_every_measured_number_names_the_file_it_comes_from(page):
    assert unsourced((ROOT / page).read_text(encoding="utf-8")) == []


def test_the_check_catches_a_number_with_no_source_or_the_wrong_one(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps({"tps": 93.456, "share": 0.4727, "wait_s": 0.000624}))
    (tmp_path / "c.py").write_text("SHARE = 0.03\nCHUNK = 256 * 1024\n")
    ok = ("We ran 93.46 tok/s, 47 % over, waited 0.62 ms; 3 % and 256 KiB by default.\n"
          "<!-- from: r.json, c.py -->\n\nA flag `--x 7 s` and a count of 12 agents need none.\n")
    assert unsourced(ok, tmp_path) == []
    assert unsourced("It ran 93.46 tok/s.\n", tmp_path) == ["no <!-- from: --> for ['93.46'] in: 'It ran 93.46 tok/s.'"]
    bad = unsourced("It ran 94.46 tok/s, 1.2–1.5x.\n<!-- from: r.json -->\n", tmp_path)
    assert bad and "94.46" in bad[0] and "1.2" in bad[0]
    assert unsourced("2 s\n<!-- from: nowhere.json -->\n", tmp_path)[0].startswith("marker names 'nowhere.json'")
    assert unsourced("47 %\n<!-- from: r.json#share -->\n", tmp_path) == []
    assert unsourced("93.46 tok/s\n<!-- from: r.json#share -->\n", tmp_path)  # not under that key
    assert "no such key" in unsourced("2 s\n<!-- from: r.json#nope -->\n", tmp_path)[0]
