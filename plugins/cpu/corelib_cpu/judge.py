"""Verification's judges: the target distribution at the draft slots of one block, read
from the block's candidates, cuts and whole rows (see ``corelib_cpu.sampler``).

:class:`SlotJudge` serves the token rule (``CpuSampler.rejection_sample``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from corelib.sampler import NEG_INF

from .draw import draw_from_weights, race_seeded_candidates, race_unseeded_candidates
from .select import nucleus_contains

if TYPE_CHECKING:
    from .sampler import Block, CpuSampler

#: Relative slack on the bounds of ``SlotJudge.bounded_test``: each float32 probability is
#: within a few ulps of its exact value, so p(d), r(d) and the kept mass the reference sums
#: are all within ~1e-6 of exact; 1e-3 is a wide margin that still settles most slots.
NUCLEUS_MASS_SLACK = 1e-3


class SlotJudge:
    """The target distribution p at a verification block's draft slots, for
    ``rejection_sample``: the ratio test of each slot, and the residual draw of each row's
    rejected slot.

    Candidate rows (top-k) use the candidates' softmax, computed once for the block: the
    reference's softmax of the whole row differs from it by at most (2W + 4) float32 ulps
    per value (see ``select.top_p_candidates_fast``), so a seeded slot whose ratio test lies
    within twice that takes the reference's softmax, and a seeded row's residual always does
    (its draw must be the reference's token). Their unseeded residual draws run together, over
    the candidates (the residual is 0 elsewhere). Whole rows use the reference's softmax of
    the slot's final row. Seeded residual draws race with the contract's noise over the
    residual's support, the reference's token; unseeded ones draw from the residual itself.
    ``tokens`` int64 [n]: the draft judged at each row of the block (0 at bonus slots)."""

    def __init__(self, sampler: CpuSampler, blk: Block, tokens: torch.Tensor):
        self.sampler, self.blk = sampler, blk
        self.V = blk.x.shape[1]
        cand = blk.cand
        self.at = {} if cand is None else {row: j for j, row in enumerate(cand.rows)}
        if cand is not None:
            self.probs = torch.softmax(cand.values, dim=-1)
            hit = cand.ids == tokens[cand.index][:, None]
            self.p_draft = (self.probs * hit).sum(dim=-1).tolist()   # one candidate at most
            self.tolerance = (4 * cand.values.shape[1] + 40) * 2.0 ** -24
        self.batched: list = []            # unseeded candidate rows' rejections: (place, q, key)
        self.drawn: list = []              # (key, token) of the other rejections
        self.totals: dict = {}             # unseeded whole row -> its weights' sum
        self.computed = None               # (row, weights) last computed into "verify_weights"

    def exact(self, row: int) -> torch.Tensor:
        """float32 [V]: the reference's softmax of the row's final logits (a workspace row,
        valid until the next call)."""
        blk = self.blk
        place = self.at.get(row)
        out = self.sampler.workspace.take("verify_p", (self.V,))
        if place is None:
            self.sampler.densify(blk, [row])
            return torch.softmax(blk.x[row], dim=-1, out=out)
        x = self.sampler.workspace.take("verify_x", (self.V,)).fill_(NEG_INF)
        x.scatter_(0, blk.cand.ids[place], blk.cand.values[place])
        return torch.softmax(x, dim=-1, out=out)

    def weights(self, row: int) -> tuple[torch.Tensor, float]:
        """An unseeded whole row's final distribution, unnormalised, and its sum: the weights
        its draw used, or computed now (into a buffer of their own)."""
        w = next((weights[rows.index(row)] for rows, weights in self.blk.weights if row in rows), None)
        if w is None:
            if self.computed is not None and self.computed[0] == row:
                w = self.computed[1]          # a rejected slot's weights, made by its ratio test
            else:
                w = self.sampler.row_weights(self.blk, [row], "verify_weights")[0]
                self.computed = (row, w)      # the buffer holds them until the next row's
        total = self.totals.get(row)
        if total is None:
            total = self.totals[row] = float(w.sum())
        return w, total

    def passes(self, row: int, token: int, uq: float) -> bool:
        """The ratio test ``u q(d) < p(d)`` at the slot of ``row``, with the reference's p(d)
        (an unseeded whole row: its draw weights, normalised; see :meth:`bounded_test`
        for a whole row whose top-p threshold is still unknown)."""
        place = self.at.get(row)
        if place is None:
            verdict = self.bounded_test(row, token, uq)
            if verdict is not None:
                return verdict
            if not self.blk.plan.seeded[row]:
                w, total = self.weights(row)
                return uq < float(w[token]) / total
            return uq < float(self.exact(row)[token])
        p = self.p_draft[place]
        if not self.blk.plan.seeded[row]:
            return uq < p
        if uq < p * (1.0 - self.tolerance):
            return True
        if uq >= p * (1.0 + self.tolerance):
            return False
        return uq < float(self.exact(row)[token])

    def bounded_test(self, row: int, token: int, uq: float) -> Optional[bool]:
        """The ratio test of a whole row whose top-p cut is pending, decided without its
        threshold where bounds settle it, else None (the caller resolves the cut). A
        verdict is the one the reference's p(d) gives, so seeded rows use it too.

        With r the row's probabilities before the cut and M the nucleus mass, p(d) is r(d)
        / M for d in the nucleus and 0 outside, and min(top_p, total) <= M <= total, the
        total within float32 rounding of 1 (``NUCLEUS_MASS_SLACK`` covers rounding; a pending
        cut has top_p < 1): a test that fails with p(d) at its upper bound r(d) / top_p
        fails, and one that passes at r(d) passes once d is known to be in the nucleus
        (``nucleus_contains``, a threshold pass and a sum instead of the radix select)."""
        found = self.blk.cuts.get(row)
        if found is None:
            return None
        record, j = found
        if record.cut[j] is not None or record.top_p is None:
            return None
        r = record.weights[j]
        r_token = float(r[token])
        if uq >= r_token / record.top_p[j] * (1.0 + NUCLEUS_MASS_SLACK):
            return False
        if uq < r_token * (1.0 - NUCLEUS_MASS_SLACK):
            inside = nucleus_contains(r[None], torch.tensor([token]), torch.tensor([record.top_p[j]]))
            if bool(inside[0]):
                return True
        return None

    def reject(self, row: int, q: torch.Tensor, key) -> None:
        """Record the residual draw of a rejected slot (``q`` float32 [V], the draft's
        distribution there): made now, or with the block's other unseeded candidate rows."""
        place = self.at.get(row)
        seeded = self.blk.plan.seeded[row]
        if place is not None and not seeded:
            self.batched.append((place, q, key))
            return
        if place is None and not seeded:
            # max(w / S - q, 0) scaled by S: the residual's own distribution
            w, total = self.weights(row)
            residual = torch.add(w, q, alpha=-total, out=self.sampler.workspace.take("verify_residual", (self.V,)))
            token, ok = draw_from_weights(residual.clamp_(min=0.0)[None], self.sampler.generator)
            if not bool(ok[0]):                        # all zero: p itself
                token, _ = draw_from_weights(w[None], self.sampler.generator)
            self.drawn.append((key, int(token[0])))
            return
        if place is None:
            p, ids = self.exact(row), None
            residual = torch.sub(p, q, out=self.sampler.workspace.take("verify_residual", (self.V,)))
        else:
            ids = self.blk.cand.ids[place]
            p = self.exact(row)[ids]
            residual = p - q[ids]
        residual.clamp_(min=0.0)
        if not bool((residual > 0).any()):
            residual = p
        if seeded:
            token = self.race(row, residual, ids)
        else:
            column = int(draw_from_weights(residual[None], self.sampler.generator)[0][0])
            token = column if ids is None else int(ids[column])
        self.drawn.append((key, token))

    def race(self, row: int, weights: torch.Tensor, ids: Optional[torch.Tensor]) -> int:
        """The contract's seeded race over ``log(weights)`` where weights > 0 (the reference's
        race over the whole row: the others are -inf there); ids: the weights' token ids
        (None: the vocabulary)."""
        support = (weights > 0).nonzero()[:, 0]
        if support.numel() == 0:                           # NaN (a flagged row): no token
            return 0
        tokens = support if ids is None else ids[support]
        key = self.blk.state.keys[row:row + 1]
        column = race_seeded_candidates(weights[support].log()[None], tokens[None], key)
        return int(tokens[column[0, 0]])

    def residual_draws(self) -> list:
        """[(key, token)] for every rejected slot."""
        if self.batched:
            cand = self.blk.cand
            places = torch.tensor([place for place, _, _ in self.batched], dtype=torch.long)
            ids = cand.ids[places]
            q = torch.stack([q_row[ids[i]] for i, (_, q_row, _) in enumerate(self.batched)])
            p = self.probs[places]
            residual = (p - q).clamp_(min=0.0)
            empty = ~(residual > 0).any(dim=-1, keepdim=True)
            weights = torch.where(empty, p, residual)
            column = race_unseeded_candidates(weights.log(), self.sampler.generator)
            tokens = ids.gather(1, column)[:, 0].tolist()
            self.drawn += [(key, token) for (_, _, key), token in zip(self.batched, tokens)]
        return self.drawn
