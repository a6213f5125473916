"""The contract's seeded noise: a counter-based hash of (seed, child, position, token id).

Every backend must reproduce these functions bit for bit (``docs/seeded-draw.md`` gives the
exact recipe). They use only 32-bit integer multiply, xor, add and shift, which wrap the same
way on CPUs, GPUs and TPUs. Right shifts go through ``torch.bitwise_right_shift`` (torch-xla
2.9 lowers the ``>>`` operator on int32 as a division rounding toward zero, so ``-5 >> 16``
gives 0 there) and are followed by a mask that clears the sign-extended bits.
"""

from __future__ import annotations

from typing import Optional

import torch

# Multipliers of the "lowbias32" integer finaliser, as signed int32 values.
_MIX_MUL_1 = 0x7FEB352D
_MIX_MUL_2 = 0x846CA68B - (1 << 32)
# Fractional digits of pi: keeps the all-zero input (seed 0, child 0, position 0) away from
# mix32's fixed point 0.
_KEY_OFFSET = 0x243F6A88
# 2**32 / golden ratio, odd: token t enters the hash as row_key + t * _TOKEN_STEP.
_TOKEN_STEP = 0x9E3779B9 - (1 << 32)
_UNIFORM_BITS = 23  # (top + 0.5) then needs 24 bits: exact in float32
_UNIFORM_SCALE = 1.0 / (1 << _UNIFORM_BITS)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int32 values: arithmetic shift, then the sign bits masked off."""
    return torch.bitwise_right_shift(x, bits) & ((1 << (32 - bits)) - 1)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """Bijective avalanche mix of int32 values. Shape kept; int32 in, int32 out; not in place."""
    x = x ^ _shift_right(x, 16)
    x = x * _MIX_MUL_1
    x = x ^ _shift_right(x, 15)
    x = x * _MIX_MUL_2
    return x ^ _shift_right(x, 16)


def mix32_(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """``mix32`` in place, for backends that keep their buffers: x (int32, any shape) becomes
    mix32(x), with ``scratch`` (int32, x's shape) holding the shifted copies. Same bits as
    ``mix32``; allocates nothing. Returns x."""
    c = _constants(x.device)
    for shift, mask, multiplier in ((c["16"], c["mask16"], c["mul1"]), (c["15"], c["mask17"], c["mul2"]),
                                    (c["16"], c["mask16"], None)):
        torch.bitwise_right_shift(x, shift, out=scratch).bitwise_and_(mask)
        x.bitwise_xor_(scratch)
        if multiplier is not None:
            x.mul_(multiplier)
    return x


_CONSTANTS: dict = {}


def _constants(device: torch.device) -> dict:
    """0-dim tensors of the in-place forms' constants: an op with a Python number wraps it
    into a tensor on every call (~1 us each), which is most of the cost on small tensors."""
    found = _CONSTANTS.get(device)
    if found is None:
        ints = {"16": 16, "15": 15, "mask16": 0xFFFF, "mask17": 0x1FFFF, "mul1": _MIX_MUL_1,
                "mul2": _MIX_MUL_2, "top": 32 - _UNIFORM_BITS, "mask_top": (1 << _UNIFORM_BITS) - 1}
        found = {name: torch.tensor(v, dtype=torch.int32, device=device) for name, v in ints.items()}
        found["tiny"] = torch.tensor(_UNIFORM_SCALE / 2, dtype=torch.float32, device=device)
        _CONSTANTS[device] = found
    return found


def split_seed(seed: int) -> tuple[int, int]:
    """A seed in [0, 2**63) as its (low, high) 32-bit halves, each as a signed int32 value."""
    lo, hi = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    return _as_int32(lo), _as_int32(hi)


def _as_int32(u: int) -> int:
    return u - (1 << 32) if u >= (1 << 31) else u


def row_keys(seed_lo: torch.Tensor, seed_hi: torch.Tensor, child: torch.Tensor,
             position: torch.Tensor) -> torch.Tensor:
    """One int32 key per row from its seed halves, child index and position.

    All inputs int32 ``[B]``; returns int32 ``[B]``. Not in place.
    """
    return mix32(row_key_prefix(seed_lo, seed_hi, child) ^ position)


def row_key_prefix(seed_lo: torch.Tensor, seed_hi: torch.Tensor, child: torch.Tensor) -> torch.Tensor:
    """The part of :func:`row_keys` that does not depend on the position (int32 ``[B]``), so
    a backend may keep it for a row's life: ``row_keys == mix32(prefix ^ position)``."""
    key = mix32(seed_lo ^ _KEY_OFFSET)
    key = mix32(key ^ seed_hi)
    return mix32(key ^ child)


def uniform_noise(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Uniform floats in (0, 1) for (row key, token id) pairs.

    keys: int32 broadcastable against token_ids (e.g. ``[B, 1]``); token_ids: int32 (e.g.
    ``[B, K]`` candidate ids or ``[1, V]`` for a whole vocabulary). Returns float32 of the
    broadcast shape: ``(top 23 bits of the hash + 0.5) / 2**23``, exact in float32.
    """
    h = mix32(keys + token_ids * _TOKEN_STEP)
    top = _shift_right(h, 32 - _UNIFORM_BITS)
    return (top.to(torch.float32) + 0.5) * _UNIFORM_SCALE


def token_offsets(token_ids: torch.Tensor) -> torch.Tensor:
    """int32, token_ids' shape: each token's share of the hash input (``token_id * step``,
    wrapping). A backend computes it once per vocabulary for :func:`seeded_gumbel_into`."""
    return token_ids.to(torch.int32) * _TOKEN_STEP


def seeded_gumbel_into(out: torch.Tensor, keys: torch.Tensor, offsets: torch.Tensor,
                       scratch: tuple[torch.Tensor, torch.Tensor],
                       logits: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``seeded_gumbel(keys, token_ids)`` written into ``out`` (float32) without allocating:
    ``offsets = token_offsets(token_ids)``, keys broadcastable against them (e.g. ``[B, 1]``
    against ``[1, V]``), ``scratch`` two int32 buffers of out's shape. With ``logits``
    (float32, out's shape) it writes the race's scores ``logits + noise`` instead. Every
    step is exact or the same float32 operation as in :func:`seeded_gumbel`, so the bits
    are the same. Returns out."""
    h, shifted = scratch
    c = _constants(h.device)
    torch.add(keys, offsets, out=h)
    mix32_(h, shifted)
    torch.bitwise_right_shift(h, c["top"], out=h).bitwise_and_(c["mask_top"])
    # Conversion first, then in-place float ops (torch.add(int, 0.5, out=float) goes through
    # a temporary tensor). u = top * 2**-23 + 2**-24 in one op: both steps are exact (top <
    # 2**23), so it equals (top + 0.5) * 2**-23 bit for bit.
    u = torch.add(c["tiny"], out.copy_(h), alpha=_UNIFORM_SCALE, out=out)
    return gumbel_from_uniform_(u, logits)


def gumbel_from_uniform_(u: torch.Tensor, logits: Optional[torch.Tensor] = None) -> torch.Tensor:
    """In place: the uniforms ``u`` (float32, from ``uniform_noise`` or bit-equal to it)
    become their Gumbel noise ``-log(-log(u))``, or with ``logits`` (float32, u's shape) the
    race's scores ``logits + noise``, by the same float32 operations as ``seeded_gumbel``
    (the bits are the same). Returns u."""
    minus_noise = u.log_().neg_().log_()                                   # log(-log(u))
    if logits is None:
        return minus_noise.neg_()
    return torch.sub(logits, minus_noise, out=u)     # logits + noise: negation is exact


def gumbel_from_uniform(u: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise ``-log(-log(u))``; float32 in, float32 out, same shape."""
    return -torch.log(-torch.log(u))


def seeded_gumbel(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel noise of the seeded draw for (row key, token id) pairs; shapes as uniform_noise."""
    return gumbel_from_uniform(uniform_noise(keys, token_ids))


# Salts of the row-uniform streams (fractional digits of e, sqrt(2) and sqrt(3), as signed
# int32): each stream gives one uniform per (seed, child, position), independent of the draw's
# noise.
STREAM_ACCEPT = 0xB7E15162 - (1 << 32)   # speculative verification: the ratio test's uniform
STREAM_XTC = 0x6A09E667                  # stage 13b: XTC's coin
STREAM_BLOCK = 0xBB67AE85 - (1 << 32)    # block verification: the uniform of each prefix's test


def stream_uniform(keys: torch.Tensor, stream: int) -> torch.Tensor:
    """One uniform in (0, 1) per row key on a stream of its own: ``uniform_noise`` of
    ``mix32(key ^ stream)`` at token 0. keys int32 ``[B]`` (``row_keys``); returns float32
    ``[B]``. Not in place."""
    return uniform_noise(mix32(keys ^ stream), torch.zeros_like(keys))
