"""Token bitmasks inside the step graph: structured output's (part of step 3) and the kept
sets the step returns (``SamplingParams.return_kept``).

The caller's packed words (``corelib.bitmask``: bit ``j % 32`` of word ``j // 32``, 1 =
allowed) enter the graph as an int32 ``[B, W]`` input; each logit reads its own bit with a
shift and an and, so XLA fuses the unpacking into the elementwise pass that applies steps 3-5:
no ``[B, V]`` boolean exists outside that fusion (``docs/tpu.md`` shows the fused HLO). Rows
without a mask carry words of -1.
"""

from __future__ import annotations

import torch
from corelib.bitmask import BITS

from .xla import iota

NEG_INF = float("-inf")


def allowed_bits(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 ``[B, V]`` expression, 1 where the token's bit is set: words int32 ``[B, W]``
    broadcast over the 32 bit positions, shifted and masked, flattened to ``W * 32`` tokens
    and cut to ``V``. Meant to be consumed elementwise (XLA fuses it)."""
    B, W = words.shape
    shifts = iota(BITS, torch.int32, words.device)[None]                       # (1, 1, 32)
    bits = torch.bitwise_right_shift(words[:, :, None], shifts) & 1             # (B, W, 32)
    return bits.reshape(B, W * BITS)[:, :vocab_size]


def apply_words(x: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """Step 3 with a token bitmask: x float32 ``[B, V]``, words int32 ``[B, ceil(V / 32)]``
    (-1 = unconstrained). Adds -inf where the bit is 0, so NaN and +inf logits stay non-finite
    for the valid-row check (``TpuSampler.any_token_left``). Not in place."""
    return x + torch.where(allowed_bits(words, x.shape[-1]) == 0, NEG_INF, 0.0)


def pack_words(keep: torch.Tensor) -> torch.Tensor:
    """int32 ``[B, ceil(V / 32)]`` words of bool ``keep`` ``[B, V]`` in the layout above (bits
    for ids >= V are 0): the core's ``pack_kept``, with the bit weights made from the cached
    iota, so that it can run inside a conditional's branch (which reads no other tensor).
    Each word is the sum of its distinct bit weights (bit 31 weighs -2**31), which is their
    bitwise or; XLA fuses the weighting into the sum. Not in place."""
    B, V = keep.shape
    W = -(-V // BITS)
    bits = keep.to(torch.int32)
    if W * BITS != V:
        bits = torch.nn.functional.pad(bits, (0, W * BITS - V))
    shifts = iota(BITS, torch.int32, keep.device)                              # (1, 32)
    weights = torch.where(shifts == BITS - 1, -(2**31), torch.bitwise_left_shift(1, shifts))
    return (bits.view(B, W, BITS) * weights).sum(dim=-1, dtype=torch.int32)
