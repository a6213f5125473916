"""Steps 10a (top-n-sigma), 13a (typical-p) and 13b (XTC) on whole rows, with the reference's
kept sets bit for bit.

Each works on the rows that use it (``m`` rows of ``V`` logits, float32, dropped tokens -inf),
reproducing the reference's float32 reductions exactly: torch reduces each row of a
contiguous tensor the same way whatever the other rows, so a row's sum, softmax or
log-softmax here has the reference's bits, and the kept sets follow.
"""

from __future__ import annotations

from typing import Optional

import torch

from corelib.sampler import typical_keep

from .rowops import top_values

NEG_INF = float("-inf")
_INF = torch.tensor(float("inf"))


# ---------------------------------------------------------------------- 10a: top-n-sigma
def top_n_sigma_thresholds(x: torch.Tensor, n_sigma: torch.Tensor, top: Optional[torch.Tensor],
                           workspace) -> torch.Tensor:
    """float32 [m]: each row's cut ``max - n * sigma`` (``Sampler.apply_top_n_sigma``: mean
    and population deviation over the row's finite logits), so the kept tokens are
    ``x >= cut``. x float32 [m, V] (not modified), n_sigma float32 [m] (> 0), top float32
    [m, 1] the rows' maxima when known.

    Rows whose logits are all finite (their sum is finite) take the reference's sums without
    its masks (the same values in the same order): one sum, one subtraction, one square and
    one more sum, in a workspace buffer. The others take the reference's computation."""
    m, V = x.shape
    total = x.sum(dim=-1, keepdim=True)
    plain = torch.isfinite(total)[:, 0]
    if not bool(plain.all()):
        return _masked_thresholds(x, n_sigma)
    count = torch.full((m, 1), float(V))
    mean = total / count
    spread = torch.sub(x, mean, out=workspace.take("sigma_scratch", (m, V)))
    variance = spread.mul_(spread).sum(dim=-1, keepdim=True) / count        # (x - mean) ** 2
    top = x.amax(dim=-1, keepdim=True) if top is None else top
    return (top - n_sigma[:, None] * variance.sqrt())[:, 0]


def _masked_thresholds(x: torch.Tensor, n_sigma: torch.Tensor) -> torch.Tensor:
    """The reference's computation of :func:`top_n_sigma_thresholds`, -inf and +inf logits
    left out of the mean and the deviation."""
    finite = torch.isfinite(x)
    count = finite.sum(dim=-1, keepdim=True).clamp(min=1).to(torch.float32)
    mean = torch.where(finite, x, 0.0).sum(dim=-1, keepdim=True) / count
    variance = torch.where(finite, (x - mean) ** 2, 0.0).sum(dim=-1, keepdim=True) / count
    return (x.amax(dim=-1, keepdim=True) - n_sigma[:, None] * variance.sqrt())[:, 0]


# ---------------------------------------------------------------------- 8a: DRY
def dry_(x: torch.Tensor, s) -> torch.Tensor:
    """Step 8a in place on x float32 [n, V]: each token that would extend a repeat of length
    L >= dry_allowed_length loses ``dry_multiplier * dry_base ** min(L - allowed, 30)`` (the
    largest over its history entries), as ``Sampler.apply_dry`` computes it. ``s``: the rows'
    step state (``dry_history`` int64 [n, H], ``dry_match`` int32 [n, H], the DRY scalars).

    The reference's rule is evaluated on the history entries that can be penalised only
    (their repeat length reaches the allowed one): a few masks over the [n, H] history
    instead of the reference's twenty. The one float operation whose bits depend on where
    an entry sits in its row, ``pow`` (torch's vector and scalar loops round differently),
    runs over the history's full [n, H] layout, as in the reference. Returns x."""
    n, V = x.shape
    match = s.dry_match
    H = match.shape[1]
    allowed = s.dry_allowed_length[:, None]                                        # int32
    row_ok = (s.dry_since_breaker[:, None] >= allowed) & (s.dry_multiplier > 0)[:, None]
    rows, cols = ((match >= allowed) & row_ok).nonzero(as_tuple=True)
    if rows.numel() == 0:
        return x
    length = s.dry_length.to(torch.long)
    window = s.dry_range.to(torch.long)
    start = torch.where(window > 0, (length - window).clamp(min=0), 0)
    start, length = start[rows], length[rows]
    tokens = s.dry_history[rows, cols]
    repeat = torch.minimum(match[rows, cols].to(torch.long), cols - start)
    repeat = torch.minimum(repeat, s.dry_since_breaker.to(torch.long)[rows])
    limit = s.dry_allowed_length.to(torch.long)[rows]
    breaker = (tokens[:, None] == s.dry_breakers[rows]).any(dim=-1)
    live = (cols >= start) & (cols < length) & ~breaker & (repeat >= limit)
    rows, cols, tokens = rows[live], cols[live], tokens[live]
    exponent = torch.zeros((n, H))
    exponent[rows, cols] = (repeat[live] - limit[live]).clamp(min=0, max=30).to(torch.float32)
    power = torch.pow(s.dry_base[:, None], exponent)
    penalty = s.dry_multiplier[rows] * power[rows, cols]
    flat = rows * V + tokens
    xf = x.view(-1)
    # x[t] - (the largest penalty on t): an amin over the entries of t
    xf.scatter_reduce_(0, flat, xf[flat] - penalty, reduce="amin")
    return x


# ---------------------------------------------------------------------- 13a: typical-p
# Radix select of the typical set's largest score: 12 bits (sign, exponent, 4 mantissa bits),
# then 10, then the last 9 (one distinct value per bin).
_SCORE_SHIFT = 19
_SCORE_MID = 9
_SCORE_BUCKETS = (0x7F800000 >> _SCORE_SHIFT) + 1         # up to +inf
# The rows whose kept tokens all have p >= e**-20 > 2**-29: float64 sums of such float32
# values are exact in any order (multiples of 2**-52 below 2), so the reference's running
# sums in score order and the histogram's sums agree exactly.
_EXACT_LOGP = -20.0
# Tokens whose probability underflowed to 0 have the reference score +inf, here |log p + H|,
# which is > 91 (log p < -103, H <= log V); a selected score below this keeps none of them.
_FINITE_SCORES = 80.0
_MARGIN = 2.0 ** -30


def typical_rows_(x: torch.Tensor, typical_p: torch.Tensor, workspace) -> torch.Tensor:
    """Step 13a in place on x float32 [m, V] (typical_p float32 [m], < 1): tokens outside
    the locally typical set -> -inf, the reference's set (``Sampler.apply_typical_p``).
    Returns x.

    The reference's log-softmax, its exp p, the entropy H (the same float32 sums as the
    reference's) and the scores |log p + H|, in workspace buffers; then, instead of the
    reference's sort, the largest score s* whose tokens of lower score hold less than
    typical_p of the mass, by a radix select over the scores' bits with float64 masses
    (:func:`typical_score_limits`); x is cut where the score exceeds s*. Rows the select
    cannot settle exactly take the reference's sort."""
    m, V = x.shape
    logp = torch.log_softmax(x, dim=-1, out=workspace.take("typical_logp", (m, V)))
    p = torch.exp(logp, out=workspace.take("typical_p", (m, V)))
    terms = torch.mul(p, logp, out=workspace.take("typical_score", (m, V)))
    total = terms.sum(dim=-1, keepdim=True)
    if bool(torch.isnan(total).any()):
        # 0 * -inf where a token is dropped: the reference's where(p > 0, p log p, 0)
        total = terms.nan_to_num_(nan=0.0).sum(dim=-1, keepdim=True)
    entropy = -total
    score = torch.add(logp, entropy, out=terms).abs_()          # == |-log p - H|, bit for bit
    cut = typical_score_limits(score, p, entropy[:, 0], typical_p, workspace)
    unsettled = torch.isnan(cut)
    if bool(unsettled.any()):
        for row in unsettled.nonzero()[:, 0].tolist():
            _typical_by_sort(x[row:row + 1], typical_p[row:row + 1])
        cut = torch.where(unsettled, float("inf"), cut)
    # copysign(inf, s* - score) is +inf where score <= s*, -inf above (s* = inf keeps all)
    keep = torch.sub(cut[:, None], score, out=score)
    return torch.minimum(x, torch.copysign(_INF, keep, out=keep), out=x)


def typical_score_limits(score: torch.Tensor, p: torch.Tensor, entropy: torch.Tensor,
                         typical_p: torch.Tensor, workspace) -> torch.Tensor:
    """float32 [m]: the reference's typical-set threshold of each row, the largest score s*
    such that the tokens of score < s* hold less than typical_p of the mass (the set is
    score <= s*); +inf when every token is kept; NaN where the row needs the reference's
    sort (its set reaches probabilities whose float64 sums could round, or underflowed
    ones). score, p float32 [m, V] (scores >= 0), entropy, typical_p float32 [m].

    Three histogram passes over the scores' bits (12, 10 and 9 bits; mass summed in float64
    per bin): the set's last bin is the largest bin holding mass whose mass strictly before
    it is < typical_p, the reference's rule on its sorted running sums."""
    m, V = score.shape
    bits = score.view(torch.int32)
    limit = typical_p.double()[:, None]
    offsets = (torch.arange(m, dtype=torch.int32) * _SCORE_BUCKETS)[:, None]
    keys = torch.bitwise_right_shift(bits, _SCORE_SHIFT,
                                     out=workspace.take("typical_keys", (m, V), torch.int32))
    keys += offsets                                                     # one bin range per row
    p64 = workspace.take("typical_p64", (m, V), torch.float64).copy_(p)
    mass = torch.bincount(keys.view(-1), p64.view(-1), minlength=m * _SCORE_BUCKETS).view(m, -1)
    total = mass.sum(dim=-1)
    bucket, before = _largest_qualifying(mass, torch.zeros_like(limit), limit)

    # the bucket's tokens (flat indices), refined by the next bits, then the last
    at = (keys == (bucket[:, None].to(torch.int32) + offsets)).view(-1).nonzero()[:, 0]
    rows = at // V
    band = bits.view(-1).index_select(0, at)
    band_p = p64.view(-1).index_select(0, at)
    middle = torch.bitwise_right_shift(band, _SCORE_MID) & ((1 << (_SCORE_SHIFT - _SCORE_MID)) - 1)
    sub, before = _largest_qualifying(_bins(rows, middle, band_p, m, _SCORE_SHIFT - _SCORE_MID),
                                      before, limit)
    inside = (middle == sub[rows]).nonzero()[:, 0]
    rows, band, band_p = rows[inside], band[inside], band_p[inside]
    last, _ = _largest_qualifying(_bins(rows, band & ((1 << _SCORE_MID) - 1), band_p, m, _SCORE_MID),
                                  before, limit)
    cut = ((bucket << _SCORE_SHIFT) | (sub << _SCORE_MID) | last).to(torch.int32).view(torch.float32)
    # exact: every token up to the bucket's end has log p >= -H - (bucket's end) >= -20
    upper = ((bucket + 1) << _SCORE_SHIFT).to(torch.int32).view(torch.float32)
    exact = (-entropy - upper >= _EXACT_LOGP) & (cut < _FINITE_SCORES)
    exact &= total >= limit[:, 0] + _MARGIN
    cut = torch.where(exact, cut, float("nan"))
    return torch.where(total < limit[:, 0] - _MARGIN, float("inf"), cut)


def _bins(rows: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, m: int, bits: int) -> torch.Tensor:
    """float64 [m, 2**bits]: weights (float64 [k]) summed per (row, key)."""
    width = 1 << bits
    return torch.bincount(rows * width + keys.to(torch.long), weights, minlength=m * width).view(m, width)


def _largest_qualifying(mass: torch.Tensor, before_all: torch.Tensor, limit: torch.Tensor):
    """One radix step over ascending bins. mass float64 [m, K]; before_all float64 [m, 1]:
    the mass before every bin. Returns (int64 [m] the largest bin holding mass whose mass
    strictly before it is < limit, float64 [m, 1] that mass)."""
    before = (mass.cumsum(dim=-1) - mass) + before_all
    qualifying = (mass > 0) & (before < limit)
    chosen = torch.where(qualifying, torch.arange(mass.shape[1]), 0).amax(dim=-1)
    return chosen, before.gather(1, chosen[:, None])


def _typical_by_sort(x: torch.Tensor, typical_p: torch.Tensor) -> None:
    """The reference's step 13a on x float32 [1, V], in place (a full sort)."""
    x.masked_fill_(~typical_keep(x, typical_p), NEG_INF)


# ---------------------------------------------------------------------- 13b: XTC
#: Rows whose threshold lets more tokens than this reach it take the reference's computation.
XTC_CANDIDATES = 64
# A candidate list is complete when its last token's probability is below the threshold by
# more than the exp's rounding could invert between two logits (a few ulps; this is 16).
_XTC_SLACK = 1.0 - 2.0 ** -20


def xtc_rows_(x: torch.Tensor, threshold: torch.Tensor, workspace) -> bool:
    """Step 13b in place on rows whose coin said act: x float32 [m, V] (dropped tokens -inf),
    threshold float32 [m]. Every token with probability >= threshold but the least likely of
    them -> -inf, when two or more reach it (``Sampler.apply_xtc``'s rule, on the reference's
    softmax of the row). Returns whether x changed.

    At most 1 / threshold tokens reach the threshold, and they are the largest logits: the
    rule runs on the row's few largest logits (group maxima, ``rowops.top_values``) with their
    reference probabilities, and writes -inf at the tokens it drops. Rows with a tiny
    threshold take the reference's computation (:func:`xtc_drops`)."""
    m, V = x.shape
    p = torch.softmax(x, dim=-1, out=workspace.take("xtc_p", (m, V)))
    limits = threshold.tolist()
    width = [min(V, int(1.0 / t) + 2) if t > 0 else V + 1 for t in limits]
    few = [row for row in range(m) if width[row] <= XTC_CANDIDATES]
    changed = False
    rest = [row for row in range(m) if width[row] > XTC_CANDIDATES]
    if few:
        index = torch.tensor(few, dtype=torch.long)
        sub, sub_p = (x, p) if len(few) == m else (x.index_select(0, index), p.index_select(0, index))
        values, ids, _ = top_values(sub, max(width[row] for row in few))
        probs = sub_p.gather(1, ids)                                      # (f, W), descending
        t = threshold[index][:, None]
        complete = probs[:, -1] < t[:, 0] * _XTC_SLACK
        above = probs >= t
        act = above.sum(dim=-1) >= 2
        smallest = torch.where(above, probs, float("inf")).amin(dim=-1, keepdim=True)
        drop = above & (probs > smallest) & (act & complete)[:, None]
        if bool(drop.any()):
            rows = index[:, None].expand_as(ids)
            x[rows[drop], ids[drop]] = NEG_INF
            changed = True
        rest += [few[j] for j in (~complete).nonzero()[:, 0].tolist()]
    for row in rest:
        drop = xtc_drops(x[row:row + 1], threshold[row:row + 1])
        if drop is not None:
            x[row:row + 1].masked_fill_(drop, NEG_INF)
            changed = True
    return changed


def xtc_drops(x: torch.Tensor, threshold: torch.Tensor) -> Optional[torch.Tensor]:
    """bool [m, V]: the tokens XTC removes from rows whose coin said act (``Sampler.apply_xtc``:
    every kept token with probability >= threshold but the least likely of them, when there
    are two or more), or None when no row loses any. x float32 [m, V], threshold float32
    [m]. Not in place."""
    p = torch.softmax(x, dim=-1)
    above = (x > NEG_INF) & (p >= threshold[:, None])
    act = above.sum(dim=-1) >= 2
    if not bool(act.any()):
        return None
    smallest = torch.where(above, p, float("inf")).amin(dim=-1, keepdim=True)
    return above & (p > smallest) & act[:, None]
