"""Row sums whose bits depend on the row alone: ``CudaSampler.row_sum`` (the core's hook,
``corelib.Sampler.row_sum``) on CUDA tensors.

``score`` runs the pipeline once over ``[B T, V]`` virtual rows where ``sample`` runs ``[B, V]``,
and the contract asks the processed logprobs of both to be equal bitwise. torch's CUDA
``sum(dim=-1)`` chooses its thread layout (block shape, programs per output) from the number
of rows, so a row's float sum can differ in its last bit between a 40-row and an 8-row tensor,
and the stages' entropies, means and totals (``corelib.reductions``) move their thresholds with
it. This Triton kernel sums each row in one program, in an order fixed by the row length
alone: lane i of a ``BLOCK``-wide accumulator adds the row's entries i, i + BLOCK, i + 2 BLOCK,
... in turn (masked entries past V add 0), then the lanes are added in pairs, (2i, 2i + 1),
level after level, an explicit tree of ``log2(BLOCK)`` levels whose every addition has two
operands (so one rounding, whatever the compiler's layout of the lanes). The bits of a row's
sum depend on V and the row's values only: not on the row count, the other rows, the row's
address or stride. float32 sums in float32 and float64 in float64, as torch's do; the error
against the exact sum is at most (ceil(V / BLOCK) + log2(BLOCK)) * eps * sum |x|, eps the
dtype's machine epsilon (torch's own reduction has a bound of the same kind; the two agree to
that tolerance, not bitwise).

Its first launch on each device is checked (:func:`choose_row_sum_path`): a row's sum must
come out the same alone, among 8 and among 40 rows, and within the bound of the exact sum;
where Triton is missing or that check fails, torch's sum runs (``CudaSampler.row_sum_path``
says which). The kernel is the custom operation ``corelib_cuda::row_sum`` (its CPU form is
torch's sum, its meta form gives the shape, its backward broadcasts the gradient), so
``score``'s gradients flow through it. It reads no device value on the host and allocates only
its ``[R]`` output, so a CUDA graph captures it like any kernel. ``TRITON_INTERPRET=1`` runs
the same kernel on CPU tensors, which is how the tests check its bits without a GPU.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from corelib.reductions import torch_row_sum
from corelib.transfer import upload

from .device import OFF_CUDA, checked_kernel, describe, device_guard, path_for

#: Lanes of the accumulator: each lane adds every BLOCK-th entry of the row. A power of two;
#: the bits of every sum depend on it, so it never changes with the device or the row count.
BLOCK = 2048
#: Warps per row's program.
NUM_WARPS = 8
#: The dtypes the kernel sums; others take torch's sum.
DTYPES = (torch.float32, torch.float64)

Kernel = Callable[[torch.Tensor], torch.Tensor]


def error_bound(values: torch.Tensor) -> torch.Tensor:
    """float64 [R]: the largest distance of the kernel's sum of each row of ``values``
    float [R, V] from the exact sum: (ceil(V / BLOCK) + log2(BLOCK)) * eps * sum |x|."""
    V = values.shape[-1]
    steps = math.ceil(V / BLOCK) + int(math.log2(BLOCK))
    return steps * torch.finfo(values.dtype).eps * values.double().abs().sum(dim=-1)


@torch.library.custom_op("corelib_cuda::row_sum", mutates_args=())
def row_sum_op(values: torch.Tensor) -> torch.Tensor:
    """Each row's sum as one operation: the Triton kernel on CUDA, torch's sum elsewhere.
    values float32 or float64 [R, V] (unit stride along V); [R], same dtype."""
    return torch_row_sum(values)


@row_sum_op.register_fake
def _(values: torch.Tensor) -> torch.Tensor:
    return values.new_empty(values.shape[:1])


@row_sum_op.register_kernel("cuda")
def _(values: torch.Tensor) -> torch.Tensor:
    return _build_triton_kernel()(values)


def _setup_backward(ctx, inputs, output) -> None:
    ctx.shape = inputs[0].shape


def _backward(ctx, grad: torch.Tensor) -> torch.Tensor:
    return grad[:, None].expand(ctx.shape)


row_sum_op.register_autograd(_backward, setup_context=_setup_backward)


@dataclass(frozen=True)
class RowSumPath:
    """How rows are summed on one device: ``kernel`` (the checked custom operation, or any
    launcher of float [R, V] -> [R]; None: torch's sum) and ``description``: "triton", or
    "torch (why)"."""

    kernel: Optional[Kernel]
    description: str

    def sum(self, values: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
        """Each row's sum over the last dimension of float ``[..., V]`` values: ``[...]``
        (``[..., 1]`` with ``keepdim``). By the kernel for float32 and float64 with V >= 1
        (a view without unit stride along V is copied first: the bits do not depend on it),
        else torch's sum. Differentiable. Not in place."""
        if self.kernel is None or values.dtype not in DTYPES or values.dim() == 0 or values.shape[-1] == 0:
            return torch_row_sum(values, keepdim=keepdim)
        flat = values.reshape(-1, values.shape[-1])
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        with device_guard(values.device):
            out = self.kernel(flat)
        out = out.view(values.shape[:-1])
        return out.unsqueeze(-1) if keepdim else out


def choose_row_sum_path(device: torch.device | str) -> RowSumPath:
    """The row sums of ``device``, decided once per device: the Triton kernel on a CUDA device
    where it imports and its first launch passes :func:`first_launch_problem`, else torch's sum
    with the reason. The first call on a CUDA device launches and waits (a sampler makes it
    when it starts, never inside a step)."""
    return path_for(device, lambda d: RowSumPath(None, OFF_CUDA.format(d.type)), _cuda_path)


def row_sum_path(device: torch.device | str) -> str:
    """Which implementation sums rows for tensors on ``device``: "triton" or "torch (why)"."""
    return choose_row_sum_path(device).description


@functools.lru_cache(maxsize=None)
def _cuda_path(device: torch.device) -> RowSumPath:
    return launch_checked(device, row_sum_op, _build_triton_kernel)


def launch_checked(device: torch.device, kernel: Kernel,
                   build: Optional[Callable[[], Kernel]] = None) -> RowSumPath:
    """The path ``kernel`` gives on ``device``: ``build`` (when given) must succeed (Triton
    imports), and its first launch must pass :func:`first_launch_problem`; else torch's sum,
    with why."""
    def built() -> Kernel:
        if build is not None:
            build()
        return kernel
    return RowSumPath(*checked_kernel(built, lambda k: first_launch_problem(k, device), "the Triton row sum"))


def first_launch_problem(kernel: Kernel, device: torch.device) -> Optional[str]:
    """None when ``kernel`` sums 40 rows of 3000 entries (a partial last block; a row of
    zeros, one with -inf, one of probabilities times their logarithm with zeros where p is 0)
    in float32 and float64 so that each row's bits are the same alone and among 8 rows, and
    each sum is within :func:`error_bound` of the exact one; else what went wrong. Compiles on
    first use and waits for the device: call it at start-up only."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((40, 3000), generator=gen) * 3
    x[1] = 0.0
    x[2, 7] = float("-inf")
    logp = torch.log_softmax(x[3] * 4, dim=-1)
    x[3] = torch.where(logp.exp() > 0, logp.exp() * logp, 0.0)
    try:
        for dtype in DTYPES:
            values = x.to(dtype)
            with device_guard(device):
                whole = kernel(upload(values, device)).cpu()
                alone = torch.cat([kernel(upload(values[i:i + 1], device)).cpu() for i in (0, 2, 3, 39)])
                some = kernel(upload(values[3:11], device)).cpu()
            if not (_same_bits(alone, whole[[0, 2, 3, 39]]) and _same_bits(some, whole[3:11])):
                return f"a row's {dtype} sum changed with the row count"
            exact = values.double().sum(dim=-1)
            finite = torch.isfinite(exact)
            if not (torch.equal(torch.isfinite(whole), finite) and bool(
                    ((whole.double() - exact)[finite].abs() <= error_bound(values)[finite]).all())):
                return f"its {dtype} sums are off the exact sums by more than the error bound"
    except Exception as exc:  # no C compiler for the launcher, no Python.h, no libcuda, ...
        return describe(exc)
    return None


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@functools.lru_cache(maxsize=1)
def _build_triton_kernel() -> Kernel:
    from . import row_sum_triton        # imports Triton
    if row_sum_triton.BLOCK != BLOCK:
        raise RuntimeError(f"the kernel's block is {row_sum_triton.BLOCK}, not {BLOCK}")

    def launch(values: torch.Tensor) -> torch.Tensor:
        R, V = values.shape
        if R == 0 or V == 0:
            return torch.zeros((R,), dtype=values.dtype, device=values.device)
        return row_sum_triton.launch(values, NUM_WARPS)

    return launch


def triton_row_sum(values: torch.Tensor) -> torch.Tensor:
    """The Triton kernel on any tensors Triton accepts (CUDA, or CPU under
    ``TRITON_INTERPRET=1``): float32 or float64 [R, V] with unit stride along V -> [R]; raises
    when Triton is missing. For tests."""
    return _build_triton_kernel()(values)
