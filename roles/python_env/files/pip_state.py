"""Report which pinned distributions a Python environment lacks (read-only).

Run with the venv's interpreter: python pip_state.py '<json>' where json is
{"pins": ["name[extras]==version", ...], "names": [...], "absent": [...]}.
A pin may carry an environment marker ("name==version ; python_version < '3.12'",
as in a lock file): one whose marker does not hold here is not wanted.
Prints {"missing": [pins not installed at that version, or names not installed],
"present": [names from "absent" that are installed], "installed": {name: version}}.
"""

import json
import re
import sys
from importlib import metadata

try:  # the same version rules pip uses (2.13.0+cpu == 2.13.0+cpu, 1.0 == 1.0.0)
    from pip._vendor.packaging.version import InvalidVersion, Version
except ImportError:  # pragma: no cover - pip always vendors packaging
    Version = None
try:
    from pip._vendor.packaging.markers import Marker
except ImportError:  # pragma: no cover
    Marker = None

PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*==\s*([^\s;]+)\s*(?:;\s*(.*?))?\s*$")


def canon(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def same_version(a, b):
    if Version is not None:
        try:
            return Version(a) == Version(b)
        except InvalidVersion:
            pass
    return a == b


def main():
    want = json.loads(sys.argv[1])
    installed = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            installed[canon(name)] = dist.version
    missing = []
    wanted = []
    for pin in want.get("pins", []):
        m = PIN.match(pin)
        if not m:
            missing.append(pin)
            continue
        if m.group(4) and Marker is not None and not Marker(m.group(4)).evaluate():
            continue
        wanted.append(pin)
        have = installed.get(canon(m.group(1)))
        if have is None or not same_version(have, m.group(3)):
            missing.append(pin)
    missing += [n for n in want.get("names", []) if canon(n) not in installed]
    present = [n for n in want.get("absent", []) if canon(n) in installed]
    keys = [canon(PIN.match(p).group(1)) for p in wanted]
    print(json.dumps({
        "missing": missing,
        "present": present,
        "installed": {k: installed[k] for k in keys if k in installed},
    }))


if __name__ == "__main__":
    main()
