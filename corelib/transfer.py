"""Host-to-device uploads that never wait: staged through pinned memory, copied non-blocking.

A copy from ordinary (pageable) host memory to a GPU is synchronous: the CUDA driver first
copies into a pinned bounce buffer and the host waits for it, whatever ``non_blocking`` says.
Every value the batch writes on ``add``, ``remove``, ``swap_rows`` and ``append`` (and the
sampler on ``verify`` and for a host token bitmask) goes through :func:`upload` instead:
the values are placed in pinned memory (torch's caching host allocator, which keeps a block
from reuse until the copies recorded on it have finished) and copied with
``non_blocking=True``.

Where no pinned allocator exists (a CPU-only torch build moving tensors to the ``meta`` device
in tests, or a device whose runtime does not pin), the staged tensor is marked instead
(:func:`is_staged`): sync detectors accept a copy from a pinned or staged source, so a test on
such a machine still proves that every upload takes this path. On the CPU device nothing is
copied at all.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

_STAGED = "_corelib_staged"
_pinning: Optional[bool] = None   # whether this process can allocate pinned memory


def can_pin() -> bool:
    """Whether this process has a pinned-memory allocator (an accelerator runtime); cached."""
    global _pinning
    if _pinning is None:
        try:
            _pinning = torch.empty(1).pin_memory().is_pinned()
        except RuntimeError:
            _pinning = False
    return _pinning


def staged(host: torch.Tensor) -> torch.Tensor:
    """``host`` (a CPU tensor) in pinned memory: itself when already pinned, else a pinned
    copy; without a pinned allocator, ``host`` marked as staged (see the module docstring)."""
    if host.is_pinned():
        return host
    if can_pin():
        return host.pin_memory()
    setattr(host, _STAGED, True)
    return host


def is_staged(tensor: torch.Tensor) -> bool:
    """True for a host tensor that may be copied to a device without waiting: pinned, or
    staged by :func:`staged` where nothing can be pinned."""
    return tensor.device.type == "cpu" and (tensor.is_pinned() or getattr(tensor, _STAGED, False))


def upload(values: torch.Tensor | Sequence, device: torch.device,
           dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``values`` (host data: a CPU tensor or a (nested) list) as a tensor on ``device``.

    On the CPU the result is a tensor of ``values`` (not a copy when it already is one of
    ``dtype``). Elsewhere it is a non-blocking copy from pinned memory: the host never waits.
    Pageable values are first copied into pinned memory, so the caller may reuse them at once;
    a caller's tensor that is already pinned is copied from directly (as torch does), so it
    must stay unchanged until the device has read it. A tensor on an accelerator is moved
    there without a host round trip."""
    if (isinstance(values, torch.Tensor) and values.device == device
            and (dtype is None or values.dtype == dtype)):
        return values       # already there: the common case of a CPU batch's step
    device = torch.device(device)
    if isinstance(values, torch.Tensor) and values.device.type != "cpu":
        return values.to(device=device, dtype=dtype or values.dtype, non_blocking=True)
    host = torch.as_tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    return staged(host).to(device, non_blocking=True)
