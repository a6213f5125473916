"""DRY (contract stage 8a) on the device, over a fixed window of each row's history.

The core keeps each row's whole history with its repeat lengths (``corelib.history``); here the
history is a right-aligned window of the last ``H`` tokens, so its tensors never change shape:

- ``history`` int32 ``[n, H]``: the last ``H`` tokens, newest in column ``H - 1``; ``EMPTY``
  (-1) before the row's first token, ``BREAKER`` (-2) where the token is one of the row's
  sequence breakers (a breaker is never penalised, and nothing needs its id afterwards);
- ``match`` int32 ``[n, H]``: the repeat length before each entry (``corelib.history``): how
  many tokens before it equal the history's last tokens;
- ``since`` int32 ``[n]``: tokens since the last breaker (all of them if none).

Appending token ``x`` shifts the history left by one and updates every repeat length in its own
column: the entry now in column ``c`` had ``old_match[c] + 1`` tokens of repeat if the token
before it (the old column ``c``) was ``x``, else 0. O(H) per row, no search.

Breakers stored as ``BREAKER`` never equal an appended token, so a repeat that runs through one
stops counting there; the exact rule caps the repeat at ``since`` anyway, and the two agree
under that cap (a repeat longer than ``since`` contains the suffix's breaker at the same
distance), which is all the penalty reads.

A row sees at most its last ``H`` tokens: the penalty equals the contract's with ``dry_range``
replaced by ``min(dry_range or infinity, H)``.
"""

from __future__ import annotations

from typing import Sequence

import torch
from corelib.history import match_lengths, trailing_run

from .xla import iota

EMPTY = -1
BREAKER = -2
#: The contract's cap on the exponent of ``dry_base``.
MAX_EXPONENT = 30


def initial_window(tokens: Sequence[int], breakers: Sequence[int],
                   window: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A row's window from its whole history (prompt + output), on the host: (int32 ``[H]``
    history, int32 ``[H]`` repeat lengths, tokens since the last breaker). The repeat lengths
    come from the Z-function over the whole history (``corelib.history.match_lengths``)."""
    history = torch.full((window,), EMPTY, dtype=torch.int32)
    match = torch.zeros(window, dtype=torch.int32)
    tail = list(tokens)[-window:]
    if tail:
        stops = set(breakers)
        lengths = match_lengths(list(tokens))[-window:]
        history[window - len(tail):] = torch.tensor(
            [BREAKER if t in stops else t for t in tail], dtype=torch.int32)
        match[window - len(tail):] = torch.tensor(lengths, dtype=torch.int32)
    return history, match, trailing_run(list(tokens), breakers)


def advance(history: torch.Tensor, match: torch.Tensor, since: torch.Tensor,
            breakers: torch.Tensor, token_ids: torch.Tensor,
            live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One appended token per row: the new ``(history, match, since)`` (module docstring).

    history, match int32 ``[n, H]``; since int32 ``[n]``; breakers int32 ``[n, NB]`` (-1 =
    none); token_ids int ``[n]`` (in range where ``live``); live bool ``[n]`` (False: the row
    is left as it is). Not in place; fixed shapes.
    """
    ids = token_ids.to(torch.int32)[:, None]                                 # (n, 1)
    is_breaker = (breakers == ids).any(dim=1)                                # (n,)
    new_match = torch.where(history == ids, match + 1, 0).to(match.dtype)
    entry = torch.where(is_breaker[:, None], BREAKER, ids).to(history.dtype)
    new_history = torch.cat([history[:, 1:], entry], dim=1)
    new_since = torch.where(is_breaker, 0, since + 1).to(since.dtype)
    keep = live[:, None]
    return (torch.where(keep, new_history, history), torch.where(keep, new_match, match),
            torch.where(live, new_since, since))


def penalties(history: torch.Tensor, match: torch.Tensor, since: torch.Tensor,
              multiplier: torch.Tensor, base: torch.Tensor, allowed: torch.Tensor,
              dry_range: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each window entry's penalty on its token: (int64 ``[n, H]`` token ids, float32
    ``[n, H]`` penalties, 0 where the entry is not penalised; its id is then 0).

    Entry ``c`` extends a repeat of ``min(match[c], since, its place in the window)`` tokens;
    multiplier float32 ``[n]`` (0 = off), base float32 ``[n]``, allowed int32 ``[n]``,
    dry_range int32 ``[n]`` (0 = the whole window). O(n H)."""
    H = history.shape[1]
    filled = (history != EMPTY).sum(dim=1, keepdim=True).to(torch.int32)     # (n, 1)
    window = dry_range[:, None]
    span = torch.where(window > 0, torch.minimum(window, filled), filled)
    place = iota(H, torch.int32, history.device) - (H - span)               # (n, H); < 0 outside
    repeat = torch.minimum(torch.minimum(match, place), since[:, None])
    least = allowed[:, None]
    hit = (place >= 0) & (history >= 0) & (repeat >= least) & (multiplier > 0)[:, None]
    exponent = (repeat - least).clamp(min=0, max=MAX_EXPONENT).to(torch.float32)
    penalty = multiplier[:, None] * torch.pow(base[:, None], exponent)
    return torch.where(hit, history, 0).to(torch.int64), torch.where(hit, penalty, 0.0)


def apply(x: torch.Tensor, tokens: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """``x[row, t] -= the largest penalty on t`` for every entry (float32 ``[n, V]`` x; int64
    and float32 ``[n, H]`` entries from ``penalties``; an entry with penalty 0 changes
    nothing). One scatter-min of ``n H`` values into x, the reference's formula: x is an
    intermediate of the step, so XLA scatters into its buffer in place (a fresh zero buffer to
    scatter into and subtract costs a write and a read of ``[n, V]`` more on XLA:CPU). Not in
    place for the caller."""
    return x.scatter_reduce(1, tokens, x.gather(1, tokens) - penalty, reduce="amin")
