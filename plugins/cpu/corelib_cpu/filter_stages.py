"""Steps 9-13d of the ``cpu`` backend (greedy's argmax and the filters), on a block of rows.

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
- step 13a (typical-p) on candidates computes the reference's rule in float64 where a margin
  proves it keeps the reference's set (``select.typical_candidates``; in a few-row block of
  top-k rows, inside the compiled call of steps 11-13, ``candidate_chain``); on whole rows it
  computes the reference's log-softmax, entropy and scores and replaces its sort by a radix
  select over the scores' bits with float64 masses (``filters``);
- step 13b (XTC) first tosses each row's coin, and only rows whose coin says so compute
  anything: the reference's softmax, and the rule on the row's few largest logits;
- the fourth release's filters run on their own rows only (``BlockPlan.stage_rows``): a
  dynamic temperature (step 10) computes the reference's entropy in workspace buffers;
  smoothing (10b) is one compiled pass with the reference's float32 products in its order
  (``kernels.smooth_rows``; torch into workspace buffers without numba); top-a, epsilon, eta,
  tail-free and p-less (11a-11c, 13c, 13d) compute the reference's probabilities and level and
  keep their rows as a pending cut, like min-p; tail-free sorts with numpy's vectorised sort;
- step 14's adaptive-p transforms its rows in place, its arithmetic in one compiled pass
  with the reference's bits (``kernels.adaptive_rows``; torch into workspace buffers
  without numba).

Shapes: ``n`` rows of a block, ``V`` vocabulary.
"""

from __future__ import annotations

import math

import torch
from corelib import StepState, pipeline, selectors
from corelib.noise import STREAM_XTC
from corelib.sampler import NEG_INF, dynamic_divisor, min_p_drops, tail_free_length

from . import kernels
from .block import Block, Candidates, Cut, pick_rows, runs, take_rows
from .filters import top_n_sigma_thresholds, typical_rows_, xtc_rows_
from .rowops import GROUP, KERNEL_ROWS, first_argmax, searches_groups
from .select import (MIN_P_MARGIN, TYPICAL_LOWEST, TYPICAL_MASS_MARGIN, kth_largest, mask_below,
                     min_p_of_candidates, top_k_candidates, top_p_candidates, top_p_candidates_fast, top_p_tolerance,
                     typical_candidates, typical_score_margin)
from .workspace import numpy_view


class _Rows:
    """Some rows' values of the step state, by name (what ``Sampler.dynamic_temperature``
    reads)."""

    def __init__(self, **values):
        self.__dict__.update(values)


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
        maxima, arrays, out = x.maxima(), None, None
        if x.top_pair is not None and x.top is x.top_pair[0] and x.maxima_array() is not None:
            arrays = (x.maxima_array(), x.top_pair[1][:, 0])
            out = self.workspace.fresh("argmax_ids", x.plan.n, torch.long)
        return first_argmax(x.x, maxima, x.top, arrays=arrays, out=out)

    def apply_temperature(self, x: Block, s: StepState) -> Block:
        """Step 10 in place on every row of the block (greedy rows divide by 1), dividing while
        copying when x is still the caller's; skipped when the block divides its top-k
        candidates only (``BlockPlan.candidates_only``: ``apply_top_k_top_p`` does it)."""
        bp = x.plan
        if bp.candidates_only:
            return x
        top = x.top
        temperature, argmax_only = bp.temperature, None
        if bp.dynatemp_rows:
            temperature, argmax_only = self.dynamic_temperatures(x, s)
        if x.owned:
            x.x.div_(temperature)
        else:
            out = self.workspace.take("x", tuple(x.x.shape))
            x.x, x.owned = torch.div(x.x, temperature, out=out), True
        x.changed()
        # x / T rounds monotonically, so the maxima divided are the divided row's maxima
        x.top = None if top is None else top / temperature
        if argmax_only:
            for row in argmax_only:            # T' = 0: the row's argmax tokens alone
                torch.threshold_(x.x[row], float(torch.nextafter(x.x[row].amax(), torch.tensor(NEG_INF))),
                                 NEG_INF)
            x.dropped = True
        return x

    def dynamic_temperatures(self, x: Block, s: StepState) -> tuple[torch.Tensor, list]:
        """Step 10's divisors when some row of the block has a dynamic temperature: (float32
        [n, 1], the plan's static ones with the dynamic rows' from the reference's
        ``dynamic_temperature`` on those rows, bit for bit; the block rows whose T' is 0,
        which keep their argmax tokens only)."""
        bp = x.plan
        rows = bp.dynatemp_rows
        index = bp.index(rows)
        sub = x.x.index_select(0, index)
        view = _Rows(dynatemp_range=s.dynatemp_range[index], dynatemp_exponent=s.dynatemp_exponent[index],
                     greedy=s.greedy[index])
        t, argmax_only = self.dynamic_temperature(sub, bp.temperature[index, 0], view)
        temperature = bp.temperature.index_copy(0, index, t[:, None])
        return temperature, [row for row, only in zip(rows, argmax_only.tolist()) if only]

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
        row's largest are cut (a :class:`~corelib_cpu.block.Cut`; x is masked when a later stage reads it).
        Blocks whose min-p rows are all top-k rows (``BlockPlan.min_p_on_candidates``) cut
        them in ``top_k_rows`` instead, on the candidates."""
        if x.plan.min_p_makes_candidates:
            return self.min_p_candidates(x, s)
        if x.plan.min_p_on_candidates:        # step 12 judges it on its candidates
            return x
        return self.min_p_whole_rows(x, x.plan.min_p_rows)

    def min_p_whole_rows(self, x: Block, rows: list) -> Block:
        """Step 11 on whole rows (block-local ``rows``): a pending cut, applied at once to
        the rows a later top-k or top-p reads."""
        sub, index = take_rows(x.x, rows, x.plan)
        probs = torch.softmax(sub, dim=-1, out=self.workspace.take("min_p_probs", tuple(sub.shape)))
        # amax is NaN when probs hold a NaN: the row then keeps nothing
        cut = x.plan.min_p[index][:, None] * probs.amax(dim=-1, keepdim=True)
        x.set_cut(rows, probs, cut)
        later = set(x.plan.top_k_rows) | set(x.plan.top_p_rows)
        x.apply_cuts([row for row in rows if row in later])
        return x

    #: Most tokens a min-p row's candidates hold (``min_p_candidates``); a row with more
    #: takes the whole-row cut.
    MIN_P_CANDIDATES = 2048

    def min_p_candidates(self, x: Block, s: StepState) -> Block:
        """Step 11 in a one-row block whose row has no top-k (``BlockPlan.min_p_makes_candidates``;
        steps 10 and 11 on the candidates only): the tokens whose logit reaches max + T (ln
        min_p - twice the settling margin) are the only ones min-p can keep (x / T is within a
        few 1e-7 of exact), found through the group maxima (``kernels.collect_above``); sorted
        and divided by T they become the row's candidates, min-p's rule applied to them
        (``select.min_p_of_candidates``, the reference's softmax where a candidate lies near
        the threshold). A row with more than ``MIN_P_CANDIDATES`` such tokens (or a NaN) is
        divided in full and cut as a whole row, as without this route.

        Where the block's group maxima and row maximum have numpy views (a few-row block),
        the whole route is one compiled call (``kernels.min_p_chain``, the same bits) into
        the workspace's buffers; a row it does not settle takes the steps one by one."""
        bp = x.plan
        row = bp.min_p_rows[0]
        constants = bp.kernel_args.get("min_p_row")
        if constants is None:                 # the plan's values: read once per plan
            t, min_p = float(bp.temperature[row, 0]), float(bp.min_p[row])
            constants = bp.kernel_args["min_p_row"] = (t, min_p, math.log(min_p) - 2 * MIN_P_MARGIN)
        t, min_p, level = constants
        maxima = x.maxima()
        maxima_array = x.maxima_array()
        held = x.top_pair is not None and x.top is x.top_pair[0] and maxima_array is not None
        if held:
            top = float(x.top_pair[1][row, 0])
        else:
            top = float(maxima[row].amax() if x.top is None else x.top[row, 0])
        found = chained = None
        if math.isfinite(top):
            import numpy as np            # present: this route runs with numba only
            # rounded down to a float32 (the kernel compares in float32)
            threshold = float(np.nextafter(np.float32(top + t * level), np.float32(NEG_INF)))
            if held:
                width = self.MIN_P_CANDIDATES
                values, values_array = self.workspace.pair("min_p_values", (1, width))
                ids, ids_array = self.workspace.pair("min_p_ids", (1, width), torch.long)
                chained = kernels.min_p_chain(x.x, row, maxima_array[row], GROUP, threshold, t, min_p, MIN_P_MARGIN,
                                              (values, ids, values_array, ids_array))
                if chained:
                    x.cand = Candidates([row], bp.index([row]), chained[0], chained[1], chained)
                    return x
            if chained is not False:           # False: too many tokens or a NaN, collect_above's None
                found = kernels.collect_above(x.x[row], maxima[row], GROUP, threshold, self.MIN_P_CANDIDATES)
        if found is None:                      # whole rows, as without candidates
            x.own()[row:row + 1].div_(bp.temperature[row:row + 1])
            x.changed()
            return self.min_p_whole_rows(x, [row])
        values, order = torch.sort(found[0], descending=True)
        ids = found[1][order][None]
        values = (values / bp.temperature[row])[None]
        index = bp.index([row])
        values = self.min_p_candidate_rows(x, index, values, ids, bp.min_p[row:row + 1])
        x.cand = Candidates([row], index, values, ids)
        return x

    def apply_top_k_top_p(self, x: Block, s: StepState) -> Block:
        """Steps 12-13: top-k rows become candidate rows (``top_k_rows``); top-p on
        candidates (``top_p_candidate_rows``) or on whole rows as a pending cut
        (``top_p_whole_rows``)."""
        bp = x.plan
        if bp.top_k_rows and self.candidate_chain(x, s):
            return x
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
        if x.cand is not None:
            if x.cand.typical:                 # the chain of steps 11-13a kept its set
                return x
            rows = self.typical_candidate_rows(x, rows, s.typical_p)
            if not rows:
                return x
        x.densify(rows)
        xx = x.own()
        for r0, r1 in runs(rows):
            typical_rows_(xx[r0:r1], s.typical_p[r0:r1], self.workspace)
        x.changed()
        x.dropped = True
        return x

    def typical_candidate_rows(self, x: Block, rows: list, typical_p: torch.Tensor) -> list:
        """Step 13a (``typical_p`` float32 [n], the block's) on the given rows that are candidate rows (after a cut: top-k, min-p's
        candidates), on their candidates alone where that provably keeps the reference's set
        (``select.typical_candidates``); returns the rows left for the whole-row path (the
        others, and rows the candidates cannot settle). Candidate values are updated in place."""
        cand = x.cand
        arrays = cand.arrays()
        if arrays is not None and len(rows) == len(cand.rows) == x.plan.n:
            # every row of the block, its candidates in the chain's buffers (a few-row step):
            # the kernel reads and writes lent buffers, and the race reads its result as is
            at, index = list(range(len(rows))), None
            shape = tuple(cand.values.shape)
            kept, kept_array = self.workspace.pair("typical_values", shape)
            settled, settled_array = self.workspace.pair("typical_settled", shape[:1], torch.bool)
            found = typical_candidates(cand.values, typical_p, arrays[0], (kept, settled, kept_array, settled_array),
                                       numpy_view(x.plan.kernel_args, "typical_p", typical_p))
            # a list of one or two flags: cheaper than numpy's reduction of them
            if found is not None and all(settled_array.tolist()):
                cand.values, cand.views = kept, (kept, cand.ids, kept_array, arrays[1])
                return []
        else:
            place = {row: j for j, row in enumerate(cand.rows)}
            at = [place[row] for row in rows if row in place]
            if not at:
                return rows
            index = torch.tensor(at, dtype=torch.long) if len(at) < len(cand.rows) else None
            values = cand.values if index is None else cand.values[index]
            found = typical_candidates(values, typical_p[cand.index if index is None else cand.index[index]])
        if found is None:
            return rows
        kept, settled = found
        done = settled.tolist()
        if all(done) and index is None:
            cand.values = kept
        else:
            places = torch.tensor([j for j, ok in zip(at, done) if ok], dtype=torch.long)
            cand.values[places] = kept[settled]
        settled_rows = {cand.rows[j] for j, ok in zip(at, done) if ok}
        return [row for row in rows if row not in settled_rows]

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


    # ---------------------------------------------------------------- the fourth release's
    # Each reads its rows whole (``row_probs``: pending cuts applied, candidates written out)
    # and computes the reference's probabilities and levels with the same float32 operations
    # (so the same bits); a dropping filter keeps its rows as a cut (p >= cut keeps exactly
    # the reference's set: it drops p < level and never a token as likely as the largest, so
    # cut = min(level, largest p)), applied to x only when a later stage reads x.

    def apply_smoothing(self, x: Block, s: StepState) -> Block:
        """Step 10b on the rows with smoothing_factor > 0: the reference's polynomial in the
        same float32 operations, in the same order, on the block's copy (in place); dropped
        tokens stay -inf. Runs of consecutive rows at a time."""
        rows = x.plan.stage_rows["smoothing"]
        if not rows:
            return x
        x.densify(rows)
        xx = x.own()
        for r0, r1 in runs(rows):
            smooth_rows_(xx[r0:r1], s.smoothing_factor[r0:r1, None], s.smoothing_curve[r0:r1, None],
                         self.workspace)
        x.changed()
        return x

    def dynamic_temperature(self, x: torch.Tensor, t: torch.Tensor, s) -> tuple[torch.Tensor, torch.Tensor]:
        """``Sampler.dynamic_temperature`` bit for bit (x float32 [m, V] whole rows, t float32
        [m] static temperatures, ``s`` the rows' dynatemp_range, dynatemp_exponent and greedy):
        the same log-softmax, exp and entropy (a nansum for the reference's where(p > 0): the
        same sum, whose only NaNs are 0 * -inf) in workspace buffers instead of five new
        [m, V] tensors; the per-row arithmetic after it is the core's (``dynamic_divisor``)."""
        shape = tuple(x.shape)
        logp = torch.log_softmax(x, dim=-1, out=self.workspace.take("dynatemp_logp", shape))
        p = torch.exp(logp, out=self.workspace.take("dynatemp_probs", shape))
        kept = (x > NEG_INF).sum(dim=-1)
        entropy = -torch.nansum(torch.mul(p, logp, out=logp), dim=-1)
        return dynamic_divisor(entropy, kept, t, s)

    def apply_top_a(self, x: Block, s: StepState) -> Block:
        """Step 11a on the rows with top_a > 0: p < top_a * max(p)**2 is cut (the reference's
        softmax and product), kept as a cut."""
        rows = x.plan.stage_rows["top_a"]
        if rows:
            probs, index = self.row_probs(x, rows)
            most = probs.amax(dim=-1, keepdim=True)
            x.set_cut(rows, probs, torch.minimum(s.top_a[index][:, None] * most * most, most))
        return x

    def apply_epsilon(self, x: Block, s: StepState) -> Block:
        """Step 11b on the rows with epsilon_cutoff > 0: p < epsilon_cutoff is cut, kept as a
        cut."""
        rows = x.plan.stage_rows["epsilon"]
        if rows:
            probs, index = self.row_probs(x, rows)
            most = probs.amax(dim=-1, keepdim=True)
            x.set_cut(rows, probs, torch.minimum(s.epsilon_cutoff[index][:, None], most))
        return x

    def apply_eta(self, x: Block, s: StepState) -> Block:
        """Step 11c on the rows with eta_cutoff > 0: the reference's log-softmax, its exp and
        entropy (the where(p > 0) of the reference is a nansum here: the same sum, whose only
        NaNs are 0 * -inf), p < min(eta, sqrt(eta) exp(-H)) cut, kept as a cut."""
        rows = x.plan.stage_rows["eta"]
        if not rows:
            return x
        x.densify(rows)
        sub, index = take_rows(x.x, rows, x.plan)
        shape = tuple(sub.shape)
        logp = torch.log_softmax(sub, dim=-1, out=self.workspace.take("eta_logp", shape))
        p = torch.exp(logp, out=self.workspace.take("eta_probs", shape))
        entropy = -torch.nansum(torch.mul(p, logp, out=logp), dim=-1, keepdim=True)
        eta = s.eta_cutoff[index][:, None]
        cutoff = torch.minimum(eta, eta.sqrt() * torch.exp(-entropy))
        x.set_cut(rows, p, torch.minimum(cutoff, p.amax(dim=-1, keepdim=True)))
        return x

    def apply_tfs(self, x: Block, s: StepState) -> Block:
        """Step 13c on the rows with tfs < 1: the reference's rule on the reference's softmax,
        the descending probabilities from a vectorised sort of the values (``sorted_desc``:
        the same sequence as torch's sort, several times faster), then the reference's
        float64 arithmetic (``tfs_thresholds``); p < the row's threshold is cut, kept as a
        cut (rows of two kept tokens or fewer keep them all: a cut of 0)."""
        rows = x.plan.stage_rows["tfs"]
        if not rows:
            return x
        probs, index = self.row_probs(x, rows)
        sub = pick_rows(x.x, rows, x.plan)
        n = (sub > NEG_INF).sum(dim=-1, keepdim=True)
        threshold = tfs_thresholds(sorted_desc(probs), n, s.tfs[index])
        x.set_cut(rows, probs, torch.where(n <= 2, 0.0, threshold))
        return x

    def apply_p_less(self, x: Block, s: StepState) -> Block:
        """Step 13d on the rows with p_less on: p < sum p**2 ("plain") or its normalised form
        (V sum p**2 - 1) / (V - 1) ("norm") is cut, kept as a cut."""
        rows = x.plan.stage_rows["p_less"]
        if not rows:
            return x
        probs, index = self.row_probs(x, rows)
        V = probs.shape[-1]
        square = torch.mul(probs, probs, out=self.workspace.take("p_less_square", tuple(probs.shape)))
        collision = square.sum(dim=-1, keepdim=True)
        norm = (V * collision - 1.0) / max(V - 1, 1)
        level = torch.where(s.p_less[index][:, None] == pipeline.P_LESS_MODES["norm"], norm, collision)
        x.set_cut(rows, probs, torch.minimum(level, probs.amax(dim=-1, keepdim=True)))
        return x

    def apply_mirostat(self, x: Block, s: StepState) -> Block:
        """Step 14, mirostat v2, on its rows (whole rows): the reference's rule
        (``selectors.mirostat_dropped``) on the log-probabilities ``sample_selected`` already
        computed (``Block.source``; the reference's log-softmax of the same logits, else
        computed here), tokens dropped in place."""
        rows = x.plan.stage_rows["mirostat"]
        if not rows:
            return x
        logp, index = self.selector_rows(x, rows)
        dropped = selectors.mirostat_dropped(logp, s.mirostat_mu[index], s.mirostat_tau[index])
        xx = x.own()
        j = 0
        for r0, r1 in runs(rows):
            xx[r0:r1].masked_fill_(dropped[j:j + r1 - r0], NEG_INF)
            j += r1 - r0
        x.changed()
        x.dropped = True
        return x

    def apply_adaptive_p(self, x: Block, s: StepState) -> Block:
        """Step 14, adaptive-p, on its rows (whole rows, in place): the reference's softmax,
        aim and transform (``selectors.adaptive_logits``), the transform in one compiled pass
        per run of rows (``kernels.adaptive_rows``) or in torch into workspace buffers."""
        rows = x.plan.stage_rows["adaptive_p"]
        if not rows:
            return x
        self.selector_rows(x, rows, log=False)
        xx = x.x
        for r0, r1 in runs(rows):
            sub = xx[r0:r1]
            shape = tuple(sub.shape)
            p = torch.softmax(sub, dim=-1, out=self.workspace.take("adaptive_probs", shape))
            aim = selectors.adaptive_aim(s.adaptive_p_target[r0:r1], s.adaptive_p_weighted[r0:r1],
                                         s.adaptive_p_total[r0:r1])
            if not kernels.adaptive_rows(sub, p, aim):
                adaptive_rows_(sub, p, aim, self.workspace)
        x.changed()
        return x

    def selector_rows(self, x: Block, rows: list, log: bool = True):
        """(float32 [m, V] the log-probabilities of the given rows after the filter group,
        or None when ``log`` is False; their indices int64 [m]), the rows made whole rows of
        x whose cuts are forgotten (x holds them): a selector rewrites them."""
        x.densify(rows)
        for row in rows:
            x.cuts.pop(row, None)
            x.masked.discard(row)
        x.own()
        index = x.plan.index(rows)
        if not log:
            return None, index
        if x.source is not None:
            return pick_rows(x.source, rows, x.plan), index
        return torch.log_softmax(x.x.index_select(0, index), dim=-1), index

    def row_probs(self, x: Block, rows: list) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 [m, V] the reference's softmax of the given rows, whole (their pending cuts
        applied, candidates written out), in the workspace; their indices int64 [m])."""
        x.densify(rows)
        sub, index = take_rows(x.x, rows, x.plan)
        probs = torch.softmax(sub, dim=-1, out=self.workspace.take("new_filter_probs", tuple(sub.shape)))
        return probs, index

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
        min_p = pick_rows(bp.min_p, rows, bp) if bp.min_p_on_candidates else None
        if not bool(complete.all()):
            spill = (~complete).nonzero().flatten()
            spilled = index[spill]
            x = blk.own()
            whole = x[spilled] if temperature is None else x[spilled] / temperature[spill]
            if min_p is not None:              # step 11 first, on the whole rows
                whole = whole.masked_fill(min_p_drops(whole, min_p[spill]), NEG_INF)
            x[spilled] = mask_below(whole, kth_largest(values[spill], k[spill]))
            blk.changed()
            for row in spilled.tolist():       # x now holds their min-p cut and more
                blk.cuts.pop(row, None)
                blk.masked.discard(row)
            keep = complete.nonzero().flatten()
            if keep.numel() == 0:
                return
            values, ids, index = values[keep], ids[keep], index[keep]
            min_p = None if min_p is None else min_p[keep]
        if min_p is not None:
            values = self.min_p_candidate_rows(blk, index, values, ids, min_p)
        blk.cand = Candidates(index.tolist(), index, values, ids)

    def candidate_chain(self, blk: Block, s: StepState) -> bool:
        """Steps 11 (when judged on the candidates), 12, 13 and 13a of a block of at most
        ``KERNEL_ROWS`` rows, every one a top-k row with no pending cut, in one compiled call
        (``kernels.candidate_chain``: the kernels ``top_k_rows``, ``top_p_candidate_rows``
        and ``typical_candidate_rows`` call one by one, the same bits; step 13a follows step
        13 in the default order, the only order of these rows). Sets blk.cand and returns
        True when every row is complete and settled; else False, writing nothing (the steps
        then run one by one, with their fallbacks for the rows this cannot settle)."""
        bp = blk.plan
        n, V = blk.x.shape
        params = bp.kernel_args.get("chain")
        if params is None:                     # the plan's rows and parameters: once per plan
            width = min(V, bp.top_k_max + self.TIE_SLACK)
            typical = None
            if bp.typical_p_rows:
                typical = (s.typical_p.clone(), TYPICAL_MASS_MARGIN, typical_score_margin(width), TYPICAL_LOWEST)
            params = bp.kernel_args["chain"] = (
                n <= KERNEL_ROWS and len(bp.top_k_rows) == n and searches_groups(V, width)
                and kernels.wanted() and kernels.chain_params(
                    width, bp.top_k, bp.temperature if bp.candidates_only and bp.temperature_on else None,
                    bp.min_p if bp.min_p_on_candidates else None, MIN_P_MARGIN,
                    bp.top_p if bp.top_p_rows else None, top_p_tolerance(width), typical))
        if not params or blk.cuts:
            return False
        maxima = blk.maxima()
        values, values_array = self.workspace.pair("chain_values", (n, params[0]))
        ids, ids_array = self.workspace.pair("chain_ids", (n, params[0]), torch.long)
        views = (values, ids, values_array, ids_array)
        scratch = self.workspace.pair("chain_scratch", (3, params[0]), torch.float64)[1]
        if kernels.candidate_chain(blk.x, maxima, GROUP, params, views, blk.maxima_array(), scratch) is None:
            return False
        rows = bp.top_k_rows
        blk.cand = Candidates(rows, bp.index(rows), values, ids, views, typical=bool(bp.typical_p_rows))
        return True

    def min_p_candidate_rows(self, blk: Block, index: torch.Tensor, values: torch.Tensor,
                             ids: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
        """Step 11 on top-k candidate rows (``BlockPlan.min_p_on_candidates``): values
        float32 [m, W] (step 10's logits of the candidates, descending, -inf below the k-th),
        ids int64 [m, W], index int64 [m] their block rows, min_p float32 [m] (0 keeps all).
        Returns the values with min-p's dropped tokens at -inf (a new tensor).

        Settled by the candidates' logits alone where no candidate lies near the threshold
        (``select.min_p_of_candidates``); the other rows take the reference's softmax of the
        whole row (x divided by its temperature) at the candidates."""
        values, settled = min_p_of_candidates(values, min_p)
        if not bool(settled.all()):
            bp = blk.plan
            for j in (~settled).nonzero()[:, 0].tolist():
                row = int(index[j])
                whole = blk.x[row:row + 1] / bp.temperature[row:row + 1]
                drops = min_p_drops(whole, min_p[j:j + 1]).gather(1, ids[j:j + 1])
                values[j:j + 1] = values[j:j + 1].masked_fill(drops, NEG_INF)
        return values

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


def smooth_rows_(x: torch.Tensor, f: torch.Tensor, c: torch.Tensor, workspace) -> None:
    """Quadratic smoothing of whole rows x float32 [m, V] in place, bit for bit the
    reference's ``m - (3 - c) / 2 * f * d * d + (c - 1) / 2 * f * d * d * d`` (d = x - m, m the
    row maximum; f, c float32 [m, 1]): the same float32 products in the same order, in one
    compiled pass (``kernels.smooth_rows``) or in torch into workspace buffers; -inf tokens
    stay -inf."""
    m = x.amax(dim=-1, keepdim=True)
    square, cube = (3.0 - c) / 2.0 * f, (c - 1.0) / 2.0 * f
    if kernels.smooth_rows(x, m, square, cube):
        return
    shape = tuple(x.shape)
    d = torch.sub(x, m, out=workspace.take("smooth_d", shape))
    t = torch.mul(square, d, out=workspace.take("smooth_t", shape)).mul_(d)
    u = torch.mul(cube, d, out=workspace.take("smooth_u", shape)).mul_(d).mul_(d)
    torch.sub(m, t, out=t).add_(u)
    torch.where(torch.isneginf(x), x, t, out=x)


def adaptive_rows_(x: torch.Tensor, p: torch.Tensor, aim: torch.Tensor, workspace) -> None:
    """Adaptive-p's transform of whole rows x float32 [m, V] in place by torch, bit for bit
    the reference's ``5 - 10 u u / (1 + u)``, u = ``|p - a| / 0.3`` (``selectors.
    adaptive_logits``; p float32 [m, V], aim float32 [m]): the same float32 operations in the
    same order, into a workspace buffer and p's own (``5 + -t`` is ``5 - t`` exactly);
    tokens at -inf (and NaN) stay."""
    u = torch.sub(p, aim[:, None], out=p).abs_().div_(selectors.ADAPTIVE_WIDTH)
    t = torch.mul(u, 10.0, out=workspace.take("adaptive_t", tuple(x.shape))).mul_(u)
    t.div_(u.add_(1.0)).neg_().add_(5.0)
    torch.where(x > NEG_INF, t, x, out=x)


def sorted_desc(probs: torch.Tensor) -> torch.Tensor:
    """float64 [m, V]: each row of probs float32 [m, V] sorted descending (NaN first, as
    torch's sort), by numpy's vectorised sort where numpy is present (the values are the
    same whichever sort orders them)."""
    try:
        import numpy as np
    except ImportError:                       # torch without numpy: torch's sort
        return torch.sort(probs, dim=-1, descending=True).values.double()
    return torch.from_numpy(np.sort(probs.numpy(), axis=-1)).flip(-1).double()


def tfs_thresholds(q: torch.Tensor, n: torch.Tensor, tfs: torch.Tensor) -> torch.Tensor:
    """float32 [m, 1]: tail-free sampling's probability threshold q_j per row (the core's
    ``tail_free_length``: second differences, their normalised float64 running sum against
    tfs, j), from q float64 [m, V] the row's probabilities
    descending, n int64 [m, 1] its kept tokens and tfs float32 [m]. Compiled where numba is
    (``kernels.tfs_thresholds``, the same bits)."""
    compiled = kernels.tfs_thresholds(q, n, tfs)
    if compiled is not None:
        return compiled
    return q.gather(1, tail_free_length(q, n, tfs) - 1).to(torch.float32)
