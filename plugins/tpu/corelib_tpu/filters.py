"""The newer filters (contract stages 10a, 13a and 13b) without sorting the vocabulary.

Same conventions as ``thresholds``: float32 ``[B, V]`` logits with dropped tokens at -inf, no
NaN, at least one finite logit per row (the sampler neutralises bad rows first); fixed shapes,
no host reads; each returns a new tensor with the dropped tokens at -inf.
"""

from __future__ import annotations

import torch

from .thresholds import _bisect_largest, order_keys

NEG_INF = float("-inf")
#: Typical-p scores are non-negative float32: [0, +inf) spans 0x7F800000 < 2**31 bit patterns.
SCORE_BISECTION_STEPS = 31


def top_n_sigma_filter(x: torch.Tensor, n_sigma: torch.Tensor) -> torch.Tensor:
    """Step 10a: drop finite logits below ``max - n * sigma`` (sigma: the population standard
    deviation of the row's finite logits, two passes as the reference computes it).
    n_sigma float32 ``[B]``, 0 = off."""
    finite = torch.isfinite(x)
    count = finite.sum(dim=-1, keepdim=True).clamp(min=1).to(torch.float32)
    mean = torch.where(finite, x, 0.0).sum(dim=-1, keepdim=True) / count
    variance = torch.where(finite, (x - mean) ** 2, 0.0).sum(dim=-1, keepdim=True) / count
    threshold = x.max(dim=-1, keepdim=True).values - n_sigma[:, None] * variance.sqrt()
    keep = (x >= threshold) | (n_sigma <= 0.0)[:, None]
    return torch.where(keep, x, NEG_INF)


def typical_p_by_bisection(x: torch.Tensor, typical_p: torch.Tensor) -> torch.Tensor:
    """Step 13a: with p the row's probabilities, H = -sum p log p and score = |-log p - H|,
    keep the smallest set of lowest-score tokens whose mass >= typical_p (ties kept, never
    empty). typical_p float32 ``[B]``, 1 = off.

    Walking the tokens by ascending score, the last one the reference keeps has the largest
    score s with ``mass(score < s) < typical_p``; that s is the largest float t with
    ``mass(score < t) < typical_p`` (the mass jumps past it right after s), found by bisection
    over the scores' bit patterns in 31 passes (each a compare and a sum over the
    vocabulary). Mass is summed in float32."""
    logp = torch.log_softmax(x, dim=-1)
    p = logp.exp()
    entropy = -torch.where(p > 0, p * logp, 0.0).sum(dim=-1, keepdim=True)
    score = torch.where(p > 0, (-logp - entropy).abs(), float("inf"))
    target = typical_p[:, None]
    lo = torch.zeros_like(target, dtype=torch.int64)                     # mass(score < 0) = 0
    top = torch.where(p > 0, score, 0.0).max(dim=-1, keepdim=True).values
    hi = order_keys(top).to(torch.int64) + 1
    lo = torch.where(target >= 1.0, hi - 1, lo)        # off: a closed bracket, its result unread
    threshold = _bisect_largest(
        lo, hi, SCORE_BISECTION_STEPS,
        lambda t, score, p, target: torch.where(score < t, p, 0.0).sum(dim=-1, keepdim=True) < target,
        (score, p, target), "typical_p")
    keep = (score <= threshold) | (target >= 1.0)
    return torch.where(keep, x, NEG_INF)


def xtc_filter(x: torch.Tensor, threshold: torch.Tensor, coin: torch.Tensor) -> torch.Tensor:
    """Step 13b: where ``coin`` (bool ``[B]``: the row's uniform < xtc_probability) is set and
    two or more kept tokens have probability >= threshold (float32 ``[B]``), drop all of them
    but those with the smallest such probability."""
    p = torch.softmax(x, dim=-1)
    above = (x > NEG_INF) & (p >= threshold[:, None])
    smallest = torch.where(above, p, float("inf")).min(dim=-1, keepdim=True).values
    act = (above.sum(dim=-1) >= 2) & coin
    return torch.where(above & (p > smallest) & act[:, None], NEG_INF, x)
