"""The sampler's CUDA device as the current one, for the calls that use the current device.

Torch ops and FlashInfer's kernels run on their tensors' device, but a Triton launch, a CUDA
graph capture (its stream and memory pool) and a replay go to the *current* device: for a
sampler on ``cuda:1`` while ``cuda:0`` is current, they must be guarded.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Optional, TypeVar

import torch


def device_guard(device: torch.device) -> ContextManager:
    """``torch.cuda.device(device)`` for a CUDA device (restored on exit); a no-op elsewhere."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


Path = TypeVar("Path")

#: A Triton kernel's path off CUDA, formatted with the device type.
OFF_CUDA = "torch (the device is {}, the Triton kernel runs on CUDA only)"


def path_for(device: torch.device | str, off_cuda: Callable[[torch.device], Path],
             on_cuda: Callable[[torch.device], Path]) -> Path:
    """``on_cuda(device)`` for a CUDA device (an index filled in from the current device, so
    callers may cache per device), else ``off_cuda(device)``: how a Triton kernel's path is
    chosen once per device."""
    device = torch.device(device)
    if device.type != "cuda":
        return off_cuda(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return on_cuda(device)


Kernel = TypeVar("Kernel")


def describe(exc: BaseException) -> str:
    """An exception as a path's reason: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def checked_kernel(build: Callable[[], Kernel], first_launch_problem: Callable[[Kernel], Optional[str]],
                   what: str) -> tuple[Optional[Kernel], str]:
    """(the kernel, "triton") when ``build()`` gives it (Triton imports) and its first launch
    shows no problem; else (None, "torch (why)"), ``what`` naming the kernel in the reason."""
    try:
        kernel = build()
    except Exception as exc:  # ImportError, or a Triton too old for this kernel
        return None, f"torch (triton failed to import: {describe(exc)})"
    problem = first_launch_problem(kernel)
    if problem is not None:
        return None, f"torch ({what} failed its first launch: {problem})"
    return kernel, "triton"
