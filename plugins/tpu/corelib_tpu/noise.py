"""The contract's seeded noise (``corelib.noise``), bit for bit, with shifts XLA gets right.

torch-xla 2.9 lowers ``int32_tensor >> n`` (``aten::__rshift__``) to a division rounding toward
zero, so ``-5 >> 16`` gives 0 on XLA instead of -1 and ``corelib.noise.mix32`` computes other
values there. ``torch.bitwise_right_shift`` lowers to XLA's arithmetic shift and equals
``>>`` on every other device; this module is ``corelib.noise`` with that one change, using
the core's constants. ``tests/test_noise_xla.py`` checks it against the core bit for bit.
"""

from __future__ import annotations

import torch
from corelib import noise as core


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int32 values (arithmetic shift, sign bits masked off)."""
    return torch.bitwise_right_shift(x, bits) & ((1 << (32 - bits)) - 1)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """``corelib.noise.mix32``: int32 in, int32 out, same shape; not in place."""
    x = x ^ _shift_right(x, 16)
    x = x * core._MIX_MUL_1
    x = x ^ _shift_right(x, 15)
    x = x * core._MIX_MUL_2
    return x ^ _shift_right(x, 16)


def row_keys(seed_lo: torch.Tensor, seed_hi: torch.Tensor, child: torch.Tensor,
             position: torch.Tensor) -> torch.Tensor:
    """``corelib.noise.row_keys``: int32 ``[B]`` inputs, int32 ``[B]`` keys; not in place."""
    key = mix32(seed_lo ^ core._KEY_OFFSET)
    key = mix32(key ^ seed_hi)
    key = mix32(key ^ child)
    return mix32(key ^ position)


def uniform_noise(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """``corelib.noise.uniform_noise``: int32 keys ``[B, 1]`` and token ids (``[1, V]`` or
    ``[B, K]``) to float32 uniforms in (0, 1) of the broadcast shape; not in place."""
    h = mix32(keys + token_ids * core._TOKEN_STEP)
    top = _shift_right(h, 32 - core._UNIFORM_BITS)
    return (top.to(torch.float32) + 0.5) * core._UNIFORM_SCALE


def seeded_gumbel(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """``corelib.noise.seeded_gumbel``: Gumbel noise of the draw, shapes as ``uniform_noise``."""
    return core.gumbel_from_uniform(uniform_noise(keys, token_ids))
