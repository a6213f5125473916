"""Verification's judges: the target distribution at the draft slots of one block, read
from the block's candidates, cuts and whole rows (see ``corelib_cpu.block``).

:class:`SlotJudge` serves the token rule (``Verification.rejection_sample``),
:class:`BlockJudge` block verification (``Verification.block_verify``), both in
``corelib_cpu.verification``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from corelib.sampler import NEG_INF

from .block import Block
from .draw import draw_from_weights, race_seeded_candidates, race_unseeded_candidates
from .select import nucleus_contains

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
    ``tokens`` int64 [n]: the draft judged at each row of the block (0 at bonus slots);
    ``generator``: the sampler's, for the unseeded draws."""

    def __init__(self, blk: Block, tokens: torch.Tensor, generator: Optional[torch.Generator]):
        self.blk, self.generator, self.workspace = blk, generator, blk.workspace
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
        out = self.workspace.take("verify_p", (self.V,))
        if place is None:
            blk.densify([row])
            return torch.softmax(blk.x[row], dim=-1, out=out)
        x = self.workspace.take("verify_x", (self.V,)).fill_(NEG_INF)
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
                w = self.blk.row_weights([row], "verify_weights")[0]
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
            residual = torch.add(w, q, alpha=-total, out=self.workspace.take("verify_residual", (self.V,)))
            token, ok = draw_from_weights(residual.clamp_(min=0.0)[None], self.generator)
            if not bool(ok[0]):                        # all zero: p itself
                token, _ = draw_from_weights(w[None], self.generator)
            self.drawn.append((key, int(token[0])))
            return
        if place is None:
            p, ids = self.exact(row), None
            residual = torch.sub(p, q, out=self.workspace.take("verify_residual", (self.V,)))
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
            column = int(draw_from_weights(residual[None], self.generator)[0][0])
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
            column = race_unseeded_candidates(weights.log(), self.generator)
            tokens = ids.gather(1, column)[:, 0].tolist()
            self.drawn += [(key, token) for (_, _, key), token in zip(self.batched, tokens)]
        return self.drawn


class BlockJudge(SlotJudge):
    """Block verification (``corelib.Sampler.block_verify``: its rule and its arithmetic) at
    the draft slots of a block. ``spans``: block-local row r -> k_r, its drafts up to the first
    slot without a token (rows left out are not judged); drafts with their probabilities q
    float32 [b, K, V]. :meth:`judge` finds each row's stop tau, :meth:`draw` and
    :meth:`residual_draws` the tokens of the rows that stop before their last draft.

    Seeded rows decide with the reference's p at their slots, the softmax of the slot's final
    row (candidates written out, cuts applied; many slots in one softmax over a workspace
    buffer), and the reference's float64 operations for w_i, R_i, h_i and the residual, which
    they race with the contract's noise: the reference's tokens. (A candidate row sums its
    residual mass over its candidates, zero elsewhere: the same terms in another order, as the
    reference's own sum takes with another thread count; a decision moves only where u lies
    within float64 rounding of h.) Rows whose exact p costs more than a softmax first try
    bounds on p(d) (:meth:`draft_bounds`): a seeded candidate row's candidates' softmax lies
    within ``tolerance`` of the reference's p (see ``select.top_p_candidates_fast``), and a
    pending top-p cut gives p(d) = r(d) / M with top_p <= M <= 1 without its threshold. The
    bounds bound every w_i; a row whose tests they settle (all drafts kept, or none, with the
    residual at slot 0) needs the exact p at slot 0 at most, the others take it at their
    slots. Unseeded rows need only the target distribution: whole rows take the reference's
    softmax with float32 residuals, candidate rows their candidates' softmax (it differs
    from the reference's in float32 rounding only, which no draw can see).

    A candidate slot whose draft is not a kept candidate has p(d) = 0 exactly: the row's later
    weights are 0 and their slots need no softmax. Each row's tau is found from the longest
    prefix down (:meth:`stop`): the test of the whole span needs no residual (h_k = w_k), a
    prefix with u_i above a bound of h_i fails without one, and any other prefix's residual
    mass R_i is summed only when every longer test failed; the residual drawn at tau is the
    one its test summed."""

    def __init__(self, blk: Block, drafts, spans: dict, generator: Optional[torch.Generator]):
        B, K = drafts.token_ids.shape
        self.S = K + 1
        ids = drafts.token_ids.clamp(min=0)
        self.tokens = torch.cat([ids, torch.zeros_like(ids[:, :1])], dim=1).view(-1)
        super().__init__(blk, self.tokens, generator)
        self.spans = spans
        self.q = drafts.probs
        self.q_draft = self.q.gather(2, ids[..., None])[..., 0].tolist()     # q_j(d_j)
        self.seeded = blk.plan.seeded
        self.kept_draft = []                # candidate place -> its draft is a kept candidate
        if blk.cand is not None:
            hit = (blk.cand.ids == self.tokens[blk.cand.index][:, None]) & (blk.cand.values > NEG_INF)
            self.kept_draft = hit.any(dim=-1).tolist()
        self.p_rows: dict = {}              # block row -> float32 [V], the reference's p
        self.p_d: dict = {}                 # block row -> the reference's p(d), a float
        self.kept = None                    # (slot, residual, its mass, p, ids) of the last sum
        self.candidate_draws = []           # unseeded candidate rows' draws: (key, weights, ids)
        # R_i <= w_i sum(p_i) and h_i = R_i / (R_i + 1 - w_i) grows with R_i, so h_i <=
        # w_i max(sum(p_i), 1). A float32 softmax's values sum to 1 within (V + 8) 2**-24 (its
        # sum of V terms, and an exp and a division per value), widened by 1%; the
        # reference's are the same values, the candidates' sum closer still.
        self.mass_bound = 1.0 + 1.01 * (self.V + 8) * 2.0 ** -24

    def bounded(self, v: int) -> bool:
        """Block row v is judged from bounds first: its exact p costs more than its bounds
        (a seeded candidate row: the reference's softmax reads V values, the bounds W; a row
        whose top-p cut is pending: the exact p needs the cut's threshold)."""
        return (v in self.at and self.seeded[v]) or self.pending_cut(v) is not None

    def pending_cut(self, v: int):
        """(the Cut, place) of block row v when its top-p threshold is still unknown."""
        found = self.blk.cuts.get(v)
        if found is None or found[0].cut[found[1]] is not None or found[0].top_p is None:
            return None
        return found

    def judge(self, u: list) -> dict:
        """row -> tau for every judged row (``u``: float [b, K], the block stream's uniforms)."""
        taus = {}
        for r, k in self.spans.items():
            if self.bounded(r * self.S):
                tau = self.bounded_stop(r, k, u[r])
                if tau is not None:
                    taus[r] = tau
        self.exact_slots([r for r in self.spans if r not in taus])
        for r, k in self.spans.items():
            if r not in taus:
                taus[r] = self.stop(r, k, u[r])
        return taus

    def exact_slots(self, rows: list) -> None:
        """The reference's p at the judged slots of ``rows``, in one softmax: every slot of a
        whole row; a candidate row's up to its first draft that is not a kept candidate (w is
        0 after it); none of an unseeded candidate row's."""
        whole, candidates = [], []
        for r in rows:
            for v in range(r * self.S, r * self.S + self.spans[r]):
                place = self.at.get(v)
                if place is None:
                    whole.append(v)
                elif self.seeded[v]:
                    if not self.kept_draft[place]:
                        break
                    candidates.append(v)
        slots = whole + candidates
        if not slots:
            return
        p = self.dense_probs(whole, candidates)
        p_d = p.gather(1, self.tokens[torch.tensor(slots, dtype=torch.long)][:, None])[:, 0].tolist()
        for i, v in enumerate(slots):
            self.p_rows[v], self.p_d[v] = p[i], p_d[i]

    def dense_probs(self, whole: list, candidates: list) -> torch.Tensor:
        """float32 [m, V]: the reference's softmax of the final rows of ``whole`` (block rows
        not in the candidate set) then ``candidates`` (candidate rows), into the workspace."""
        workspace, blk = self.workspace, self.blk
        n = len(whole) + len(candidates)
        logits = workspace.take("block_x", (n, self.V))
        if whole:
            blk.densify(whole)
            torch.index_select(blk.x, 0, torch.tensor(whole, dtype=torch.long), out=logits[:len(whole)])
        if candidates:
            places = torch.tensor([self.at[v] for v in candidates], dtype=torch.long)
            logits[len(whole):].fill_(NEG_INF).scatter_(1, blk.cand.ids[places], blk.cand.values[places])
        return torch.softmax(logits, dim=-1, out=workspace.take("block_p", (n, self.V)))

    def bounded_stop(self, r: int, k: int, u: list) -> Optional[int]:
        """tau for row r from bounds on its weights (:meth:`draft_bounds`), or None when they
        do not settle it (then :meth:`stop` decides with the reference's p). Settles tau = 0
        (every test fails for every w within the bounds; the residual at slot 0 has w_0 = 1,
        exact) from the upper bounds, and tau = k (the whole span's test passes for every w_k
        within them) from the lower ones, found only then."""
        high = self.bounded_weights(r, k, upper=True)
        if high is None:
            return None
        if u[k - 1] > high[k]:
            if all(u[i - 1] > high[i] * self.mass_bound for i in range(1, k)):
                return 0
            return None
        low = self.bounded_weights(r, k, upper=False)
        return k if low is not None and u[k - 1] <= low[k] else None

    def bounded_weights(self, r: int, k: int, upper: bool) -> Optional[list]:
        """[w_0 .. w_k] from the upper (or lower) bounds of each p_j(d_j), None where a slot
        has none: bounds on the reference's weights, since w_(j+1) grows with w_j and p_j(d_j)."""
        w = [1.0]
        for j in range(k):
            bounds = self.draft_bounds(r * self.S + j, upper)
            if bounds is None:
                return None
            w.append(next_weight(w[-1], bounds, self.q_draft[r][j]))
        return w

    def draft_bounds(self, v: int, upper: bool) -> Optional[float]:
        """An upper (or lower) bound on the reference's p(d) at block row v without its
        softmax, or None. A candidate row: 0 for a draft that is not a kept candidate, else its
        candidates' softmax within ``tolerance`` (relative; none for subnormal values). A
        pending top-p cut with probabilities r before it: p(d) = r(d) / M, M the nucleus mass,
        top_p <= M <= sum(r) ~ 1, for d in the nucleus (``nucleus_contains``, asked for the
        lower bound only), 0 outside; float32 rounding within ``NUCLEUS_MASS_SLACK``, as in
        :meth:`SlotJudge.bounded_test`."""
        place = self.at.get(v)
        if place is not None:
            if not self.kept_draft[place]:
                return 0.0
            p = self.p_draft[place]
            if not self.seeded[v]:
                return p                    # an unseeded row's own target
            if p < 2.0 ** -100:
                return None
            return p * (1.0 + self.tolerance) if upper else p * (1.0 - self.tolerance)
        found = self.pending_cut(v)
        if found is None:
            return None
        record, j = found
        token = self.tokens[v:v + 1]
        r_d, top_p = float(record.weights[j][token]), record.top_p[j]
        if upper:
            return r_d / top_p * (1.0 + NUCLEUS_MASS_SLACK)
        inside = bool(nucleus_contains(record.weights[j][None], token, torch.tensor([top_p]))[0])
        return r_d * (1.0 - NUCLEUS_MASS_SLACK) if inside else 0.0

    def stop(self, r: int, k: int, u: list) -> int:
        """tau for row r with k drafts judged, by the reference's p (``u``: float [K], the
        block stream's uniforms of its slots): the largest i with ``u[i - 1] <= h_i``, 0 if
        none."""
        w = self.weights_of(r, k)
        for i in range(k, 0, -1):
            if i == k:
                h = w[k]
            elif u[i - 1] > w[i] * self.mass_bound:      # h_i <= w_i (1 + gamma) < u: fails
                continue
            elif w[i] > 0:
                mass = self.residual(r, i, w[i])
                denominator = mass + 1.0 - w[i]
                h = mass / max(denominator, 1e-300) if denominator > 0 else 1.0
            else:                           # R_i = sum max(0 - q, 0) = 0
                h = 0.0
            if u[i - 1] <= h:
                return i
        return 0

    def weights_of(self, r: int, k: int) -> list:
        """[w_0 .. w_k] (Python floats: float64 as the reference's), w_0 = 1 and w_(j+1) =
        min(w_j p_j(d_j) / q_j(d_j), 1)."""
        w = [1.0]
        for j in range(k):
            v = r * self.S + j
            p_d = self.p_d.get(v)
            if p_d is None:
                # a candidate row's: 0 for a draft that is not a kept candidate, the candidates'
                # softmax for an unseeded row; a seeded row has the reference's up to there
                # (exact_slots), and w = 0 after it
                place = self.at[v]
                p_d = self.p_draft[place] if self.kept_draft[place] and not self.seeded[v] else 0.0
            w.append(next_weight(w[-1], p_d, self.q_draft[r][j]))
        return w

    def target(self, v: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """p at block row v: (float32 [V], None) for a whole row; (float32 [W], the
        candidates' ids) for a candidate row: the reference's p there (seeded) or the
        candidates' softmax (unseeded)."""
        place = self.at.get(v)
        if place is None:                   # settled by bounds, a whole row's slot 0 needs it
            p = self.p_rows.get(v)
            return (self.exact(v) if p is None else p), None
        ids = self.blk.cand.ids[place]
        if not self.seeded[v]:
            return self.probs[place], ids
        p = self.p_rows.get(v)
        return (self.exact(v) if p is None else p)[ids], ids

    def residual(self, r: int, i: int, w: float) -> float:
        """R_i = sum_x max(w p_i(x) - q_i(x), 0) at row r's slot i (float64 for seeded rows,
        as the reference sums it), keeping the residual for :meth:`draw`."""
        v = r * self.S + i
        p, ids = self.target(v)
        q = self.q[r, i] if ids is None else self.q[r, i][ids]
        if self.seeded[v]:
            res64 = (w * p.double() - q.double()).clamp_(min=0.0)
            res, mass = res64.float(), float(res64.sum())
        else:
            res = torch.sub(p * w, q).clamp_(min=0.0)
            mass = float(res.sum())
        self.kept = (v, res, mass, p, ids)
        return mass

    def draw(self, r: int, tau: int) -> None:
        """Record the token row r emits at slot tau (< its k): a draw from max(w_tau p_tau -
        q_tau, 0) renormalised (p_tau where that is all zero), with step 14's noise at the
        slot; made now, or with the block's other unseeded candidate rows
        (:meth:`residual_draws`)."""
        v = r * self.S + tau
        if self.kept is None or self.kept[0] != v:
            self.residual(r, tau, self.weights_of(r, tau)[tau])
        _, res, mass, p, ids = self.kept
        weights = res if mass > 0 else p
        if self.seeded[v]:
            self.drawn.append(((r, tau), self.race(v, weights, ids)))
        elif ids is not None:
            self.candidate_draws.append(((r, tau), weights, ids))
        else:
            self.drawn.append(((r, tau), int(draw_from_weights(weights[None], self.generator)[0][0])))

    def residual_draws(self) -> list:
        """[((row, slot), token)] for every row that stopped before its last draft."""
        if self.candidate_draws:
            weights = torch.stack([weights for _, weights, _ in self.candidate_draws])
            columns = race_unseeded_candidates(weights.log(), self.generator)[:, 0].tolist()
            self.drawn += [(key, int(ids[column]))
                           for (key, _, ids), column in zip(self.candidate_draws, columns)]
            self.candidate_draws = []
        return self.drawn


def next_weight(w: float, p_d: float, q_d: float) -> float:
    """Block verification's w_(j+1) = min(w_j p_j(d_j) / q_j(d_j), 1), 0 once w_j is 0, as the
    reference computes it in float64 (a draft the draft model could not draw but the target
    can has ratio inf). Non-decreasing in w and in p_d."""
    if w <= 0:
        return 0.0
    ratio = p_d / q_d if q_d > 0 else (math.inf if p_d > 0 else 0.0)
    return min(w * ratio, 1.0)
