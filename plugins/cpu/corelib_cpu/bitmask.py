"""Step 3's token bitmask on CPUs: the packed words applied while the logits are copied.

Grammar engines hand over int32 words, bit ``j % 32`` of word ``j // 32`` set for allowed
tokens (``corelib.bitmask``). Unpacking them into a ``[B, V]`` boolean and filling with it costs
several passes (a boolean ``masked_fill`` alone runs ~10x slower than a copy on these CPUs).
Here each byte of a row's words indexes a table of 256 x 8 float32 addends (0 for an allowed
token, -inf for a banned one): one gather of 32 bytes per 8 tokens builds the row's addends in
the cache, and one addition writes the masked row, reading the caller's logits if the row was
not copied yet. A row of -1 words (unconstrained) is only copied.

Adding -inf (instead of overwriting) keeps what step 3's validity check must see: NaN stays
NaN and +inf becomes NaN, so a row with NaN or +inf anywhere is still flagged afterwards.
"""

from __future__ import annotations

import sys

import torch
from corelib.bitmask import unpack_bitmask

NEG_INF = float("-inf")


def _byte_table() -> torch.Tensor:
    """float32 [256, 8]: for byte b, 0 where bit j of b is set, -inf where it is not."""
    bits = torch.bitwise_right_shift(torch.arange(256)[:, None], torch.arange(8)) & 1
    return torch.where(bits.bool(), 0.0, NEG_INF).to(torch.float32)


_TABLE = _byte_table()


def apply_bitmask_rows(src: torch.Tensor, words: torch.Tensor, out: torch.Tensor, workspace) -> torch.Tensor:
    """``out = src`` with the tokens whose bit is 0 set to -inf, row by row. src float32
    [n, V] (the caller's rows or ``out`` itself), words int32 [n, ceil(V / 32)], out float32
    [n, V] (may be src). The byte table's addends for one row live in ``workspace`` buffers
    (a row's worth, so they stay in L2). Returns out."""
    n, V = src.shape
    words = words.contiguous()
    W = words.shape[1]
    if sys.byteorder != "little":       # the byte table assumes byte k holds bits 8k..8k+7
        if out is not src:
            out.copy_(src)
        return out.masked_fill_(~unpack_bitmask(words, V), NEG_INF)
    free = (words == -1).all(dim=1).tolist()
    index = workspace.take("bitmask_index", (4 * W,), torch.long)
    addends = workspace.take("bitmask_addends", (4 * W, 8))
    flat = addends.view(-1)[:V]
    for row in range(n):
        if free[row]:
            if out is not src:
                out[row].copy_(src[row])
            continue
        index.copy_(words[row].view(torch.uint8))          # little-endian: byte k = bits 8k..8k+7
        torch.index_select(_TABLE, 0, index, out=addends)
        torch.add(src[row], flat, out=out[row])
    return out
