"""Step 3's token bitmask on the float32 working copy, in place, without a ``[B, V]`` boolean.

The mask is the packed int32 format grammar engines fill (``corelib.bitmask``): token ``j`` is
allowed when bit ``j % 32`` of word ``j // 32`` is 1. On a CUDA device a Triton kernel (Triton
ships with CUDA builds of torch; it is imported on first use) reads each row's words and writes
-inf only where a bit is 0: it never reads the logits and allocates nothing, so a row of -1
words costs one read of its ``ceil(V / 32)`` words. Elsewhere (CPU tensors, a torch without
Triton) the torch expression runs, which unpacks a boolean mask first.

Triton compiles its launcher on first use (it needs a C compiler, ``Python.h`` and libcuda),
so importing it proves nothing: :func:`choose_bitmask_path` launches the kernel once on a tiny
mask when a sampler starts (and when the backend is probed) and checks what it wrote; if that
fails, the device keeps the torch expression and the reason is reported
(``CudaSampler.bitmask_path``, ``corelib info``). A step never compiles anything.

``TRITON_INTERPRET=1`` (set before Triton is imported) runs the same kernel on CPU tensors,
which is how the tests check it without a GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from corelib.bitmask import BITS, bitmask_width, pack_bitmask, unpack_bitmask
from corelib.transfer import upload

from .device import OFF_CUDA, checked_kernel, describe, device_guard, path_for

NEG_INF = float("-inf")
#: Tokens per Triton program (32 words of the mask).
BLOCK = 1024

Kernel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class BitmaskPath:
    """How step 3 runs on one device: the checked Triton launcher, or None for the torch
    expression; ``description`` is "triton" or "torch (why)"."""

    kernel: Optional[Kernel]
    description: str

    def apply(self, x: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        """Set ``x[row, j]`` to -inf where bit j of ``words[row]`` is 0; returns ``x``.

        x: float32 ``[B, V]``, modified IN PLACE. words: int32 ``[B, ceil(V / 32)]`` on x's
        device (-1 words leave their 32 tokens alone). The kernel needs unit stride along V;
        other views take the torch expression. The launch is guarded to x's device (Triton
        launches on the current one)."""
        if self.kernel is None or x.stride(-1) != 1:
            return torch_apply_token_bitmask_(x, words)
        with device_guard(x.device):
            return self.kernel(x, words if words.stride(-1) == 1 else words.contiguous())


def apply_token_bitmask_(x: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """:meth:`BitmaskPath.apply` with the path of x's device (:func:`choose_bitmask_path`).
    IN PLACE on x float32 ``[B, V]``; words int32 ``[B, ceil(V / 32)]``."""
    return choose_bitmask_path(x.device).apply(x, words)


def torch_apply_token_bitmask_(x: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """The torch fallback of :func:`apply_token_bitmask_` (allocates a bool ``[B, V]``)."""
    return x.masked_fill_(~unpack_bitmask(words, x.shape[-1]), NEG_INF)


def bitmask_path(device: torch.device) -> str:
    """Which implementation runs for tensors on ``device``: "triton" or "torch (why)"."""
    return choose_bitmask_path(device).description


def choose_bitmask_path(device: torch.device | str) -> BitmaskPath:
    """The bitmask path of ``device``, decided once per device: the Triton kernel on a CUDA
    device where it imports and its first launch writes the right tokens, else the torch
    expression with the reason. The first call on a CUDA device launches and synchronises
    (a sampler makes it when it starts, never inside a step)."""
    return path_for(device, lambda d: BitmaskPath(None, OFF_CUDA.format(d.type)), _cuda_path)


@functools.lru_cache(maxsize=None)
def _cuda_path(device: torch.device) -> BitmaskPath:
    return launch_checked(device, _build_triton_kernel)


def launch_checked(device: torch.device, build: Callable[[], Kernel]) -> BitmaskPath:
    """The path that ``build``'s launcher gives on ``device``: it must build (Triton imports)
    and its first launch must write exactly the torch expression's tokens."""
    return BitmaskPath(*checked_kernel(build, lambda kernel: first_launch_problem(kernel, device),
                                       "the Triton kernel"))


def first_launch_problem(kernel: Kernel, device: torch.device) -> Optional[str]:
    """None when ``kernel`` masks a tiny batch on ``device`` as the torch expression does
    (2 rows of 70 tokens: a full word, a partial word, an unconstrained row), else what went
    wrong. Compiles on first use, and waits for the device: call it at start-up only."""
    allowed = torch.zeros((2, 70), dtype=torch.bool)
    allowed[0, ::3] = True
    allowed[1] = True
    words = pack_bitmask(allowed)
    want = torch_apply_token_bitmask_(torch.zeros((2, 70)), words)
    try:
        x = upload(torch.zeros((2, 70)), device)
        with device_guard(device):
            kernel(x, upload(words, device))
        got = x.cpu()
    except Exception as exc:  # no C compiler for the launcher, no Python.h, no libcuda, ...
        return describe(exc)
    if not torch.equal(got, want):
        return "it masked other tokens than the torch expression"
    return None


def triton_import_error() -> Optional[str]:
    """None when the Triton kernel builds (Triton imports), else why not. Says nothing about
    its launch (see :func:`choose_bitmask_path`)."""
    try:
        _build_triton_kernel()
    except Exception as exc:
        return describe(exc)
    return None


@functools.lru_cache(maxsize=1)
def _build_triton_kernel() -> Kernel:
    import triton
    import triton.language as tl

    @triton.jit
    def mask_kernel(x_ptr, words_ptr, vocab_size, x_row_stride, words_row_stride,
                    BLOCK_SIZE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        ids = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        inside = ids < vocab_size
        # Each word is loaded by its 32 tokens; they share a cache line, so the words are read
        # from memory once.
        word = tl.load(words_ptr + row * words_row_stride + ids // 32, mask=inside, other=-1)
        bit = (word >> (ids % 32)) & 1
        tl.store(x_ptr + row * x_row_stride + ids, float("-inf"), mask=inside & (bit == 0))

    def launch(x: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        B, V = x.shape
        if B == 0 or V == 0:
            return x
        grid = (B, triton.cdiv(V, BLOCK))
        mask_kernel[grid](x, words, V, x.stride(0), words.stride(0), BLOCK_SIZE=BLOCK)
        return x

    return launch


def triton_apply_token_bitmask_(x: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """The Triton kernel on any tensors Triton accepts (CUDA, or CPU under
    ``TRITON_INTERPRET=1``); raises when Triton is missing. For tests and benchmarks."""
    return _build_triton_kernel()(x, words)
