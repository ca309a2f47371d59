"""Filters for NVIDIA's apt packages: the CUDA repository's address and the nvidia_driver plan.

    {{ 'https://developer.download.nvidia.com/compute/cuda/repos'
       | llmhost_cuda_repo_uri('Ubuntu', '24.04', 'x86_64') }}
        -> .../repos/ubuntu2404/x86_64/  ('' where NVIDIA has no repository)

    {{ host | llmhost_driver_plan(settings, tables) }}

The nvidia_driver role's preflight gathers what the host has (``host``), its settings
(``settings``, the nvidia_driver_* values) and its package tables (``tables``), and
gets back the plan every later phase of the role reads; see ``driver_plan``. Only the
standard library: tests/ansible/test_driver_plan.py loads this file directly.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping, Sequence
from typing import Any

# Directory names of NVIDIA's CUDA repository per distribution and release, and
# its names for the architectures. The nvidia_driver and dcgm_exporter roles both
# add this repository.
CUDA_REPO_DIRS: dict[str, dict[str, str]] = {
    "Ubuntu": {"22.04": "ubuntu2204", "24.04": "ubuntu2404"},
    "Debian": {"12": "debian12"},
}
CUDA_REPO_ARCHS: dict[str, str] = {"x86_64": "x86_64", "aarch64": "sbsa"}

_INSTALLED = re.compile(r"(?m)^ii\s+(\S+?)(?::\S+)?$")
_DRIVER_PACKAGE = re.compile(r"^(nvidia-|libnvidia-|cuda-drivers)")


class PlanError(ValueError):
    """The tables have no packages for this distribution and source."""


def release(distribution: str, version: Any) -> str:
    """Ubuntu: major.minor ("24.04"); others: the major version ("12")."""
    return str(version) if distribution == "Ubuntu" else str(version).split(".")[0]


def cuda_repo_uri(base: str, distribution: str, version: Any, architecture: str) -> str:
    """The apt URI of NVIDIA's CUDA repository for a host, ending in '/'; '' if there is none."""
    directory = CUDA_REPO_DIRS.get(distribution, {}).get(release(distribution, version))
    if not directory:
        return ""
    return f"{str(base).rstrip('/')}/{directory}/{CUDA_REPO_ARCHS.get(architecture, architecture)}/"


def _bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on", "y", "t")
    return bool(value)


def _b64text(value: Any) -> str:
    if not value:
        return ""
    return base64.b64decode(str(value)).decode("utf-8", "replace").strip()


def driver_plan(host: Mapping[str, Any], settings: Mapping[str, Any], tables: Mapping[str, Any]) -> dict[str, Any]:
    """What nvidia_driver does on one host.

    host: name, gpus, nvswitches (PCI addresses), skip_reason ('' to install),
      distribution, distribution_version, architecture, kernel, dpkg (dpkg-query
      ``${db:Status-Abbrev} ${Package}`` lines), nouveau_loaded, nvidia_loaded,
      nvidia_version_b64 (the module's sysfs version file, base64, '' if none),
      mokutil (``mokutil --sb-state`` output), secureboot_var_b64 (the SecureBoot EFI
      variable, base64, '' if none).
    settings: the nvidia_driver_* values without the prefix: source, branch,
      kernel_modules, packages, kernel_headers, fabricmanager, adopt_existing,
      blacklist_nouveau, persistenced, allow_reboot, cuda_repo_url, cuda_repo_key_name.
    tables: default_source, debian_branch, packages, fabricmanager (the role's vars).
    """
    skip = str(host.get("skip_reason") or "").strip()
    plan: dict[str, Any] = {"install": not skip, "skip_reason": skip, "host": host["name"],
                            "gpus": list(host.get("gpus") or []), "nvswitches": list(host.get("nvswitches") or [])}
    if skip:
        return plan

    distribution = str(host["distribution"])
    rel = release(distribution, host["distribution_version"])
    source = str(settings["source"])
    if source == "auto":
        source = tables["default_source"].get(distribution, "distro")
    wanted_branch = str(settings["branch"])
    branch = (str(tables["debian_branch"].get(rel, wanted_branch))
              if distribution == "Debian" and source == "distro" else wanted_branch)
    modules = str(settings["kernel_modules"])

    if settings.get("packages"):
        driver_packages = [str(p) for p in settings["packages"]]
    else:
        try:
            names = tables["packages"][distribution][source][modules]
        except KeyError as exc:
            raise PlanError(f"no driver packages for {distribution} with nvidia_driver_source {source} and "
                            f"nvidia_driver_kernel_modules {modules}") from exc
        driver_packages = [p.replace("BRANCH", branch) for p in names]
    headers = [f"linux-headers-{host['kernel']}"] if _bool(settings["kernel_headers"]) else []
    fabricmanager = _bool(settings["fabricmanager"]) and len(plan["nvswitches"]) > 0
    fm_packages = ([p.replace("BRANCH", branch)
                    for p in tables["fabricmanager"].get(distribution, {}).get(source, [])]
                   if fabricmanager else [])

    installed = _INSTALLED.findall(str(host.get("dpkg") or ""))
    nouveau_loaded = _bool(host.get("nouveau_loaded"))
    nvidia_loaded = _bool(host.get("nvidia_loaded"))
    loaded_version = _b64text(host.get("nvidia_version_b64"))
    # A driver of the wanted branch that works but came from no package (NVIDIA's
    # .run installer, a vendor image, a host-mounted driver) is adopted, not
    # overwritten: installing packages over it would break it.
    unmanaged = (_bool(settings["adopt_existing"]) and nvidia_loaded and loaded_version.split(".")[0] == branch
                 and not any(_DRIVER_PACKAGE.match(p) for p in installed))
    missing_driver = [] if unmanaged else [p for p in driver_packages if p not in installed]
    missing = [] if unmanaged else [p for p in driver_packages + headers + fm_packages if p not in installed]
    # The SecureBoot EFI variable: 4 little-endian attribute bytes, then the value
    # byte; its base64 ends in "AE=" when the value is 1.
    secure_boot = ("SecureBoot enabled" in str(host.get("mokutil") or "")
                   or re.match(r".*AAE=$", str(host.get("secureboot_var_b64") or "")) is not None)

    blacklist = _bool(settings["blacklist_nouveau"])
    reasons = ([f"driver packages to install: {', '.join(missing_driver)}"] if missing_driver else [])
    if nouveau_loaded and blacklist:
        reasons.append("nouveau is loaded")
    if not nvidia_loaded:
        reasons.append("the nvidia kernel module is not loaded")
    if loaded_version and loaded_version.split(".")[0] != branch:
        reasons.append(f"the loaded nvidia module is {loaded_version}, not branch {branch}")

    repo = None
    if source == "cuda_repo":
        uri = cuda_repo_uri(settings["cuda_repo_url"], distribution, rel, str(host["architecture"]))
        repo = {"uri": uri, "key_url": uri + str(settings["cuda_repo_key_name"])}
    allow_reboot = _bool(settings["allow_reboot"])
    plan.update({
        "distribution": f"{distribution} {rel}",
        "source": source,
        "branch": branch,
        "kernel_modules": modules,
        "packages": driver_packages,
        "kernel_headers": headers,
        "fabricmanager": fabricmanager,
        "fabricmanager_packages": fm_packages,
        "missing_packages": missing,
        "driver_change": len(missing_driver) > 0,
        "unmanaged_driver": unmanaged,
        "repo": repo,
        "nouveau": {"blacklist": blacklist, "loaded": nouveau_loaded},
        "persistenced": _bool(settings["persistenced"]),
        "nvidia_module": {"loaded": nvidia_loaded, "version": loaded_version or None},
        "secure_boot": secure_boot,
        "reboot": {
            "due": len(reasons) > 0,
            "reasons": reasons,
            "allowed": allow_reboot,
            "action": "none" if not reasons else ("reboot" if allow_reboot else "stop"),
        },
    })
    return plan


def _filter_driver_plan(host: Mapping[str, Any], settings: Mapping[str, Any],
                        tables: Mapping[str, Any]) -> dict[str, Any]:
    try:
        return driver_plan(host, settings, tables)
    except PlanError as exc:
        from ansible.errors import AnsibleFilterError

        raise AnsibleFilterError(f"llmhost_driver_plan: {exc}") from exc


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"llmhost_cuda_repo_uri": cuda_repo_uri, "llmhost_driver_plan": _filter_driver_plan}


__all__: Sequence[str] = ("CUDA_REPO_ARCHS", "CUDA_REPO_DIRS", "cuda_repo_uri", "driver_plan", "release")
