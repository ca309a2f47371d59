"""docs/testing.md stays true of the suites it describes:

- its table of suites names every folder of tests/ that holds tests, and no other;
- every `make TARGET` it names exists;
- the fuzzer's default number of cases is the harness's;
- it counts no tests (a count would be wrong by the next commit).
"""

from __future__ import annotations

import re

from tests.harness.paths import ROOT

DOC = ROOT / "docs" / "testing.md"
TESTS = ROOT / "tests"


def _table_rows() -> list[list[str]]:
    """The rows of the suite table (the one whose header starts with "| suite |")."""
    lines = DOC.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| suite |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_the_table_names_every_folder_of_tests():
    named = {m for row in _table_rows() for m in re.findall(r"`tests/(\w+)`", row[0])}
    folders = {p.relative_to(TESTS).parts[0] for p in TESTS.rglob("test_*.py")}
    assert named == folders


def test_every_make_target_it_names_exists():
    makefiles = [ROOT / "Makefile", *sorted((ROOT / "mk").glob("*.mk"))]
    targets = {m for f in makefiles for m in re.findall(r"^([\w-]+):", f.read_text(), re.M)}
    named = set(re.findall(r"`make ([\w-]+)", DOC.read_text()))
    assert named and named <= targets, named - targets


def test_the_fuzzers_default_is_the_harness_default():
    harness = (TESTS / "harness" / "fuzz.py").read_text()
    (default,) = re.findall(r'os\.environ\.get\("FUZZ_EXAMPLES", "(\d+)"\)', harness)
    stated = re.findall(r"`FUZZ_EXAMPLES` cases per\s+endpoint, ([\d,]+) by default", DOC.read_text())
    assert stated and {s.replace(",", "") for s in stated} == {default}


def test_it_counts_no_tests():
    text = re.sub(r"\s+", " ", DOC.read_text())
    assert re.findall(r"\b\d[\d,]* (?:\w+ )?tests\b", text) == []
