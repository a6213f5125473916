"""The Triton kernel of ``corelib_cuda.row_sum`` (imported on first use: it imports Triton).
See that module for what it computes and why its bits depend on the row alone."""

from __future__ import annotations

import triton
import triton.language as tl

#: Lanes of the accumulator (2 ** LEVELS): each adds every BLOCK-th entry of the row.
LEVELS = 11
BLOCK = 2 ** LEVELS


@triton.jit
def halve(acc):
    """Lanes (2i, 2i + 1) -> lane i: one two-operand addition each, whatever the layout."""
    a, b = tl.split(tl.reshape(acc, [acc.shape[0] // 2, 2]))
    return a + b


@triton.jit
def row_sum_kernel(x_ptr, out_ptr, vocab_size, x_row_stride, BLOCK_SIZE: tl.constexpr):
    """out[row] = the sum of x[row, :vocab_size], one program per row. BLOCK_SIZE == 2048."""
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * x_row_stride
    lanes = tl.arange(0, BLOCK_SIZE)
    acc = tl.zeros([BLOCK_SIZE], dtype=out_ptr.dtype.element_ty)
    for start in range(0, vocab_size, BLOCK_SIZE):
        ids = start + lanes
        acc += tl.load(base + ids, mask=ids < vocab_size, other=0.0)
    # 2048 lanes -> 1: the eleven levels written out
    acc = halve(halve(halve(halve(halve(halve(halve(halve(halve(halve(halve(acc)))))))))))
    tl.store(out_ptr + row + tl.arange(0, 1), acc)


def launch(values, num_warps: int):
    """[R] sums of float32/float64 values [R, V] (unit stride along V, R >= 1, V >= 1)."""
    import torch
    R, V = values.shape
    out = torch.empty((R,), dtype=values.dtype, device=values.device)
    row_sum_kernel[(R,)](values, out, V, values.stride(0), BLOCK_SIZE=BLOCK, num_warps=num_warps)
    return out
