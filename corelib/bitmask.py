"""Packed token bitmasks: the int32 format grammar engines (xgrammar, llguidance) fill.

Token ``j`` is allowed when bit ``j % 32`` (least significant first) of word ``j // 32`` is 1;
a word of -1 allows its 32 tokens. A row needs ``ceil(V / 32)`` words; bits for ids >= V in
the last word are ignored.
"""

from __future__ import annotations

import torch

__all__ = ["bitmask_width", "pack_bitmask", "pack_kept", "token_words", "unpack_bitmask"]

BITS = 32


def bitmask_width(vocab_size: int) -> int:
    """Words per row: ``ceil(vocab_size / 32)``."""
    return (vocab_size + BITS - 1) // BITS


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool ``[..., V]``, True for allowed tokens, from int32 words ``[..., ceil(V / 32)]``.
    Not in place (allocates the boolean tensor; fast backends apply the words directly)."""
    shifts = torch.arange(BITS, dtype=torch.int32, device=words.device)
    bits = torch.bitwise_right_shift(words[..., None], shifts) & 1        # (..., W, 32)
    return bits.flatten(-2)[..., :vocab_size].to(torch.bool)


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., ceil(V / 32)]`` words from bool ``allowed`` ``[..., V]`` (the inverse of
    ``unpack_bitmask``; tokens past V in the last word are set, as grammar engines leave
    them). For tests and engines that build masks from token lists."""
    V = allowed.shape[-1]
    width = bitmask_width(V)
    padded = torch.ones((*allowed.shape[:-1], width * BITS), dtype=torch.int64, device=allowed.device)
    padded[..., :V] = allowed.to(torch.int64)
    weights = torch.bitwise_left_shift(torch.ones(BITS, dtype=torch.int64, device=allowed.device),
                                       torch.arange(BITS, device=allowed.device))
    words = (padded.view(*allowed.shape[:-1], width, BITS) * weights).sum(dim=-1)
    # Values in [0, 2**32): wrap to the signed int32 with the same bits.
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_kept(keep: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., ceil(V / 32)]`` words from bool ``keep`` ``[..., V]``, bits for ids >= V
    0: the layout of ``out.kept`` (``SamplingParams.return_kept``). Two passes over ``keep``
    (bool times the bit weights, then each word's int32 sum of its distinct weights, which is
    its bitwise or), the weights made by device ops: no host data to upload, so it runs without
    a host sync, captures in CUDA graphs and traces on XLA. Not in place."""
    V = keep.shape[-1]
    width = bitmask_width(V)
    if width * BITS != V:
        keep = torch.cat([keep, keep.new_zeros((*keep.shape[:-1], width * BITS - V))], dim=-1)
    return (keep.view(*keep.shape[:-1], width, BITS) * bit_weights(keep.device)).sum(dim=-1, dtype=torch.int32)


def bit_weights(device: torch.device) -> torch.Tensor:
    """int32 [32]: bit j's value in a signed word (bit 31 weighs -2**31), made on ``device``."""
    return torch.bitwise_left_shift(torch.ones(BITS, dtype=torch.int32, device=device),
                                    torch.arange(BITS, dtype=torch.int32, device=device))


def token_words(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 ``[B, ceil(V / 32)]``: each row's token (int64 ``[B]``) alone as a packed set (a
    greedy row's kept set); an id outside [0, V) sets no bit. O(B W): no pass over the
    vocabulary. Not in place."""
    width = bitmask_width(vocab_size)
    inside = (token_ids >= 0) & (token_ids < vocab_size)
    word = torch.where(inside, token_ids // BITS, -1)
    bit = torch.bitwise_left_shift(torch.ones_like(token_ids, dtype=torch.int32),
                                   (token_ids % BITS).to(torch.int32))
    column = torch.arange(width, device=token_ids.device)[None, :]
    return torch.where(column == word[:, None], bit[:, None], 0).to(torch.int32)
