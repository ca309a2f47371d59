"""A fake /sys tree for tests that detect hardware: PCI functions, loaded modules, Secure Boot.

The nvidia_driver role (and anything else that reads sysfs) takes its root from a
variable (``nvidia_driver_sysfs_root``); tests build this tree under a temporary root,
here or inside a booted test host, and point the variable at it.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

SECUREBOOT_VAR = "SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c"


@dataclass(frozen=True)
class Sysfs:
    """A fake /sys: NVIDIA GPUs (plus their HDMI audio functions), NVSwitches, other devices,
    loaded modules, Secure Boot."""

    gpus: int = 1
    nvswitches: int = 0
    nouveau_loaded: bool = False
    nvidia_version: str | None = None
    secure_boot: bool | None = None

    def script(self, root: str) -> str:
        """Shell commands that build this tree under ROOT (run here or inside the test host)."""
        dev = f"{root}/bus/pci/devices"
        funcs: list[tuple[str, str, str]] = [("0000:00:00.0", "0x8086", "0x060000"),   # host bridge
                                             ("0000:00:1f.2", "0x8086", "0x010601")]   # SATA
        for i in range(self.gpus):
            funcs += [(f"0000:{0x18 + i:02x}:00.0", "0x10de", "0x030200"),
                      (f"0000:{0x18 + i:02x}:00.1", "0x10de", "0x040300")]           # HDMI audio: no GPU
        for i in range(self.nvswitches):
            funcs.append((f"0000:{0x80 + i:02x}:00.0", "0x10de", "0x068000"))
        lines = [f"rm -rf {shlex.quote(root)}", f"mkdir -p {shlex.quote(dev)} {shlex.quote(root)}/module"]
        for addr, vendor, cls in funcs:
            d = shlex.quote(f"{dev}/{addr}")
            lines += [f"mkdir -p {d}", f"printf '{vendor}\\n' > {d}/vendor", f"printf '{cls}\\n' > {d}/class"]
        if self.nouveau_loaded:
            lines.append(f"mkdir -p {shlex.quote(root)}/module/nouveau")
        if self.nvidia_version:
            lines += [f"mkdir -p {shlex.quote(root)}/module/nvidia",
                      f"printf '{self.nvidia_version}\\n' > {shlex.quote(root)}/module/nvidia/version"]
        if self.secure_boot is not None:
            efi = shlex.quote(f"{root}/firmware/efi/efivars")
            value = "\\001" if self.secure_boot else "\\000"
            lines += [f"mkdir -p {efi}", f"printf '\\006\\000\\000\\000{value}' > {efi}/{SECUREBOOT_VAR}"]
        return "\n".join(lines) + "\n"
