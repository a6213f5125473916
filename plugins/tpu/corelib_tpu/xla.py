"""The few torch-xla calls the plugin makes, imported lazily, and no-ops on other devices.

The sampler also runs on a plain torch device (``TpuSampler("cpu")``): the same traced code
executes eagerly, which is how its logic is tested without torch-xla.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Optional, Sequence

import torch

#: torch-xla's counter of graphs compiled (not found in its in-memory graph cache).
COMPILE_COUNTER = "UncachedCompile"


class RecompilationError(RuntimeError):
    """A strict sampler compiled a graph after its warm-up."""


def is_xla(device: torch.device) -> bool:
    return torch.device(device).type == "xla"


def default_device() -> torch.device:
    """The first XLA device (imports torch-xla)."""
    import torch_xla
    return torch.device(torch_xla.device())


def launch(tensors: Sequence[torch.Tensor]) -> None:
    """Compile (if new) and start the graph computing ``tensors``, without waiting for it.

    Only these tensors' pending operations are cut into the graph, so a graph holds exactly
    one sampler operation whatever else the caller has pending. No-op off XLA.
    """
    tensors = [t for t in tensors if t.device.type == "xla"]
    if tensors:
        import torch_xla
        torch_xla._XLAC._xla_sync_multi(tensors, devices=[], wait=False)


def bitcast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret the bits of ``tensor`` as ``dtype`` (same element size); not a copy off XLA.

    On XLA this is a one-op user computation (``BitcastConvert``) inside the lazy graph:
    torch-xla 2.9 runs ``Tensor.view(dtype)`` eagerly, which would cut every graph in two at
    each bitcast. The computation is built once per input shape and type.
    """
    if tensor.device.type != "xla":
        return tensor.view(dtype)
    import torch_xla
    import torch_xla.core.xla_builder as xb
    shape = xb.tensor_shape(tensor)
    key = (tuple(tensor.shape), tensor.dtype, dtype)
    computation = _BITCASTS.get(key)
    if computation is None:
        target = xb._PT_XLA_TYPE_MAP[dtype]
        computation = xb.create_computation("bitcast", lambda p: p.bitcast(target), [shape])
        _BITCASTS[key] = computation
    return torch_xla._XLAC._xla_user_computation("xla::bitcast", [tensor], computation)[0]


_BITCASTS: dict = {}


def iota(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.arange(n)`` as a ``[1, n]`` tensor on ``device``, made once and reused.

    torch-xla builds ``arange`` on the host and uploads it at every call (10 to 50 ms for a
    128k vocabulary); a cached tensor enters each graph as an input instead.
    """
    key = (n, dtype, str(device))
    tensor = _IOTAS.get(key)
    if tensor is None:
        tensor = torch.arange(n, dtype=dtype)[None, :].to(device)
        _IOTAS[key] = tensor
    return tensor


_IOTAS: dict = {}


#: Environment variable naming the persistent compile cache's directory (``compile_cache``).
CACHE_ENV = "CORELIB_TPU_COMPILE_CACHE"


def default_cache_dir() -> Path:
    """Where ``compile_cache(True)`` keeps compiled graphs: ``$XDG_CACHE_HOME/corelib/xla``
    (``~/.cache/corelib/xla`` without it), one folder per torch-xla version, since a graph
    compiled by one version is not loaded by another."""
    import torch_xla
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "corelib" / "xla" / f"torch_xla-{torch_xla.__version__}"


def compile_cache(path: "str | os.PathLike | bool | None" = None, readonly: bool = False) -> Optional[Path]:
    """Switch on torch-xla's persistent compile cache for this process, so that a later
    process compiling the same graphs loads them from disk instead (``torch_xla.runtime.
    initialize_cache``). path: a directory, True for ``default_cache_dir()``, None for the
    ``CORELIB_TPU_COMPILE_CACHE`` environment variable (unset or empty: off), False for off
    (both return None).
    readonly: load from the cache without adding to it (workers sharing one directory).

    Must come before this process's first XLA computation, as torch-xla requires; a later
    call with the directory already in use returns it, one with another directory raises
    RuntimeError. Returns the directory in use."""
    if path is None:
        path = os.environ.get(CACHE_ENV) or None
    if path is None or path is False:
        return None
    import torch_xla
    import torch_xla.runtime as xr
    directory = default_cache_dir() if path is True else Path(path).expanduser()
    current = os.environ.get("XLA_PERSISTENT_CACHE_PATH")
    if torch_xla._XLAC._xla_computation_cache_is_initialized():
        if current and Path(current) == directory:
            return directory
        raise RuntimeError(
            f"compile_cache({str(directory)!r}): this process already ran XLA computations "
            f"{'with the cache in ' + repr(current) if current else 'without a persistent cache'}; "
            f"switch it on before the first one (create the TpuSampler with compile_cache=..., "
            f"or set {CACHE_ENV} before starting)")
    directory.mkdir(parents=True, exist_ok=True)
    xr.initialize_cache(str(directory), readonly=readonly)
    return directory


def persistent_cache_hits() -> int:
    """Graphs loaded from the persistent compile cache so far in this process."""
    return _counter("PersistentCacheHit")


def compile_count() -> int:
    """Graphs compiled so far in this process (0 when torch-xla is not loaded)."""
    return _counter(COMPILE_COUNTER)


def _counter(name: str) -> int:
    """torch-xla's counter ``name`` (0 when torch-xla is not loaded or it never counted)."""
    if "torch_xla" not in sys.modules:
        return 0
    import torch_xla.debug.metrics as met
    return int(met.counter_value(name) or 0)


class CompileGuard:
    """Counts the graphs a sampler's operations compile; in strict mode, once armed (after
    warm-up), raises ``RecompilationError`` naming the operation that compiled one.

    Shared by a sampler and its batches, so adds, removes and appends are watched too.
    """

    def __init__(self, strict: bool = False):
        self.strict = strict
        self.armed = False
        self.compiled_after_warmup = 0

    @contextmanager
    def watch(self, operation: str):
        before = compile_count()
        yield
        new = compile_count() - before
        if new and self.armed:
            self.compiled_after_warmup += new
            if self.strict:
                raise RecompilationError(
                    f"{operation} compiled {new} new XLA graph(s) after warmup(); warm up with "
                    f"the shapes, dtypes and logits layouts used in serving (see docs/tpu.md)")


def padded_block(tensor: torch.Tensor, shape: Sequence[int], fill, dtype: torch.dtype) -> torch.Tensor:
    """A new ``dtype`` tensor of ``shape`` filled with ``fill``, ``tensor`` in its leading
    corner (each dimension of ``tensor`` at most ``shape``'s), on ``tensor``'s device."""
    out = torch.full(tuple(shape), fill, dtype=dtype, device=tensor.device)
    out[tuple(slice(0, size) for size in tensor.shape)] = tensor.to(dtype)
    return out


def fit_block(tensor: torch.Tensor, shape: Sequence[int], fill, dtype: torch.dtype,
              device: torch.device, guard: "CompileGuard", what: str) -> torch.Tensor:
    """``tensor`` as ``dtype`` ``shape`` on ``device`` (``padded_block``): a host tensor is
    padded on the host and uploaded without blocking; a device tensor of another shape or
    dtype goes through a one-op graph (one per input shape and dtype, watched as ``what``);
    one that already fits is returned as it is."""
    if tuple(tensor.shape) == tuple(shape) and tensor.dtype == dtype:
        return tensor.to(device, non_blocking=True)
    padded = padded_block(tensor, shape, fill, dtype)
    if tensor.device.type == "cpu":
        return padded.to(device, non_blocking=True)
    with guard.watch(what):
        launch([padded])
    return padded
