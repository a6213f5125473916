"""Is there a usable NVIDIA GPU, and which path (FlashInfer or torch) will the backend run?

The GPU decides whether the backend is available at all; FlashInfer only decides the path:
without it (not installed, an import error, a GPU too old for its kernels) the backend still
runs, on its torch path, and says why. Tests gate their GPU cases on :func:`cuda_availability`
so that tests and runtime agree.
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
from corelib import Availability

#: Volta and newer: the torch path uses nothing newer than what torch's CUDA builds support.
MIN_CAPABILITY = (7, 0)
#: FlashInfer's sampling kernels are built for Turing (sm75) and newer.
FLASHINFER_MIN_CAPABILITY = (7, 5)
#: Set to 0 / false / off to force the torch path even where FlashInfer works.
ENV_FLASHINFER = "CORELIB_CUDA_FLASHINFER"


@dataclass(frozen=True)
class PathChoice:
    """Which path unseeded rows take: ``"flashinfer"`` or ``"torch"``, and why."""

    path: str
    reason: str

    @property
    def flashinfer(self) -> bool:
        return self.path == "flashinfer"


def cuda_availability(device_index: int = 0) -> Availability:
    """Whether torch sees a CUDA GPU this backend supports (the reason when not)."""
    if not torch.cuda.is_available():
        built = torch.version.cuda or "no CUDA (a CPU-only build)"
        return Availability(False, f"no CUDA GPU: torch.cuda.is_available() is False "
                                   f"(torch {torch.__version__}, built with {built})")
    if torch.version.hip is not None:
        return Availability(False, f"torch {torch.__version__} is a ROCm build; corelib-cuda "
                                   f"needs an NVIDIA GPU with CUDA")
    capability = torch.cuda.get_device_capability(device_index)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device_index)
        return Availability(False, f"unsupported GPU {name} (compute capability "
                                   f"{capability[0]}.{capability[1]}); corelib-cuda needs "
                                   f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer")
    return Availability(True)


def flashinfer_choice(capability: Optional[tuple[int, int]]) -> PathChoice:
    """The path for a GPU of ``capability`` (None: no GPU). Imports FlashInfer (once)."""
    if _flashinfer_disabled_by_env():
        return PathChoice("torch", f"torch path active because {ENV_FLASHINFER}="
                                   f"{os.environ[ENV_FLASHINFER]!r} disables FlashInfer")
    if capability is None:
        return PathChoice("torch", "torch path active because there is no CUDA GPU for FlashInfer")
    if capability < FLASHINFER_MIN_CAPABILITY:
        return PathChoice("torch", f"torch path active because FlashInfer needs compute "
                                   f"capability {FLASHINFER_MIN_CAPABILITY[0]}."
                                   f"{FLASHINFER_MIN_CAPABILITY[1]}+, this GPU has "
                                   f"{capability[0]}.{capability[1]}")
    version, error = import_flashinfer()
    if error is not None:
        return PathChoice("torch", f"torch path active because flashinfer cannot be used: {error}")
    return PathChoice("flashinfer", f"FlashInfer path active (flashinfer {version}) for "
                                    f"unseeded rows; seeded rows use the torch path")


def probe() -> Availability:
    """The backend's probe: available with a GPU; the reason names the active path of
    unseeded rows, of the token bitmask and of the stages' row sums (whose Triton kernels are
    launched once here, see ``corelib_cuda.bitmask.choose_bitmask_path`` and
    ``corelib_cuda.row_sum.choose_row_sum_path``)."""
    gpu = cuda_availability()
    if not gpu.available:
        return gpu
    from .bitmask import choose_bitmask_path
    from .row_sum import choose_row_sum_path
    choice = flashinfer_choice(torch.cuda.get_device_capability(0))
    bitmask = choose_bitmask_path(torch.device("cuda", 0))
    sums = choose_row_sum_path(torch.device("cuda", 0))
    return Availability(True, available_reason(choice, bitmask.description, sums.description))


def available_reason(choice: PathChoice, bitmask: str, row_sums: Optional[str] = None) -> str:
    """What ``corelib info`` shows for an available backend: the paths (the row sums' when
    given)."""
    reason = f"{choice.reason}; token bitmask: {bitmask}"
    return reason if row_sums is None else f"{reason}; row sums: {row_sums}"


@functools.lru_cache(maxsize=1)
def import_flashinfer() -> tuple[Optional[str], Optional[str]]:
    """(version, None) when ``flashinfer.sampling`` imports, else (None, the error).

    Importing FlashInfer takes seconds, so it happens only where a GPU makes it useful, and
    only once per process.
    """
    try:
        with warnings.catch_warnings():   # its CUTLASS DSL's deprecation notices are not ours
            warnings.simplefilter("ignore", DeprecationWarning)
            import flashinfer
            import flashinfer.sampling  # noqa: F401  (the module the backend calls)
    except Exception as exc:  # ImportError, OSError from a CUDA library, RuntimeError, ...
        kind = "is not installed" if isinstance(exc, ModuleNotFoundError) and exc.name == "flashinfer" else "failed to import"
        return None, f"flashinfer {kind} ({type(exc).__name__}: {exc})"
    return getattr(flashinfer, "__version__", "unknown"), None


def _flashinfer_disabled_by_env() -> bool:
    value = os.environ.get(ENV_FLASHINFER)
    return value is not None and value.strip().lower() in {"0", "false", "off", "no"}
