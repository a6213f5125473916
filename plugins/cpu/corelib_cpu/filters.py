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

NEG_INF = float("-inf")


# ---------------------------------------------------------------------- 10a: top-n-sigma
def top_n_sigma_thresholds(x: torch.Tensor, n_sigma: torch.Tensor, top: Optional[torch.Tensor],
                           workspace) -> torch.Tensor:
    """float32 [m]: each row's cut ``max - n * sigma`` (``Sampler.apply_top_n_sigma``: mean
    and population deviation over the row's finite logits), so the kept tokens are
    ``x >= cut``. x float32 [m, V] (not modified), n_sigma float32 [m] (> 0), top float32
    [m, 1] the rows' maxima when known.

    Rows whose logits are all finite (their sum is finite) take the reference's sums without
    its masks (the same values in the same order): one sum, one subtraction, one square and
    one more sum, in a workspace row. The others take the reference's computation."""
    m, V = x.shape
    total = x.sum(dim=-1, keepdim=True)
    plain = torch.isfinite(total)[:, 0]
    if not bool(plain.all()):
        return _masked_thresholds(x, n_sigma)
    count = torch.full((m, 1), float(V))
    mean = total / count
    spread = workspace.take("sigma_scratch", (V,))
    variance = torch.empty((m, 1))
    for row in range(m):
        torch.sub(x[row], mean[row], out=spread)
        variance[row] = spread.mul_(spread).sum() / count[row]                # (x - mean) ** 2
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


# ---------------------------------------------------------------------- 13a: typical-p
def typical_rows_(x: torch.Tensor, typical_p: torch.Tensor, workspace) -> torch.Tensor:
    """Step 13a in place on x float32 [m, V] (typical_p float32 [m], < 1): tokens outside
    the locally typical set -> -inf (``Sampler.apply_typical_p``'s set). Returns x."""
    logp = torch.log_softmax(x, dim=-1)
    p = logp.exp()
    entropy = -torch.where(p > 0, p * logp, 0.0).sum(dim=-1, keepdim=True)
    score = torch.where(p > 0, (-logp - entropy).abs(), float("inf"))
    order = torch.argsort(score, dim=-1, stable=True)
    ordered_p = p.gather(1, order).double()
    mass_before = ordered_p.cumsum(dim=-1) - ordered_p
    inside = mass_before < typical_p.double()[:, None]
    last = inside.sum(dim=-1, keepdim=True).clamp(min=1) - 1
    threshold = score.gather(1, order.gather(1, last))
    return x.masked_fill_(score > threshold, NEG_INF)


# ---------------------------------------------------------------------- 13b: XTC
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
