"""Pack the llmhost sources that python_env installs into one tar archive, so that they
reach a host in one transfer instead of one per file.

    python3 pack_llmhost_sources.py SOURCE_DIR ARCHIVE FILE...

FILE are paths relative to SOURCE_DIR (the role's list of package files). The archive
holds them and their directories, owned by root, files 0644 and directories 0755.
Runs on the controller with Ansible's own Python; needs nothing but the standard library.
"""

from __future__ import annotations

import sys
import tarfile
from pathlib import Path, PurePosixPath


def _as_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    info.mode = 0o755 if info.isdir() else 0o644
    return info


def pack(source: Path, archive: Path, files: list[str]) -> None:
    for name in files:
        rel = PurePosixPath(name)
        if rel.is_absolute() or ".." in rel.parts or not (source / rel).is_file():
            raise SystemExit(f"not a file under {source}: {name}")
    dirs = sorted({str(p) for name in files for p in PurePosixPath(name).parents if str(p) != "."})
    with tarfile.open(archive, "w") as tar:
        for name in [*dirs, *sorted(files)]:
            tar.add(source / name, arcname=name, recursive=False, filter=_as_root)


if __name__ == "__main__":
    if len(sys.argv) < 4:
        raise SystemExit(__doc__)
    pack(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
