"""Step 3's token bitmask on the float32 working copy, in place, without a ``[B, V]`` boolean.

The mask is the packed int32 format grammar engines fill (``corelib.bitmask``): token ``j`` is
allowed when bit ``j % 32`` of word ``j // 32`` is 1. On a CUDA device a Triton kernel (Triton
ships with CUDA builds of torch; it is imported on first use) reads each row's words and writes
-inf only where a bit is 0: it never reads the logits and allocates nothing, so a row of -1
words costs one read of its ``ceil(V / 32)`` words. Elsewhere (CPU tensors, a torch without
Triton) the torch expression runs, which unpacks a boolean mask first.

``TRITON_INTERPRET=1`` (set before Triton is imported) runs the same kernel on CPU tensors,
which is how the tests check it without a GPU.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
from corelib.bitmask import unpack_bitmask

NEG_INF = float("-inf")
#: Tokens per Triton program (32 words of the mask).
BLOCK = 1024


def apply_token_bitmask_(x: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """Set ``x[row, j]`` to -inf where bit j of ``words[row]`` is 0; returns ``x``.

    x: float32 ``[B, V]`` with unit stride along V, modified in place. words: int32
    ``[B, ceil(V / 32)]`` on x's device (-1 words leave their 32 tokens alone). On CUDA with
    Triton: the kernel; otherwise ``masked_fill_`` with the unpacked boolean mask."""
    kernel = triton_kernel() if x.is_cuda and x.stride(-1) == 1 else None
    if kernel is None:
        return torch_apply_token_bitmask_(x, words)
    return kernel(x, words if words.stride(-1) == 1 else words.contiguous())


def torch_apply_token_bitmask_(x: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """The torch fallback of :func:`apply_token_bitmask_` (allocates a bool ``[B, V]``)."""
    return x.masked_fill_(~unpack_bitmask(words, x.shape[-1]), NEG_INF)


def bitmask_path(device: torch.device) -> str:
    """Which implementation runs for tensors on ``device``: "triton" or "torch (why)"."""
    if device.type != "cuda":
        return f"torch (the device is {device.type}, the Triton kernel runs on CUDA only)"
    if triton_kernel() is None:
        return f"torch (triton failed to import: {triton_import_error()})"
    return "triton"


@functools.lru_cache(maxsize=1)
def triton_kernel() -> Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """The Triton launcher, or None when Triton cannot be imported (checked once)."""
    try:
        return _build_triton_kernel()
    except Exception:  # ImportError, or a Triton too old for this kernel
        return None


def triton_import_error() -> Optional[str]:
    try:
        _build_triton_kernel()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@functools.lru_cache(maxsize=1)
def _build_triton_kernel() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
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
