"""Step 14 without noise for every token of every row.

- Candidate rows (top-k): a Gumbel race over the W candidates only. Seeded rows use the
  contract's noise for the candidates' ids, so the winner is the reference's token (every
  token outside the candidates is -inf there and cannot win).
- Whole rows, unseeded, with no probability cut pending (``UNSEEDED_RACE_MIN_VOCAB`` tokens
  or more): where numba runs, the race of seeded rows below (its compiled search for the few
  tokens that can win) with keys the generator draws for the step, one per row
  (``race_unseeded_rows``); the same Gumbel-max draw, with the seeded noise's 23-bit
  uniforms. Otherwise, and for rows of a pending cut, one uniform per row through the
  inverse CDF, located with per-block sums of the row's weights (the last filter's
  probabilities, or ``exp(x - max)``); a small vocabulary (``SMALL_VOCAB``) searches one
  cumulative sum of every weight instead.
- Whole rows, seeded: the reference's race ``argmax(x + noise)``. Where numba runs, the
  compiled search of ``kernels.seeded_race_candidates`` finds the few tokens that can win
  (most rows: one), without the noise of the others, and they race as candidate rows do.
  Otherwise (and for rows it declines) the 23-bit hash bounds the noise
  (:data:`NOISE_SPREAD`), so a token whose logit lies more than that spread below the row's
  best cannot win: groups of tokens entirely below it are skipped, and the noise is
  computed, in place and in cache-sized chunks, only for the rest (its hash by the compiled
  kernel of ``kernels`` where numba is installed, the same bits as torch's). Rows of a
  probability cut (min-p, top-p) race with the cut's weights instead of a masked copy of x:
  when the cut keeps few tokens (``KEPT_LIST_SHARE``), over a list of them, as candidate
  rows race; otherwise the groups without a kept token are skipped, and rows that cannot
  skip most groups race without the cut first when it keeps most of the mass, again only
  where it drops the winner.

Shapes: ``n`` rows, ``V`` vocabulary, ``W`` candidates. Nothing here modifies its inputs.
"""

from __future__ import annotations

from typing import Optional

import torch
from corelib.noise import gumbel_from_uniform, gumbel_from_uniform_, seeded_gumbel_into, token_offsets

from . import kernels
from .rowops import GROUP, first_argmax, group_maxima, is_finite

# Tokens per block of the inverse-CDF search: the second search reads one block per row.
CDF_BLOCK = 256
_TINY = torch.finfo(torch.float32).tiny
_INF = torch.tensor(float("inf"))
_NEG_INF = torch.tensor(float("-inf"))
_LOG2E = 1.4426950408889634
_FUSED_LIMIT = 64.0
_LONG_MAX = torch.iinfo(torch.long).max
# The seeded noise takes 2**23 values, from g((0.5) / 2**23) to g((2**23 - 0.5) / 2**23), g the
# Gumbel transform: about -2.81 to 16.64. Measured with the same float32 functions, widened
# by 1e-3 for the last bit of the logarithms.
_EXTREMES = gumbel_from_uniform(torch.tensor([0.5, 2.0**23 - 0.5]) / 2.0**23).tolist()
#: Largest possible difference between two tokens' seeded noise values.
NOISE_SPREAD = (_EXTREMES[1] - _EXTREMES[0]) + 1e-3
# Relative slack on the pruning bound: far above float32 rounding of the scores and the cut.
_PRUNE_SLACK = 2.0 ** -16
# Rows race without their cut first when its weights (probabilities) keep at least this mass
# on average: the race's winner is dropped with probability 1 - mass, and racing a row again
# costs about twice what the cut's mask adds to one race.
_KEPT_MASS_FIRST = 0.6
#: Rows of a cut that keeps at most 1/KEPT_LIST_SHARE of the vocabulary (or GROUP tokens)
#: race over a list of their kept tokens, as candidate rows do.
KEPT_LIST_SHARE = 32
#: Seeded whole rows race over at most this many candidates, the tokens whose score can be
#: the largest (``kernels.seeded_race_candidates``); a row with more (ties of huge logits)
#: races over every token.
RACE_CANDIDATES = 64
#: Seeded whole rows of a smaller vocabulary race over every token without looking for the
#: groups that can win (at most 7 groups: skipping half of them saves less than the search).
PRUNE_MIN_VOCAB = 8 * GROUP
#: Unseeded whole rows of a smaller vocabulary draw through the inverse CDF, not the race:
#: measured at V = 4096, 32 rows take 0.47 ms by the race and 0.36 ms by the inverse CDF; at
#: V = 8192, 0.72 ms and 1.07 ms (one row: the race is faster from V = 2048).
UNSEEDED_RACE_MIN_VOCAB = 64 * GROUP


# ---------------------------------------------------------------------- candidate rows
def race_seeded_candidates(values: torch.Tensor, ids: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """int64 [n, 1]: the column of the reference's seeded winner when only the candidates can
    win. values float32 [n, W] (-inf = dropped), ids int64 [n, W] distinct per row, keys int32
    [n] (``corelib.noise.row_keys``). Ties of ``value + noise`` go to the lowest id, as the
    reference's argmax over the vocabulary does."""
    scores = seeded_scores(values, keys, ids)
    best = scores.amax(dim=-1, keepdim=True)
    return torch.where(scores == best, ids, _LONG_MAX).argmin(dim=-1, keepdim=True)


def seeded_scores(values: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """float32 [n, W]: ``values + noise`` of the contract for each row's own token ids (values
    float32 [n, W], keys int32 [n], ids int64 [n, W]), the hash by the compiled kernel where
    it runs, else by torch: the same bits."""
    scores = torch.empty(values.shape)
    if kernels.seeded_uniforms_into(scores, keys, ids):
        return gumbel_from_uniform_(scores, values)
    scratch = (torch.empty(ids.shape, dtype=torch.int32), torch.empty(ids.shape, dtype=torch.int32))
    return seeded_gumbel_into(scores, keys[:, None], token_offsets(ids), scratch, values)


def candidate_winners(values: torch.Tensor, ids: torch.Tensor, keys: Optional[torch.Tensor],
                      generator: Optional[torch.Generator], arrays: Optional[tuple] = None,
                      workspace=None, keys_array=None):
    """(ids int64 [n], finite bool [n], every): the winning token of every candidate row,
    whether its value is finite and whether every one is (read in the kernel call: no
    operator call), every row seeded or none, by one compiled call; None where the compiled
    path does not run (nothing drawn). Both tensors are new (the caller may hand them on).

    - Seeded (``keys`` int32 [n]): the winner of :func:`race_seeded_candidates`, the
      reference's token. Settled from float64 estimates of the scores where they leave one
      possible winner in every row (``kernels.seeded_candidates_settled``, one call);
      otherwise the noise takes four calls (the hash in one compiled call, then ``log``,
      ``neg`` and ``log`` in place: torch's logarithms, whose bits the reference's race
      reads) and ``kernels.seeded_race_winners`` subtracts it and picks the winner.
    - Unseeded (``keys`` None): a Gumbel race as :func:`race_unseeded_candidates`'s, its
      noise made inside ``kernels.unseeded_race_winners`` from one 64-bit key that
      ``generator`` draws for the step: one operator call where the torch noise is four (a
      B = 1 step's time is mostly such calls after a model's forward pass has evicted their
      code). The same distribution, not the same uniforms as the torch path.

    ``arrays``: the numpy views of (values, ids) when the caller has them
    (``Candidates.arrays``), and ``workspace`` then lends the noise's and the key's buffers
    (pairs) and the new ids and flags (``Workspace.fresh``), so the step converts no tensor
    for the race; ``keys_array``: the numpy view of ``keys`` when the caller keeps one."""
    if not kernels.wanted():
        return None
    lent = arrays is not None and workspace is not None
    outputs = None
    if lent:
        n = values.shape[0]
        outputs = (workspace.fresh("race_ids", n, torch.long), workspace.fresh("race_finite", n, torch.bool))
    if keys is None:
        if lent:
            key, key_array = workspace.pair("race_key", (1,), torch.long)
        else:
            key = torch.empty(1, dtype=torch.long)
            key_array = key.numpy()
        key.random_(generator=generator)
        return kernels.unseeded_race_winners(values, ids, key_array, arrays if lent else None, outputs)
    if keys_array is None:
        keys_array = keys.contiguous().numpy()
    settled = kernels.seeded_candidates_settled(values, ids, keys_array, arrays if lent else None, outputs)
    if settled is not None:
        return settled
    if lent:
        minus_noise, noise_array = workspace.pair("race_scores", tuple(values.shape))
    else:
        minus_noise = torch.empty(values.shape)
    if not kernels.seeded_uniforms_into(minus_noise, keys, ids,
                                        *((arrays[1], noise_array) if lent else (None, None)),
                                        keys_array):
        return None                        # the kernels failed to load: no race kernel either
    minus_noise.log_().neg_().log_()
    return kernels.seeded_race_winners(values, minus_noise, ids,
                                       (arrays[0], noise_array, arrays[1]) if lent else None, outputs)


def race_unseeded_candidates(values: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """int64 [n, 1]: the winning column of a Gumbel race over values float32 [n, W] (-inf =
    dropped) with ``generator``."""
    u = torch.rand(values.shape, generator=generator).clamp_min_(_TINY)
    return (values - u.log_().neg_().log_()).argmax(dim=-1, keepdim=True)


# ---------------------------------------------------------------------- whole rows, seeded
def draw_seeded_rows(x: torch.Tensor, keys: torch.Tensor, offsets: Optional[torch.Tensor] = None,
                     workspace=None, chunk_elements: int = 1 << 17,
                     kept: Optional[torch.Tensor] = None):
    """``argmax(x + noise)`` over whole rows, the reference's token. x float32 [n, V] (-inf =
    dropped), keys int32 [n]; ``offsets``: ``token_offsets(arange(V))`` (made here when
    None); ``workspace`` lends the chunk buffers; ``chunk_elements``: logits per chunk of
    the full race (its buffers stay in the cache); ``kept``: float32 [n, V] weights of a
    probability cut not yet applied to x, whose zeros drop tokens too (a cut: a token is
    dropped only when every token of a lower logit in its row is).

    Returns ``(token ids int64 [n], ok bool [n])``, ok False where the winner's score is not
    finite (every token dropped, or +inf from float32 overflow upstream). Without ``kept``,
    the compiled search for the tokens that can win answers when it runs (module
    docstring); otherwise, and for the rows it declines: rows where at most
    half of the groups of ``GROUP`` tokens can hold the winner race over those groups only
    (see the module docstring), and rows keeping few tokens over a list of them. The others
    race over every token; with ``kept`` holding most of the mass, first without the cut: a
    winner with a positive weight also wins among the kept tokens (the lowest id of the best
    score over a superset), and only the rows whose winner is dropped race again with the
    cut. Nothing is modified."""
    n, V = x.shape
    if kept is None:
        won = race_few_winners(x, keys, workspace)
        if won is not None:
            return won
    if kept is not None:
        listed = kept_ids(kept, max(GROUP, V // KEPT_LIST_SHARE))
        if listed is not None:               # few kept tokens: race over them alone
            ids, present = listed
            values = x.gather(1, ids).masked_fill_(present.logical_not_(), float("-inf"))
            column = race_seeded_candidates(values, ids, keys)
            return ids.gather(1, column)[:, 0], is_finite(values.gather(1, column)[:, 0])
    if V >= PRUNE_MIN_VOCAB:    # below it, the search for live groups costs more than it saves
        maxima = group_maxima(x)
        if kept is not None:
            # a cut keeps the largest logits, so a group holding a kept token has its largest
            # logit kept: these are the maxima of x masked by the cut, without the mask (the
            # softmax's rounding could break the order only between logits ulps apart, far
            # inside the bound's slack)
            maxima = torch.where(group_maxima(kept) > 0, maxima, _NEG_INF)
        top = maxima.amax(dim=-1, keepdim=True)
        cut = top - NOISE_SPREAD - (top.abs() + NOISE_SPREAD) * _PRUNE_SLACK
        live = maxima >= cut                                              # (n, groups)
        most = int(live.sum(dim=-1).max())
        if 0 < most <= maxima.shape[1] // 2:
            return race_live_groups(x, keys, live, most, kept)
    if offsets is None:
        offsets = token_offsets(torch.arange(V))
    if kept is None or float(kept.sum(dim=-1).mean()) < _KEPT_MASS_FIRST:
        return race_whole_rows(x, keys, offsets, workspace, chunk_elements, kept)
    ids, ok = race_whole_rows(x, keys, offsets, workspace, chunk_elements)
    dropped = (kept.gather(1, ids[:, None])[:, 0] > 0).logical_not_()
    if bool(dropped.any()):
        redo = dropped.nonzero()[:, 0]
        ids[redo], ok[redo] = race_whole_rows(x[redo], keys[redo], offsets, workspace,
                                              chunk_elements, kept[redo])
    return ids, ok


def race_few_winners(x: torch.Tensor, keys: torch.Tensor, workspace=None, keys_array=None):
    """The race of whole rows x float32 [n, V] with keys int32 [n] over the few tokens that
    can win it (``kernels.seeded_race_candidates``): (token ids int64 [n], ok bool [n]), the
    reference's tokens; None where the compiled path does not run or declines a row. When
    every row has one such token (most rows), it is the winner: no noise is computed; else
    the candidates race as candidate rows do. ``keys_array``: keys' numpy view when the
    caller has it (converted once here otherwise, for both calls)."""
    if keys_array is None:
        keys_array = keys.contiguous().numpy()
    found = kernels.seeded_race_candidates(x, keys, GROUP, RACE_CANDIDATES, workspace, keys_array)
    if found is None:
        return None
    values, ids = found
    if values.shape[1] == 1:        # finite: the search declines NaN, +inf and empty rows
        return ids[:, 0].clone(), torch.ones(ids.shape[0], dtype=torch.bool)
    won = candidate_winners(values, ids, keys, None, keys_array=keys_array)
    return None if won is None else (won[0], won[1])


def race_unseeded_rows(x: torch.Tensor, generator: Optional[torch.Generator], workspace=None):
    """Step 14 for unseeded whole rows x float32 [n, V] (their final logits, -inf = dropped)
    as seeded rows draw: keys int32 [n] from ``generator``, then ``race_few_winners``. A
    Gumbel-max draw, so each token wins with its softmax probability up to the 23-bit
    uniforms of the contract's noise: a token more than :data:`NOISE_SPREAD` below its row's
    best never wins (an exponential race over float32 uniforms cuts the same tail). Returns
    ``(token ids int64 [n], ok bool [n])``, ok False where the winner is not finite; None
    below ``UNSEEDED_RACE_MIN_VOCAB`` (the inverse CDF costs less there), where the compiled
    path does not run (nothing drawn from the generator), or where it declines a
    row (a NaN or +inf logit, a row of -inf only, ties of more than ``RACE_CANDIDATES``
    tokens): the caller draws those rows its own way."""
    n, V = x.shape
    if V < UNSEEDED_RACE_MIN_VOCAB or not kernels.wanted():
        return None
    if workspace is not None:
        keys, keys_array = workspace.pair("unseeded_row_keys", (n,), torch.int32)
    else:
        keys = torch.empty(n, dtype=torch.int32)
        keys_array = keys.numpy()
    keys.random_(generator=generator)
    return race_few_winners(x, keys, workspace, keys_array)


def kept_ids(kept: torch.Tensor, cap: int):
    """(ids int64 [n, m], present bool [n, m]): each row's tokens of positive weight in
    kept float32 [n, V], ascending, padded with V - 1 (present False) to the longest row's
    count m (at least 1); None when a row keeps more than ``cap`` tokens (NaN weights are not
    positive)."""
    n, V = kept.shape
    listed = kernels.positive_ids(kept, cap)
    if listed is False:
        return None
    if listed is None:                       # torch: count, then place the nonzero entries
        positive = kept > 0
        counts = positive.sum(dim=-1)
        most = int(counts.max())
        if most > cap:
            return None
        width = max(1, most)
        rows, cols = positive.nonzero().unbind(1)
        starts = counts.cumsum(0) - counts
        ids = torch.full((n, width), V - 1, dtype=torch.long)
        ids[rows, torch.arange(rows.shape[0]) - starts[rows]] = cols
    else:
        ids, counts = listed
        ids = ids[:, :max(1, int(counts.max()))]
    present = torch.arange(ids.shape[1]) < counts[:, None]
    return ids, present


def race_whole_rows(x: torch.Tensor, keys: torch.Tensor, offsets: torch.Tensor, workspace=None,
                    chunk_elements: int = 1 << 17, kept: Optional[torch.Tensor] = None):
    """``draw_seeded_rows`` over every token of every row, in chunks of about
    ``chunk_elements`` logits, with ``kept``'s zeros masked in each chunk's scores."""
    n, V = x.shape
    rows = max(1, chunk_elements // V)
    one_chunk = 0 < n <= rows
    if not one_chunk:
        ids = torch.empty(n, dtype=torch.long)
        best = torch.empty(n)
    for r0 in range(0, n, rows):
        r1 = min(r0 + rows, n)
        shape = (r1 - r0, V)
        scores = _take(workspace, "noise_scores", shape, torch.float32)
        scratch = (_take(workspace, "noise_hash", shape, torch.int32),
                   _take(workspace, "noise_shift", shape, torch.int32))
        if kernels.seeded_uniforms_into(scores, keys[r0:r1]):
            gumbel_from_uniform_(scores, x[r0:r1])
        else:
            seeded_gumbel_into(scores, keys[r0:r1, None], offsets[None, :], scratch, x[r0:r1])
        if kept is not None:
            # sign(w) - 0.5 is -0.5 where w == 0, 0.5 where w > 0: copysign and min drop the
            # former (the hash's buffer is free again by now)
            mask = torch.sign(kept[r0:r1], out=scratch[0].view(torch.float32)).sub_(0.5)
            torch.minimum(scores, torch.copysign(_INF, mask, out=mask), out=scores)
        winner = first_argmax(scores)
        if one_chunk:                                   # one chunk: its results are the rows'
            return winner, is_finite(scores.gather(1, winner[:, None])[:, 0])
        ids[r0:r1], best[r0:r1] = winner, scores.gather(1, winner[:, None])[:, 0]
    return ids, is_finite(best)


def race_live_groups(x: torch.Tensor, keys: torch.Tensor, live: torch.Tensor, most: int,
                     kept: Optional[torch.Tensor] = None):
    """``draw_seeded_rows`` over the live groups only (bool [n, groups], at most ``most`` per
    row). Their tokens are gathered in ascending id order, so the first maximum is the
    lowest id among ties, as over the whole row."""
    n, V = x.shape
    groups = live.shape[1]
    order = torch.where(live, torch.arange(groups), groups).sort(dim=-1).values[:, :most]
    raw = (order[:, :, None] * GROUP + torch.arange(GROUP)).reshape(n, -1)   # (n, most * GROUP)
    cols = raw.clamp(max=V - 1)
    dead = raw >= V                                                          # padding, short group
    if kept is not None:
        dead |= kept.gather(1, cols) == 0
    values = x.gather(1, cols).masked_fill_(dead, float("-inf"))
    scores = seeded_scores(values, keys, cols)
    winner = scores.argmax(dim=-1, keepdim=True)
    return cols.gather(1, winner)[:, 0], is_finite(scores.gather(1, winner)[:, 0])


def _take(workspace, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    if workspace is None:
        return torch.empty(shape, dtype=dtype)
    return workspace.take(name, shape, dtype)


# ---------------------------------------------------------------------- whole rows, unseeded
def exp_weights(x: torch.Tensor, out: Optional[torch.Tensor] = None,
                top: Optional[torch.Tensor] = None, sparse: bool = False) -> torch.Tensor:
    """float32 [n, V]: ``exp(x - max)`` per row, the unnormalised softmax of x (only ratios
    matter to the draw, and it costs one exp per logit against softmax's two passes more).
    ``top``: x's row maxima (float32 [n, 1]) when the caller has them. Not in place
    (``out``: a float32 [n, V] buffer for the result).

    ``sparse``: many tokens may lie far below the maximum (dropped in bulk to -inf, or a row
    sharpened by a temperature below 1). torch's exp then takes a slow path for every group
    of lanes holding an input whose result underflows (~15x the time of the whole pass when
    half a row is dropped); exp2 does not, so such rows are computed as
    ``exp2((x - max) log2(e))``, one operation slower on ordinary rows. Its weights differ
    from exp's in the last bits (relative 1e-5 at most), which no draw can see."""
    top = x.amax(dim=-1, keepdim=True) if top is None else top
    out = torch.empty_like(x) if out is None else out
    if not sparse:
        return torch.sub(x, top, out=out).exp_()
    if float(top.abs().max()) <= _FUSED_LIMIT:
        # log2(e) x - log2(e) max in one operation: its rounding error, relative to the
        # exponent, stays below 1e-5 for the tokens that hold any mass when |max| <= 64
        return torch.add(top * -_LOG2E, x, alpha=_LOG2E, out=out).exp2_()
    return torch.sub(x, top, out=out).mul_(_LOG2E).exp2_()


def draw_by_inverse_cdf(x: torch.Tensor, generator: Optional[torch.Generator],
                        out: Optional[torch.Tensor] = None):
    """One token per row drawn from softmax(x), x float32 [n, V] (-inf = dropped), with one
    uniform per row. Returns ``(token ids int64 [n], ok bool [n])`` (see draw_from_weights).
    ``out``: a float32 [n, V] buffer for the weights."""
    return draw_from_weights(exp_weights(x, out), generator)


def draw_from_weights(weights: torch.Tensor, generator: Optional[torch.Generator], workspace=None):
    """One token per row with probability proportional to weights float32 [n, V] (>= 0).

    The weights are summed per block of ``CDF_BLOCK`` tokens; a uniform picks a block by the
    blocks' cumulative mass (float64), then a token inside it. Targets are kept strictly
    below each total, so the first cumulative sum above a target always grows there: only
    tokens with positive weight can be returned. Returns ``(token ids int64 [n], ok bool
    [n])``: ok is False for a row whose total weight is not a positive finite number (NaN
    from float32 overflow upstream); its id is then arbitrary and the caller must flag it.

    A vocabulary of at most ``SMALL_VOCAB`` tokens is searched in one level (the cumulative
    sum of every weight, float64): the same uniform and rule, in a third of the operator
    calls, which is what a step costs at such sizes (``workspace`` lends its float64 buffer:
    a fresh one of a large batch costs more in page faults than the sum itself)."""
    n, V = weights.shape
    if V <= SMALL_VOCAB:
        return _draw_one_level(weights, generator, workspace)
    blocks = block_sums(weights)                                           # (n, nb) float64
    cum = blocks.cumsum(dim=-1)
    total = cum[:, -1:]
    ok = ((total > 0) & (total < _INF64))[:, 0]                 # False for NaN
    target = torch.minimum(torch.rand((n, 1), dtype=torch.float64, generator=generator) * total,
                           torch.nextafter(total, _ZERO64))
    block = torch.searchsorted(cum, target, right=True).clamp_(max=blocks.shape[1] - 1)
    # The mass before the block, within rounding (the clamps below absorb it).
    rest = target - (cum.gather(1, block) - blocks.gather(1, block))
    cols = block * CDF_BLOCK + _CDF_COLUMNS                                 # (n, CDF_BLOCK)
    local = weights.gather(1, cols.clamp(max=V - 1)).double()
    if V % CDF_BLOCK:                              # a short last block: no repeats of token V-1
        local.masked_fill_(cols >= V, 0.0)
    inside = local.cumsum(dim=-1)
    rest = torch.minimum(rest.clamp_(min=0.0), torch.nextafter(inside[:, -1:], _ZERO64))
    offset = torch.searchsorted(inside, rest, right=True).clamp_(max=CDF_BLOCK - 1)
    return (cols.gather(1, offset))[:, 0].clamp_(max=V - 1), ok


def _draw_one_level(weights: torch.Tensor, generator: Optional[torch.Generator], workspace=None):
    """``draw_from_weights`` for a small vocabulary: one searchsorted over the float64
    cumulative sum of the row's weights, the target kept strictly below the total."""
    n, V = weights.shape
    u = torch.rand((n, 1), dtype=torch.float64, generator=generator)
    drawn = kernels.inverse_cdf(weights, u)                  # the same ids, in one call
    if drawn is not None:
        return drawn
    cum = torch.cumsum(weights, dim=-1, dtype=torch.float64,
                       out=_take(workspace, "cdf", (n, V), torch.float64))          # (n, V)
    total = cum[:, -1:]
    ok = ((total > 0) & (total < _INF64))[:, 0]                 # False for NaN
    target = torch.minimum(u * total, torch.nextafter(total, _ZERO64))
    return torch.searchsorted(cum, target, right=True)[:, 0].clamp_(max=V - 1), ok


#: Vocabularies up to this size draw with one level of search (``draw_from_weights``).
SMALL_VOCAB = 4 * CDF_BLOCK
_ZERO64 = torch.zeros((), dtype=torch.float64)
_INF64 = torch.tensor(float("inf"), dtype=torch.float64)
_CDF_COLUMNS = torch.arange(CDF_BLOCK)[None, :]


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
