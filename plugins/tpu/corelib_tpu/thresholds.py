"""Top-k and top-p without sorting the vocabulary: traced-friendly threshold searches.

Every function here has fixed shapes, no data-dependent Python branches and no host reads, so
XLA compiles it once per shape. Each returns the logits with dropped tokens at -inf; the kept
set is always ``{token: x >= threshold}`` for a per-row threshold, as in the reference.

Two ways to find the thresholds:

- ``top_k_top_p_candidates``: one ``topk`` with a static K gives each row's K largest logits,
  enough for top-k when every row's k <= K and for top-p over what top-k kept.
- ``top_k_by_bisection`` and ``top_p_by_bisection``: an exact bisection over the float32 bit
  patterns (up to 32 and 30 passes over the vocabulary, each a compare and a sum) for any k
  or nucleus size; ``top_k_by_candidates`` when only top-p needs it. Counts, and top-p's
  search for its bracket, use ``column_sum``, a reduction XLA:CPU vectorises; top-p's kept
  set is decided by the row's own float32 sum (``_holds_mass``).

Shapes: ``B`` rows, ``V`` vocabulary. Inputs are float32 ``[B, V]`` with no NaN and at least
one finite logit per row (the sampler neutralises bad rows first).
"""

from __future__ import annotations

import math

import torch
from corelib.ranking import top_entries as ordered_top

from . import xla
from .xla import bitcast, iota

NEG_INF = float("-inf")
_SIGN_FLIP = 0x7FFFFFFF
#: Bisection passes: int32 keys span 2**32 values; float32 probabilities in [0, 1] span
#: 0x3F800001 < 2**30 bit patterns.
KEY_BISECTION_STEPS = 32
PROB_BISECTION_STEPS = 30
#: float32 holds every integer below this exactly (counts summed as float32 stay exact).
_FLOAT_EXACT = 2**24
#: order_keys(-inf): keys below it are NaN bit patterns, where every compare is false.
_NEG_INF_KEY = 0xFF800000 ^ _SIGN_FLIP ^ -(1 << 32)


def order_keys(x: torch.Tensor) -> torch.Tensor:
    """int32 keys ordered as the float32 values ``x`` (any shape): ``a < b`` iff
    ``key(a) < key(b)``, and -0.0 and +0.0 share key 0. Not in place."""
    bits = bitcast(x, torch.int32)
    keys = torch.where(bits < 0, bits ^ _SIGN_FLIP, bits)
    return torch.where(x == 0, torch.zeros_like(keys), keys)


def value_of_key(keys: torch.Tensor) -> torch.Tensor:
    """float32 values of int32 order keys (inverse of ``order_keys``, zero as +0.0)."""
    bits = torch.where(keys < 0, keys ^ _SIGN_FLIP, keys)
    return bitcast(bits, torch.float32)


def _bisect_largest(lo: torch.Tensor, hi: torch.Tensor, steps: int, holds,
                    operands: tuple[torch.Tensor, ...], key: str) -> torch.Tensor:
    """The largest float32 ``t`` with ``holds(t, *operands)`` true, per row, searched over bit
    patterns.

    lo, hi: int64 ``[B, 1]`` order keys (``order_keys``) with ``holds`` true at lo and false at
    hi (int64 so ``hi - lo`` may reach 2**32); ``holds`` maps float32 thresholds ``[B, 1]``
    (and the operands) to bool ``[B, 1]`` and must be monotone (true below some value, false
    above); it reads only its arguments and Python scalars, since on XLA the steps are one
    loop (``xla.fori_loop``, traced once per ``key``). ``steps`` must bring ``hi - lo`` to 1.
    Each step is one pass over the vocabulary inside ``holds``, which compares floats (a key
    order equals the float order), so no ``[B, V]`` bitcast is needed.
    Returns float32 ``[B, 1]``, a value ``holds`` was true at.
    """
    def step(lo, hi, open_, *operands):
        # A shift, not ``//``: torch-xla 2.9 divides int64 through float32 (2**30 + 1 // 1
        # rounds), which would stop the search short of the exact threshold.
        mid = torch.bitwise_right_shift(lo + hi, 1)
        ok = holds(value_of_key(mid.to(torch.int32)), *operands)
        lo, hi = torch.where(ok, mid, lo), torch.where(ok, hi, mid)
        return lo, hi, (hi - lo > 1).any()

    # The loop ends when every row's bracket is closed (a step changes nothing after that),
    # so a search over a narrow bracket takes as many passes as the bracket has bits.
    lo, _, _ = xla.fori_loop(steps, step, (lo, hi, (hi - lo > 1).any()), operands,
                             ("bisect", key), live=2)
    return value_of_key(lo.to(torch.int32))


def top_k_by_bisection(x: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Step 12 for any k: keep logits >= the k-th largest (ties at the boundary kept).

    x float32 ``[B, V]``; top_k int32 ``[B]`` (0 = off; k > V keeps all). The k-th largest
    value is the largest t with ``count(x >= t) >= k``, found exactly in 32 passes. Returns a
    new tensor.
    """
    V = x.shape[-1]
    k = top_k.to(torch.int64).clamp(min=0, max=V)[:, None]               # (B, 1)
    lo = torch.full_like(k, _NEG_INF_KEY)                                  # count(x >= -inf) = V
    hi = order_keys(x.max(dim=-1, keepdim=True).values).to(torch.int64) + 1   # count 0 < k
    lo = torch.where(k == 0, hi - 1, lo)               # off: a closed bracket, its result unread
    # counts summed in float32 (exact below 2**24): an int sum is int64 in torch, which
    # XLA:CPU may widen into an s64 [B, V] copy at every pass
    kth = _bisect_largest(lo, hi, KEY_BISECTION_STEPS,
                          lambda t, x, k: column_sum((x >= t).to(torch.float32)) >= k,
                          (_padded(x, NEG_INF), k.to(torch.float32)), "top_k")
    return torch.where((x >= kth) | (k == 0), x, NEG_INF)


def top_k_by_candidates(x: torch.Tensor, top_k: torch.Tensor, candidates: int) -> torch.Tensor:
    """Step 12 when every row's k <= ``candidates`` (larger k are clamped): keep logits >=
    the k-th largest, read from ``top_values``. x float32 ``[B, V]``; top_k int32 ``[B]``
    (0 = off). Returns a new tensor."""
    K = min(candidates, x.shape[-1])
    values = top_values(x, K)
    k = top_k.to(torch.int64).clamp(min=0, max=K)[:, None]
    kth = torch.where(k > 0, values.gather(1, (k - 1).clamp(min=0)), NEG_INF)
    return torch.where(x >= kth, x, NEG_INF)


def top_p_by_bisection(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Step 13 for any nucleus size: keep the smallest most-likely set with mass >= top_p.

    x float32 ``[B, V]`` (dropped tokens -inf); top_p float32 ``[B]`` (1 = off). With p the
    probabilities, the kept set is ``p >= t*`` for the largest ``t*`` with
    ``sum(p[p >= t*]) >= top_p``: the same set as the reference's sorted cumulative sum (ties
    at the boundary kept, never empty), searched over the probabilities' bit patterns
    (non-negative floats: [0, 1] spans fewer than 2**30). Mass is summed in float32.
    Returns a new tensor.

    The float32 mass of ``{p >= t}`` never grows with t (non-negative terms summed in a fixed
    order), so ``t*`` is the one boundary of a monotone predicate: any bracket that holds it
    gives the same ``t*``, bit for bit, whatever passes narrowed it. The search therefore
    runs twice: first with a mass summed in another order (``_rough_mass``, a reduction
    XLA:CPU vectorises, about a quarter of the exact pass's time), which only picks the
    bracket; then the exact mass checks the bracket's two ends and closes it, in a few
    passes where the bracket is narrow, as where a check fails it falls back to a side of the
    whole range.
    """
    probs, total = softmax_and_total(x)
    p = top_p[:, None]
    # Above the largest probability no mass is left. The largest is weights' largest, exp(0),
    # over total: 1 / total with a margin for an exp that rounds 0 up, in place of a max pass.
    top = torch.clamp(2.0 ** -10 / total + 1.0 / total, max=1.0)
    hi = order_keys(top).to(torch.int64) + 1
    # One key below the smallest positive probability every positive one is kept, as at 0, so
    # the search may start there unchecked (it was a pass of its own): a row whose search
    # never holds above it (top_p above the float32 total) ends there and keeps every token.
    smallest = torch.where(probs > 0, probs, 1.0).min(dim=-1, keepdim=True).values
    floor = order_keys(smallest).to(torch.int64) - 1
    floor = torch.where(p >= 1.0, hi - 1, floor)       # off: a closed bracket, its result unread
    lo, hi = _top_p_bracket(probs, p, floor, hi)
    threshold = _bisect_largest(lo, hi, PROB_BISECTION_STEPS, _holds_mass, (probs, p), "top_p")
    threshold = torch.where(order_keys(threshold).to(torch.int64) == floor, 0.0, threshold)
    keep = (probs >= threshold) | (p >= 1.0)
    return torch.where(keep, x, NEG_INF)


#: The rough search's margin: the rough and the exact mass differ by float32 rounding (at most
#: 7 units of 2**-24 measured over V = 32000 to 151936 and logit scales 0.01 to 3; about 100
#: units at worst by the depth of both sums), so a probe whose rough mass clears top_p by this
#: much falls on the same side exactly. One that does not is caught by the exact check and
#: costs passes, not bits.
_ROUGH_MARGIN = 2.0 ** -20
#: The rough mass sums columns of this many tokens first.
_ROUGH_ROWS = 32


def _holds_mass(t: torch.Tensor, probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """bool ``[B, 1]``: the float32 mass of ``{probs >= t}`` reaches p (float32 ``[B, 1]``
    each). The exact predicate of ``top_p_by_bisection``: every kept set is decided by it."""
    return torch.where(probs >= t, probs, 0.0).sum(dim=-1, keepdim=True) >= p


def _rough_mass(probs: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """float32 ``[B, 1]``: the mass of ``{probs >= t}`` (probs float32 ``[B, V]``, V a
    multiple of ``_ROUGH_ROWS``; t float32 ``[B, 1]``), by ``column_sum``: not the order of
    the row's own sum, so its rounding differs."""
    return column_sum(torch.where(probs >= t, probs, 0.0))


def column_sum(v: torch.Tensor) -> torch.Tensor:
    """float32 ``[B, 1]``: the sums of v's rows (float32 ``[B, V]``, V a multiple of
    ``_ROUGH_ROWS``, typically an unmaterialised expression), summed as ``[B, 32, V / 32]``
    over the 32 first. That reduction keeps the minor dimension, which XLA:CPU vectorises with
    v's compare and select fused in (about a quarter of the time of the row's own sum, which
    it lowers as v written out and a tree of scalar reduce-windows). Its order is not the
    row's sum's: the same sums for integer-valued terms (counts, exact below 2**24), others
    may round differently. The zero column keeps XLA from merging the two sums back into one
    over the row."""
    B, V = v.shape
    part = v.reshape(B, _ROUGH_ROWS, V // _ROUGH_ROWS).sum(dim=1)
    return torch.cat([part, torch.zeros_like(part[:, :1])], dim=1).sum(dim=-1, keepdim=True)


def _padded(x: torch.Tensor, value: float) -> torch.Tensor:
    """x float32 ``[B, V]`` with columns of ``value`` appended up to a multiple of
    ``_ROUGH_ROWS`` (``column_sum``'s shape); x itself when V is one."""
    pad = (-x.shape[-1]) % _ROUGH_ROWS
    # from a column of x, so that the padding is traced (a tensor of its own would enter a
    # loop's trace as a constant input), and expanded, as V may be below pad
    return torch.cat([x, torch.full_like(x[:, :1], value).expand(-1, pad)], dim=1) if pad else x


def _top_p_bracket(probs: torch.Tensor, p: torch.Tensor, floor: torch.Tensor,
                   hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``[B, 1]`` keys (lo, hi) that hold ``top_p_by_bisection``'s boundary: the exact
    mass holds at lo (or lo is ``floor``) and not at hi. floor, hi: int64 ``[B, 1]``, the
    whole range (hi exact-false, floor as in ``top_p_by_bisection``).

    A bisection over [floor, hi) with ``_rough_mass`` keeps the largest probe whose rough mass
    clears p by ``_ROUGH_MARGIN`` and the smallest that falls short of it by as much; two
    exact passes check those two, and where one fails its side of the whole range is kept."""
    padded = _padded(probs, 0.0)

    def rough(lo, hi, low, high, open_, padded, p):
        mid = torch.bitwise_right_shift(lo + hi, 1)
        mass = _rough_mass(padded, value_of_key(mid.to(torch.int32)))
        ok = mass >= p
        low = torch.where(mass >= p + _ROUGH_MARGIN, mid, low)
        high = torch.where(mass < p - _ROUGH_MARGIN, mid, high)
        lo, hi = torch.where(ok, mid, lo), torch.where(ok, hi, mid)
        return lo, hi, low, high, (hi - lo > 1).any()

    _, _, low, high, _ = xla.fori_loop(PROB_BISECTION_STEPS, rough,
                                       (floor, hi, floor, hi, (hi - floor > 1).any()),
                                       (padded, p), ("bisect", "top_p rough"), live=4)
    low_holds = (low == floor) | _holds_mass(value_of_key(low.to(torch.int32)), probs, p)
    high_fails = (high == hi) | ~_holds_mass(value_of_key(high.to(torch.int32)), probs, p)
    # At most one check fails (the mass is monotone and low < high).
    lo_b = torch.where(low_holds, torch.where(high_fails, low, high), floor)
    hi_b = torch.where(low_holds, torch.where(high_fails, high, hi), low)
    return lo_b, hi_b


def top_k_top_p_candidates(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                           min_p: torch.Tensor, candidates: int) -> torch.Tensor:
    """Steps 11-13 from the ``candidates`` largest logits of each row, as one threshold.

    x float32 ``[B, V]``; min_p float32 ``[B]`` (0 = off); top_k int32 ``[B]`` (0 = off);
    top_p float32 ``[B]`` (1 = off). Rows whose result is used must have k <= candidates, and
    k >= 1 when top_p < 1 (larger k are clamped). Every step keeps ``{x >= t}`` for a row
    threshold t, so the result is ``x`` where ``x >= max(t_min_p, t_top_k, t_top_p)``:

    - min-p keeps a top set of the row, so ``{x >= k-th largest}`` intersected with it is what
      top-k keeps after it (all of it when fewer than k tokens survive min-p); the candidates
      can be taken first, and the row max min-p needs is the first of them;
    - top-p walks the kept candidates in order with probabilities normalised over every kept
      token (the candidates' mass plus a count over the vocabulary of the tokens tied with the
      k-th largest outside them); its threshold is the logit of the last token of the
      nucleus. Ties with the k-th largest outside the candidates are kept by the compare,
      and a nucleus not reached within the candidates ends in those ties.

    Exact but for min-p and top-p boundaries compared in logit rather than probability
    space (a token within float rounding of the boundary). Returns a new tensor.
    """
    return top_k_top_p_with_ids(x, top_k, top_p, min_p, candidates)[0]


def top_k_top_p_with_ids(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                         min_p: torch.Tensor, candidates: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``top_k_top_p_candidates``, the ids of the candidates it read (int64 ``[B, K]``, K =
    ``min(candidates, V)``, the row's K largest logits of ``x``) and float32 ``[B, 3]``: the
    K-th largest logit, the largest and the kept set's threshold. The draw races over the
    candidates where they hold every kept token (``TpuSampler.draw``: the K-th largest below
    the threshold) instead of finding them again."""
    K = min(candidates, x.shape[-1])
    values, ids = top_entries(x, K)                                        # (B, K) descending
    k = top_k.to(torch.int64).clamp(min=0, max=K)[:, None]
    # Gathers, not static slices: XLA:CPU turns a static slice of topk's output into a sort.
    top = values.gather(1, torch.zeros_like(k))                            # row max
    kth = torch.where(k > 0, values.gather(1, (k - 1).clamp(min=0)), NEG_INF)
    floor = torch.maximum(top + torch.log(min_p)[:, None], kth)            # steps 11-12
    # The mass top-p normalises by: the kept candidates', plus the kept tokens outside them,
    # which (a row with top_p < 1 has k >= 1 here, so floor >= kth >= every non-candidate)
    # all equal the k-th largest exactly: counted, not exp-summed, and only where some row's
    # K-th candidate reaches its floor (none is outside otherwise).
    weights = torch.exp(values - top)                                      # (B, K)
    kept = values >= floor
    smallest = values.gather(1, torch.full_like(k, K - 1))                # the K-th largest
    outside = _kept_outside(x, floor, kept, smallest)
    total = torch.where(kept, weights, 0.0).sum(dim=-1, keepdim=True) + outside * torch.exp(kth - top)
    cand = torch.where(kept, weights / total, 0.0)                         # (B, K)
    # Exclusive running sum (shifted, not cumsum - cand, which rounds once more).
    mass_before = torch.cat([torch.zeros_like(cand[:, :1]), torch.cumsum(cand, dim=-1)[:, :-1]], dim=-1)
    p = top_p[:, None]
    in_nucleus = (mass_before < p).sum(dim=-1, keepdim=True)
    last = values.gather(1, (in_nucleus - 1).clamp(min=0))                 # step 13
    threshold = torch.where(p >= 1.0, floor, torch.maximum(floor, last))
    edges = torch.cat([smallest, top, threshold], dim=1)
    return torch.where(x >= threshold, x, NEG_INF), ids, edges


def _kept_outside(x: torch.Tensor, floor: torch.Tensor, kept: torch.Tensor,
                  last: torch.Tensor) -> torch.Tensor:
    """float32 ``[B, 1]``: the tokens of x float32 ``[B, V]`` at or above ``floor`` (float32
    ``[B, 1]``) that are not among the candidates (``kept``: bool ``[B, K]``, the candidates
    at or above it; ``last``: float32 ``[B, 1]``, the K-th largest logit). A token outside
    the candidates is at most ``last``, so where every row's ``last`` is below its floor
    there is none, and the count over the vocabulary (a pass) runs in a conditional on
    some row's ``last`` reaching its floor: ties at the K-th candidate, or k = K."""
    def count(x, floor, kept):
        if x.shape[-1] >= _FLOAT_EXACT:                            # a float32 count could round
            return ((x >= floor).sum(dim=-1, keepdim=True)
                    - kept.sum(dim=-1, keepdim=True)).to(torch.float32)
        # float32 sums: torch sums a bool into int64, which XLA:CPU widens into an s64
        # [B, V] copy before reducing (three times the time of this sum)
        return ((x >= floor).to(torch.float32).sum(dim=-1, keepdim=True)
                - kept.to(torch.float32).sum(dim=-1, keepdim=True))

    def none(x, floor, kept):
        return torch.zeros_like(floor)

    return xla.cond((last >= floor).any(), count, none, [x, floor, kept], "kept outside")


def min_p_filter(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Step 11 in logit space: keep tokens with ``x >= max(x) + log(min_p)``, the set
    ``prob >= min_p * max prob`` up to float rounding at the boundary, without a softmax.
    x float32 ``[B, V]``; min_p float32 ``[B]`` (0 = off: log 0 = -inf keeps all).
    Returns a new tensor."""
    floor = x.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]
    return torch.where(x >= floor, x, NEG_INF)


def narrow_rows(x: torch.Tensor, k: int, greedy: torch.Tensor) -> torch.Tensor:
    """bool ``[B]``: rows of x float32 ``[B, V]`` free of NaN and +inf that keep at most ``k``
    tokens (x > -inf), or are greedy (bool ``[B]``).

    One float32 sum over x of 1 per kept token and ``2**24`` per NaN or +inf: a row without
    those sums to its kept count, exactly (counts below ``2**24``), and a row with one sums to
    at least ``2**24`` (adding non-negative floats never rounds a partial sum down), so
    ``sum <= k`` answers both questions in one reduction. Two sums (a count of each) took
    XLA:CPU two passes over ``[B, V]``; float32, not int: torch sums int32 into int64, which
    XLA:CPU materialises as an s64 ``[B, V]`` copy before reducing."""
    if x.shape[-1] >= _FLOAT_EXACT or k >= _FLOAT_EXACT:        # a count could round
        bad = torch.isnan(x) | (x == float("inf"))
        free = bad.to(torch.float32).sum(dim=-1) == 0
        return free & (greedy | ((x > NEG_INF).to(torch.float32).sum(dim=-1) <= k))
    return narrow_of_code(kept_code(x), k, greedy)


def kept_code(x: torch.Tensor) -> torch.Tensor:
    """float32 ``[B]``: ``narrow_rows``'s one reduction, each row's kept count (x > -inf) when
    it holds no NaN or +inf, at least ``2**24`` when it does. x float32 ``[B, V]`` with V
    below ``2**24``."""
    bad = torch.isnan(x) | (x == float("inf"))
    return torch.where(bad, float(_FLOAT_EXACT), (x > NEG_INF).to(torch.float32)).sum(dim=-1)


def narrow_of_code(code: torch.Tensor, k: int, greedy: torch.Tensor) -> torch.Tensor:
    """``narrow_rows`` from ``kept_code``'s answer (float32 ``[B]``): bool ``[B]``."""
    return (code < _FLOAT_EXACT) & (greedy | (code <= k))


def softmax_rows(x: torch.Tensor) -> torch.Tensor:
    """float32 ``[B, V]`` probabilities ``exp(x - max) / sum`` (the reference's formula)."""
    return softmax_and_total(x)[0]


def softmax_and_total(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 ``[B, V]`` probabilities as ``softmax_rows``, float32 ``[B, 1]`` the sum of
    ``exp(x - max)`` they divide by: 1 / total is the largest probability)."""
    weights = torch.exp(x - x.max(dim=-1, keepdim=True).values)
    total = weights.sum(dim=-1, keepdim=True)
    return weights / total, total


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """int64 ``[B]``: the lowest index of each row's maximum (``torch.argmax``'s answer).

    x float32 ``[B, V]`` (no NaN), typically an unmaterialised expression such as logits plus
    noise. Two stages, so the vocabulary is reduced once: the max of each chunk of ``L``
    tokens (``x`` computed inside the reduction), then the first chunk holding the row
    maximum is re-read by a gather of its ``L`` tokens. XLA:CPU runs this 5 times faster than
    a max followed by a min over ``where(x == max, iota, V)``, and it never sorts.
    """
    B, V = x.shape
    L, C = _chunking(V, max(1, math.isqrt(V) * 5 // 7))
    chunk_max = _chunk_max(x, L, C)                                       # (B, C')
    best = chunk_max.max(dim=-1, keepdim=True).values
    chunk = _first_index(chunk_max == best)                               # (B, 1)
    ids = chunk * L + iota(L, torch.int64, x.device)                      # (B, L)
    values = x.gather(1, ids.clamp(max=V - 1))
    values = torch.where(ids < V, values, NEG_INF)
    offset = _first_index(values == values.max(dim=-1, keepdim=True).values)
    return (chunk * L + offset)[:, 0]


def top_values(x: torch.Tensor, k: int) -> torch.Tensor:
    """float32 ``[B, k]``: each row's k largest values, descending (``topk(x, k).values``)."""
    return top_entries(x, k)[0]


def top_entries(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k largest values, descending, and their ids (``torch.topk(x, k)``).

    x float32 ``[B, V]``; returns float32 ``[B, k]`` and int64 ``[B, k]``. Exact without a
    ``topk`` over the vocabulary (torch-xla lowers it to a sort): the k chunks with the largest
    maxima hold the k largest values (any value outside them is at most its own chunk's
    maximum, at most the k-th largest chunk maximum), so one ``topk`` over the chunk maxima
    and one over those k chunks' k * L tokens give them. Candidates stay in id order, so
    where ``topk`` is stable (XLA's is) equal values come lower id first, the contract's
    order (a chunk left out that holds the k-th largest value t has maximum t, else k chunks
    of maxima above t would hold k values above t, so the chunks taken with maximum t come
    before it and hold ties of lower ids). A vocabulary of fewer than k chunks takes one
    ``topk``; every token (k = V: ``logprobs=-1``), where XLA's ``topk`` does not keep that
    order, takes the core's ``ranking.top_entries`` (a stable sort). Only k = V: the
    documented warm-up ends a thousand memory maps under the default ``vm.max_map_count``,
    and the ordered search in the step graphs' top-k route took it past.
    """
    B, V = x.shape
    if k >= V:
        return ordered_top(x, k)
    L, C = _chunking(V, max(1, 2 * math.isqrt(max(1, V // max(k, 1)))))
    if C < k or k * L >= V:
        top = torch.topk(x, k, dim=-1)
        return top.values, top.indices
    chunk_max = _chunk_max(x, L, C)                                       # (B, C')
    chunks = torch.topk(chunk_max, k, dim=-1).indices.sort(dim=-1).values  # (B, k), id order
    ids = (chunks[:, :, None] * L + iota(L, torch.int64, x.device)).reshape(B, k * L)
    values = x.gather(1, ids.clamp(max=V - 1))
    top = torch.topk(torch.where(ids < V, values, NEG_INF), k, dim=-1)
    return top.values, ids.gather(1, top.indices)


def _chunking(V: int, target: int) -> tuple[int, int]:
    """A chunk length near ``target`` that divides V when one does within a factor of 2 (a
    tail chunk would need its own reduction), and the number of whole chunks."""
    target = max(1, min(target, V))
    for delta in range(target // 2 + 1):
        for L in (target + delta, target - delta):
            if 1 <= L <= V and V % L == 0:
                return L, V // L
    return target, V // target


def _chunk_max(x: torch.Tensor, L: int, C: int) -> torch.Tensor:
    """float32 ``[B, C]`` maxima of the whole chunks, plus one column for a tail if any."""
    B, V = x.shape
    body = x if C * L == V else x[:, :C * L]
    chunk_max = body.reshape(B, C, L).max(dim=-1).values
    if C * L < V:
        chunk_max = torch.cat([chunk_max, x[:, C * L:].max(dim=-1, keepdim=True).values], dim=1)
    return chunk_max


def _first_index(mask: torch.Tensor) -> torch.Tensor:
    """int64 ``[B, 1]``: the first True column of each row of a small bool ``[B, n]``."""
    n = mask.shape[-1]
    index = iota(n, torch.float32, mask.device)
    return torch.where(mask, index, float(n)).min(dim=-1, keepdim=True).values.to(torch.int64)
