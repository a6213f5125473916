"""The arithmetic of step 14's stateful selectors (mirostat v2, adaptive-p): how each reshapes
a row's distribution, and how appending a token advances its state. Plain torch over ``[R]``
and ``[R, V]`` tensors, shared by the reference stages (``Sampler.apply_mirostat``,
``apply_adaptive_p``), the batch (``append``) and ``verify``'s slots; the stage table
(``corelib.pipeline``) names the ``advance_*`` functions (``Stage.advance``), each called as ``advance(state, fields, logp, ids, row_sum=...)`` with
the sampler's row sum (``Sampler.row_sum``; the batch's ``row_sum`` in ``append``). Imports no
other part of corelib but ``corelib.reductions``.
"""

from __future__ import annotations

import math

import torch

from .reductions import RowSum, row_logsumexp, torch_row_sum

#: Bits mirostat counts for an appended token it had dropped (its p' is 0).
UNKEPT_BITS = 64.0
#: Adaptive-p's width: u = |p - a| / WIDTH.
ADAPTIVE_WIDTH = 0.3
_LN2 = math.log(2.0)


def mirostat_dropped(logp: torch.Tensor, mu: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """bool [R, V]: the tokens mirostat v2 drops: surprise -log2 p > mu (float32 [R]), never the
    most likely ones; nothing on rows with tau (float32 [R]) 0. ``logp``: float32 [R, V]
    log-probabilities of the current distribution."""
    most = logp.amax(dim=-1, keepdim=True)
    return (-logp / _LN2 > mu[:, None]) & (logp < most) & (tau > 0)[:, None]


def advance_mirostat(state: dict, fields: dict, logp: torch.Tensor, ids: torch.Tensor,
                     row_sum: RowSum = torch_row_sum) -> dict:
    """mu <- mu - eta * (-log2 p'_t - tau) for appended ids (int64 [R]), p'_t the token's
    probability in the renormalised distribution mirostat drew from (``logp`` float32 [R, V]:
    the distribution before mirostat); a token it had dropped counts ``UNKEPT_BITS``. Rows with
    tau 0 keep their mu. The renormalising sum by ``row_sum`` (``reductions.row_logsumexp``)."""
    mu, tau, eta = state["mirostat_mu"], fields["mirostat_tau"], fields["mirostat_eta"]
    kept = logp.masked_fill(mirostat_dropped(logp, mu, tau), float("-inf"))
    drawn = kept.gather(1, ids[:, None])[:, 0] - row_logsumexp(kept, row_sum)
    bits = torch.where(torch.isfinite(drawn), -drawn / _LN2, UNKEPT_BITS)
    return {"mirostat_mu": torch.where(tau > 0, mu - eta * (bits - tau), mu)}


def adaptive_aim(target: torch.Tensor, weighted: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """float32 [R]: the probability adaptive-p favours, a = clamp(2 target - weighted / total,
    0, 1), from the row values float32 [R]."""
    return (2.0 * target - weighted / total.clamp(min=1e-30)).clamp(0.0, 1.0)


def adaptive_logits(p: torch.Tensor, target: torch.Tensor, weighted: torch.Tensor,
                    total: torch.Tensor) -> torch.Tensor:
    """float32 [R, V]: adaptive-p's logits 5 - 10 u**2 / (1 + u), u = |p - a| / 0.3 (float32
    operations in this order), a = ``adaptive_aim``, for probabilities ``p`` [R, V] and the
    row values [R]."""
    u = (p - adaptive_aim(target, weighted, total)[:, None]).abs() / ADAPTIVE_WIDTH
    return 5.0 - 10.0 * u * u / (1.0 + u)


def advance_adaptive_p(state: dict, fields: dict, logp: torch.Tensor, ids: torch.Tensor,
                       row_sum: RowSum = torch_row_sum) -> dict:
    """w <- p_t + decay * w, s <- 1 + decay * s for appended ids (int64 [R]), p_t from ``logp``
    (float32 [R, V], the distribution before the transform). Rows that are off (target < 0)
    keep theirs. ``row_sum``: unused (no sum over the vocabulary), taken as every advance
    takes it."""
    on, decay = fields["adaptive_p_target"] >= 0, fields["adaptive_p_decay"]
    weighted, total = state["adaptive_p_weighted"], state["adaptive_p_total"]
    p_t = logp.gather(1, ids[:, None])[:, 0].exp()
    return {"adaptive_p_weighted": torch.where(on, p_t + decay * weighted, weighted),
            "adaptive_p_total": torch.where(on, 1.0 + decay * total, total)}
