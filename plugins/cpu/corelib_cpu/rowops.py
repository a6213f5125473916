"""Row-wise selections faster than torch's generic kernels on CPUs, with the same results.

``torch.topk`` copies every row into (value, index) pairs before selecting, and
``torch.argmax`` is a scalar loop; both cost several times a vectorised pass. A row's k
largest values lie in the k groups (of G consecutive tokens) with the largest maxima, and
its first maximum in the first group that reaches the row's maximum: one vectorised max per
group, then work on k * G tokens. Shapes: ``n`` rows, ``V`` vocabulary.
"""

from __future__ import annotations

from typing import Optional

import torch
from corelib.ranking import top_entries

from . import kernels

#: Tokens per group: large groups make the per-group maxima cheap, small ones the gather.
GROUP = 128
#: Up to this many rows, ``top_values`` runs its group search in one compiled call (where
#: numba is): at B = 1 the torch path's eight operator calls are most of the step; with more
#: rows torch's calls serve them all at once.
KERNEL_ROWS = 2
#: Up to this many elements, ``first_argmax`` is torch.argmax itself.
ARGMAX_ELEMENTS = 1 << 16
_COLUMNS = torch.arange(GROUP)


def group_maxima(x: torch.Tensor, group: int = GROUP, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float32 [n, ceil(V / group)]: the maximum of each group of ``group`` consecutive
    tokens of x float32 [n, V] (the last group may be shorter). NaN propagates. ``out``:
    float32 [n, V // group] to write them into, for V a multiple of ``group`` only."""
    n, V = x.shape
    full = V // group
    if out is not None:
        return torch.amax(x.reshape(n, full, group), dim=-1, out=out)
    maxima = x[:, : full * group].reshape(n, full, group).amax(dim=-1)
    if full * group < V:
        maxima = torch.cat([maxima, x[:, full * group:].amax(dim=-1, keepdim=True)], dim=1)
    return maxima


def group_columns(groups: torch.Tensor, V: int, group: int = GROUP) -> torch.Tensor:
    """int64 [n, g * group]: the token ids of the given groups (int64 [n, g]), clamped to
    V - 1 past the end of a short last group (callers mask those columns)."""
    cols = groups[:, :, None] * group + (_COLUMNS if group == GROUP else torch.arange(group))
    return cols.reshape(groups.shape[0], -1).clamp_(max=V - 1)


def top_values(x: torch.Tensor, width: int, maxima: Optional[torch.Tensor] = None,
               compiled: bool = False):
    """The ``width`` largest values of each row of x float32 [n, V], descending, with their
    ids (int64 [n, width]) and ``floor`` float32 [n]: no token outside the groups searched
    exceeds it (a tie with ``floor`` may lie outside; -inf when every group was searched).
    ``maxima``: x's :func:`group_maxima`, when the caller has them.

    The values are torch.topk's; among equal values the ids may come in another order.
    ``compiled``: blocks of at most ``KERNEL_ROWS`` rows search in one compiled call, whose
    ids among equal values (which of them, at the last place) differ from this torch path's:
    only for callers to whom they are alike (the candidates of top-k, which race and cut by
    value), never for the top-N log-probabilities, whose ids must not depend on the block."""
    n, V = x.shape
    if not searches_groups(V, width):
        values, ids = torch.topk(x, min(width, V), dim=-1)
        return values, ids, torch.full((n,), float("-inf"))
    maxima = group_maxima(x) if maxima is None else maxima
    if compiled and n <= KERNEL_ROWS:
        found = kernels.top_group_values(x, maxima, width, GROUP)
        if found is not None:
            return found
    group_top, groups = torch.topk(maxima, width, dim=-1)                  # (n, width)
    cols = group_columns(groups, V)
    picked = x.gather(1, cols)
    if V % GROUP:                          # a short last group: hide its clamped repeats
        repeat = torch.arange(cols.shape[1]) % GROUP >= (V % GROUP)
        last = groups.repeat_interleave(GROUP, dim=1) == maxima.shape[1] - 1
        picked = picked.masked_fill(repeat & last, float("-inf"))
    values, at = torch.topk(picked, width, dim=-1)
    return values, cols.gather(1, at), group_top[:, -1]


def top_logprobs(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 15's top-N in the contract's order: the ``width`` (<= V) largest values of each
    row of x float32 [n, V], descending, and their ids (int64 [n, width]), among equal values
    the lowest id first, so the ids never depend on the block or the path
    (``kernels.top_and_rank`` keeps this order). A NaN (a flagged row's) ranks as +inf does,
    ties with it in id order, and is returned as it is; every token (``width`` = V) is the
    stable descending sort, NaN first. The values are torch.topk's. Not in place.

    Through the group maxima where :func:`searches_groups`: the groups searched are the
    ``width`` largest maxima, among equal maxima the lowest groups; a value tied at the
    ``width``-th place outside them lies in a group of maximum equal to it and of a higher
    index than every such group searched, each of which holds a tie of lower ids, so the
    lowest ids among the ties are all searched."""
    n, V = x.shape
    if width >= V:
        return torch.sort(x, dim=-1, descending=True, stable=True)
    search = searches_groups(V, width)
    maxima = group_maxima(x) if search else x.amax(dim=-1)
    if bool(torch.isnan(maxima).any()):
        _, ids = top_logprobs(torch.where(torch.isnan(x), float("inf"), x), width)
        return x.gather(1, ids), ids
    if not search:
        return _first_largest(x, width)
    _, groups = _first_largest(maxima, width)
    cols = group_columns(groups.sort(dim=-1).values, V)            # ids ascending
    picked = x.gather(1, cols)
    if V % GROUP:                  # a short last group (searched last): hide its clamped repeats
        picked = picked.masked_fill(cols.diff(dim=-1, prepend=cols[:, :1] - 1) == 0, float("-inf"))
    values, at = _first_largest(picked, width)
    return values, cols.gather(1, at)


def _first_largest(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``width`` (< L) largest values of each row of x float32 [n, L] holding no NaN,
    descending, and their positions, among equal values the lowest position first: the
    core's ``ranking.top_entries``' answer, which it returns where ties at the ``width``-th
    place reach past the set one ``torch.topk`` found.

    Why not ``top_entries`` always: this is the CPU's fast path for the common row. The core
    avoids host syncs (it serves every backend), so it always makes its passes over the row
    (NaN test, where, comparisons, two running sums, a scatter over L); here one topk and a
    host check of the ties decide, and rows without ties past the set need only the topk
    and a sort of the ``width``. Measured through :func:`top_logprobs` at V = 128256, one
    thread: B = 8, N = 5, 0.35 ms against 0.65 with ``top_entries`` always; B = 32, N = 20,
    2.1 against 3.1 ms."""
    floor = torch.topk(x, width, dim=-1)
    if bool(((x >= floor.values[:, -1:]).sum(dim=-1) > width).any()):
        return top_entries(x, width)       # ties past the set found: the core's running count
    # positions ascending, so a stable sort by value puts the lowest first among equals
    at = floor.indices.sort(dim=-1).values
    values, order = torch.sort(x.gather(1, at), dim=-1, descending=True, stable=True)
    return values, at.gather(1, order)


def searches_groups(V: int, width: int) -> bool:
    """Whether :func:`top_values` finds ``width`` values of a V-token row through its group
    maxima (else ``torch.topk`` of the row: as few groups as values wanted, or a small row)."""
    return -(-V // GROUP) > width and V >= 4 * GROUP


def first_argmax(x: torch.Tensor, maxima: Optional[torch.Tensor] = None,
                 top: Optional[torch.Tensor] = None, rows: Optional[torch.Tensor] = None,
                 arrays: Optional[tuple] = None, out: Optional[tuple] = None) -> torch.Tensor:
    """int64 [n]: the lowest index of each row's maximum (``torch.argmax``'s answer) for x
    float32 [n, V] (``maxima``: its :func:`group_maxima`, when the caller has them; ``top``:
    float32 [n, 1], the rows' maxima when the caller knows them and they hold no NaN). Rows
    holding a NaN go to torch.argmax (which returns the NaN). Small tensors (at most
    ``ARGMAX_ELEMENTS``) go to torch.argmax too: its one call beats the group search's dozen.

    ``rows``: int64 [n], the rows are ``x[rows]`` (x float32 [m, V], contiguous; ``maxima``
    and ``top`` are then the n rows'), read where they are. ``arrays``: (maxima, top) as
    numpy views (top's float32 [n]) when the caller has both, for the compiled search, and
    ``out`` a new int64 [n] tensor with its numpy view for its ids (``Workspace.fresh``)."""
    V = x.shape[1]
    if V < 4 * GROUP or x.numel() <= ARGMAX_ELEMENTS:
        ids = torch.argmax(x, dim=-1)
        return ids if rows is None else ids.index_select(0, rows)
    if maxima is None:
        maxima = group_maxima(x) if rows is None else group_maxima(x).index_select(0, rows)
    if top is None:
        top = maxima.amax(dim=-1, keepdim=True)
        if bool(torch.isnan(top).any()):
            ids = torch.argmax(x, dim=-1)
            return ids if rows is None else ids.index_select(0, rows)
    if rows is None and x.shape[0] <= KERNEL_ROWS:     # a few rows: one compiled call
        found = kernels.first_max_at(x, maxima, top, GROUP, arrays, out)
        if found is not None:
            return found
    group = (maxima == top).to(torch.uint8).argmax(dim=-1, keepdim=True)   # first such group
    cols = group_columns(group, V)
    values = x.gather(1, cols) if rows is None else x.reshape(-1)[rows[:, None] * V + cols]
    inside = (values == top).to(torch.uint8).argmax(dim=-1, keepdim=True)
    return cols.gather(1, inside)[:, 0]


def count_at_least(x: torch.Tensor, value: torch.Tensor,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """int64 [n]: how many entries of each row of x float32 [n, V] are >= value float32
    [n, 1] (NaN entries never count): the reference's ``(x >= value).sum(dim=-1)``. One
    compiled pass where numba runs (``kernels.count_at_least``); else sign arithmetic instead
    of a boolean tensor (``out``: a float32 [n, V] buffer for it), rows of an infinite value
    by the comparison itself. Small tensors (at most ``ARGMAX_ELEMENTS``) compare and sum: two
    operator calls instead of six, the same counts."""
    if x.numel() <= ARGMAX_ELEMENTS:
        return (x >= value).sum(dim=-1)
    counted = kernels.count_at_least(x, value)
    if counted is not None:
        return counted
    if not bool(torch.isfinite(value).all()):
        # an infinite value: inf - inf is NaN below, where x >= value counts the equal entries
        return (x >= value).sum(dim=-1)
    steps = torch.sub(x, value, out=out).sign_().add_(1.0).clamp_(0.0, 1.0).nan_to_num_(0.0)
    return steps.sum(dim=-1).to(torch.long)


#: A 0-dim True, made once, read only (callers combine it into new tensors): the flags of a
#: check the host has settled for every row or left to a later check (``finite_rows``, the
#: greedy ``drawn_is_finite``). With :func:`all_true` the marks :func:`known_true` reads.
TRUE = torch.tensor(True)
_ALL_TRUE: dict = {}


def all_true(n: int) -> torch.Tensor:
    """bool [n] all True, made once per n (read only: callers combine it into new tensors).
    Also a mark: a step's flags that are this tensor are known on the host to be all true."""
    out = _ALL_TRUE.get(n)
    if out is None:
        out = _ALL_TRUE[n] = torch.ones(n, dtype=torch.bool)
    return out


def known_true(flags: torch.Tensor) -> bool:
    """Whether ``flags`` is one of the shared all-true marks (:data:`TRUE`, ``all_true(n)``):
    an identity test, no operator call."""
    return flags is TRUE or (flags.dim() == 1 and flags is _ALL_TRUE.get(flags.shape[0]))


def is_finite(x: torch.Tensor) -> torch.Tensor:
    """bool, x's shape: neither NaN nor +-inf (``torch.isfinite``'s answer). ``x - x`` is 0
    for finite values and NaN otherwise: two operator calls where torch.isfinite makes
    four, which is what counts on the few-element tensors of a step."""
    return (x - x) == 0
