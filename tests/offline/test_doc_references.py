"""What the docs and the code cite exists in this repository: every relative link of README.md and
docs/*.md names a file here, and a ``#anchor`` one of that page's headings; nothing cites a path
outside the repository or a numbered section ("§") of a design the repository does not hold
(docs/polykv.md names its sections, it does not number them)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")


def docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose(path: Path) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fenced = [], False
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            out.append((i, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    for _, line in prose(path):
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            if n:
                seen[f"{s}-{n}"] = 1
    return set(seen)


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    bad = []
    for i, line in prose(path):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists() or root not in (dest, *dest.parents):
                bad.append(f"{path.name}:{i}: {target} (no such file in the repository)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{path.name}:{i}: {target} (no heading #{anchor} in {dest.name})")
    return bad


def test_relative_links_of_the_docs_resolve():
    links = [t for p in docs() for _, line in prose(p) for t in LINK.findall(line)]
    assert any("#" in t for t in links), "the docs link to sections"
    bad = [b for p in docs() for b in broken_links(p)]
    assert not bad, "\n".join(bad)


def test_the_link_check_catches_a_missing_file_and_heading(tmp_path):
    (tmp_path / "a.md").write_text("# A page\n\n## `Node` and pacing (v2)\n\n[ok](#node-and-pacing-v2) "
                                   "[gone](b.md) [bad](#pacing)\n\n```text\n[in code](x.md)\n```\n")
    assert anchors(tmp_path / "a.md") == {"a-page", "node-and-pacing-v2"}
    bad = broken_links(tmp_path / "a.md", tmp_path)
    assert len(bad) == 2 and "b.md" in bad[0] and "#pacing" in bad[1]


def test_nothing_cites_numbered_sections_or_paths_outside_the_repository():
    files = docs() + [p for d in ("opencoti", "examples", "scripts", "tests") for p in sorted((ROOT / d).rglob("*"))
                      if p.suffix in (".py", ".md") and p != Path(__file__).resolve()]
    bad = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
           for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
           if "§" in line or "../shared/" in line or "shared/DESIGN.md" in line]
    assert not bad, "\n".join(bad)
