"""Make the hash-locked requirements file of the serving venv (`make lock`).

One resolve of the engine, Triton's Python packages and llmhost's own
dependencies (roles/python_env/files/locks/<profile>.in), with
`uv pip compile --generate-hashes`: the numpy and protobuf that Triton's
packages need come from overrides.txt, the CUDA-only wheels the role removes
on profile cpu (python_env_cpu_remove_packages) are left out. Profile gpu
(gpu.in) locks the default build the package index serves: vLLM's unsuffixed
wheel and the torch it is built against, a CUDA build (its nvidia-* runtime
wheels are on the same index); the header names its CUDA version, which the
role's preflight checks the driver against. The indexes are
the ones this machine's pip is configured with (`pip config list`), read at
run time and never written into the lock: the lock holds `name==version` lines
with their hashes, nothing else.

    python -m lab.pip_lock --profile cpu --python-version 3.11
    python -m lab.pip_lock --profile gpu --python-version 3.12
"""

import argparse
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from llmhost import cuda

ROOT = Path(__file__).resolve().parent.parent
LOCKS = ROOT / "roles" / "python_env" / "files" / "locks"
DEFAULTS = ROOT / "roles" / "python_env" / "defaults" / "main.yml"


def pip_sources(config_text):
    """index-url, extra-index-url and find-links from `pip config list` output.

    A later line wins over an earlier one for the same key (pip lists global,
    user, site, then the environment's settings).
    """
    found = {}
    for line in config_text.splitlines():
        m = re.match(r"^[^.=]*\.([a-z-]+)='(.*)'$", line.strip())
        if m and m.group(1) in ("index-url", "extra-index-url", "find-links"):
            found[m.group(1)] = m.group(2).split()
    return found


def uv_argv(uv, profile, python_version, platform, sources, out, requirements=None):
    """The uv command line that makes the lock of profile for python_version (from
    requirements, default locks/<profile>.in)."""
    argv = [
        uv, "pip", "compile", "--no-config", "--quiet",
        "--generate-hashes", "--no-header",
        "--python-version", python_version, "--python-platform", platform,
        # pip's own rule across several indexes: the best version wherever it is.
        "--index-strategy", "unsafe-best-match",
        "--override", str(LOCKS / "overrides.txt"),
    ]
    if profile == "cpu":
        defaults = yaml.safe_load(DEFAULTS.read_text())
        for name in defaults["python_env_cpu_remove_packages"]:
            argv += ["--no-emit-package", name]
    for url in sources.get("index-url", [])[:1]:
        argv += ["--index-url", url]
    for url in sources.get("extra-index-url", []):
        argv += ["--extra-index-url", url]
    for link in sources.get("find-links", []):
        argv += ["--find-links", link]
    return [*argv, "-o", str(out), str(requirements or LOCKS / f"{profile}.in")]


def check_lock(text):
    """Problems of a lock: option lines (an index) or a requirement without a hash."""
    problems = []
    for block in re.split(r"\n(?=\S)", text):
        first = block.split("\n", 1)[0].strip()
        if not first or first.startswith("#"):
            continue
        if first.startswith("-"):
            problems.append(f"an option line: {first}")
        elif "--hash=sha256:" not in block:
            problems.append(f"no hash: {first}")
    return problems


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="cpu", choices=["cpu", "gpu"])
    ap.add_argument("--python-version", default="3.11")
    ap.add_argument("--platform", default="x86_64-manylinux_2_35",
                    help="uv's --python-platform (nvidia-pytriton 0.7.0 needs glibc 2.35)")
    ap.add_argument("--uv", default=shutil.which("uv") or str(Path(sys.executable).parent / "uv"))
    ap.add_argument("-i", "--input", type=Path,
                    help="the requirements to lock (default locks/<profile>.in; e.g. another CUDA build's)")
    ap.add_argument("-o", "--output", type=Path)
    args = ap.parse_args(argv)
    requirements = args.input or LOCKS / f"{args.profile}.in"
    if not requirements.exists():
        ap.error(f"{requirements} does not exist: write the profile's requirements first")
    out = args.output or LOCKS / f"{args.profile}-py{args.python_version}.txt"
    config = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                            capture_output=True, text=True, check=True).stdout
    cmd = uv_argv(args.uv, args.profile, args.python_version, args.platform, pip_sources(config), out, requirements)
    print("+", shlex.join(cmd), file=sys.stderr)
    if subprocess.run(cmd, check=False).returncode != 0:
        print(f"{out}: uv found no resolution for profile {args.profile} on Python {args.python_version}"
              " (its reason above)", file=sys.stderr)
        return 1
    body = out.read_text()
    head = (f"# The serving venv of profile {args.profile} on Python {args.python_version} ({args.platform}),\n"
            f"# hash-locked: made by `make lock` (python -m lab.pip_lock --profile {args.profile}"
            f" --python-version {args.python_version}).\n"
            "# Installed by the python_env role with pip install --require-hashes --no-deps -r.\n")
    lock_cuda = cuda.lock_cuda(body)
    if lock_cuda:
        head += (f"# torch is a CUDA {lock_cuda} build: preflight refuses a driver that cannot run it"
                 " (llmhost gpu-info).\n")
    out.write_text(head + body)
    problems = check_lock(body)
    if args.profile == "gpu" and not lock_cuda:
        problems.append("torch is not a CUDA build (no +cuXYZ, no cuda-toolkit or nvidia-cuda-runtime pin)")
    if problems:
        print(f"{out}: " + "; ".join(problems), file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
