"""The reference backend's steps 9-14 (the greedy argmax, the table's "filter" and "select"
groups, the draw): plain, readable torch (full sorts where a fast backend avoids them), the
oracle every backend is checked against. Mixed into ``Sampler`` (``corelib.sampler``), whose
template calls them; a backend overrides the stages it does faster. Shapes: ``B`` rows, ``V``
vocabulary. These stages never modify their input tensors.
"""

from __future__ import annotations

import torch

from . import pipeline, selectors
from .batch import StepState
from .logit_stages import NEG_INF
from .noise import STREAM_XTC, gumbel_from_uniform, row_keys, seeded_gumbel
from .reductions import RowSum, torch_row_sum


def min_p_drops(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Step 11's dropped set: bool [B, V] for logits x float32 [B, V] and min_p float32 [B]
    (0 drops nothing): probability below min_p times the row's largest, by torch's softmax.
    Not in place."""
    probs = torch.softmax(x, dim=-1)
    return probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True)


def typical_keep(x: torch.Tensor, typical_p: torch.Tensor,
                 row_sum: RowSum = torch_row_sum) -> torch.Tensor:
    """Step 13a's kept set by a full sort: bool [B, V] for logits x float32 [B, V] and
    typical_p float32 [B] (every row filtered, 1 included). Mass summed in float64; the
    entropy by ``row_sum`` (``Sampler.row_sum``). Not in place."""
    logp = torch.log_softmax(x, dim=-1)
    p = logp.exp()
    entropy = -row_sum(torch.where(p > 0, p * logp, 0.0), keepdim=True)
    score = torch.where(p > 0, (-logp - entropy).abs(), float("inf"))
    order = torch.argsort(score, dim=-1, stable=True)
    ordered_p = p.gather(1, order).double()
    mass_before = ordered_p.cumsum(dim=-1) - ordered_p
    inside = mass_before < typical_p.double()[:, None]
    last = inside.sum(dim=-1, keepdim=True).clamp(min=1) - 1
    threshold = score.gather(1, order.gather(1, last))
    return score <= threshold


def dynamic_divisor(entropy: torch.Tensor, kept: torch.Tensor, t: torch.Tensor,
                    s: StepState) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 10's dynamic temperature from each row's entropy (float32 [B], nats) and kept-token
    count (int or float32 [B], whole numbers): (float32 [B] divisor: T' on dynamic rows with more than one kept token, 1
    on dynamic rows with one, ``t`` elsewhere; bool [B]: T' = 0, the argmax tokens alone stay).
    ``t`` float32 [B], the static temperatures (greedy rows 1). Not in place."""
    ratio = (entropy / kept.clamp(min=2).to(torch.float32).log()).clamp(min=0.0)
    d = s.dynatemp_range
    lo = (t - d).clamp(min=0.0)
    dynamic = lo + (t + d - lo) * ratio.pow(s.dynatemp_exponent)
    on = (d > 0) & ~s.greedy
    t = torch.where(on, torch.where(kept > 1, dynamic, 1.0), t)
    argmax_only = on & (kept > 1) & (dynamic == 0)
    return torch.where(argmax_only, 1.0, t), argmax_only


def tail_free_length(q: torch.Tensor, n: torch.Tensor, tfs: torch.Tensor,
                     row_sum: RowSum = torch_row_sum) -> torch.Tensor:
    """Step 13c's kept length j (int64 [B, 1], >= 1): for each row's probabilities sorted in
    descending order, float64 ``q`` [B, M] (its first n kept, M >= 3 or the row's n <= M),
    the smallest j whose normalised second differences sum past ``tfs`` (float32 [B]), n - 2
    when none does. ``n`` int [B, 1] kept tokens (rows with n <= 2 keep everything: the
    caller's test). The differences' total by ``row_sum`` (``Sampler.row_sum``). Not in
    place."""
    second = (q[:, :-2] - 2.0 * q[:, 1:-1] + q[:, 2:]).abs()
    inside = torch.arange(second.shape[-1], device=q.device)[None, :] < n - 2
    second = torch.where(inside, second, 0.0)
    total = row_sum(second, keepdim=True)
    weights = torch.where(total > 1e-6, second / total.clamp(min=1e-300),
                          inside.double() / (n - 2).clamp(min=1).double())
    passed_before = (torch.cumsum(weights, dim=-1) <= tfs.double()[:, None]) & inside
    return torch.minimum(passed_before.sum(dim=-1, keepdim=True) + 1, (n - 2).clamp(min=1))


def nucleus_keep(probs: torch.Tensor, ordered: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Step 13's kept set: bool [B, V], True for tokens in the nucleus (ties at its edge kept).

    probs: float32 [B, V] renormalised over what steps 11-12 left; ordered: float32 [B, K], the
    row's K largest probs in descending order (K = V, or any K that holds the whole nucleus);
    top_p: float32 [B] (1 keeps every token). Mass is summed in float64. Not in place.
    """
    ordered64 = ordered.double()
    mass_before = ordered64.cumsum(dim=-1) - ordered64
    # Token j (by rank) is in the nucleus when the mass strictly before it is < top_p.
    in_nucleus = mass_before < top_p.double()[:, None]
    last = in_nucleus.sum(dim=-1, keepdim=True).clamp(min=1) - 1           # (B, 1)
    threshold = ordered.gather(1, last)
    return (probs >= threshold) | (top_p >= 1.0)[:, None]


class FilterStages:
    """Steps 9-14 of the reference backend (mixed into ``Sampler``)."""

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Step 9: int64 [B], the lowest id among the row's maxima."""
        return torch.argmax(x, dim=-1)

    def apply_temperature(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 10: ``x / temperature`` per row (greedy rows divide by 1). With
        ``dynatemp_range`` d > 0 (float32 [B], 0 = static), the row's temperature comes from
        the entropy H of its current distribution over its n kept tokens: T' = lo + (hi - lo)
        * (H / ln n) ** ``dynatemp_exponent``, lo = max(0, T - d), hi = T + d; n <= 1 leaves
        the logits as they are, T' = 0 keeps the argmax tokens only. Not in place."""
        t = torch.where(s.greedy, torch.ones_like(s.temperature), s.temperature)
        if not s.any_dynatemp:
            return x / t[:, None]
        t, argmax_only = self.dynamic_temperature(x, t, s)
        out = x / t[:, None]
        return torch.where(argmax_only[:, None] & (x < x.amax(dim=-1, keepdim=True)), NEG_INF, out)

    def dynamic_temperature(self, x: torch.Tensor, t: torch.Tensor,
                            s: StepState) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 10's temperature per row when some row is dynamic: (float32 [B] divisor, 1 where
        the logits stay as they are; bool [B]: T' = 0, only the argmax tokens stay). ``t``:
        the static temperatures (greedy rows 1). Not in place."""
        logp = torch.log_softmax(x.detach(), dim=-1)     # T' is a constant for gradients
        p = logp.exp()
        entropy = -self.row_sum(torch.where(p > 0, p * logp, 0.0))
        # counted in float32 where that is exact (below 2^24 tokens): an int64 count made XLA
        # widen the comparison into an s64 [B, V] buffer
        kept = (x > NEG_INF).sum(dim=-1, dtype=torch.float32 if x.shape[-1] < 2 ** 24 else None)
        return dynamic_divisor(entropy, kept, t, s)

    def apply_top_n_sigma(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 10a: over each row's finite logits, drop those below max - n * sigma (sigma their
        population standard deviation). ``top_n_sigma`` float32 [B], 0 = off. Not in place."""
        finite = torch.isfinite(x)
        count = finite.sum(dim=-1, keepdim=True).clamp(min=1).to(torch.float32)
        mean = self.row_sum(torch.where(finite, x, 0.0), keepdim=True) / count
        variance = self.row_sum(torch.where(finite, (x - mean) ** 2, 0.0), keepdim=True) / count
        threshold = x.amax(dim=-1, keepdim=True) - s.top_n_sigma[:, None] * variance.sqrt()
        keep = (x >= threshold) | (s.top_n_sigma <= 0.0)[:, None]
        return x.masked_fill(~keep, NEG_INF)

    def apply_min_p(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 11: drop tokens with prob < min_p * max prob (min_p 0 keeps all). Not in place."""
        return x.masked_fill(min_p_drops(x, s.min_p), NEG_INF)

    def apply_smoothing(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 10b, quadratic smoothing: with m the row's largest kept logit, d = x - m and c =
        ``smoothing_curve`` (float32 [B]), each kept logit becomes m - (3 - c) / 2 * f * d**2
        + (c - 1) / 2 * f * d**3, f = ``smoothing_factor`` (float32 [B], 0 = off); dropped
        tokens stay -inf. Not in place."""
        f, c = s.smoothing_factor[:, None], s.smoothing_curve[:, None]
        m = x.detach().amax(dim=-1, keepdim=True)            # a constant for gradients
        d = x - m
        smoothed = m - (3.0 - c) / 2.0 * f * d * d + (c - 1.0) / 2.0 * f * d * d * d
        return torch.where((f > 0) & (x > NEG_INF), smoothed, x)

    def apply_top_a(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 11a: drop tokens with p < ``top_a`` * max(p)**2 (``top_a`` float32 [B], 0 =
        off; the most likely tokens always stay). Not in place."""
        p = torch.softmax(x, dim=-1)
        most = p.amax(dim=-1, keepdim=True)
        return x.masked_fill((p < s.top_a[:, None] * most * most) & (p < most), NEG_INF)

    def apply_epsilon(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 11b: drop tokens with p < ``epsilon_cutoff`` (float32 [B], 0 = off), never the
        most likely ones. Not in place."""
        p = torch.softmax(x, dim=-1)
        most = p.amax(dim=-1, keepdim=True)
        return x.masked_fill((p < s.epsilon_cutoff[:, None]) & (p < most), NEG_INF)

    def apply_eta(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 11c: with H = -sum p ln p, drop tokens with p < min(eta, sqrt(eta) * exp(-H))
        (``eta_cutoff`` float32 [B], 0 = off), never the most likely ones. Not in place."""
        logp = torch.log_softmax(x, dim=-1)
        p = logp.exp()
        entropy = -self.row_sum(torch.where(p > 0, p * logp, 0.0), keepdim=True)
        eta = s.eta_cutoff[:, None]
        cutoff = torch.minimum(eta, eta.sqrt() * torch.exp(-entropy))
        most = p.amax(dim=-1, keepdim=True)
        return x.masked_fill((p < cutoff) & (p < most), NEG_INF)

    def apply_top_k_top_p(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Steps 12-13 by a full sort (the reference; fast backends avoid the sort).

        top_k int32 [B] (0 = off): keep logits >= the k-th largest. top_p float32 [B] (1 = off):
        keep the smallest most-likely set whose mass >= top_p of what is left, ties at the
        boundary kept, never fewer than one token. Not in place."""
        if s.any_top_k:
            x = self.apply_top_k(x, s)
        if s.any_top_p:
            x = self.apply_top_p(x, s)
        return x

    def apply_top_k(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 12 alone; see ``apply_top_k_top_p``."""
        V = x.shape[-1]
        k = s.top_k.to(torch.long).clamp(max=V)
        ordered = torch.sort(x, dim=-1, descending=True).values
        kth = ordered.gather(1, (k - 1).clamp(min=0)[:, None])            # (B, 1)
        keep = (x >= kth) | (k == 0)[:, None]
        return x.masked_fill(~keep, NEG_INF)

    def apply_top_p(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 13 alone; see ``apply_top_k_top_p``. Mass is summed in float64."""
        probs = torch.softmax(x, dim=-1)
        ordered = torch.sort(probs, dim=-1, descending=True).values
        return x.masked_fill(~nucleus_keep(probs, ordered, s.top_p), NEG_INF)

    def apply_typical_p(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 13a: over the probabilities left, H = -sum p log p and score = |-log p - H|;
        keep the smallest set of lowest-score tokens whose mass >= typical_p (ties at the
        boundary kept, never fewer than one token). ``typical_p`` float32 [B], 1 = off. Mass
        summed in float64, by a full sort (the reference). Not in place."""
        keep = typical_keep(x, s.typical_p, self.row_sum) | (s.typical_p >= 1.0)[:, None]
        return x.masked_fill(~keep, NEG_INF)

    def apply_tfs(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 13c, tail-free sampling (``tfs`` float32 [B], 1 = off): the kept probabilities
        sorted descending, q_1 >= ... >= q_n (n <= 2: nothing happens); the second differences
        |q_i - 2 q_(i+1) + q_(i+2)|, i = 1..n-2, normalised to sum 1 (uniform when their sum
        is <= 1e-6); keep q_1..q_j for the smallest j whose running sum passes ``tfs`` (j =
        n - 2 when none does), with every token tied with q_j. Sums in float64, by a full sort
        (the reference). Not in place."""
        if x.shape[-1] <= 2:        # every row keeps n <= 2 tokens (and XLA cannot sum 0 columns)
            return x
        p = torch.softmax(x, dim=-1)
        q = torch.sort(p, dim=-1, descending=True).values.double()
        n = (x > NEG_INF).sum(dim=-1, keepdim=True)
        threshold = q.gather(1, tail_free_length(q, n, s.tfs, self.row_sum) - 1).to(p.dtype)
        keep = (p >= threshold) | (n <= 2) | (s.tfs >= 1.0)[:, None]
        return x.masked_fill(~keep, NEG_INF)

    def apply_p_less(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 13d, p-less: drop tokens with p < L, L = sum p**2 ("plain") or (V sum p**2 - 1)
        / (V - 1) ("norm", V the vocabulary); ``p_less`` int32 [B]: ``pipeline.P_LESS_MODES``,
        0 = off. Never the most likely tokens. Not in place."""
        p = torch.softmax(x, dim=-1)
        collision = self.row_sum(p * p, keepdim=True)
        V = x.shape[-1]
        norm = (V * collision - 1.0) / max(V - 1, 1)
        mode = s.p_less[:, None]
        level = torch.where(mode == pipeline.P_LESS_MODES["norm"], norm, collision)
        most = p.amax(dim=-1, keepdim=True)
        return x.masked_fill((mode != pipeline.P_LESS_OFF) & (p < level) & (p < most), NEG_INF)

    def apply_xtc(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 13b, XTC: with probability ``xtc_probability`` (float32 [B], 0 = off; the coin
        from ``row_uniforms`` on the XTC stream), when two or more kept tokens have probability
        >= ``xtc_threshold``, drop all of them but those with the smallest such probability.
        Not in place."""
        p = torch.softmax(x, dim=-1)
        above = (x > NEG_INF) & (p >= s.xtc_threshold[:, None])
        smallest = torch.where(above, p, float("inf")).amin(dim=-1, keepdim=True)
        coin = self.row_uniforms(s, STREAM_XTC) < s.xtc_probability
        act = (above.sum(dim=-1) >= 2) & coin
        return x.masked_fill(above & (p > smallest) & act[:, None], NEG_INF)

    def apply_mirostat(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 14, mirostat v2 (``mirostat_tau`` float32 [B], 0 = off): drop the tokens whose
        surprise -log2 p exceeds the row's ``mirostat_mu`` (float32 [B], the batch's state),
        never the most likely ones; the draw then takes the renormalised rest. Not in place."""
        dropped = selectors.mirostat_dropped(torch.log_softmax(x, dim=-1), s.mirostat_mu, s.mirostat_tau)
        return x.masked_fill(dropped, NEG_INF)

    def apply_adaptive_p(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 14, adaptive-p (``adaptive_p_target`` float32 [B], < 0 = off): each kept token's
        logit becomes 5 - 10 u**2 / (1 + u), u = |p - a| / 0.3, a = clamp(2 target - w / s, 0,
        1) from the row's state (``adaptive_p_weighted`` w, ``adaptive_p_total`` s, float32
        [B]); dropped tokens stay -inf. Not in place."""
        shaped = selectors.adaptive_logits(torch.softmax(x, dim=-1), s.adaptive_p_target,
                                           s.adaptive_p_weighted, s.adaptive_p_total)
        return torch.where((s.adaptive_p_target >= 0)[:, None] & (x > NEG_INF), shaped, x)

    def draw(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 14: int64 [B] by the Gumbel-max race ``argmax(x + gumbel)`` over kept tokens
        (x float32 [B, V], dropped tokens -inf). Seeded rows use the contract's noise
        function; others this sampler's generator. Never waits on the host."""
        B, V = x.shape
        noise = torch.zeros_like(x)
        if s.any_unseeded:
            u = torch.rand(x.shape, generator=self.generator, device=x.device)
            noise = gumbel_from_uniform(u)
        if s.any_seeded:
            keys = row_keys(s.seed_lo, s.seed_hi, s.child, s.position)[:, None]
            vocab = torch.arange(V, dtype=torch.int32, device=x.device)[None, :]
            noise = torch.where(s.seeded[:, None], seeded_gumbel(keys, vocab), noise)
        return torch.argmax(x + noise, dim=-1)
