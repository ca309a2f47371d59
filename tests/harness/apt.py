"""The build machine's apt sources (deb822 and one-line lists), copied into the test rootfs."""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from tests.harness.shell import TestHostError


@dataclass
class AptSource:
    types: list[str]
    uris: list[str]
    suites: list[str]
    components: list[str]
    signed_by: str | None = None


def _deb822_stanzas(text: str) -> list[dict[str, str]]:
    stanzas: list[dict[str, str]] = []
    current: dict[str, str] = {}
    key: str | None = None
    for raw in text.splitlines():
        if raw.startswith("#"):
            continue
        if not raw.strip():
            if current:
                stanzas.append(current)
            current, key = {}, None
            continue
        if raw[0] in " \t" and key is not None:
            current[key] += "\n" + raw.strip()
            continue
        if ":" in raw:
            k, v = raw.split(":", 1)
            key = k.strip().lower()
            current[key] = v.strip()
    if current:
        stanzas.append(current)
    return stanzas


def host_apt_sources() -> list[AptSource]:
    """Every enabled deb source of the host, deb822 files and one-line lists alike."""
    sources: list[AptSource] = []
    d = Path("/etc/apt/sources.list.d")
    for path in sorted(d.glob("*.sources")) if d.is_dir() else []:
        for st in _deb822_stanzas(path.read_text()):
            if st.get("enabled", "yes").lower() == "no":
                continue
            signed = st.get("signed-by")
            sources.append(
                AptSource(
                    types=st.get("types", "").split(),
                    uris=st.get("uris", "").split(),
                    suites=st.get("suites", "").split(),
                    components=st.get("components", "").split(),
                    signed_by=signed if signed and "\n" not in signed else None,
                )
            )
    lists = [Path("/etc/apt/sources.list")]
    lists += sorted(d.glob("*.list")) if d.is_dir() else []
    for path in lists:
        if not path.is_file():
            continue
        for raw in path.read_text().splitlines():
            line = raw.split("#", 1)[0].strip()
            m = re.match(r"^(deb|deb-src)\s+(\[[^\]]*\]\s+)?(\S+)\s+(\S+)\s*(.*)$", line)
            if not m:
                continue
            opts = m.group(2) or ""
            sb = re.search(r"signed-by=(\S+?)[\s\]]", opts + " ")
            sources.append(
                AptSource(
                    types=[m.group(1)],
                    uris=[m.group(3)],
                    suites=[m.group(4)],
                    components=m.group(5).split(),
                    signed_by=sb.group(1) if sb else None,
                )
            )
    return sources


def suite_sources(sources: list[AptSource], suite: str) -> list[AptSource]:
    """Sources for this suite and its companions (-updates, -security, ...)."""
    return [
        s
        for s in sources
        if "deb" in s.types and any(x == suite or x.startswith((f"{suite}-", f"{suite}/")) for x in s.suites)
    ]


def host_mirror(suite: str) -> str:
    for src in suite_sources(host_apt_sources(), suite):
        if suite in src.suites and src.uris:
            return src.uris[0]
    raise TestHostError(f"no apt source for suite {suite!r} in the host's /etc/apt/sources.list(.d): pass --mirror URL")


def write_rootfs_sources(root: Path, suite: str) -> None:
    """Copy the host's apt sources for the suite into the rootfs (deb822)."""
    srcs = suite_sources(host_apt_sources(), suite)
    if not srcs:
        return  # keep debootstrap's sources.list (from --mirror)
    stanzas = []
    for s in srcs:
        lines = [
            "Types: deb",
            f"URIs: {' '.join(s.uris)}",
            f"Suites: {' '.join(x for x in s.suites)}",
            f"Components: {' '.join(s.components) or 'main'}",
        ]
        if s.signed_by:
            key = Path(s.signed_by)
            if key.is_absolute() and key.is_file():
                target = root / key.relative_to("/")
                if not target.exists():
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(key, target)
            lines.append(f"Signed-By: {s.signed_by}")
        stanzas.append("\n".join(lines))
    d = root / "etc/apt/sources.list.d"
    d.mkdir(parents=True, exist_ok=True)
    (d / "testhost-host.sources").write_text(
        "# Copied from the build host's apt sources by tests/harness/apt.py\n" + "\n\n".join(stanzas) + "\n"
    )
    (root / "etc/apt/sources.list").unlink(missing_ok=True)
