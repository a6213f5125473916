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

    #: Most (tensor, array) pairs kept by ``pair`` before they are all dropped (their shapes
    #: follow the requests' parameters, so a long-lived sampler could meet many).
    PAIRS = 64

    def __init__(self):
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self._pairs: dict[tuple, tuple] = {}
        self._fresh: dict[tuple, list] = {}
        # the keys of pairs and fresh chunks made under torch.inference_mode, which a call
        # outside it must replace: known here, so the common call asks torch nothing
        self._inference_pairs: set = set()
        self._inference_fresh: set = set()
        #: This thread's block in progress had every row valid, known on the host
        #: (``neutralise_rows`` sets it, ``flag_invalid`` reads it).
        self.rows_valid = False
        #: the step's ids when ``flag_invalid`` knew every row valid (every id in [0, V))
        self.sampled_ids = None
        #: the candidate race's flags when every winner was finite (a new all-true tensor,
        #: which ``flag_invalid`` may return as the step's valid flags)
        self.true_flags = None

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

    def pair(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> tuple:
        """(tensor, numpy array): a buffer of its own per (name, shape, dtype) and its numpy
        view, made once and returned again by later calls, for the small outputs the
        compiled kernels write on every step of a few-row block: no allocation and no
        tensor-to-numpy conversion per step (each is several operator calls, most of a
        B = 1 step's host time). Valid until the next ``pair`` of the same key on the same
        thread; never hand one to a caller outside the step."""
        key = (name, shape, dtype)
        got = self._pairs.get(key)
        if got is None or (key in self._inference_pairs and not torch.is_inference_mode_enabled()):
            if len(self._pairs) >= self.PAIRS:
                self._pairs.clear()
            tensor = torch.empty(shape, dtype=dtype)
            got = self._pairs[key] = (tensor, tensor.numpy())
            mark(self._inference_pairs, key, tensor.is_inference())
        return got

    #: How many new tensors ``fresh`` makes at a time.
    FRESH = 64

    def fresh(self, name: str, n: int, dtype: torch.dtype) -> tuple:
        """(tensor, numpy array): a new ``[n]`` tensor each call, never returned again, and its
        numpy view, for a step's outputs that go to the caller (the race's ids and flags).
        They are the rows of a chunk made ``FRESH`` at a time with their views: a cold step
        then pays no allocation and no conversion (``torch.from_numpy`` alone costs more
        after a model's forward pass than the race it wraps). A chunk lives while a caller
        holds one of its rows."""
        key = (name, n, dtype)
        pool = self._fresh.get(key)
        if not pool or (key in self._inference_fresh and not torch.is_inference_mode_enabled()):
            if len(self._fresh) >= self.PAIRS:
                self._fresh.clear()
            chunk = torch.empty((self.FRESH, n), dtype=dtype)
            pool = self._fresh[key] = [(row, row.numpy()) for row in reversed(chunk.unbind(0))]
            mark(self._inference_fresh, key, chunk.is_inference())
        return pool.pop()

    def nbytes(self) -> int:
        """Bytes held by this thread's buffers."""
        return (sum(b.numel() * b.element_size() for b in self._buffers.values())
                + sum(t.numel() * t.element_size() for t, _ in self._pairs.values())
                + sum(t.numel() * t.element_size() for pool in self._fresh.values() for t, _ in pool))


def numpy_view(held: dict, name: str, tensor: torch.Tensor):
    """The numpy view of ``tensor`` (a CPU tensor), kept in ``held`` under ``name`` for as
    long as the same tensor object comes back: a step state's per-row views live as long as
    the batch's rows stay, and each conversion is four operator calls of a B = 1 step. A
    tensor that is not contiguous is converted each time (its contiguous copy is not its
    memory)."""
    got = held.get(name)
    if got is not None and got[0] is tensor:
        return got[1]
    if not tensor.is_contiguous():
        return tensor.contiguous().numpy()
    array = tensor.numpy()
    held[name] = (tensor, array)
    return array


def mark(keys: set, key, inference: bool) -> None:
    """Record in ``keys`` whether the buffers of ``key`` were made under inference mode."""
    if inference:
        keys.add(key)
    else:
        keys.discard(key)
