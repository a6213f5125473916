"""Prove that code never waits on the device: ``with no_host_sync(): sampler.step(...)``.

Detectors, all raising :class:`HostSyncError` (a RuntimeError) at the offending call:

- host reads: a torch dispatch mode rejects the ops whose result needs device values on the
  host: ``.item()`` / ``int(t)`` / ``bool(t)`` (``_local_scalar_dense``), ``nonzero``,
  ``torch.multinomial``, boolean-mask indexing, ``masked_select``, ``unique``, a copy from a
  device to the host that blocks, and ``Tensor.tolist`` (which bypasses dispatch, so it is
  patched for the duration);
- host-to-device copies that wait: the same mode rejects a copy op (``_to_copy``, ``copy_``,
  ``_copy_from``) from a host tensor to a device when the source is pageable (neither pinned
  nor staged by ``corelib.transfer``: the driver copies pageable memory synchronously, whatever
  ``non_blocking`` says) or when it is blocking (``non_blocking=False``); and any other op that
  mixes host tensors (beyond 0-dim scalars) with device tensors, which copies them implicitly
  and blocking (an index built on the host used on a device tensor, host values written
  through ``index_put``);
- uploads that dispatch no copy at all: ``torch.tensor``, ``torch.as_tensor``,
  ``torch.asarray`` and ``Tensor.new_tensor`` build host data into a device tensor below the
  dispatcher (on the ``meta`` device no copy is even attempted), so they are patched for the
  duration: host data bound for a device raises;
- on CUDA, also ``torch.cuda.set_sync_debug_mode("error")``, torch's own check that fails any
  call that synchronises the device with the host.

The dispatch checks work on CPU tensors, where nothing would ever actually wait (every tensor
counts as a device tensor for the host reads), and on the ``meta`` device, whose tensors are
not on the host: there the upload checks see every copy the code makes, so CI proves the torch
path and the batch's uploads sync-free without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Optional

import torch
from corelib.transfer import is_staged
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten

_HOST_READS = {
    aten._local_scalar_dense, aten.nonzero, aten.multinomial, aten.masked_select,
    aten.unique_consecutive, aten._unique, aten._unique2, aten.unique_dim, aten.is_nonzero,
    aten.equal,
}
#: Copy ops and how to find (source, destination device, non_blocking) in their arguments.
_COPIES = {
    aten._to_copy: lambda args, kw: (args[0], kw.get("device") or args[0].device, kw.get("non_blocking", False)),
    aten.copy_: lambda args, kw: (args[1], args[0].device, _arg(args, kw, 2, "non_blocking")),
    aten._copy_from: lambda args, kw: (args[0], args[1].device, _arg(args, kw, 2, "non_blocking")),
    aten._copy_from_and_resize: lambda args, kw: (args[0], args[1].device, False),
}
#: The factories that turn host data into a tensor; ``Tensor.new_tensor`` is patched apart.
_FACTORIES = ("tensor", "as_tensor", "asarray")


class HostSyncError(RuntimeError):
    """An operation inside ``no_host_sync`` waits on the device, or makes it wait on the host."""


def _arg(args, kwargs, index: int, name: str, default=False):
    return args[index] if len(args) > index else kwargs.get(name, default)


class _SyncDetector(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in _HOST_READS:
            raise HostSyncError(f"{func} reads device values on the host")
        if packet is aten.index and _has_bool_index(args):
            raise HostSyncError(f"{func} with a boolean mask needs the mask's count on the host")
        if packet in _COPIES:
            _check_copy(func, *_COPIES[packet](args, kwargs))
        else:
            _check_mixed_devices(func, args, kwargs)
        return func(*args, **kwargs)


def _check_copy(func, source: torch.Tensor, destination, non_blocking: bool) -> None:
    destination = torch.device(destination)
    if source.device.type == "cpu" and destination.type != "cpu":
        if not is_staged(source):
            raise HostSyncError(f"{func} copies a pageable host tensor {list(source.shape)} to "
                                f"{destination}: the driver copies pageable memory synchronously "
                                f"(stage it through corelib.transfer.upload)")
        if not non_blocking:
            raise HostSyncError(f"{func} copies a host tensor {list(source.shape)} to "
                                f"{destination} with non_blocking=False: the host waits for it")
    elif source.device.type != "cpu" and destination.type == "cpu" and not non_blocking:
        raise HostSyncError(f"{func} copies a {source.device} tensor {list(source.shape)} to the "
                            f"host: the host waits for the device")


def _check_mixed_devices(func, args, kwargs) -> None:
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if not any(t.device.type != "cpu" for t in tensors):
        return
    host = next((t for t in tensors if t.device.type == "cpu" and t.dim() > 0), None)
    if host is not None:
        raise HostSyncError(f"{func} mixes a host tensor {list(host.shape)} with device tensors: "
                            f"it is copied to the device implicitly, and blocking")


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


def _target_device(data: Any, device) -> torch.device:
    """Where a factory puts ``data``: ``device``, else a tensor's own device, else torch's
    default device."""
    if device is not None:
        return torch.device(device)
    if isinstance(data, torch.Tensor):
        return data.device
    return torch.get_default_device()


def _refuse_host_upload(what: str, data: Any, target: torch.device) -> None:
    """HostSyncError when ``data`` (host data: a list, a scalar, a CPU tensor) is bound for a
    device: these factories copy it there blocking."""
    on_host = not isinstance(data, torch.Tensor) or data.device.type == "cpu"
    if target.type != "cpu" and on_host:
        raise HostSyncError(f"{what} of host data on {target} uploads host values blocking "
                            f"(use corelib.transfer.upload)")


def _guarded_factory(name: str, factory: Callable) -> Callable:
    @functools.wraps(factory)
    def guarded(data, *args, device=None, **kwargs):
        if name == "as_tensor" and len(args) > 1:   # as_tensor(data, dtype, device)
            device, args = args[1], args[:1]
        _refuse_host_upload(f"torch.{name}", data, _target_device(data, device))
        return factory(data, *args, device=device, **kwargs)
    return guarded


def _guarded_new_tensor(new_tensor: Callable) -> Callable:
    @functools.wraps(new_tensor)
    def guarded(self, data, *args, device=None, **kwargs):
        _refuse_host_upload("Tensor.new_tensor", data, torch.device(device) if device is not None else self.device)
        return new_tensor(self, data, *args, device=device, **kwargs)
    return guarded


def _tolist(self):
    raise HostSyncError("Tensor.tolist() reads device values on the host")


@contextlib.contextmanager
def _patched(owner, name: str, replacement) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def no_host_sync(device: Optional[torch.device | str] = None) -> Iterator[None]:
    """Raise HostSyncError on any host read of device values, and on any upload that waits,
    inside the block (see the module docstring).

    ``device``: a CUDA device also turns on torch's sync debug mode (restored after)."""
    device = torch.device(device) if device is not None else None
    previous_mode = None
    if device is not None and device.type == "cuda":
        previous_mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
    try:
        with contextlib.ExitStack() as patches:
            patches.enter_context(_patched(torch.Tensor, "tolist", _tolist))
            patches.enter_context(_patched(torch.Tensor, "new_tensor",
                                           _guarded_new_tensor(torch.Tensor.new_tensor)))
            for name in _FACTORIES:
                patches.enter_context(_patched(torch, name, _guarded_factory(name, getattr(torch, name))))
            with _SyncDetector():
                yield
    finally:
        if previous_mode is not None:
            torch.cuda.set_sync_debug_mode(previous_mode)
