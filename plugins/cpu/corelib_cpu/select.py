"""Steps 12-13 without sorting the vocabulary: top-k from group maxima (``rowops``), top-p
on candidates from their own softmax under a proven error bound, and top-p on whole rows by a
radix select over the bits of the probabilities.

Every function keeps exactly the reference's set (``corelib.Sampler.apply_top_k`` /
``apply_top_p``): the same k-th value with ties kept, the same softmax probabilities, the same
float64 nucleus sums. Shapes: ``n`` rows, ``V`` vocabulary, ``W`` candidate columns.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import kernels
from .rowops import GROUP, KERNEL_ROWS, group_maxima, searches_groups, top_values

NEG_INF = float("-inf")

# A positive float32's bit pattern (read as int32) orders like its value, so its top 12 bits
# (sign, exponent, 3 mantissa bits) name a bucket, the next 10 a sub-bucket, the last 10 a
# value. Few first-pass buckets keep the per-bucket work (cumulative sums, the search) small;
# the bucket holding the threshold spans 1/8 of an octave, a few percent of a flat row.
_KEY_SHIFT = 20
_SUB_BITS = 10
#: Workspace name of the int32 [n, V] scratch buffer (free again once a function returns).
SCRATCH = "scratch32"
# Probabilities are at most 1.0 (bits 0x3F800000): buckets past its one stay empty. NaN rows
# are clamped into the last bucket, have no mass below it and go to the sort.
_PROB_BUCKETS = (0x3F800000 >> _KEY_SHIFT) + 1
# Buckets from here up hold values >= 2**-29: float32 multiples of 2**-52, so float64 sums of
# them below 2 are exact, in any order (the reference's sequential cumsum included).
_EXACT_BUCKET = (127 - 29) << (23 - _KEY_SHIFT)
# A nucleus whose mass ends this close above top_p may depend on the reference's rounding of
# tiny tail values; such rows take the exact sort (they only occur by construction).
_MARGIN = 2.0 ** -30


def top_k_candidates(x: torch.Tensor, k: torch.Tensor, width: int,
                     temperature: Optional[torch.Tensor] = None, maxima: Optional[torch.Tensor] = None):
    """Step 12 as candidates. x float32 [n, V] (dropped tokens -inf), k int64 [n] in [1, V],
    ``width`` >= max(k) candidate columns (a few more catch ties at the k-th value).
    ``temperature`` float32 [n, 1]: x is step 10's input, and the candidates are divided by
    it (x / T is non-decreasing in x, so its k largest are the k largest of x divided, ties
    made by the division included: they are judged after it). ``maxima``: x's group maxima.

    Returns ``(values, ids, complete)``: values float32 [n, W] descending, tokens below the
    k-th largest set to -inf; ids int64 [n, W]; complete bool [n], False where tokens tied
    with the k-th value may lie beyond the W columns or the groups searched (the caller then
    masks the row in full with :func:`mask_below`). Does not modify x."""
    n, V = x.shape
    if n <= KERNEL_ROWS and searches_groups(V, width):
        # a block of few rows: the group search and the cut below in one compiled call
        maxima = group_maxima(x) if maxima is None else maxima
        fused = kernels.group_top_k(x, maxima, width, GROUP, k, temperature)
        if fused is not None:
            return fused
    values, ids, floor = top_values(x, width, maxima, compiled=True)    # (n, W), descending
    compiled = kernels.top_k_of_candidates(values, k, temperature, floor, width >= V)
    if compiled is not None:                                # the same bits, in one call
        return compiled[0], ids, compiled[1]
    floor = floor[:, None]
    if temperature is not None:
        values, floor = values / temperature, floor / temperature
    kth = values.gather(1, (k - 1)[:, None])                            # (n, 1)
    complete = ((values[:, -1:] < kth) & (floor < kth)) | (kth == NEG_INF)
    if width >= V:
        complete = torch.ones_like(complete)
    return values.masked_fill(values < kth, NEG_INF), ids, complete[:, 0]


# Min-p on candidates: a candidate whose log-distance below the row's largest logit differs
# from -ln(min_p) by more than this is judged by that distance alone. The reference's float32
# rounding (x - max, exp, the normalisation, min_p * max p) moves that distance by under 4e-6
# (distances up to 46, min_p >= 1e-20: ``plan.MIN_P_ON_CANDIDATES``).
MIN_P_MARGIN = 2.0 ** -13


def min_p_of_candidates(values: torch.Tensor, min_p: torch.Tensor):
    """Step 11 on candidate rows from their logits alone. values float32 [n, W]: step 10's
    logits of each row's largest tokens, descending (-inf = dropped; the row's largest
    first), min_p float32 [n] (0 keeps all, else at least ``plan.MIN_P_ON_CANDIDATES``).
    Returns ``(values, settled bool [n])``: a new tensor with the tokens min-p drops at -inf,
    and whether each row is the reference's for sure.

    The reference keeps p >= min_p * max p, which in exact arithmetic is x - max >= ln(min_p):
    no sum over the row is needed. Rows where some finite candidate lies within
    ``MIN_P_MARGIN`` of that threshold, or whose largest logit is not finite, are not
    settled (the caller takes the reference's softmax for them). Tokens outside the
    candidates are below the k-th largest, dropped by step 12 whatever min-p says."""
    compiled = kernels.min_p_of_candidates(values, min_p, MIN_P_MARGIN)
    if compiled is not None:                                # the same decisions, one call
        return compiled
    top = values[:, :1].double()
    log_min_p = torch.where(min_p > 0, min_p, 1.0).double().log()[:, None]
    distance = values.double() - top - log_min_p
    finite = values > NEG_INF
    settled = ((distance.abs() > MIN_P_MARGIN) | ~finite).all(dim=-1) & torch.isfinite(top[:, 0])
    drop = (distance < 0) & (min_p > 0)[:, None]
    return values.masked_fill(drop, NEG_INF), settled


def kth_largest(values: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """float32 [n, 1]: the k-th largest of each row of descending ``values`` [n, W]."""
    return values.gather(1, (k - 1)[:, None])


def mask_below(x: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """x[row, t] = -inf where x < threshold[row] (float32 [n, 1]). In place; returns x."""
    return x.masked_fill_(x < threshold, NEG_INF)


def top_p_candidates(values: torch.Tensor, probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Step 13 on candidates. values float32 [n, W] (-inf = dropped), probs float32 [n, W]:
    the reference's softmax of the masked row at the candidates (0 where dropped), top_p
    float32 [n] (1 keeps all). Returns new values with tokens outside the nucleus at -inf.

    The reference sums the sorted probabilities of the whole row; beyond the candidates they
    are 0, which changes neither the sums nor (see ``last`` below) the threshold."""
    keep, _ = nucleus_of_candidates(values, probs, top_p)
    return values.masked_fill(~keep, NEG_INF)


def nucleus_of_candidates(values: torch.Tensor, probs: torch.Tensor, top_p: torch.Tensor):
    """(keep bool [n, W], margin float64 [n]) for candidate rows: the reference's nucleus
    rule on ``probs`` float32 [n, W]; ``margin`` is how far the decisive sums and the
    threshold's neighbours sit from flipping the decision (see :func:`top_p_candidates_fast`)."""
    ordered, order = torch.sort(probs, dim=-1, descending=True)
    ordered64 = ordered.double()
    mass_before = ordered64.cumsum(dim=-1) - ordered64
    p64 = top_p.double()[:, None]
    in_nucleus = mass_before < p64
    # When every candidate, zeros included, is in the nucleus, the reference's last position
    # is one of its zeros too: the threshold is 0 in both.
    last = in_nucleus.sum(dim=-1, keepdim=True).clamp(min=1) - 1
    threshold = ordered.gather(1, last)
    keep = (probs >= threshold) | (top_p >= 1.0)[:, None]
    # Distance of the nucleus sums from top_p, and of other values from the threshold
    # (relative), ignoring tokens whose logit equals the threshold token's (equal in any sum).
    sums_gap = (mass_before - p64).abs().amin(dim=-1)
    threshold_value = values.gather(1, order.gather(1, last))
    others = values != threshold_value
    t64 = threshold.double()
    value_gap = torch.where(others, (probs.double() - t64).abs() / t64.clamp(min=1e-300),
                            float("inf")).amin(dim=-1)
    margin = torch.minimum(sums_gap, value_gap)
    # Relative bounds mean nothing for subnormal probabilities: never settle on those.
    tiny = (t64[:, 0] > 0) & (t64[:, 0] < 2.0 ** -100)
    return keep, torch.where(tiny, 0.0, margin)


# Typical-p on candidates: the reference's float32 log-softmax, entropy and probabilities
# over the whole row move a token's log p and the entropy by a few 1e-6 (log p down to
# ``TYPICAL_LOWEST``), its masses by as much; a row is settled by the candidates alone when
# every decision is farther than these from flipping.
TYPICAL_MASS_MARGIN = 2.0 ** -14


def typical_score_margin(W: int) -> float:
    """How far (relative to 1 + H + |log p|) a candidate's score must lie from the threshold
    token's for a row of W candidates to be settled. Every token outside the candidates is
    -inf in the reference's row (p = 0: it adds nothing to a sum), so its float32 sums have at
    most W nonzero terms. Its log p = x - max - log(sum) is off by a few ulps of |x - max| +
    log(sum), so by at most 4 * 2^-24 of 1 + |log p| (W <= 2^20); its entropy, a sum of at
    most W terms p log p, by (W - 1) ulps of H from the order, plus sum p * (its log p's error),
    at most 4 * 2^-24 of 1 + H + |log p| weighted by p. So a score |log p + H| is off by less
    than E = (W + 8) * 2^-23 of 1 + H + |log p|. Two scores that close have |log p| within 2H
    of each other, so the threshold token's error is at most 3E of the other token's 1 + H +
    |log p|: 4E for the pair; the margin is twice that."""
    return (W + 8) * 2.0 ** -20


#: float32's exp underflows towards 0 below about -87: a kept candidate below this log p
#: leaves its row to the reference (whose p there would be 0 and its score inf)
TYPICAL_LOWEST = -80.0


def typical_candidates(values: torch.Tensor, typical_p: torch.Tensor, values_array=None,
                       out: Optional[tuple] = None, typical_p_array=None):
    """Step 13a on candidate rows from their candidates alone: values float32 [n, W]
    (-inf = dropped, every token outside the candidates dropped too), typical_p float32 [n]
    (1 keeps all). Returns ``(values with the tokens outside the typical set at -inf,
    settled bool [n])`` by the compiled kernel (``kernels.typical_of_candidates``: the
    reference's rule in float64, a row settled where no decision lies within the margins
    above); None where the compiled path does not run (the caller reads whole rows, the
    reference's computation). ``values_array``, ``out``, ``typical_p_array``: see
    ``kernels.typical_of_candidates``."""
    return kernels.typical_of_candidates(values, typical_p, TYPICAL_MASS_MARGIN,
                                         typical_score_margin(values.shape[-1]), TYPICAL_LOWEST,
                                         values_array, out, typical_p_array)


def top_p_tolerance(W: int) -> float:
    """The relative margin :func:`top_p_candidates_fast` settles W candidates by (see there)."""
    return (4 * W + 40) * 2.0 ** -24


def top_p_candidates_fast(values: torch.Tensor, top_p: torch.Tensor):
    """Step 13 on candidates from the softmax of the candidates alone. values float32 [n, W]
    descending (-inf = dropped), top_p float32 [n]. Returns ``(values, settled bool [n])``;
    rows not settled must take :func:`top_p_candidates` with the reference's probabilities.

    The reference's probabilities come from a softmax over the whole masked row: the same
    exp(v - max) terms, summed in another order. A sum of at most W positive float32 terms,
    in any order, is within (W - 1) ulps (relative) of the exact sum, so the two softmaxes
    differ by at most (2W + 4) ulps per value, and every float64 prefix sum by as much
    relative to the mass. A row is settled when no prefix sum lies within twice that of
    top_p and no other value lies that close to the threshold: both rules then pick the
    same tokens. (Exact boundaries, which hand-made cases hit, are never settled.) The
    probabilities follow the values' descending order, up to rounding between nearly equal
    values, which the second rule leaves unsettled next to the threshold: no sort needed.
    The compiled kernel (``kernels.top_p_of_candidates``) applies the same rules in float64."""
    tolerance = top_p_tolerance(values.shape[-1])
    compiled = kernels.top_p_of_candidates(values, top_p, tolerance)
    if compiled is not None:
        return compiled
    probs = torch.softmax(values, dim=-1)
    p64 = probs.double()
    before = p64.cumsum(dim=-1).sub_(p64)                                # mass before each
    top = top_p.double()[:, None]
    # When every candidate, zeros included, is in the nucleus, the reference's last position
    # is one of its zeros too: the threshold is 0 in both.
    last = (before < top).sum(dim=-1, keepdim=True).clamp_(min=1).sub_(1)
    threshold = probs.gather(1, last)
    t64 = threshold.double()
    sums_gap = (before - top).abs_().amin(dim=-1)
    # Other values' distance from the threshold, relative, ignoring tokens whose logit equals
    # the threshold token's (equal in any sum).
    relative = (p64 - t64).abs_().div_(t64.clamp(min=1e-300))
    value_gap = relative.masked_fill_(values == values.gather(1, last), float("inf")).amin(dim=-1)
    # Relative bounds mean nothing for subnormal probabilities: never settle on those.
    tiny = (t64[:, 0] > 0) & (t64[:, 0] < 2.0 ** -100)
    settled = ((torch.minimum(sums_gap, value_gap) > tolerance) & ~tiny) | (top_p >= 1.0)
    return values.masked_fill(~(probs >= threshold) & (top < 1.0), NEG_INF), settled


def nucleus_threshold(probs: torch.Tensor, top_p: torch.Tensor, workspace=None) -> torch.Tensor:
    """Step 13 on whole rows: float32 [n], the smallest kept probability, so the nucleus is
    ``probs >= threshold``. probs float32 [n, V], a softmax; top_p float32 [n] in (0, 1).

    The reference keeps every token whose probability is >= v*, the smallest value v with
    mass(probs > v) < top_p. Two histogram passes over the float bits find v* exactly (see
    :func:`select_by_histogram`); rows where float64 sums could round (a nucleus reaching
    values below 2**-29, or ending within 2**-30 of top_p) take the reference's sort. Does not
    modify probs."""
    threshold, exact = select_by_histogram(probs, top_p, workspace)
    if not bool(exact.all()):
        rows = (~exact).nonzero().flatten()
        threshold[rows] = threshold_by_sort(probs[rows], top_p[rows])
    return threshold


def nucleus_contains(probs: torch.Tensor, tokens: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """bool [n]: token ``tokens[row]`` is in the row's nucleus, by the reference's rule, without
    its threshold. probs float32 [n, V] (a softmax), tokens int64 [n], top_p float32 [n].

    The reference keeps the tokens whose probability is >= v*, the smallest value whose
    mass strictly before it (sorted, descending) is < top_p; so a token with probability p
    is kept exactly when the mass M of the probabilities > p is < top_p. M is summed in
    float32 first (one threshold pass and a sum per row): a float32 sum of V non-negative
    terms, in any order, is within (V - 1) * 2**-24 of M relatively, which decides the
    comparison unless top_p lies that close (a few rows in a hundred). Those rows sum in
    float64, exact when p >= 2**-29 (every term is a multiple of 2**-52), as the
    reference's own sums are. False (undecided) for smaller or NaN probabilities: the
    caller then finds the threshold."""
    n, V = probs.shape
    picked = probs.gather(1, tokens[:, None])[:, 0]
    # |rough - M| <= gamma * M with gamma = k u / (1 - k u), k = V - 1 additions, u = 2**-24
    # (widened by 1%), so rough / (1 + gamma) <= M <= rough / (1 - gamma)
    ku = (V - 1) * 2.0 ** -24
    gamma = 1.01 * ku / (1.0 - ku) if ku < 0.5 else float("inf")
    inside = []
    for row, (p, limit) in enumerate(zip(picked.tolist(), top_p.tolist())):
        above = torch.threshold(probs[row], p, 0.0)
        rough = float(above.sum())
        if rough < limit * (1.0 - gamma):
            inside.append(True)
        elif rough >= limit * (1.0 + gamma):
            inside.append(False)
        else:
            inside.append(float(above.double().sum()) < limit)
    return torch.tensor(inside, dtype=torch.bool) & (picked >= 2.0 ** -29)


def select_by_histogram(probs: torch.Tensor, top_p: torch.Tensor, workspace=None):
    """The nucleus threshold by radix select. probs float32 [n, V], top_p float32 [n].

    Pass 1 sums the probability mass per bucket of the top 12 bits (sign, exponent, 3
    mantissa bits) in float64 and finds the lowest bucket whose mass strictly above is
    < top_p: v* lies in it. Passes 2 and 3 do the same over that bucket's tokens with the
    next 10 bits, then the last 10 (one distinct value per bin). Returns ``(threshold
    float32 [n], exact bool [n])``; rows with ``exact`` False must use
    :func:`threshold_by_sort`. ``workspace`` (a :class:`~corelib_cpu.workspace.Workspace`)
    lends the [n, V] int32 keys (as ``SCRATCH``) and a [V] float64 row."""
    n, V = probs.shape
    bits = probs.view(torch.int32)
    p64 = top_p.double()[:, None]

    # Pass 1 over every token: compiled, one read of the row (the same float64 sums, in
    # token order); in torch a row at a time, so the float64 copy bincount needs stays one
    # row (and its histogram) in the cache.
    compiled = kernels.bucket_mass(probs, _KEY_SHIFT, _PROB_BUCKETS)
    if compiled is not None:
        mass, count = compiled
    else:
        keys = _take(workspace, SCRATCH, (n, V), torch.int32)
        torch.bitwise_right_shift(bits, _KEY_SHIFT, out=keys).clamp_(0, _PROB_BUCKETS - 1)   # (n, V)
        row64 = _take(workspace, "select_row64", (V,), torch.float64)
        mass = torch.stack([torch.bincount(keys[i], row64.copy_(probs[i]), minlength=_PROB_BUCKETS)
                            for i in range(n)])
    bucket, above = lowest_qualifying(mass, torch.zeros_like(p64), p64)   # (n,), (n, 1)

    # Passes 2 and 3 over the bucket's tokens only (flat indices: 1-D gathers are ~10x
    # cheaper than indexing with row and column tensors).
    if compiled is not None:
        size = int(count.gather(1, bucket[:, None]).sum())
        at = kernels.band_indices(probs, bucket, _KEY_SHIFT, _PROB_BUCKETS, size)
    else:
        at = (keys == bucket[:, None].to(torch.int32)).view(-1).nonzero()[:, 0]   # (m,)
    rows = at // V
    band = bits.view(-1).index_select(0, at)                          # float32 bits, (m,)
    low = band & ((1 << _KEY_SHIFT) - 1)
    middle = low >> _SUB_BITS
    sub, above = lowest_qualifying(bin_mass(rows, middle, band.view(torch.float32), n), above, p64)
    inside = (middle == sub[rows]).nonzero()[:, 0]
    rows, band = rows[inside], band[inside]
    mass3 = bin_mass(rows, band & ((1 << _SUB_BITS) - 1), band.view(torch.float32), n)
    last, above = lowest_qualifying(mass3, above, p64)

    threshold_bits = ((bucket << _KEY_SHIFT) | (sub << _SUB_BITS) | last).to(torch.int32)
    mass_from = above[:, 0] + mass3.gather(1, last[:, None])[:, 0]    # mass of probs >= v*
    exact = (bucket >= _EXACT_BUCKET) & (mass_from - p64[:, 0] >= _MARGIN)
    return threshold_bits.view(torch.float32).clone(), exact


def _take(workspace, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    if workspace is None:
        return torch.empty(shape, dtype=dtype)
    return workspace.take(name, shape, dtype)


def bin_mass(rows: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, n: int) -> torch.Tensor:
    """float64 [n, 2**_SUB_BITS]: weights (float32 [m]) summed in float64 per (row, key)."""
    bins = 1 << _SUB_BITS
    flat = rows * bins + keys.to(torch.long)
    return torch.bincount(flat, weights.double(), minlength=n * bins).view(n, bins)


def lowest_qualifying(mass: torch.Tensor, above_all: torch.Tensor, p64: torch.Tensor):
    """One radix step. mass float64 [n, K]: mass per bin (bins ascending in value);
    above_all float64 [n, 1]: mass above every bin. Returns (bin int64 [n], the mass above
    that bin float64 [n, 1]) for the lowest non-empty bin whose mass above is < top_p."""
    above = mass_above(mass) + above_all
    chosen = first_true((mass > 0) & (above < p64))
    return chosen, above.gather(1, chosen[:, None])


def threshold_by_sort(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The reference's computation of the nucleus threshold (a full sort): float32 [n] from
    probs float32 [n, V] and top_p float32 [n]. For the rare rows the histogram cannot settle."""
    ordered = torch.sort(probs, dim=-1, descending=True).values
    ordered64 = ordered.double()
    mass_before = ordered64.cumsum(dim=-1) - ordered64
    in_nucleus = mass_before < top_p.double()[:, None]
    last = in_nucleus.sum(dim=-1, keepdim=True).clamp(min=1) - 1
    return ordered.gather(1, last)[:, 0]


def mass_above(mass: torch.Tensor) -> torch.Tensor:
    """float64 [n, K] -> float64 [n, K]: for each bin, the mass of the bins after it.

    ``total - prefix``: when every bin from here up holds values >= 2**-29 (the only bins an
    exact row reads) both sums and their difference are exact."""
    prefix = mass.cumsum(dim=-1)
    return prefix[:, -1:] - prefix


def first_true(mask: torch.Tensor) -> torch.Tensor:
    """int64 [n]: index of the first True of each row of bool [n, K] (every row has one)."""
    return mask.to(torch.uint8).argmax(dim=-1)
