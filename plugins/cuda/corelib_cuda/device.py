"""The sampler's CUDA device as the current one, for the calls that use the current device.

Torch ops and FlashInfer's kernels run on their tensors' device, but a Triton launch, a CUDA
graph capture (its stream and memory pool) and a replay go to the *current* device: for a
sampler on ``cuda:1`` while ``cuda:0`` is current, they must be guarded.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch


def device_guard(device: torch.device) -> ContextManager:
    """``torch.cuda.device(device)`` for a CUDA device (restored on exit); a no-op elsewhere."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()
