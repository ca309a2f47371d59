"""Imports go through packages, never around them: no code in src/, lab/ or tests/
edits sys.path or imports a module by its file path, and no role reaches out of itself
with role_path/../.. (each role reads only its own files). A match names the file and line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.harness.paths import ROOT

PYTHON_TRICKS = re.compile(
    r"sys\.path\s*(\.(insert|append|extend|remove)\b|\[[^\]]*\]\s*=|\s*[+]?=)"
    r"|spec_from_file_location|SourceFileLoader|runpy\.run_path|importlib\.machinery\.PathFinder"
    r"|exec\(\s*open\("
)
ROLE_ESCAPE = re.compile(r"role_path\s*(\}\}\s*)?[/'\"+ ~]*\.\./\.\.")


def _python_files() -> list[Path]:
    files = [p for top in ("src", "lab", "tests") for p in (ROOT / top).rglob("*.py")]
    this = Path(__file__).resolve()  # its patterns and examples would match themselves
    return sorted(p for p in files if "__pycache__" not in p.parts and p.resolve() != this)


def _matches(pattern: re.Pattern[str], files: list[Path]) -> list[str]:
    hits = []
    for path in files:
        for no, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            code = line.split("#", 1)[0] if path.suffix == ".py" else line
            if pattern.search(code):
                hits.append(f"{path.relative_to(ROOT)}:{no}: {line.strip()}")
    return hits


def test_no_sys_path_edits_or_imports_by_file_path():
    files = _python_files()
    assert len(files) > 100  # the scan sees the tree
    assert _matches(PYTHON_TRICKS, files) == []


def test_no_role_reaches_out_of_itself():
    files = sorted(p for top in ("roles", "playbooks") for p in (ROOT / top).rglob("*.y*ml"))
    files += sorted((ROOT / "roles").rglob("*.j2"))
    assert files
    assert _matches(ROLE_ESCAPE, files) == []


@pytest.mark.parametrize("line", [
    "sys.path.insert(0, _entry)",
    "sys.path[:0] = ['/tmp/site']",
    "sys.path = [x]",
    "sys.path += extra",
    "spec = importlib.util.spec_from_file_location('m', p)",
    "runpy.run_path('lab/testhost.py')",
])
def test_the_python_scan_catches_each_trick(line: str):
    assert PYTHON_TRICKS.search(line)


@pytest.mark.parametrize("line", [
    "src: \"{{ role_path }}/../../monitoring/x.yml\"",
    "path: \"{{ role_path + '/../../files' }}\"",
])
def test_the_role_scan_catches_an_escape(line: str):
    assert ROLE_ESCAPE.search(line)


@pytest.mark.parametrize("line", ["print(sys.path)", "if _entry not in sys.path_hooks: pass",
                                  "src: \"{{ role_path }}/templates/x.j2\""])
def test_ordinary_lines_pass(line: str):
    assert not PYTHON_TRICKS.search(line) and not ROLE_ESCAPE.search(line)
