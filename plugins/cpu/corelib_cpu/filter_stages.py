"""Steps 9-13b of the ``cpu`` backend (greedy's argmax and the filters), on a block of rows.

Mixed into :class:`~corelib_cpu.sampler.CpuSampler`; each ``apply_*`` method overrides the
reference's stage of the same name (``corelib.Sampler``) and takes and returns a
:class:`~corelib_cpu.block.Block`, updated in place. What differs from the reference:

- step 9 uses group maxima (``rowops``) instead of torch.argmax;
- step 10a (top-n-sigma) computes the reference's mean and deviation with the same float32
  reductions, and cuts each row with one threshold pass;
- step 11 (min-p) keeps its cut pending (:class:`~corelib_cpu.block.Cut`) until a stage reads
  the row;
- step 12 selects candidates (k-th value and ties as the reference) from group maxima;
  when every random row of a block has a top-k, step 10 divides the candidates only;
- step 13 on candidates uses the candidates' own softmax when an error bound proves it picks
  the reference's tokens (else the reference's softmax of the masked row); on whole rows it
  keeps the probabilities as a pending cut: the draw tries a token first and keeps it when it
  is in the nucleus (``select.nucleus_contains``), and only rows that miss, or a later stage
  that reads the row, find the threshold by a radix select over the probabilities' bits
  (``select.nucleus_threshold``);
- step 13a (typical-p) computes the reference's log-softmax, entropy and scores and replaces
  its sort by a radix select over the scores' bits with float64 masses (``filters``);
- step 13b (XTC) first tosses each row's coin, and only rows whose coin says so compute
  anything: the reference's softmax, and the rule on the row's few largest logits.

Shapes: ``n`` rows of a block, ``V`` vocabulary.
"""

from __future__ import annotations

import torch
from corelib import StepState
from corelib.noise import STREAM_XTC
from corelib.sampler import NEG_INF

from .block import Block, Candidates, Cut, pick_rows, runs, take_rows
from .filters import top_n_sigma_thresholds, typical_rows_, xtc_rows_
from .rowops import first_argmax
from .select import kth_largest, mask_below, top_k_candidates, top_p_candidates, top_p_candidates_fast


class FilterStages:
    """Steps 9-13b of :class:`~corelib_cpu.sampler.CpuSampler` (which provides ``workspace``
    and the core's ``row_uniforms``)."""

    #: Extra candidate columns beyond the largest top_k, to catch ties at the k-th value
    #: without masking the whole row.
    TIE_SLACK = 8

    def argmax(self, x: Block) -> torch.Tensor:
        """Step 9: int64 [n], the lowest id among each row's maxima, from the group maxima
        (and the row maxima, when step 5's are still x's)."""
        if x.unread is not None:
            return first_argmax(x.unread.source, x.maxima(), x.top, rows=x.unread.rows)
        return first_argmax(x.x, x.maxima(), x.top)

    def apply_temperature(self, x: Block, s: StepState) -> Block:
        """Step 10 in place on every row of the block (greedy rows divide by 1), dividing while
        copying when x is still the caller's; skipped when the block divides its top-k
        candidates only (``BlockPlan.candidates_only``: ``apply_top_k_top_p`` does it)."""
        bp = x.plan
        if bp.candidates_only:
            return x
        top = x.top
        if x.owned:
            x.x.div_(bp.temperature)
        else:
            out = self.workspace.take("x", tuple(x.x.shape))
            x.x, x.owned = torch.div(x.x, bp.temperature, out=out), True
        x.changed()
        # x / T rounds monotonically, so the maxima divided are the divided row's maxima
        x.top = None if top is None else top / bp.temperature
        return x

    def apply_top_n_sigma(self, x: Block, s: StepState) -> Block:
        """Step 10a on the rows that use it (``s.top_n_sigma`` float32 [n], 0 = off): tokens
        below max - n * sigma over the row's finite logits -> -inf, in place, one threshold
        pass per row; the threshold is the reference's, bit for bit
        (``filters.top_n_sigma_thresholds``)."""
        xx = x.own()
        top = x.top
        kept_maxima = top is not None
        for r0, r1 in runs(x.plan.top_n_sigma_rows):
            row_top = None if top is None else top[r0:r1]
            thresholds = top_n_sigma_thresholds(xx[r0:r1], s.top_n_sigma[r0:r1], row_top, self.workspace)
            if kept_maxima:                    # each row's maximum survives its own cut
                kept_maxima = bool((thresholds <= row_top[:, 0]).all())
            below = torch.nextafter(thresholds, torch.tensor(NEG_INF)).tolist()
            for row, value in zip(range(r0, r1), below):
                torch.threshold_(xx[row], value, NEG_INF)      # keeps x > below, i.e. x >= threshold
        x.changed()
        x.top = top if kept_maxima else None
        x.dropped = True
        return x

    def apply_min_p(self, x: Block, s: StepState) -> Block:
        """Step 11 on the rows with min_p > 0: tokens whose probability is < min_p * the
        row's largest are cut (a :class:`~corelib_cpu.block.Cut`; x is masked when a later stage reads it)."""
        rows = x.plan.min_p_rows
        sub, index = take_rows(x.x, rows, x.plan)
        probs = torch.softmax(sub, dim=-1, out=self.workspace.take("min_p_probs", tuple(sub.shape)))
        # amax is NaN when probs hold a NaN: the row then keeps nothing
        cut = x.plan.min_p[index][:, None] * probs.amax(dim=-1, keepdim=True)
        x.set_cut(rows, probs, cut)
        later = set(x.plan.top_k_rows) | set(x.plan.top_p_rows)
        x.apply_cuts([row for row in rows if row in later])
        return x

    def apply_top_k_top_p(self, x: Block, s: StepState) -> Block:
        """Steps 12-13: top-k rows become candidate rows (``top_k_rows``); top-p on
        candidates (``top_p_candidate_rows``) or on whole rows as a pending cut
        (``top_p_whole_rows``)."""
        bp = x.plan
        if bp.top_k_rows:
            self.top_k_rows(x, bp.top_k_rows)                                   # step 12
        if bp.top_p_rows:                                                       # step 13
            if x.cand is not None and len(x.cand.rows) == bp.n:     # every row a candidate row
                whole = []
            else:
                candidate_rows = x.candidate_rows
                whole = [i for i in bp.top_p_rows if i not in candidate_rows]
            if len(whole) < len(bp.top_p_rows):
                self.top_p_candidate_rows(x.cand, bp.top_p, x.x.shape[1])
            if whole:
                self.top_p_whole_rows(x, whole)
        return x

    def apply_typical_p(self, x: Block, s: StepState) -> Block:
        """Step 13a on the rows with typical_p < 1, as whole rows: their final logits so far
        (candidates and cuts written out), then the reference's kept set
        (``filters.typical_rows_``) applied in place, runs of consecutive rows at a time."""
        rows = x.plan.typical_p_rows
        x.densify(rows)
        xx = x.own()
        for r0, r1 in runs(rows):
            typical_rows_(xx[r0:r1], s.typical_p[r0:r1], self.workspace)
        x.changed()
        x.dropped = True
        return x

    def apply_xtc(self, x: Block, s: StepState) -> Block:
        """Step 13b: each XTC row's coin first (``row_uniforms`` on the XTC stream, as the
        reference); rows whose coin says act lose every kept token with probability >=
        xtc_threshold but the least likely of them, when two or more are (the reference's
        rule on the reference's softmax of the row, among its few largest logits:
        ``filters.xtc_rows_``), in place, runs of consecutive rows at a time. Rows whose coin
        says no are untouched."""
        coin = (self.row_uniforms(s, STREAM_XTC) < s.xtc_probability).tolist()
        rows = [row for row in x.plan.xtc_rows if coin[row]]
        if not rows:
            return x
        x.densify(rows)
        xx = x.own()
        changed = False
        for r0, r1 in runs(rows):
            changed |= xtc_rows_(xx[r0:r1], s.xtc_threshold[r0:r1], self.workspace)
        if changed:
            x.changed()
        return x


    def top_k_rows(self, blk: Block, rows: list) -> None:
        """Step 12 for the given rows of blk.x float32 [n, V] (top_k int64 [n], 1..V there),
        as candidates (blk.cand). When the block divides candidates only (see
        ``BlockPlan.candidates_only``), the candidates are divided by the temperature here.

        Rows whose ties at the k-th value may run past the candidate columns are masked in
        place in x (divided first where needed) and left out of the candidates (their next
        stages take the whole row)."""
        bp = blk.plan
        blk.apply_cuts(rows)
        sub, index = take_rows(blk.x, rows, bp)
        k = pick_rows(bp.top_k, rows, bp)
        width = min(blk.x.shape[1], bp.top_k_max + self.TIE_SLACK)
        divide = bp.candidates_only and bp.temperature_on
        temperature = pick_rows(bp.temperature, rows, bp) if divide else None
        maxima = blk.maxima() if sub is blk.x else None
        values, ids, complete = top_k_candidates(sub, k, width, temperature, maxima)
        if not bool(complete.all()):
            spill = (~complete).nonzero().flatten()
            spilled = index[spill]
            x = blk.own()
            whole = x[spilled] if temperature is None else x[spilled] / temperature[spill]
            x[spilled] = mask_below(whole, kth_largest(values[spill], k[spill]))
            blk.changed()
            for row in spilled.tolist():       # x now holds their min-p cut and more
                blk.cuts.pop(row, None)
                blk.masked.discard(row)
            keep = complete.nonzero().flatten()
            if keep.numel() == 0:
                return
            values, ids, index = values[keep], ids[keep], index[keep]
        blk.cand = Candidates(index.tolist(), index, values, ids)

    def top_p_candidate_rows(self, cand: Candidates, top_p: torch.Tensor, V: int) -> None:
        """Step 13 on candidate rows (top_p float32 [n] per block row; 1 keeps all).

        From the softmax of the candidates alone when that provably picks the reference's
        tokens (``select.top_p_candidates_fast``); the other rows take the reference's
        softmax of the whole masked row."""
        p = top_p if len(cand.rows) == top_p.shape[0] else top_p[cand.index]
        values, settled = top_p_candidates_fast(cand.values, p)
        if not bool(settled.all()):
            rows = (~settled).nonzero().flatten()
            masked_rows = torch.full((rows.numel(), V), NEG_INF)
            masked_rows.scatter_(1, cand.ids[rows], cand.values[rows])
            probs = torch.softmax(masked_rows, dim=-1).gather(1, cand.ids[rows])
            values[rows] = top_p_candidates(cand.values[rows], probs, p[rows])
        cand.values = values

    def top_p_whole_rows(self, blk: Block, rows: list) -> None:
        """Step 13 on whole rows of blk.x float32 [n, V] (top_p float32 [n], < 1 there): their
        probabilities, kept as a pending cut (see :class:`~corelib_cpu.block.Cut`; x is masked when read)."""
        blk.apply_cuts(rows)                        # min-p first: top-p renormalises
        sub, index = take_rows(blk.x, rows, blk.plan)
        probs = torch.softmax(sub, dim=-1, out=self.workspace.take("top_p_probs", tuple(sub.shape)))
        top_p = blk.plan.top_p[index].tolist()
        blk.attach(Cut(rows, probs, [None] * len(rows), top_p))
