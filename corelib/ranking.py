"""Step 15's order of a top-N list: best first, equal values by increasing token id.

``torch.topk`` leaves the order of equal values to the kernel (on the CPU it differs between
rows of one call), so two backends, or one backend's two paths, could list different ids for
the same log-probabilities. The contract fixes one order and this is the reference's
implementation of it, without a host sync and with one ``topk`` over the vocabulary.
"""

from __future__ import annotations

import torch


def top_entries(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n`` (1 <= n <= V) largest values of each row of x float32 ``[B, V]``, descending,
    among equal values the lowest id first: (float32 ``[B, n]`` values, int64 ``[B, n]`` ids).
    NaN counts as larger than every number, as in ``torch.topk`` and ``torch.sort`` (a flagged
    row's), and equal to +inf here: a row holding either lists them first, in id order. Not
    in place.

    Which entries: those above the n-th largest value, then the lowest ids equal to it (a
    running count of the ties). Their ids come out ascending from their running count, and a
    stable sort of those n values puts equal values in that order."""
    B, V = x.shape
    if n >= V:
        values, ids = torch.sort(x, dim=-1, descending=True, stable=True)
        return values, ids
    nan = torch.isnan(x)
    keyed = torch.where(nan, torch.inf, x)          # NaN first, and comparable
    boundary = torch.topk(keyed, n, dim=-1).values[:, -1:]                     # (B, 1)
    above = keyed > boundary
    tied = keyed == boundary
    # counts as int64 before the running sums: XLA keeps a bool cumsum bool
    room = n - above.to(torch.long).sum(dim=-1, keepdim=True)                  # ties to take
    chosen = above | (tied & (tied.to(torch.long).cumsum(dim=-1) <= room))     # n per row
    place = torch.where(chosen, chosen.to(torch.long).cumsum(dim=-1) - 1, n)   # n: the spill column
    ids = torch.zeros((B, n + 1), dtype=torch.long, device=x.device)
    ids.scatter_(1, place, torch.arange(V, device=x.device).expand(B, V))
    ids = ids[:, :n]                                                           # ascending
    order = torch.sort(keyed.gather(1, ids), dim=-1, descending=True, stable=True).indices
    ids = ids.gather(1, order)
    return x.gather(1, ids), ids
