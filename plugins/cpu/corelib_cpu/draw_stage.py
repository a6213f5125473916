"""Step 14 of the ``cpu`` backend, the draw, on a block of rows.

Mixed into :class:`~corelib_cpu.sampler.CpuSampler`. Candidate rows race with noise for the
candidates only (seeded rows with the contract's noise, so their tokens are the reference's),
whole seeded rows race with the contract's noise for the tokens that can still win
(``draw.draw_seeded_rows``), and whole unseeded rows race the same way with keys from the
generator where their logits are their final distribution, else draw with one uniform per
row through the inverse CDF. A pending top-p cut (:class:`~corelib_cpu.block.Cut`) is tried
before its threshold is known: a token drawn from the whole row is kept when it is in the
nucleus. Shapes: ``n`` rows of a block, ``V`` vocabulary, ``W`` candidates.
"""

from __future__ import annotations

from typing import Optional

import torch
from corelib import StepState
from corelib.noise import token_offsets

from .block import Block, Candidates, Cut, pick_rows, rows_of, runs
from .draw import (candidate_winners, draw_from_weights, draw_seeded_rows, race_seeded_candidates,
                   race_unseeded_candidates, race_unseeded_rows)
from .plan import BlockPlan
from .rowops import TRUE, is_finite
from .select import nucleus_contains



class DrawStage:
    """Step 14 of :class:`~corelib_cpu.sampler.CpuSampler` (which provides ``workspace``,
    ``generator`` and ``_offsets``, a dict)."""

    #: Logits per chunk of the seeded whole-row race (its three buffers stay in L2).
    NOISE_CHUNK = 1 << 17
    #: Draws from the whole distribution a top-p row tries before it finds its threshold.
    NUCLEUS_TRIES = 2

    def draw(self, x: Block, s: StepState) -> torch.Tensor:
        """Step 14 for the block's random rows: int64 [n] token ids (greedy rows 0: the
        template takes their argmax). Candidate rows race over their candidates, whole rows
        draw from their kept probabilities or race with the contract's noise (see the module
        docstring). Records ``drawn_finite`` for ``drawn_is_finite``.

        Whole rows in ``s.undrawn`` (verification's draft slots judged by the ratio test,
        whose draw nothing reads) are not drawn: their id is 0 and their ``drawn_finite``
        says whether the row's largest logit is finite, which is whether any draw from it
        would be (float32 overflow leaves +inf at the top, and a top token is always kept)."""
        bp = x.plan
        n = bp.n
        cand, candidate_rows = x.cand, x.candidate_rows
        if cand is not None and len(cand.rows) == n:           # the common top-k block
            if not bp.any_seeded or len(bp.seeded_rows) == n:
                won = candidate_winners(cand.values, cand.ids, s.keys if bp.any_seeded else None,
                                        self.generator, cand.arrays(), self.workspace, s.keys_array)
                if won is not None:
                    x.drawn_finite = won[1]
                    if won[2]:             # every winner finite: flag_invalid may hand it on
                        self.workspace.true_flags = won[1]
                    return won[0]
            pos = self.race_candidates(cand, bp, s.keys)
            x.drawn_finite = is_finite(cand.values.gather(1, pos)[:, 0])
            return cand.ids.gather(1, pos)[:, 0]
        undrawn = s.undrawn
        if candidate_rows or undrawn:
            whole = [i for i in bp.random_rows if i not in candidate_rows and i not in undrawn]
        else:
            whole = bp.random_rows
        if len(whole) == n:
            # every row drawn from its weights or raced: ``ok`` (a positive finite total, a
            # finite winning score) already says that the token's logit is finite
            ids, x.drawn_finite = self.draw_whole(x, whole, s.keys)
            return ids
        tokens = torch.zeros(n, dtype=torch.long)
        ok = None
        if whole:
            ids, ok = self.draw_whole(x, whole, s.keys)
            tokens[bp.index(whole)] = ids
            ok = torch.ones(n, dtype=torch.bool).index_put_((bp.index(whole),), ok)
        finite = self.finite_at(x.x, tokens)
        for r0, r1 in runs(sorted(row for row in undrawn if row not in candidate_rows)):
            finite[r0:r1] = is_finite(x.x[r0:r1].amax(dim=1))
        if cand is not None:
            pos = self.race_candidates(cand, bp, s.keys)
            tokens[cand.index] = cand.ids.gather(1, pos)[:, 0]
            finite[cand.index] = is_finite(cand.values.gather(1, pos)[:, 0])
        x.drawn_finite = finite if ok is None else finite & ok
        return tokens

    def drawn_is_finite(self, x: Block, final: Block, token_ids: torch.Tensor, s: StepState) -> torch.Tensor:
        """bool [n]: the chosen token's logit is finite where it was chosen (step 9's x for
        greedy rows, the final distribution for random rows: see ``draw``). False where
        float32 overflowed after step 5."""
        if final.drawn_finite is None:                         # every row greedy
            if final.top is not None:     # x is still step 5's, whose valid rows' maxima are finite
                return TRUE
            return self.finite_at(final.x, token_ids)
        if not final.plan.any_greedy:
            return final.drawn_finite
        return torch.where(s.greedy, self.finite_at(final.x, token_ids), final.drawn_finite)

    @staticmethod
    def finite_at(x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """bool [n]: x[row, tokens[row]] is finite (tokens int64 [n], all in [0, V))."""
        return is_finite(x.gather(1, tokens[:, None])[:, 0])

    def race_candidates(self, cand: Candidates, bp: BlockPlan, keys: Optional[torch.Tensor]) -> torch.Tensor:
        """int64 [nc, 1]: each candidate row's winning column (seeded rows: the contract's
        noise for the candidates' ids; the others: this sampler's generator)."""
        if len(cand.rows) == bp.n:          # every row of the block: its places are its rows
            seeded = bp.seeded_rows
        else:
            seeded = [i for i, row in enumerate(cand.rows) if bp.seeded[row]]
        if not seeded:
            return race_unseeded_candidates(cand.values, self.generator)
        row_keys = keys[cand.index]
        if len(seeded) == len(cand.rows):
            return race_seeded_candidates(cand.values, cand.ids, row_keys)
        pos = race_unseeded_candidates(cand.values, self.generator)
        sel = torch.tensor(seeded, dtype=torch.long)
        pos[sel] = race_seeded_candidates(cand.values[sel], cand.ids[sel], row_keys[sel])
        return pos

    def draw_whole(self, blk: Block, rows: list, keys: Optional[torch.Tensor]):
        """(int64 [m] token ids, bool [m] ok) for whole rows (block-local, ascending): seeded
        rows by the contract's race over their final logits, the others by the inverse CDF
        over their kept probabilities or exp(x - max)."""
        bp = blk.plan
        if rows is bp.random_rows:
            seeded, unseeded = bp.random_seeded, bp.random_unseeded
        else:
            seeded = [row for row in rows if bp.seeded[row]]
            unseeded = [row for row in rows if not bp.seeded[row]]
        if not seeded:
            return self.draw_unseeded_whole(blk, unseeded)
        if not unseeded:
            return self.draw_seeded_whole(blk, seeded, keys)
        at = {row: j for j, row in enumerate(rows)}
        merged = torch.empty(len(rows), dtype=torch.long)
        merged_ok = torch.empty(len(rows), dtype=torch.bool)
        for subset, (ids, ok) in ((seeded, self.draw_seeded_whole(blk, seeded, keys)),
                                  (unseeded, self.draw_unseeded_whole(blk, unseeded))):
            where = torch.tensor([at[row] for row in subset], dtype=torch.long)
            merged[where], merged_ok[where] = ids, ok
        return merged, merged_ok

    def draw_unseeded_whole(self, blk: Block, rows: list):
        """(int64 [m] ids, bool [m] ok) for unseeded whole rows: rows whose x is their final
        distribution (no cut, or one applied to x) race as seeded rows do with keys from the
        generator (``draw.race_unseeded_rows``); the others, and the rows the race declines,
        draw through the inverse CDF over their kept probabilities (pending top-p cuts first
        from the whole distribution, ``draw_in_nucleus``)."""
        record, at = blk.common_cut(rows)
        if record is not None and record.pending(at) == at:
            return self.draw_in_nucleus(record, at)
        if not any(row in blk.cuts and row not in blk.masked for row in rows):
            won = race_unseeded_rows(pick_rows(blk.x, rows, blk.plan), self.generator, self.workspace)
            if won is not None:
                return won
        return draw_from_weights(blk.weights_of(rows), self.generator, self.workspace)

    def draw_in_nucleus(self, record: Cut, at: list):
        """Unseeded draws from pending top-p cuts (places ``at`` of ``record``) without their
        thresholds: a token drawn from the whole distribution is kept when it is in the
        nucleus (rejection sampling: an accepted token follows the renormalised nucleus
        exactly); rows rejected ``NUCLEUS_TRIES`` times resolve their cut and draw from it.
        A row's acceptance rate is its nucleus mass, >= top_p."""
        probs = rows_of(record.weights, at)
        top_p = torch.tensor([record.top_p[j] for j in at], dtype=torch.float32)
        ids, ok = draw_from_weights(probs, self.generator, self.workspace)
        settled = nucleus_contains(probs, ids, top_p) | ~ok
        for _ in range(self.NUCLEUS_TRIES - 1):
            if bool(settled.all()):
                return ids, ok
            redo = (~settled).nonzero()[:, 0]
            again, again_ok = draw_from_weights(probs[redo], self.generator, self.workspace)
            ids[redo], ok[redo] = again, again_ok
            settled[redo] = nucleus_contains(probs[redo], again, top_p[redo]) | ~again_ok
        if not bool(settled.all()):
            redo = (~settled).nonzero()[:, 0]
            places = [at[j] for j in redo.tolist()]
            record.resolve(places, self.workspace)
            ids[redo], ok[redo] = draw_from_weights(rows_of(record.weights, places), self.generator,
                                                   self.workspace)
        return ids, ok

    def draw_seeded_whole(self, blk: Block, rows: list, keys: torch.Tensor):
        """(int64 [m] ids, bool [m] ok) for seeded whole rows: the reference's race over their
        final logits. Rows of one cut not yet applied to x race with the cut's weights as
        the mask (``draw.draw_seeded_rows``: no masked copy of x is written). When the
        rows' top-p cuts are all pending they race over the whole row first: when the
        winner is in the nucleus it also wins among the kept tokens (the lowest id of the
        best score over a superset); the others resolve their cut and race over the kept
        tokens. Every other row races over x masked by its cuts (``apply_cuts`` resolves
        those still pending)."""
        bp = blk.plan
        record, at = blk.common_cut(rows)
        row_keys = pick_rows(keys, rows, bp)
        pending = None if record is None else record.pending(at)
        if pending == [] and not any(row in blk.masked for row in rows):
            return self.race_rows(pick_rows(blk.x, rows, bp), row_keys, rows_of(record.weights, at))
        if pending is None or pending != at:
            blk.apply_cuts(rows)
            return self.race_rows(pick_rows(blk.x, rows, bp), row_keys)
        x = pick_rows(blk.x, rows, bp)
        ids, ok = self.race_rows(x, row_keys)
        top_p = torch.tensor([record.top_p[j] for j in at], dtype=torch.float32)
        settled = nucleus_contains(rows_of(record.weights, at), ids, top_p)
        if not bool(settled.all()):
            redo = (~settled).nonzero()[:, 0]
            places = [at[j] for j in redo.tolist()]
            record.resolve(places, self.workspace)
            ids[redo], ok[redo] = self.race_rows(x[redo], row_keys[redo], rows_of(record.weights, places))
        return ids, ok

    def race_rows(self, x: torch.Tensor, keys: torch.Tensor, kept: Optional[torch.Tensor] = None):
        """The contract's seeded race over whole rows x float32 [m, V] with keys int32 [m]
        (``draw.draw_seeded_rows``; ``kept``: weights whose zeros drop tokens too)."""
        return draw_seeded_rows(x, keys, self.offsets(x.shape[1]), self.workspace, self.NOISE_CHUNK, kept)

    def offsets(self, V: int) -> torch.Tensor:
        """int32 [V]: every token's share of the seeded hash (``token_offsets``), made once."""
        offsets = self._offsets.get(V)
        if offsets is None:
            offsets = self._offsets[V] = token_offsets(torch.arange(V))
        return offsets
