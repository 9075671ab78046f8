"""docs/benchmarks.md is generated from committed results, and every number on it is in one."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import report  # noqa: E402

NUMBER = re.compile(r"(?<![\w.\-/])\d+(?:[.,]\d+)*")


def numbers_of(text: str) -> set[str]:
    return {n.replace(",", "") for n in NUMBER.findall(text)}


def result_numbers() -> set[str]:
    """Every number in the committed result files, as written and as floats rounded to 0-3 places."""
    out: set[str] = set()

    def walk(x):
        if isinstance(x, bool):
            return
        if isinstance(x, (int, float)):
            out.add(str(x))
            if isinstance(x, float):
                out.update(f"{x:.{d}f}" for d in range(4))
        elif isinstance(x, dict):
            for k, v in x.items():
                out.update(numbers_of(str(k)))
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
        elif isinstance(x, str):
            out.update(numbers_of(x))

    for path in report.RESULTS.glob("*/*.json"):
        walk(json.loads(path.read_text()))
    return out


def prose(page: str) -> str:
    """The page's own text: without the generated blocks (checked against their results by
    ``report.py --check``), code blocks and inline code (commands, paths, flags, identifiers)."""
    page = report.BLOCK.sub("", page)
    page = re.sub(r"```.*?```", "", page, flags=re.S)
    return re.sub(r"`[^`]*`", "", page)


def test_page_is_what_the_committed_results_give():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"), "--check"], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr


def test_every_number_on_the_page_is_in_a_committed_result():
    known = result_numbers()
    missing = sorted(numbers_of(prose(report.PAGE.read_text())) - known)
    assert not missing, f"numbers on docs/benchmarks.md found in no committed result: {missing}"


def test_a_hand_edited_table_is_caught(tmp_path, monkeypatch):
    results = tmp_path / "results" / "box-2c-0000"
    results.mkdir(parents=True)
    payload = {"benchmark": "demo", "time": "2026-12-03T10:00:00+0000", "machine": {"cpu": "CPU", "loadavg": [0.5]},
               "report": {"headers": ["case", "tok/s"], "rows": [["one session", 93.25]]}}
    (results / "demo.json").write_text(json.dumps(payload))
    page = tmp_path / "page.md"
    page.write_text("# x\n\n<!-- generated: demo -->\n<!-- end generated: demo -->\n")
    monkeypatch.setattr(report, "RESULTS", tmp_path / "results")
    assert report.main(["--page", str(page)]) == 0
    text = page.read_text()
    assert "| one session | 93.25 |" in text and "benchmarks/results/box-2c-0000/demo.json" in text
    assert report.main(["--page", str(page), "--check"]) == 0
    page.write_text(text.replace("93.25", "99.00"))  # a number typed in by hand
    assert report.main(["--page", str(page), "--check"]) == 1
    payload["report"]["rows"][0][1] = 91.0  # a new measurement changes the table
    (results / "demo.json").write_text(json.dumps(payload))
    report.main(["--page", str(page)])
    assert "| one session | 91.00 |" in page.read_text()


def test_number_extraction_skips_names_and_code():
    assert numbers_of("SmolLM2-135M ran 93.5 tok/s on 2 cores, 1,024 tokens") == {"93.5", "2", "1024"}
    assert numbers_of(prose("run `--rounds 3` and\n```\nx 7\n```\n then 4")) == {"4"}
    assert numbers_of(prose("a 5\n<!-- generated: x -->\n| 9 |\n<!-- end generated: x -->\n")) == {"5"}


@pytest.mark.parametrize("block", ["peer_llamacpp", "quant", "pools", "cascade", "fanout", "admission_sim",
                                   "cluster"])
def test_each_headline_benchmark_has_a_generated_block(block):
    assert f"<!-- generated: {block} -->" in report.PAGE.read_text()
