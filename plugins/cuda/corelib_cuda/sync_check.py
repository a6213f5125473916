"""Prove that code never waits on the device: ``with no_host_sync(): sampler.step(...)``.

Two detectors, both raising :class:`HostSyncError` (a RuntimeError) at the offending call:

- on every device, a torch dispatch mode that rejects the ops whose result needs device values
  on the host: ``.item()`` / ``int(t)`` / ``bool(t)`` (``_local_scalar_dense``), ``nonzero``,
  ``torch.multinomial``, boolean-mask indexing, ``masked_select``, ``unique``, and
  ``Tensor.tolist`` (which bypasses dispatch, so it is patched for the duration);
- on CUDA, also ``torch.cuda.set_sync_debug_mode("error")``, torch's own check that fails any
  call that synchronises the device with the host.

The first detector works on CPU tensors, where nothing would ever actually wait, so CI proves
the torch path sync-free without a GPU.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_HOST_READS = {
    aten._local_scalar_dense, aten.nonzero, aten.multinomial, aten.masked_select,
    aten.unique_consecutive, aten._unique, aten._unique2, aten.unique_dim, aten.is_nonzero,
    aten.equal,
}


class HostSyncError(RuntimeError):
    """An operation read device values on the host inside ``no_host_sync``."""


class _HostReadDetector(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in _HOST_READS:
            raise HostSyncError(f"{func} reads device values on the host")
        if func.overloadpacket is aten.index and _has_bool_index(args):
            raise HostSyncError(f"{func} with a boolean mask needs the mask's count on the host")
        return func(*args, **kwargs)


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


@contextlib.contextmanager
def no_host_sync(device: Optional[torch.device | str] = None) -> Iterator[None]:
    """Raise HostSyncError on any host read of device values inside the block.

    ``device``: a CUDA device also turns on torch's sync debug mode (restored after)."""
    device = torch.device(device) if device is not None else None
    original_tolist = torch.Tensor.tolist

    def tolist(self):
        raise HostSyncError("Tensor.tolist() reads device values on the host")

    previous_mode = None
    if device is not None and device.type == "cuda":
        previous_mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
    torch.Tensor.tolist = tolist
    try:
        with _HostReadDetector():
            yield
    finally:
        torch.Tensor.tolist = original_tolist
        if previous_mode is not None:
            torch.cuda.set_sync_debug_mode(previous_mode)
