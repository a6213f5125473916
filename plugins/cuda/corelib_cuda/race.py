"""Step 14's seeded draw in one pass over the final logits: a Triton kernel that hashes the
contract's noise for each (row key, token id), adds it to the logit and keeps each block's
winner, so the ~20 elementwise torch kernels of ``seeded_gumbel`` and the race's add and argmax
become one read of ``[B, V]`` (plus ``[B, V / BLOCK]`` partial winners, reduced in torch).

The kernel computes the contract's noise with the same operations (``corelib.noise``, bit for
bit up to the logarithm): the 32-bit hash in unsigned arithmetic (the same bits as the signed
wrap-around of the torch form), the uniform ``(top 23 bits + 0.5) / 2**23`` exactly, and
``-log(-log(u))`` through libdevice's ``logf``, the function torch's CUDA ``log`` calls; the
argmax keeps the first of equal scores, as ``torch.argmax`` does. Its first launch on each
device is checked against the torch expression (:func:`choose_race_path`), as the bitmask
kernel's is; where that fails, or off CUDA, the torch expression runs.

The kernel is registered as the custom operation ``corelib_cuda::seeded_race`` (its CPU form
is the torch expression, its meta form gives the shape), so that dispatch-level tools
(``corelib_cuda.traffic``) see it as the one operation it is.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable

import torch
from corelib.noise import seeded_gumbel
from corelib.transfer import upload

from .device import OFF_CUDA, describe, device_guard, path_for

#: Tokens per Triton program: V = 128256 makes 63 partial winners per row.
BLOCK = 2048

Race = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def torch_seeded_race(x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """int64 [B]: ``argmax(x + seeded_gumbel(keys, token ids))`` per row, the reference's
    expression. x float32 [B, V]; keys int32 [B] (``corelib.noise.row_keys``). Not in place."""
    vocab = torch.arange(x.shape[-1], dtype=torch.int32, device=x.device)[None, :]
    return torch.argmax(x + seeded_gumbel(keys[:, None], vocab), dim=-1)


@torch.library.custom_op("corelib_cuda::seeded_race", mutates_args=())
def seeded_race(x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The seeded race as one operation: the Triton kernel on CUDA, the torch expression
    elsewhere. x float32 [B, V] (unit stride along V), keys int32 [B]; int64 [B]."""
    return torch_seeded_race(x, keys)


@seeded_race.register_fake
def _(x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0],), dtype=torch.long)


@seeded_race.register_kernel("cuda")
def _(x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    return _build_triton_race()(x, keys)


@dataclass(frozen=True)
class RacePath:
    """How step 14 draws seeded rows on one device: ``race`` (the checked custom operation,
    or the torch expression) and ``description``: "triton", or "torch (why)"."""

    race: Race
    description: str

    def draw(self, x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """int64 [B] seeded winners of x float32 [B, V] with keys int32 [B]. Not in place."""
        if self.race is torch_seeded_race or x.stride(-1) != 1:
            return torch_seeded_race(x, keys)
        with device_guard(x.device):
            return self.race(x, keys)


def choose_race_path(device: torch.device | str) -> RacePath:
    """The seeded race of ``device``, decided once per device: the Triton kernel on a CUDA
    device where it imports and its first launch picks the torch expression's tokens, else the
    torch expression with the reason. The first call on a CUDA device launches and waits."""
    return path_for(device, lambda d: RacePath(torch_seeded_race, OFF_CUDA.format(d.type)), _cuda_path)


@functools.lru_cache(maxsize=None)
def _cuda_path(device: torch.device) -> RacePath:
    return launch_checked(device, seeded_race)


def launch_checked(device: torch.device, race: Race) -> RacePath:
    """The path ``race`` gives on ``device``: its first launch must pick the torch
    expression's winners on rows of 3000 tokens (blocks, a partial last block, ties of -inf
    rows), else the torch expression, with why."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((6, 3000), generator=gen) * 4
    x[1, 100:] = float("-inf")
    x[2] = float("-inf")
    keys = torch.randint(-2**31, 2**31 - 1, (6,), generator=gen, dtype=torch.int64).to(torch.int32)
    want = torch_seeded_race(x, keys)
    try:
        with device_guard(device):
            got = race(upload(x, device), upload(keys, device)).cpu()
    except Exception as exc:  # no Triton, no C compiler for its launcher, ...
        return RacePath(torch_seeded_race, f"torch (the Triton race failed its first launch: {describe(exc)})")
    if not torch.equal(got, want):
        return RacePath(torch_seeded_race, "torch (the Triton race picked other tokens than the torch expression)")
    return RacePath(race, "triton")


@functools.lru_cache(maxsize=1)
def _build_triton_race() -> Race:
    import triton
    import triton.language as tl
    import triton.language.extra.libdevice  # noqa: F401  (tl.extra.libdevice below)
    # libdevice's logf is what torch's CUDA log computes; Triton's own tl.log is an
    # approximation there. The interpreter has no libdevice.
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"

    @triton.jit
    def race_kernel(x_ptr, keys_ptr, best_ptr, where_ptr, vocab_size, x_row_stride, blocks,
                    BLOCK_SIZE: tl.constexpr, LIBDEVICE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        block = tl.program_id(1)
        ids = block * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        inside = ids < vocab_size
        key = tl.load(keys_ptr + row).to(tl.uint32, bitcast=True)
        # corelib.noise in uint32: key + id * step, mix32, top 23 bits
        h = key + ids.to(tl.uint32) * 0x9E3779B9
        h = h ^ (h >> 16)
        h = h * 0x7FEB352D
        h = h ^ (h >> 15)
        h = h * 0x846CA68B
        h = h ^ (h >> 16)
        u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        if LIBDEVICE:
            noise = -tl.extra.libdevice.log(-tl.extra.libdevice.log(u))
        else:       # Triton's interpreter (tests on CPU tensors): numpy's log
            noise = -tl.log(-tl.log(u))
        x = tl.load(x_ptr + row * x_row_stride + ids, mask=inside, other=float("-inf"))
        score = tl.where(inside, x + noise, float("-inf"))
        best, where = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(best_ptr + row * blocks + block, best)
        tl.store(where_ptr + row * blocks + block, block * BLOCK_SIZE + where)

    def launch(x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        B, V = x.shape
        if B == 0 or V == 0:
            return torch.zeros((B,), dtype=torch.long, device=x.device)
        blocks = triton.cdiv(V, BLOCK)
        best = torch.empty((B, blocks), dtype=torch.float32, device=x.device)
        where = torch.empty((B, blocks), dtype=torch.int32, device=x.device)
        race_kernel[(B, blocks)](x, keys.to(torch.int32).contiguous(), best, where, V, x.stride(0),
                                 blocks, BLOCK_SIZE=BLOCK, LIBDEVICE=not interpreted)
        # the first block holding the row's largest score, then its first index
        return where.gather(1, best.argmax(dim=1, keepdim=True))[:, 0].long()

    return launch


def triton_seeded_race(x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The Triton kernel on any tensors Triton accepts (CUDA, or CPU under
    ``TRITON_INTERPRET=1``); raises when Triton is missing. For tests."""
    return _build_triton_race()(x, keys)
