"""The README is a manual whose commands exist, and no link in it or in docs/ points nowhere.

- Every `make TARGET` and `llmhost COMMAND` the README names exists.
- Its Contents list names exactly its `##` sections, in order.
- Every relative link in README.md, docs/*.md and CHANGELOG.md reaches a file, and
  an `#anchor` reaches a heading of that file (GitHub's slugs).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.harness.paths import ROOT

README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "CHANGELOG.md"]
FENCE = re.compile(r"```.*?```", re.S)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def prose(path: Path) -> str:
    return FENCE.sub("", path.read_text())


def anchors(path: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", prose(path), re.M)}


def relative_links(path: Path) -> list[str]:
    return [m.group(1) for m in re.finditer(r"\]\(([^)\s]+)\)", prose(path)) if not re.match(r"[a-z]+:", m.group(1))]


def make_targets() -> set[str]:
    text = "\n".join(p.read_text() for p in [ROOT / "Makefile", *sorted((ROOT / "mk").glob("*.mk"))])
    return {t for line in re.findall(r"^([a-z][\w. -]*):(?!=)", text, re.M) for t in line.split()}


def llmhost_commands() -> set[str]:
    from llmhost.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return set(sub.choices)


def test_every_command_the_readme_names_exists() -> None:
    text = README.read_text()
    targets = set(re.findall(r"\bmake ([a-z][\w-]*)", text))
    assert targets and not targets - make_targets(), sorted(targets - make_targets())
    code = "\n".join(FENCE.findall(text))
    commands = {*re.findall(r"`llmhost ([a-z][\w-]*)", text),
                *re.findall(r"^\s*(?:\.venv/bin/)?llmhost ([a-z][\w-]*)", code, re.M)}
    assert commands and not commands - llmhost_commands(), sorted(commands - llmhost_commands())


def test_readme_contents_lists_its_sections_in_order() -> None:
    text = prose(README)
    contents = text.split("## Contents", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^- \[([^\]]+)\]\(#([^)]+)\)$", contents, re.M)
    sections = [h for h in re.findall(r"^## (.+)$", text, re.M) if h != "Contents"]
    assert [name for name, _ in listed] == sections, (listed, sections)
    assert all(anchor == slug(name) for name, anchor in listed), listed


def broken_links(doc: Path) -> list[str]:
    bad = []
    for link in relative_links(doc):
        path, _, fragment = link.partition("#")
        target = (doc.parent / path).resolve() if path else doc
        if not target.exists():
            bad.append(f"{link}: no such file")
        elif fragment and target.suffix == ".md" and fragment not in anchors(target):
            bad.append(f"{link}: no heading #{fragment}")
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_relative_links_resolve(doc: Path) -> None:
    assert not broken_links(doc)


def test_the_link_check_catches_a_broken_link(tmp_path: Path) -> None:
    """The check can fail: a missing file and a missing heading are both found."""
    doc = tmp_path / "a.md"
    doc.write_text("# Title\n[x](b.md) [y](#nowhere) [z](#title) [w](https://example.com/c.md)\n")
    assert broken_links(doc) == ["b.md: no such file", "#nowhere: no heading #nowhere"]
