"""The build machine's pip configuration, and what a test host needs of it: the local folders
to bind into it and the python_env role's pip variables."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from tests.harness.shell import TestHostError

HOST_PIP_CA = "/etc/ssl/llmhost-pip-ca.crt"


def pip_config() -> dict[str, Any]:
    """The host's effective pip index settings, and the local folders they use."""
    r = subprocess.run([sys.executable, "-m", "pip", "config", "list"], text=True, capture_output=True, check=False)
    if r.returncode != 0:
        raise TestHostError(f"`{sys.executable} -m pip config list` failed:\n{r.stderr.strip()}")
    # pip precedence: environment > command section (install) > global section.
    rank = {"global": 1, "install": 2, ":env:": 3}
    best: dict[str, tuple[int, str]] = {}
    for line in r.stdout.splitlines():
        m = re.match(r"^([^.=]+|:env:)\.([A-Za-z0-9_-]+)=(.*)$", line.strip())
        if not m or m.group(1) not in rank:
            continue
        section, key, raw = m.groups()
        try:
            value = str(json.loads(raw)) if raw.startswith('"') else raw.strip("'")
        except ValueError:
            value = raw.strip("'\"")
        key = key.replace("_", "-")
        if key not in best or rank[section] >= best[key][0]:
            best[key] = (rank[section], value)

    def values(key: str) -> list[str]:
        return best[key][1].split() if key in best else []

    find_links = values("find-links")
    extra = values("extra-index-url")
    index = values("index-url")
    binds: list[str] = []

    def local_dir(url: str, index_url: bool) -> None:
        parsed = urlparse(url)
        if parsed.scheme not in ("", "file"):
            return
        p = Path(unquote(parsed.path)).resolve()
        if not p.exists():
            return
        if p.is_file():
            p = p.parent
        elif index_url and p.name == "simple":
            p = p.parent  # PEP 503 trees link to ../../files and the like
        binds.append(str(p))

    for url in find_links:
        local_dir(url, index_url=False)
    for url in [*extra, *index]:
        local_dir(url, index_url=True)
    unique: list[str] = []
    for b in sorted(set(binds), key=len):
        if not any(b == u or b.startswith(u + "/") for u in unique):
            unique.append(b)
    # A CA bundle pip trusts here (e.g. for an HTTPS proxy or a private index) is
    # bound into the host at a fixed path and handed to the role as python_env_pip_cert.
    cert = values("cert")
    cert_src = str(Path(cert[0]).resolve()) if cert and Path(cert[0]).is_file() else None
    return {
        "find_links": find_links,
        "extra_index_urls": extra,
        "index_url": index[0] if index else None,
        "constraints": values("constraint"),
        "cert": HOST_PIP_CA if cert_src else None,
        "bind": sorted(unique) + ([f"{cert_src}:{HOST_PIP_CA}"] if cert_src else []),
    }


def local_index_files(url: str) -> str | None:
    """The flat folder of files behind a local PEP 503 index (file:///x/simple -> /x/files), if any."""
    parsed = urlparse(url)
    if parsed.scheme != "file":
        return None
    tree = Path(unquote(parsed.path))
    files = tree.parent / "files" if tree.name == "simple" else None
    return str(files) if files is not None and files.is_dir() else None


def pip_role_vars(cfg: dict[str, Any]) -> dict[str, Any]:
    # The hash-locked install (python_env_requirements_lock) takes no extra index: a
    # local index's own folder of files serves as find-links instead (the lock's hashes
    # name the files). An extra index that has none leaves the lock out.
    local = {u: local_index_files(u) for u in cfg["extra_index_urls"]}
    extra = [u for u, files in local.items() if files is None]
    out: dict[str, Any] = {
        "python_env_pip_find_links": cfg["find_links"] + [f for f in local.values() if f],
        "python_env_pip_extra_index_urls": extra,
    }
    if extra:
        out["python_env_requirements_lock"] = ""
    if cfg["index_url"]:
        out["python_env_pip_index_url"] = cfg["index_url"]
    if cfg.get("cert"):
        out["python_env_pip_cert"] = cfg["cert"]
    return out
