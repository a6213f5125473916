"""Is an XLA device usable here? Answered without importing torch-xla.

Importing torch-xla takes seconds and initialises its runtime, so discovery looks only at what
is cheap to see: whether the package is installed (and built for the installed torch), the
``PJRT_DEVICE`` variable torch-xla itself reads, and the device files a TPU VM exposes.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from importlib import metadata

from corelib import Availability

#: Device files of TPU chips: /dev/accel* on TPU v4 and later, /dev/vfio/<n> on v2/v3 VMs.
TPU_DEVICE_PATTERNS = ("/dev/accel*", "/dev/vfio/[0-9]*")


def probe() -> Availability:
    """The ``tpu`` backend's availability (see the module docstring).

    XLA on the CPU (``PJRT_DEVICE=CPU``) is available but never auto-selected: it is an
    emulation for tests and development, slower than the ``cpu`` backend.
    """
    if importlib.util.find_spec("torch_xla") is None:
        return Availability(False, "torch_xla is not installed (pip install torch==X torch-xla==X "
                                   "with the same version X)")
    mismatch = torch_version_mismatch()
    if mismatch:
        return Availability(False, mismatch)
    pjrt = os.environ.get("PJRT_DEVICE", "").strip().upper()
    if pjrt == "CPU":
        return Availability(True, "XLA on the CPU (PJRT_DEVICE=CPU): for tests and development, "
                                  "not auto-selected", auto=False)
    if pjrt not in ("", "TPU"):
        return Availability(False, f"PJRT_DEVICE={pjrt} is not a device this backend runs on "
                                   f"(TPU, or CPU for tests)")
    chips = tpu_device_files()
    if chips:
        return Availability(True, f"TPU found ({len(chips)} device file(s), e.g. {chips[0]})")
    return Availability(False, "no TPU found (no /dev/accel* or /dev/vfio device); "
                               "PJRT_DEVICE=CPU runs XLA on the CPU for tests")


def tpu_device_files() -> list[str]:
    """Paths of TPU chip device files present on this machine (sorted; empty if none)."""
    found: set[str] = set()
    for pattern in TPU_DEVICE_PATTERNS:
        found.update(glob.glob(pattern))
    return sorted(found)


def torch_version_mismatch() -> str:
    """A reason string when torch-xla was built for another torch release, else ``""``.

    torch-xla X.Y only imports with torch X.Y; reading both versions from the installed
    distributions' metadata costs no import.
    """
    try:
        xla_version = metadata.version("torch-xla")
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return ""  # a source build without metadata: let the factory's import decide
    if _release(xla_version) != _release(torch_version):
        return (f"torch-xla {xla_version} needs torch {'.'.join(_release(xla_version))}, "
                f"but torch {torch_version} is installed")
    return ""


def _release(version: str) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:2])
