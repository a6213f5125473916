"""Steps 12-13 without sorting the vocabulary: top-k by ``torch.topk``, top-p by a histogram
select over the bits of the probabilities.

Every function keeps exactly the reference's set (``corelib.Sampler.apply_top_k`` /
``apply_top_p``): the same k-th value with ties kept, the same softmax probabilities, the same
float64 nucleus sums. Shapes: ``n`` rows, ``V`` vocabulary, ``W`` candidate columns.
"""

from __future__ import annotations

import sys

import torch

NEG_INF = float("-inf")

# A positive float32's bit pattern orders like its value, so its top 16 bits (sign, exponent,
# 7 mantissa bits) name a bucket and its low 16 bits a value within the bucket.
_BUCKETS = 1 << 16
_HIGH, _LOW = (1, 0) if sys.byteorder == "little" else (0, 1)
# Buckets from here up hold values >= 2**-29: float32 multiples of 2**-52, so float64 sums of
# them below 2 are exact, in any order (the reference's sequential cumsum included).
_EXACT_BUCKET = (127 - 29) << 7
# A nucleus whose mass ends this close above top_p may depend on the reference's rounding of
# tiny tail values; such rows take the exact sort (they only occur by construction).
_MARGIN = 2.0 ** -30


def top_k_candidates(x: torch.Tensor, k: torch.Tensor, width: int):
    """Step 12 as candidates. x float32 [n, V] (dropped tokens -inf), k int64 [n] in [1, V],
    ``width`` >= max(k) candidate columns (a few more catch ties at the k-th value).

    Returns ``(values, ids, complete)``: values float32 [n, W] descending, tokens below the
    k-th largest set to -inf; ids int64 [n, W]; complete bool [n], False where tokens tied
    with the k-th value may lie beyond the W columns (the caller then masks the row in full
    with :func:`mask_below`). Does not modify x."""
    V = x.shape[-1]
    values, ids = torch.topk(x, width, dim=-1)                          # (n, W), descending
    kth = values.gather(1, (k - 1)[:, None])                            # (n, 1)
    complete = (values[:, -1:] < kth) | (kth == NEG_INF)
    if width >= V:
        complete = torch.ones_like(complete)
    return values.masked_fill(values < kth, NEG_INF), ids, complete[:, 0]


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
    ordered = torch.sort(probs, dim=-1, descending=True).values
    ordered64 = ordered.double()
    mass_before = ordered64.cumsum(dim=-1) - ordered64
    in_nucleus = mass_before < top_p.double()[:, None]
    # When every candidate, zeros included, is in the nucleus, the reference's last position
    # is one of its zeros too: the threshold is 0 in both.
    last = in_nucleus.sum(dim=-1, keepdim=True).clamp(min=1) - 1
    threshold = ordered.gather(1, last)
    keep = (probs >= threshold) | (top_p >= 1.0)[:, None]
    return values.masked_fill(~keep, NEG_INF)


def nucleus_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Step 13 on whole rows: float32 [n], the smallest kept probability, so the nucleus is
    ``probs >= threshold``. probs float32 [n, V], a softmax; top_p float32 [n] in (0, 1).

    The reference keeps every token whose probability is >= v*, the smallest value v with
    mass(probs > v) < top_p. Two histogram passes over the float bits find v* exactly (see
    :func:`select_by_histogram`); rows where float64 sums could round (a nucleus reaching
    values below 2**-29, or ending within 2**-30 of top_p) take the reference's sort. Does not
    modify probs."""
    threshold, exact = select_by_histogram(probs, top_p)
    if not bool(exact.all()):
        rows = (~exact).nonzero().flatten()
        threshold[rows] = threshold_by_sort(probs[rows], top_p[rows])
    return threshold


def select_by_histogram(probs: torch.Tensor, top_p: torch.Tensor):
    """The nucleus threshold by radix select. probs float32 [n, V], top_p float32 [n].

    Pass 1 sums the probability mass per bucket (top 16 bits) in float64 and finds the
    lowest bucket whose mass strictly above is < top_p: v* lies in it. Pass 2 does the same
    over that bucket's tokens with the low 16 bits, each bin holding one distinct value.
    Returns ``(threshold float32 [n], exact bool [n])``; rows with ``exact`` False must use
    :func:`threshold_by_sort`."""
    n, V = probs.shape
    halves = probs.view(torch.int16)                                    # (n, 2V)
    high, low = halves[:, _HIGH::2], halves[:, _LOW::2]                 # (n, V) views
    p64 = top_p.double()[:, None]
    row = torch.arange(n)

    # Pass 1: buckets (exponent + 7 mantissa bits).
    keys = high.to(torch.long) + (row * _BUCKETS)[:, None]
    mass = torch.bincount(keys.view(-1), probs.double().view(-1), minlength=n * _BUCKETS).view(n, _BUCKETS)
    above = mass_above(mass)
    bucket = first_true((mass > 0) & (above < p64))                     # (n,)
    above_bucket = above.gather(1, bucket[:, None])                     # (n, 1)

    # Pass 2: the distinct values inside that bucket.
    band_rows, band_cols = (high == bucket.to(torch.int16)[:, None]).nonzero(as_tuple=True)
    values = (low[band_rows, band_cols].to(torch.long) & 0xFFFF) + band_rows * _BUCKETS
    mass2 = torch.bincount(values, probs[band_rows, band_cols].double(), minlength=n * _BUCKETS).view(n, _BUCKETS)
    above2 = mass_above(mass2) + above_bucket
    value = first_true((mass2 > 0) & (above2 < p64))                    # (n,)

    bits = ((bucket << 16) | value).to(torch.int32)
    threshold = bits.view(torch.float32)
    mass_from = (above2.gather(1, value[:, None]) + mass2.gather(1, value[:, None]))[:, 0]
    exact = (bucket >= _EXACT_BUCKET) & (mass_from - p64[:, 0] >= _MARGIN)
    return threshold.clone(), exact


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
    """float64 [n, K] -> float64 [n, K]: for each bin, the mass of the bins after it."""
    from_here = mass.flip(-1).cumsum(-1).flip(-1)
    above = torch.zeros_like(mass)
    above[:, :-1] = from_here[:, 1:]
    return above


def first_true(mask: torch.Tensor) -> torch.Tensor:
    """int64 [n]: index of the first True of each row of bool [n, K] (every row has one)."""
    return mask.to(torch.uint8).argmax(dim=-1)
