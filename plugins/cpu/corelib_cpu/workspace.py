"""Buffers reused across blocks and steps, one set per thread.

Every large temporary of a block (the float32 working copy, softmax outputs, histogram keys)
has the block's shape, ``[rows per block, V]``, so a handful of buffers serve every step:
no allocation, no page faults, and the memory stays warm in the cache. Buffers grow when a
larger block arrives and are never shrunk.
"""

from __future__ import annotations

import threading

import torch


class Workspace(threading.local):
    """Named buffers; ``take(name, shape, dtype)`` returns a view of the buffer ``name``.

    Per thread (``threading.local``), so one sampler may serve several threads. A view stays
    valid until the next ``take`` of the same name on the same thread."""

    def __init__(self):
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        numel = 1
        for size in shape:
            numel *= size
        key = (name, dtype)
        buffer = self._buffers.get(key)
        # a buffer made under torch.inference_mode (vLLM runs its steps there) may not be
        # written outside it: a call outside gets a new one
        if (buffer is None or buffer.numel() < numel
                or (buffer.is_inference() and not torch.is_inference_mode_enabled())):
            buffer = torch.empty(numel, dtype=dtype)
            self._buffers[key] = buffer
        return buffer[:numel].view(shape)

    def nbytes(self) -> int:
        """Bytes held by this thread's buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
