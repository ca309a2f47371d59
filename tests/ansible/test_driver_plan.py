"""The nvidia_driver plan (filter llmhost_driver_plan, filter_plugins/llmhost_nvidia.py)
on hand-made hosts, with the role's own package tables; test_nvidia_driver.py runs
the role itself on simulated hosts."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from filter_plugins import llmhost_nvidia as nvidia
from tests.ansible._helpers import ROLES, load_yaml

VARS = load_yaml(ROLES / "nvidia_driver" / "vars" / "main.yml")
DEFAULTS = load_yaml(ROLES / "nvidia_driver" / "defaults" / "main.yml")
TABLES = {"default_source": VARS["_nvidia_driver_default_source"],
          "debian_branch": VARS["_nvidia_driver_debian_branch"],
          "packages": VARS["_nvidia_driver_package_table"],
          "fabricmanager": VARS["_nvidia_driver_fabricmanager_table"]}
SETTINGS = {k: DEFAULTS[f"nvidia_driver_{k}"] for k in (
    "source", "branch", "kernel_modules", "packages", "kernel_headers", "fabricmanager", "adopt_existing",
    "blacklist_nouveau", "persistenced", "allow_reboot", "cuda_repo_url", "cuda_repo_key_name")}
BRANCH = str(DEFAULTS["nvidia_driver_branch"])


def host(**over: Any) -> dict[str, Any]:
    h = {"name": "h", "gpus": ["0000:01:00.0"], "nvswitches": [], "skip_reason": "", "distribution": "Ubuntu",
         "distribution_version": "24.04", "architecture": "x86_64", "kernel": "6.8.0-50-generic", "dpkg": "",
         "nouveau_loaded": False, "nvidia_loaded": False, "nvidia_version_b64": "", "mokutil": "",
         "secureboot_var_b64": ""}
    h.update(over)
    return h


def plan(h: dict[str, Any], **settings: Any) -> dict[str, Any]:
    return nvidia.driver_plan(h, {**SETTINGS, **settings}, TABLES)


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_a_skipped_host_gets_only_the_reason() -> None:
    p = plan(host(skip_reason="llmhost_profile is cpu", gpus=[]))
    assert p == {"install": False, "skip_reason": "llmhost_profile is cpu", "host": "h", "gpus": [], "nvswitches": []}


def test_ubuntu_fresh_host_installs_the_server_packages_and_reboots_if_allowed() -> None:
    p = plan(host())
    assert p["install"] and p["source"] == "distro" and p["branch"] == BRANCH
    assert p["packages"] == [f"nvidia-headless-{BRANCH}-server-open", f"nvidia-utils-{BRANCH}-server"]
    assert p["missing_packages"] == p["packages"] + p["kernel_headers"]
    assert p["driver_change"] and p["repo"] is None
    assert p["reboot"]["due"] and "the nvidia kernel module is not loaded" in p["reboot"]["reasons"]
    assert p["reboot"]["action"] == ("reboot" if SETTINGS["allow_reboot"] else "stop")


def test_debian_auto_takes_the_cuda_repository_with_its_uri() -> None:
    p = plan(host(distribution="Debian", distribution_version="12.7"))
    assert p["distribution"] == "Debian 12" and p["source"] == "cuda_repo"
    assert p["repo"]["uri"] == SETTINGS["cuda_repo_url"].rstrip("/") + "/debian12/x86_64/"
    assert p["repo"]["key_url"] == p["repo"]["uri"] + SETTINGS["cuda_repo_key_name"]
    assert p["packages"][0] == f"nvidia-driver-pinning-{BRANCH}"


def test_debian_distro_is_its_own_branch() -> None:
    p = plan(host(distribution="Debian", distribution_version="12"), source="distro")
    assert p["branch"] == VARS["_nvidia_driver_debian_branch"]["12"]


def test_installed_and_loaded_driver_needs_nothing() -> None:
    pkgs = plan(host())["packages"] + ["linux-headers-6.8.0-50-generic"]
    dpkg = "".join(f"ii  {p}:amd64\n" for p in pkgs)
    p = plan(host(dpkg=dpkg, nvidia_loaded=True, nvidia_version_b64=b64(f"{BRANCH}.95.05\n")))
    assert p["missing_packages"] == [] and not p["driver_change"]
    assert p["reboot"] == {"due": False, "reasons": [], "allowed": SETTINGS["allow_reboot"], "action": "none"}
    assert p["nvidia_module"] == {"loaded": True, "version": f"{BRANCH}.95.05"}


def test_old_loaded_module_is_a_reason_to_reboot() -> None:
    p = plan(host(nvidia_loaded=True, nvidia_version_b64=b64("535.1.2")))
    assert f"the loaded nvidia module is 535.1.2, not branch {BRANCH}" in p["reboot"]["reasons"]


@pytest.mark.parametrize("adopt,expect_missing", [(True, False), (False, True)])
def test_a_driver_from_no_package_is_adopted_unless_told_not_to(adopt: bool, expect_missing: bool) -> None:
    p = plan(host(nvidia_loaded=True, nvidia_version_b64=b64(f"{BRANCH}.1")), adopt_existing=adopt)
    assert p["unmanaged_driver"] is adopt
    assert bool(p["missing_packages"]) is expect_missing


def test_fabric_manager_only_with_nvswitches() -> None:
    with_sw = plan(host(nvswitches=["0000:05:00.0"]), fabricmanager=True)
    assert with_sw["fabricmanager"] and with_sw["fabricmanager_packages"] == [
        p.replace("BRANCH", BRANCH) for p in TABLES["fabricmanager"]["Ubuntu"]["distro"]]
    assert plan(host(), fabricmanager=True)["fabricmanager_packages"] == []


def test_secure_boot_from_mokutil_or_the_efi_variable() -> None:
    assert plan(host(mokutil="SecureBoot enabled\n"))["secure_boot"] is True
    assert plan(host(secureboot_var_b64=base64.b64encode(b"\x06\x00\x00\x00\x01").decode()))["secure_boot"] is True
    assert plan(host(secureboot_var_b64=base64.b64encode(b"\x06\x00\x00\x00\x00").decode()))["secure_boot"] is False


def test_given_packages_and_string_booleans() -> None:
    p = plan(host(), packages=["my-driver"], kernel_headers="false", blacklist_nouveau="yes")
    assert p["packages"] == ["my-driver"] and p["kernel_headers"] == [] and p["nouveau"]["blacklist"] is True


def test_unknown_table_entry_is_an_error() -> None:
    with pytest.raises(nvidia.PlanError):
        plan(host(distribution="Fedora", distribution_version="40"))


@pytest.mark.parametrize("dist,version,arch,want", [
    ("Ubuntu", "22.04", "x86_64", "ubuntu2204/x86_64/"), ("Ubuntu", "24.04", "aarch64", "ubuntu2404/sbsa/"),
    ("Debian", "12.5", "x86_64", "debian12/x86_64/"), ("Debian", "11", "x86_64", None),
])
def test_cuda_repo_uri(dist: str, version: str, arch: str, want: str | None) -> None:
    got = nvidia.cuda_repo_uri("https://example.com/repos/", dist, version, arch)
    assert got == ("https://example.com/repos/" + want if want else "")
