"""Repeat lengths for DRY (contract stage 8a), kept incrementally per row.

For a history ``h`` of ``m`` tokens, ``match[i]`` (``0 <= i < m``) is the largest ``l <= i``
such that the ``l`` tokens before position ``i`` equal the last ``l`` tokens of ``h``: had the
history continued like its earlier occurrence, ``h[i]`` would come next after a repeat of
length ``match[i]``. DRY penalises token ``h[i]`` by that length.

Appending a token ``x`` changes every entry, but by one rule: the new ``match[i]`` is
``match[i - 1] + 1`` where ``h[i - 1] == x`` and 0 elsewhere (a repeat of the new suffix must
end with ``x``). So one append costs O(m) elementwise work per row, with no search and no
vocabulary-sized pass; a request joining the batch computes its array once, with the
Z-function of the reversed history (also O(m)).
"""

from __future__ import annotations

from typing import Sequence

import torch


def match_lengths(history: Sequence[int]) -> list[int]:
    """``match`` for a whole history (host, O(m)): ``match[i] = Z(reversed h)[m - i]``, where
    ``Z[k]`` is the longest common prefix of the reversed history and its suffix from ``k``."""
    r = list(reversed(history))
    m = len(r)
    if m == 0:
        return []
    z = [0] * m
    left = right = 0
    for k in range(1, m):
        if k < right:
            z[k] = min(right - k, z[k - left])
        while k + z[k] < m and r[z[k]] == r[k + z[k]]:
            z[k] += 1
        if k + z[k] > right:
            left, right = k, k + z[k]
    return [0] + [z[m - i] for i in range(1, m)]


def trailing_run(history: Sequence[int], breakers: Sequence[int]) -> int:
    """Tokens at the end of ``history`` after its last sequence breaker (all of them if none)."""
    stop = set(breakers)
    run = 0
    for token in reversed(history):
        if token in stop:
            break
        run += 1
    return run


def advance_matches(history: torch.Tensor, match: torch.Tensor, length: torch.Tensor,
                    since_breaker: torch.Tensor, breakers: torch.Tensor, token_ids: torch.Tensor,
                    live: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One appended token per row; returns the new ``(history, match, length, since_breaker)``.

    history int64 ``[n, H]`` (first ``length`` entries real, -1 after), match int32 ``[n, H]``,
    length int32 ``[n]``, since_breaker int32 ``[n]`` (trailing non-breaker tokens), breakers
    int64 ``[n, NB]`` (-1 = none), token_ids int64 ``[n]``, live bool ``[n]`` (False: row left as
    it is; ``length < H`` must hold where True). Not in place; traceable (fixed shapes)."""
    ids = token_ids[:, None]
    extended = torch.where(history == ids, match + 1, 0).to(match.dtype)      # (n, H)
    new_match = torch.cat([torch.zeros_like(match[:, :1]), extended[:, :-1]], dim=1)
    columns = torch.arange(history.shape[1], device=history.device)[None, :]
    new_history = torch.where(columns == length.to(torch.long)[:, None], ids, history)
    is_breaker = (breakers == ids).any(dim=1)
    new_since = torch.where(is_breaker, 0, since_breaker + 1).to(since_breaker.dtype)
    keep = live[:, None]
    return (torch.where(keep, new_history, history), torch.where(keep, new_match, match),
            torch.where(live, length + 1, length), torch.where(live, new_since, since_breaker))
