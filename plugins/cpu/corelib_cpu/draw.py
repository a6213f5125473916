"""Step 14 without noise for every token of every row.

- Candidate rows (top-k): a Gumbel race over the W candidates only. Seeded rows use the
  contract's noise for the candidates' ids, so ``argmax(value + noise)`` is the reference's
  token (every token outside the candidates is -inf there and cannot win).
- Whole rows, unseeded: one uniform per row through the inverse CDF, located with per-block
  sums (two passes over the row: softmax, or the last filter's probabilities, and the block
  sums).
- Whole rows, seeded: the reference's race over the row (the contract fixes the noise of every
  kept token, so every kept token's noise is computed).

Shapes: ``n`` rows, ``V`` vocabulary, ``W`` candidates. Nothing here modifies its inputs.
"""

from __future__ import annotations

from typing import Optional

import torch
from corelib.noise import seeded_gumbel

from .rowops import first_argmax

# Tokens per block of the inverse-CDF search: the second search reads one block per row.
CDF_BLOCK = 256
_TINY = torch.finfo(torch.float32).tiny


def draw_seeded_candidates(values: torch.Tensor, ids: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """int64 [n]: the reference's seeded token when only the candidates can win.

    values float32 [n, W] (-inf = dropped), ids int64 [n, W] distinct per row, keys int32 [n]
    (``corelib.noise.row_keys``). Ties of ``value + noise`` go to the lowest id, as the
    reference's argmax over the vocabulary does."""
    scores = values + seeded_gumbel(keys[:, None], ids.to(torch.int32))
    best = scores.amax(dim=-1, keepdim=True)
    beyond = torch.iinfo(torch.long).max
    return torch.where(scores == best, ids, beyond).amin(dim=-1)


def draw_unseeded_candidates(values: torch.Tensor, ids: torch.Tensor,
                             generator: Optional[torch.Generator]) -> torch.Tensor:
    """int64 [n]: a Gumbel race over the candidates with ``generator``. values float32 [n, W]
    (-inf = dropped), ids int64 [n, W]."""
    u = torch.rand(values.shape, generator=generator).clamp_min_(_TINY)
    winner = torch.argmax(values - torch.log(-torch.log(u)), dim=-1, keepdim=True)
    return ids.gather(1, winner)[:, 0]


def draw_seeded_rows(x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """int64 [n]: ``argmax(x + noise)`` over whole rows, the reference's computation. x float32
    [n, V] (-inf = dropped), keys int32 [n]."""
    vocab = torch.arange(x.shape[-1], dtype=torch.int32)[None, :]
    return first_argmax(x + seeded_gumbel(keys[:, None], vocab))


def draw_by_inverse_cdf(x: torch.Tensor, generator: Optional[torch.Generator],
                        out: Optional[torch.Tensor] = None):
    """One token per row drawn from softmax(x), x float32 [n, V] (-inf = dropped), with one
    uniform per row. Returns ``(token ids int64 [n], ok bool [n])`` (see draw_from_weights).

    The weights are torch's softmax: its exp is the fastest torch offers here, and the
    normalisation is free (only ratios matter). ``out``: a float32 [n, V] buffer for them."""
    weights = torch.softmax(x, dim=-1) if out is None else torch.softmax(x, dim=-1, out=out)
    return draw_from_weights(weights, generator)


def draw_from_weights(weights: torch.Tensor, generator: Optional[torch.Generator]):
    """One token per row with probability proportional to weights float32 [n, V] (>= 0).

    The weights are summed per block of ``CDF_BLOCK`` tokens; a uniform picks a block by the
    blocks' cumulative mass (float64), then a token inside it. Only tokens with positive
    weight can be returned. Returns ``(token ids int64 [n], ok bool [n])``: ok is False for
    a row whose total weight is not a positive finite number (NaN from float32 overflow
    upstream); its id is then arbitrary and the caller must flag the row."""
    n, V = weights.shape
    blocks = block_sums(weights)                                           # (n, nb) float64
    cum = blocks.cumsum(dim=-1)
    total = cum[:, -1]
    ok = torch.isfinite(total) & (total > 0)
    target = torch.rand(n, dtype=torch.float64, generator=generator) * total
    block = torch.searchsorted(cum, target[:, None], right=True)
    # u * total can round up to total itself: stay on the last block with mass.
    block = torch.minimum(block, last_positive(blocks)).clamp_(min=0)
    before = torch.where(block > 0, cum.gather(1, (block - 1).clamp(min=0)), 0.0)
    cols = block * CDF_BLOCK + torch.arange(CDF_BLOCK)[None, :]            # (n, CDF_BLOCK)
    local = weights.gather(1, cols.clamp(max=V - 1)).double()
    local = torch.where(cols < V, local, 0.0)
    offset = torch.searchsorted(local.cumsum(dim=-1), (target[:, None] - before), right=True)
    offset = nearest_positive(local, offset.clamp_(max=CDF_BLOCK - 1))
    return (block * CDF_BLOCK + offset)[:, 0].clamp_(max=V - 1), ok


def block_sums(weights: torch.Tensor) -> torch.Tensor:
    """float64 [n, ceil(V / CDF_BLOCK)]: sums of consecutive blocks of weights float32 [n, V].

    Summed in float32 (torch's cascade sum: relative error ~1e-7 for 256 terms, far below
    what any test of the draw could see; a float64 sum would first copy every weight)."""
    n, V = weights.shape
    full = V // CDF_BLOCK
    sums = weights[:, : full * CDF_BLOCK].reshape(n, full, CDF_BLOCK).sum(dim=-1)
    if full * CDF_BLOCK < V:
        sums = torch.cat([sums, weights[:, full * CDF_BLOCK:].sum(dim=-1, keepdim=True)], dim=1)
    return sums.double()


def last_positive(values: torch.Tensor) -> torch.Tensor:
    """int64 [n, 1]: the last column of values [n, C] holding a positive value."""
    cols = torch.arange(values.shape[1])[None, :]
    return torch.where(values > 0, cols, -1).amax(dim=-1, keepdim=True)


def nearest_positive(local: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """offset int64 [n, 1] moved to a column of local float64 [n, C] holding a positive value.

    Rounding between the block sums and the in-block cumulative sums can land one step past
    the block's last positive weight (or on a masked token right after it); step back to the
    nearest positive column at or before it, else the first one after."""
    hit = local.gather(1, offset) > 0
    if bool(hit.all()):
        return offset
    cols = torch.arange(local.shape[1])[None, :]
    positive = local > 0
    before = torch.where(positive & (cols <= offset), cols, -1).amax(dim=-1, keepdim=True)
    after = torch.where(positive, cols, local.shape[1]).amin(dim=-1, keepdim=True)
    fixed = torch.where(before >= 0, before, after.clamp(max=local.shape[1] - 1))
    return torch.where(hit, offset, fixed)
