"""The reasoning budget's per-row state (contract step 8b), kept incrementally.

Each row that has a ``thinking_budget`` carries three markers: the start marker, the end marker
and the forced sequence f (what step 8b forces once the budget is spent). For each marker m the
row keeps a bit set over its prefixes: bit k is set when the history ends with ``m[:k + 1]``
(the shift-and, or "bitap", matcher). Appending a token t sets bit k + 1 where bit k was set
and ``m[k + 1] == t``, and bit 0 where ``m[0] == t``: one elementwise step per token, fixed
shapes, no search, so the update runs on any device, in a CUDA graph and in an XLA trace.

From the bits:

- a marker occurs (as a contiguous run) ending at the new token when its last bit is set;
- the row is thinking when the last start marker ends after the last end marker; ``count`` is
  the number of tokens after that start marker, -1 when the row is not thinking. A start
  marker resets the count to 0; an end marker sets it to -1;
- f's bits are cleared when a start marker completes, so they describe only the history after
  it: the longest suffix equal to a proper prefix of f is the highest set bit k with
  k + 1 < len(f), and the forced token is ``f[k + 1]`` (``f[0]`` when none is set).

Markers live in one int64 tensor ``[B, 3, L]`` (start, end, forced; -1 padding on the right)
and their bits in one bool tensor of the same shape. :func:`replay` computes the same state on
the host for a whole history (a request joining the batch or resuming), with the same rules.
"""

from __future__ import annotations

from typing import Sequence

import torch

START, END, FORCED = 0, 1, 2
NOT_THINKING = -1
NO_BUDGET = -1


def marker_table(start: Sequence[int], end: Sequence[int], forced: Sequence[int],
                 width: int) -> torch.Tensor:
    """int64 ``[3, width]``: the three markers, left-aligned, -1 after each."""
    table = torch.full((3, width), -1, dtype=torch.long)
    for i, marker in enumerate((start, end, forced)):
        table[i, : len(marker)] = torch.tensor(list(marker), dtype=torch.long)
    return table


def replay(history: Sequence[int], start: Sequence[int], end: Sequence[int],
           forced: Sequence[int]) -> tuple[list[int], int]:
    """The state after ``history`` (host, O(len(history))): (the three markers' bit sets as
    Python ints, bit k = the history ends with ``marker[:k + 1]``; the think count, -1 when not
    thinking). Same rules as :func:`advance`."""
    markers = (list(start), list(end), list(forced))
    bits, count = [0, 0, 0], NOT_THINKING
    for token in history:
        for i, marker in enumerate(markers):
            grown = (bits[i] << 1) | 1
            bits[i] = sum(1 << k for k, m in enumerate(marker) if m == token and grown >> k & 1)
        start_done = bool(markers[START]) and bits[START] >> (len(markers[START]) - 1) & 1
        end_done = bool(markers[END]) and bits[END] >> (len(markers[END]) - 1) & 1
        if start_done:
            bits[FORCED] = 0
        if end_done:
            count = NOT_THINKING
        elif start_done:
            count = 0
        elif count >= 0:
            count += 1
    return bits, count


def bits_tensor(bits: Sequence[int], width: int) -> torch.Tensor:
    """bool ``[3, width]`` of :func:`replay`'s bit sets."""
    return torch.tensor([[bool(b >> k & 1) for k in range(width)] for b in bits], dtype=torch.bool)


def advance(markers: torch.Tensor, match: torch.Tensor, count: torch.Tensor,
            token_ids: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One appended token per row; returns the new ``(match, count)``.

    markers int64 ``[n, 3, L]`` (-1 padding), match bool ``[n, 3, L]``, count int32 ``[n]``
    (-1 = not thinking), token_ids int64 ``[n]``, live bool ``[n]`` (False: the row is left as
    it is). Rows without a budget have all -1 markers and stay as they are. Not in place;
    traceable (fixed shapes)."""
    grown = torch.cat([torch.ones_like(match[..., :1]), match[..., :-1]], dim=-1)
    new = grown & (markers == token_ids[:, None, None])
    done = completed(markers, new)                                          # (n, 3)
    start_done, end_done = done[:, START], done[:, END]
    kept = torch.ones_like(done)
    new = new & torch.stack([kept[:, START], kept[:, END], ~start_done], dim=1)[..., None]
    thinking = count >= 0
    new_count = torch.where(end_done, NOT_THINKING,
                            torch.where(start_done, 0, torch.where(thinking, count + 1, NOT_THINKING)))
    return (torch.where(live[:, None, None], new, match),
            torch.where(live, new_count.to(count.dtype), count))


def completed(markers: torch.Tensor, match: torch.Tensor) -> torch.Tensor:
    """bool ``[n, 3]``: each marker's last bit is set (the history ends with the whole marker);
    False for an empty marker."""
    length = (markers >= 0).sum(dim=-1)                                     # (n, 3)
    last = match.gather(-1, (length - 1).clamp(min=0)[..., None])[..., 0]
    return last & (length > 0)


def forced_tokens(markers: torch.Tensor, match: torch.Tensor, count: torch.Tensor,
                  budget: torch.Tensor) -> torch.Tensor:
    """Step 8b's forced token per row: int64 ``[n]``, ``f[j]`` for a thinking row whose count
    reached its budget (j = the longest suffix of the history after the start marker that is
    a proper prefix of f), -1 elsewhere. budget int32 ``[n]``, -1 = none. Not in place."""
    forced = markers[:, FORCED]                                             # (n, L)
    length = (forced >= 0).sum(dim=-1, keepdim=True)
    prefix = torch.arange(1, forced.shape[-1] + 1, device=forced.device)[None, :]
    matched = torch.where(match[:, FORCED] & (prefix < length), prefix, 0).amax(dim=-1)
    token = forced.gather(1, matched[:, None])[:, 0]
    due = (budget >= 0) & (count >= budget)
    return torch.where(due, token, -1)
