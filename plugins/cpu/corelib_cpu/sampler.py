"""The ``cpu`` backend's sampler: the contract's stages at close to memory speed on CPUs.

What differs from the reference (``corelib.Sampler``), stage by stage:

- rows are processed in blocks of about ``BLOCK_ELEMENTS`` logits held in a per-thread
  workspace, so every stage of a block runs on data still in the cache, nothing is
  allocated per step, and no temporary reaches ``B x V``;
- the facts of a step that only change when requests join or leave (which rows use which
  stage, effective parameters, blocks) are kept by the batch (``plan.StepPlan``), so a
  step's Python work is a few dozen tensor calls;
- step 2's copy is made only when a stage writes: rows that only read the logits (top-k
  candidates, the draws, softmax) read the caller's tensor, which is never modified;
- steps 3-8 work in place; penalties touch only the tokens a row has seen, from the running
  slots kept by :class:`~corelib_cpu.batch.CpuBatch`;
- step 9 and step 15's top-N use group maxima (``rowops``) instead of torch.argmax/topk;
- step 12 selects candidates (k-th value and ties as the reference) from group maxima;
  when every random row of a block has a top-k, step 10 divides the candidates only;
- step 13 on candidates uses the candidates' own softmax when an error bound proves it picks
  the reference's tokens (else the reference's softmax of the masked row); on whole rows it
  keeps the probabilities as a pending cut (:class:`Cut`): the draw tries a token first
  and keeps it when it is in the nucleus (``select.nucleus_contains``), and only rows that
  miss, or logprobs of the final distribution, find the threshold by a radix select over
  the probabilities' bits (``select.nucleus_threshold``); the logits are masked only when
  something reads them; masks use thresholds and copysign/min, never boolean fills (which
  run ~40x slower than arithmetic on CPUs);
- step 14 draws candidate rows with noise for the candidates only (seeded rows with the
  contract's noise, so their tokens are the reference's), whole unseeded rows with one
  uniform per row through the inverse CDF, and whole seeded rows with the contract's noise
  for the tokens that can still win (``draw.draw_seeded_rows``).

Every kept set equals the reference's (the conformance suite checks it), and so do seeded
tokens. Shapes: ``B`` rows, ``V`` vocabulary, ``n`` rows of a block, ``W`` candidates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from corelib import Logprobs, Sampler, SamplerOutput, SamplingBatch, StepState
from corelib.noise import token_offsets
from corelib.sampler import INVALID_TOKEN, NEG_INF

from .batch import CpuBatch
from .draw import (
    draw_from_weights,
    draw_seeded_rows,
    exp_weights,
    race_seeded_candidates,
    race_unseeded_candidates,
)
from .plan import BlockPlan, StepPlan, make_plan
from .rowops import count_at_least, first_argmax, group_maxima, is_finite, top_values
from .select import (
    kth_largest,
    mask_below,
    nucleus_contains,
    nucleus_threshold,
    top_k_candidates,
    top_p_candidates,
    top_p_candidates_fast,
)
from .workspace import Workspace


class RowSlice:
    """The step state of rows ``r0:r1``: tensor fields sliced on first use, others as is.

    Duck-types ``StepState`` for the reference's stage methods."""

    def __init__(self, s: StepState, r0: int, r1: int):
        self._s, self._rows = s, slice(r0, r1)

    def __getattr__(self, name):
        value = getattr(self._s, name)
        if isinstance(value, torch.Tensor):
            value = value[self._rows]
        setattr(self, name, value)
        return value


@dataclass
class Candidates:
    """Rows of a block whose kept set is a few candidate tokens (rows with top-k)."""

    rows: list             # block-local rows, ascending
    index: torch.Tensor    # int64 [nc], the same rows
    values: torch.Tensor   # float32 [nc, W], descending before top-p; -inf = dropped
    ids: torch.Tensor      # int64 [nc, W]


@dataclass
class Cut:
    """Whole rows filtered by a probability threshold (min-p, top-p): token t of row
    ``rows[j]`` is kept when its probability is >= ``cut[j]`` (a NaN cut keeps none).
    ``weights`` float32 [m, V]: once the cut is known, the kept probabilities, 0 elsewhere
    (the draw's weights, and where a positive cut leaves the mask).

    A top-p cut starts pending (``cut[j]`` None, ``weights`` the row's probabilities,
    ``top_p[j]`` its parameter): the draw tries tokens of the whole distribution and keeps
    one when it is in the nucleus (:func:`~corelib_cpu.select.nucleus_contains`), and the
    threshold is found (:meth:`CpuSampler.resolve`) only when that fails or the whole kept
    set is read."""

    rows: list
    weights: torch.Tensor
    cut: list
    top_p: Optional[list] = None

    def pending(self, at: list) -> list:
        """The places among ``at`` whose cut is not known yet."""
        return [j for j in at if self.cut[j] is None]


@dataclass
class Block:
    """One block of rows after steps 1-13."""

    plan: BlockPlan
    x: torch.Tensor                      # float32 [n, V]: step 8's logits, divided in place
                                         # by step 10 unless the block divides candidates
                                         # only (candidate rows: see cand; rows with a cut:
                                         # masked when read, see cuts)
    owned: bool                          # x is the workspace's copy (else the caller's rows)
    raw: Optional[torch.Tensor] = None   # float32 [n, V] raw logprobs (step 1), or None
    valid: Optional[torch.Tensor] = None # bool [n]
    greedy_ids: Optional[torch.Tensor] = None   # int64 [n] argmax after step 8
    cand: Optional[Candidates] = None
    cuts: dict = field(default_factory=dict)     # block row -> (its latest Cut, place in it)
    masked: set = field(default_factory=set)     # rows whose cut is applied to x
    top: Optional[torch.Tensor] = None           # float32 [n, 1]: x's row maxima, or None
    _maxima: Optional[torch.Tensor] = None

    @property
    def candidate_rows(self) -> set:
        return set(self.cand.rows) if self.cand is not None else set()

    def maxima(self) -> torch.Tensor:
        """x's group maxima (``rowops.group_maxima``), computed once until x changes."""
        if self._maxima is None:
            self._maxima = group_maxima(self.x)
        return self._maxima

    def changed(self) -> None:
        """x was written: forget what was derived from it."""
        self._maxima = None
        self.top = None


class CpuSampler(Sampler):
    """The ``cpu`` backend (see the module docstring). Block-sized buffers live in
    ``self.workspace`` (one set per thread) and serve every step.

    ``block_elements``: logits per block (rows per block = block_elements // V, at least 1).
    """

    name = "cpu"
    default_device = "cpu"
    batch_class = CpuBatch
    #: Logits per block: 4 MiB of float32, so a block's few live copies stay in L2/L3.
    BLOCK_ELEMENTS = 1 << 20
    #: Logits per chunk of the seeded whole-row race (its three buffers stay in L2).
    NOISE_CHUNK = 1 << 17
    #: Extra candidate columns beyond the largest top_k, to catch ties at the k-th value
    #: without masking the whole row.
    TIE_SLACK = 8
    #: Draws from the whole distribution a top-p row tries before it finds its threshold.
    NUCLEUS_TRIES = 2

    def __init__(self, device: torch.device | str | None = None,
                 generator: Optional[torch.Generator] = None,
                 block_elements: Optional[int] = None):
        super().__init__(device, generator)
        if self.device.type != "cpu":
            raise ValueError(f"the cpu backend runs on CPU tensors, got device {self.device}")
        self.block_elements = int(block_elements or self.BLOCK_ELEMENTS)
        if self.block_elements < 1:
            raise ValueError(f"block_elements must be >= 1, got {block_elements!r}")
        self.workspace = Workspace()
        self._offsets: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------------ public API
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample one token per row. logits ``[B, V]`` or ``[num_requests, V]``, any float
        dtype; never modified."""
        s = self.step_state(logits, batch)
        if s.num_rows == 0:
            return self.empty_output(s)
        plan = self.plan(logits, batch, s)
        keys = plan.row_keys(s)
        request_index = batch.request_index(s.num_rows) if logits.shape[0] != s.num_rows else None
        if len(plan.blocks) == 1:
            token_ids, valid, logprobs = self.sample_block(logits, batch, s, plan, plan.blocks[0],
                                                           keys, request_index)
        else:
            token_ids = torch.empty(s.num_rows, dtype=torch.long)
            valid = torch.empty(s.num_rows, dtype=torch.bool)
            pieces = []
            for bp in plan.blocks:
                ids, ok, lp = self.sample_block(logits, batch, s, plan, bp, keys, request_index)
                token_ids[bp.r0:bp.r1], valid[bp.r0:bp.r1] = ids, ok
                pieces.append(lp)
            logprobs = join_logprobs(pieces) if s.num_logprobs is not None else None
        token_ids = torch.where(valid, token_ids, INVALID_TOKEN)
        return SamplerOutput(token_ids, valid, logprobs)

    def sample_block(self, logits, batch, s, plan, bp, keys, request_index):
        """Steps 1-15 for one block: (int64 [n] ids, bool [n] valid, logprobs or None)."""
        blk = self.run_block(logits, batch, s, plan, bp, request_index)        # steps 1-13
        ids, finite = self.draw_block(blk, keys)                               # step 14
        logprobs = None
        if s.num_logprobs is not None:                                         # step 15
            logprobs = self.block_logprobs(blk, ids, s)
        return ids, blk.valid & finite, logprobs

    def processed_logits(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """float32 ``[B, V]``: the final distribution's logits (steps 2-13; greedy rows stop
        after step 8), dropped tokens -inf: the reference's result, from this backend's stages."""
        s = self.step_state(logits, batch)
        out = torch.empty((s.num_rows, s.vocab_size), dtype=torch.float32)
        if s.num_rows == 0:
            return out
        plan = self.plan(logits, batch, s)
        request_index = batch.request_index(s.num_rows) if logits.shape[0] != s.num_rows else None
        for bp in plan.blocks:
            out[bp.r0:bp.r1] = self.materialize(self.run_block(logits, batch, s, plan, bp, request_index))
        return out

    # ------------------------------------------------------------------ plan
    def plan(self, logits: torch.Tensor, batch: SamplingBatch, s: StepState) -> StepPlan:
        """The step's host facts (see ``plan.StepPlan``), kept by a ``CpuBatch`` until its
        rows change."""
        rows_per_block = max(1, self.block_elements // s.vocab_size)
        sparse = s.any_penalties and isinstance(batch, CpuBatch) and batch.has_penalty_slots
        build = lambda: make_plan(s, rows_per_block, sparse)                   # noqa: E731
        if isinstance(batch, CpuBatch):
            return batch.cached_plan((s.num_rows, rows_per_block), build)
        return build()

    # ------------------------------------------------------------------ steps 1-13
    def run_block(self, logits: torch.Tensor, batch: SamplingBatch, s: StepState, plan: StepPlan,
                  bp: BlockPlan, request_index: Optional[torch.Tensor]) -> Block:
        """Steps 1-13 for the rows of ``bp``."""
        rs = s if len(plan.blocks) == 1 else RowSlice(s, bp.r0, bp.r1)
        blk = self.block_source(logits, bp, request_index)                     # step 2
        if s.num_logprobs is not None and s.logprobs_mode == "raw":             # step 1
            blk.raw = torch.log_softmax(blk.x, dim=-1, out=self.workspace.take("raw", tuple(blk.x.shape)))
        blk.valid = self.mask_block(blk, s, rs)                                 # steps 3-5
        if s.any_bias:
            self.own(blk).scatter_add_(1, rs.bias_ids, rs.bias_values)          # step 6
            blk.changed()
        if s.any_penalties:
            self.penalize_block(blk, batch, rs, plan)                           # steps 7-8
        if bp.any_greedy:
            blk.greedy_ids = first_argmax(blk.x, blk.maxima())                  # step 9
        if not bp.all_greedy:
            self.filter_block(blk)                                              # steps 10-13
        return blk

    def block_source(self, logits: torch.Tensor, bp: BlockPlan,
                     request_index: Optional[torch.Tensor]) -> Block:
        """Step 2, lazily: a Block whose x is the caller's float32 rows when they can be read
        as they are (copied into the workspace by :meth:`own` before any write), else a
        float32 copy in the workspace (per-request logits expanded to rows)."""
        if request_index is None:
            rows = logits[bp.r0:bp.r1]
            if rows.dtype == torch.float32 and rows.is_contiguous():
                return Block(bp, rows, owned=False)
        else:
            rows = logits.index_select(0, request_index[bp.r0:bp.r1])
        x = self.workspace.take("x", (bp.n, logits.shape[1]))
        return Block(bp, x.copy_(rows), owned=True)

    def own(self, blk: Block) -> torch.Tensor:
        """blk.x as the workspace's copy, ready to be written in place."""
        if not blk.owned:
            blk.x = self.workspace.take("x", tuple(blk.x.shape)).copy_(blk.x)
            blk.owned = True
        return blk.x

    def mask_block(self, blk: Block, s: StepState, rs) -> torch.Tensor:
        """Steps 3-5 in place on blk.x float32 [n, V]; returns bool [n] valid rows (no NaN/+inf
        before masking, a token left after it). Invalid rows become zeros, as in the
        reference, so they cannot disturb later stages."""
        finite = None
        if s.any_allowed or s.any_bad_words or s.any_min_tokens:
            x = self.own(blk)
            if s.any_allowed:
                # masked_fill can hide a NaN or +inf; the others below add -inf, which keeps
                # them (NaN + -inf and +inf + -inf are NaN), so one maximum after them is enough.
                top = x.amax(dim=-1)
                finite = ~(torch.isnan(top) | (top == float("inf")))
                x.masked_fill_(~rs.allowed_mask, NEG_INF)                       # step 3
            if s.any_bad_words:
                self.ban_in_place(x, rs.bad_last, self.bad_word_hits(rs))       # step 4
            if s.any_min_tokens:
                pending = (rs.position < rs.min_tokens)[:, None]
                self.ban_in_place(x, rs.stop_ids, rs.stop_valid & pending)      # step 5
            blk.changed()
        # NaN with a NaN, +inf with a +inf, -inf if all masked; from the group maxima when a
        # later stage reads them anyway (greedy rows, candidates of undivided rows) and steps
        # 6-8 do not change x first
        wants_maxima = ((blk.plan.any_greedy or blk.plan.candidates_only)
                        and not (s.any_bias or s.any_penalties))
        top = blk.maxima().amax(dim=-1) if wants_maxima else blk.x.amax(dim=-1)
        valid = is_finite(top) if finite is None else finite & (top > NEG_INF)
        if not bool(valid.all()):
            self.own(blk).masked_fill_(~valid[:, None], 0.0)
            blk.changed()
        else:
            blk.top = top[:, None]
        return valid

    @staticmethod
    def bad_word_hits(rs) -> torch.Tensor:
        """bool [n, W]: bad words whose prefix the row's generated tokens end with (the
        reference's rule; see ``Sampler.apply_bad_words``)."""
        recent = rs.recent[:, None, :]
        matches = ((rs.bad_prefix == recent) | (rs.bad_prefix == -2)).all(dim=-1)
        return matches & rs.bad_valid

    @staticmethod
    def ban_in_place(x: torch.Tensor, ids: torch.Tensor, banned: torch.Tensor) -> None:
        """x[row, ids[row, j]] += -inf where banned[row, j] (the reference's ``_add_at``, in
        place). ids int64 [n, J], banned bool [n, J]."""
        x.scatter_add_(1, ids, torch.where(banned, NEG_INF, 0.0).to(x.dtype))

    def penalize_block(self, blk: Block, batch: SamplingBatch, rs, plan: StepPlan) -> None:
        """Steps 7-8 in place on blk.x float32 [n, V]: repetition penalty over seen tokens,
        then frequency and presence penalties over generated ones. From the batch's slots
        when it keeps them (only the seen tokens are read and written), else from its dense
        counts."""
        x = self.own(blk)
        blk.changed()
        if not plan.sparse_penalties:
            x.copy_(self.apply_penalties(x, rs))
            return
        r0, r1 = blk.plan.r0, blk.plan.r1
        ids, counts, length = batch.penalty_slots(plan.num_rows)
        length = length[r0:r1]
        width = int(length.max())
        if width == 0:
            return
        real = torch.arange(width)[None, :] < length[:, None]                   # (n, width)
        rows, slots = real.nonzero(as_tuple=True)
        flat = rows * x.shape[1] + ids[r0:r1, :width][rows, slots]
        xf = x.view(-1)
        v = xf[flat]
        r = rs.repetition_penalty[rows]
        v = torch.where(v > 0, v / r, v * r)                                    # step 7
        c = counts[r0:r1, :width][rows, slots].to(torch.float32)
        occurred = (c > 0).to(torch.float32)
        # Same expression, in the same order, as the reference's dense step 8.
        xf[flat] = v - rs.frequency_penalty[rows] * c - rs.presence_penalty[rows] * occurred

    def filter_block(self, blk: Block) -> None:
        """Steps 10-13 for the block's random rows (greedy rows have neutral parameters)."""
        bp = blk.plan
        if bp.temperature_on and not bp.candidates_only:
            self.divide(blk)                                                    # step 10
        if bp.min_p_rows:
            self.min_p_rows(blk, bp.min_p_rows)                                 # step 11
        if bp.top_k_rows:
            self.top_k_rows(blk, bp.top_k_rows)                                 # step 12
        if bp.top_p_rows:                                                       # step 13
            candidate_rows = blk.candidate_rows
            whole = [i for i in bp.top_p_rows if i not in candidate_rows]
            if len(whole) < len(bp.top_p_rows):
                self.top_p_candidate_rows(blk.cand, bp.top_p, blk.x.shape[1])
            if whole:
                self.top_p_whole_rows(blk, whole)

    def divide(self, blk: Block) -> None:
        """Step 10 in place on every row of blk.x (greedy rows divide by 1). Divides while
        copying when x is still the caller's."""
        top = blk.top
        if blk.owned:
            blk.x.div_(blk.plan.temperature)
        else:
            out = self.workspace.take("x", tuple(blk.x.shape))
            blk.x, blk.owned = torch.div(blk.x, blk.plan.temperature, out=out), True
        blk.changed()
        # x / T rounds monotonically, so the maxima divided are the divided row's maxima
        blk.top = None if top is None else top / blk.plan.temperature

    def min_p_rows(self, blk: Block, rows: list) -> None:
        """Step 11 on the given rows of blk.x float32 [n, V]: tokens whose probability is
        < min_p * the row's largest are cut (min_p float32 [n]; 0 keeps all). Rows that a
        later stage reads in full get the cut applied to x at once."""
        sub, index = take_rows(blk.x, rows, blk.plan)
        probs = torch.softmax(sub, dim=-1, out=self.workspace.take("min_p_probs", tuple(sub.shape)))
        # amax is NaN when probs hold a NaN: the row then keeps nothing
        cut = blk.plan.min_p[index][:, None] * probs.amax(dim=-1, keepdim=True)
        self.set_cut(blk, rows, probs, cut)
        later = set(blk.plan.top_k_rows) | set(blk.plan.top_p_rows)
        self.apply_cuts(blk, [row for row in rows if row in later])

    def set_cut(self, blk: Block, rows: list, probs: torch.Tensor, cut: torch.Tensor) -> None:
        """Record a cut (see :class:`Cut`) of the given rows: probs float32 [m, V] become the
        kept probabilities in place (see :meth:`threshold_rows`)."""
        record = Cut(rows, probs, [None] * len(rows))
        self.threshold_rows(record, list(range(len(rows))), cut[:, 0].tolist())
        self.attach(blk, record)

    @staticmethod
    def attach(blk: Block, record: Cut) -> None:
        for j, row in enumerate(record.rows):
            blk.cuts[row] = (record, j)
            blk.masked.discard(row)

    @staticmethod
    def threshold_rows(record: Cut, at: list, cuts: list) -> None:
        """Set the cuts of places ``at`` and zero their weights below them, one threshold
        pass per row (``p > the float32 just below the cut`` keeps exactly ``p >= cut``; a
        NaN cut keeps nothing)."""
        below = torch.nextafter(torch.tensor(cuts), torch.tensor(NEG_INF)).tolist()
        for j, cut, value in zip(at, cuts, below):
            torch.threshold_(record.weights[j], value, 0.0)
            record.cut[j] = cut

    def resolve(self, record: Cut, at: list) -> None:
        """Find the pending top-p cuts of places ``at``: the nucleus threshold by histogram
        select over the rows' probabilities (``select.nucleus_threshold``)."""
        at = record.pending(at)
        if not at:
            return
        index = torch.tensor(at, dtype=torch.long)
        probs = record.weights if len(at) == len(record.rows) else record.weights.index_select(0, index)
        top_p = torch.tensor([record.top_p[j] for j in at], dtype=torch.float32)
        threshold = nucleus_threshold(probs, top_p, self.workspace)
        # a row with a NaN (float32 overflow upstream) is NaN throughout: it keeps nothing
        threshold = torch.where(torch.isnan(probs[:, 0]), float("nan"), threshold)
        self.threshold_rows(record, at, threshold.tolist())

    def apply_cuts(self, blk: Block, rows: list) -> None:
        """Mask x where the cut of the given rows drops tokens (-inf), for stages that read
        x itself. A positive cut keeps exactly the tokens with positive weight; a cut of 0
        keeps every token; a NaN cut none."""
        pending = [row for row in rows if row in blk.cuts and row not in blk.masked]
        if not pending:
            return
        x = self.own(blk)
        for row in pending:
            record, j = blk.cuts[row]
            self.resolve(record, [j])
            if record.cut[j] != 0.0:
                # sign(w) - 0.5 is -0.5 where w == 0 and 0.5 where w > 0; copysign makes that
                # -inf / +inf and min() masks. (No subtraction of a tiny value: subnormal
                # results cost a microcode assist each on x86, ~100x an ordinary one.)
                sign = torch.sign(record.weights[j], out=self.workspace.take("sign", (x.shape[1],)))
                torch.minimum(x[row], torch.copysign(_INF, sign.sub_(0.5), out=sign), out=x[row])
            blk.masked.add(row)
        blk.changed()

    def top_k_rows(self, blk: Block, rows: list) -> None:
        """Step 12 for the given rows of blk.x float32 [n, V] (top_k int64 [n], 1..V there),
        as candidates (blk.cand). When the block divides candidates only (see
        ``BlockPlan.candidates_only``), the candidates are divided by the temperature here.

        Rows whose ties at the k-th value may run past the candidate columns are masked in
        place in x (divided first where needed) and left out of the candidates (their next
        stages take the whole row)."""
        bp = blk.plan
        self.apply_cuts(blk, rows)
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
            x = self.own(blk)
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
        probabilities, kept as a pending cut (see :class:`Cut`; x is masked when read)."""
        self.apply_cuts(blk, rows)                        # min-p first: top-p renormalises
        sub, index = take_rows(blk.x, rows, blk.plan)
        probs = torch.softmax(sub, dim=-1, out=self.workspace.take("top_p_probs", tuple(sub.shape)))
        top_p = blk.plan.top_p[index].tolist()
        self.attach(blk, Cut(rows, probs, [None] * len(rows), top_p))

    # ------------------------------------------------------------------ step 14
    def draw_block(self, blk: Block, keys: Optional[torch.Tensor]):
        """Step 14 for a block: (int64 [n] token ids, bool [n] finite): finite is False where
        the drawn token's final logit is not finite (the core's ``drawn_is_finite``: float32
        overflow after step 5 flags the row instead of returning an arbitrary id)."""
        bp = blk.plan
        n = bp.n
        if bp.all_greedy:
            return blk.greedy_ids, self.finite_at(blk.x, blk.greedy_ids)
        cand, candidate_rows = blk.cand, blk.candidate_rows
        whole = [i for i in range(n) if not bp.greedy[i] and i not in candidate_rows]
        if cand is not None and len(cand.rows) == n:           # the common top-k block
            pos = self.race_candidates(cand, bp, keys)
            return cand.ids.gather(1, pos)[:, 0], is_finite(cand.values.gather(1, pos)[:, 0])
        tokens = blk.greedy_ids.clone() if bp.any_greedy else torch.zeros(n, dtype=torch.long)
        ok = None
        if whole:
            ids, ok = self.draw_whole(blk, whole, keys)
            if len(whole) == n:
                tokens = ids
            else:
                tokens[bp.index(whole)] = ids
                ok = torch.ones(n, dtype=torch.bool).index_put_((bp.index(whole),), ok)
        finite = self.finite_at(blk.x, tokens)
        if cand is not None:
            pos = self.race_candidates(cand, bp, keys)
            tokens[cand.index] = cand.ids.gather(1, pos)[:, 0]
            finite[cand.index] = is_finite(cand.values.gather(1, pos)[:, 0])
        return tokens, finite if ok is None else finite & ok

    @staticmethod
    def finite_at(x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """bool [n]: x[row, tokens[row]] is finite (tokens int64 [n], all in [0, V))."""
        return is_finite(x.gather(1, tokens[:, None])[:, 0])

    def race_candidates(self, cand: Candidates, bp: BlockPlan, keys: Optional[torch.Tensor]) -> torch.Tensor:
        """int64 [nc, 1]: each candidate row's winning column (seeded rows: the contract's
        noise for the candidates' ids; the others: this sampler's generator)."""
        seeded = [i for i, row in enumerate(cand.rows) if bp.seeded[row]]
        if not seeded:
            return race_unseeded_candidates(cand.values, self.generator)
        row_keys = keys[bp.r0:bp.r1][cand.index]
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
        """(int64 [m] ids, bool [m] ok): inverse-CDF draws for unseeded whole rows."""
        record, at = self.common_cut(blk, rows)
        if record is not None and record.pending(at) == at:
            return self.draw_in_nucleus(record, at)
        return draw_from_weights(self.weights_of(blk, rows), self.generator)

    def draw_in_nucleus(self, record: Cut, at: list):
        """Unseeded draws from pending top-p cuts (places ``at`` of ``record``) without their
        thresholds: a token drawn from the whole distribution is kept when it is in the
        nucleus (rejection sampling: an accepted token follows the renormalised nucleus
        exactly); rows rejected ``NUCLEUS_TRIES`` times resolve their cut and draw from it.
        A row's acceptance rate is its nucleus mass, >= top_p."""
        probs = rows_of(record.weights, at)
        top_p = torch.tensor([record.top_p[j] for j in at], dtype=torch.float32)
        ids, ok = draw_from_weights(probs, self.generator)
        settled = nucleus_contains(probs, ids, top_p) | ~ok
        for _ in range(self.NUCLEUS_TRIES - 1):
            if bool(settled.all()):
                return ids, ok
            redo = (~settled).nonzero()[:, 0]
            again, again_ok = draw_from_weights(probs[redo], self.generator)
            ids[redo], ok[redo] = again, again_ok
            settled[redo] = nucleus_contains(probs[redo], again, top_p[redo]) | ~again_ok
        if not bool(settled.all()):
            redo = (~settled).nonzero()[:, 0]
            places = [at[j] for j in redo.tolist()]
            self.resolve(record, places)
            ids[redo], ok[redo] = draw_from_weights(rows_of(record.weights, places), self.generator)
        return ids, ok

    def draw_seeded_whole(self, blk: Block, rows: list, keys: torch.Tensor):
        """(int64 [m] ids, bool [m] ok) for seeded whole rows: the reference's race over their
        final logits. Rows with a pending top-p cut race over the whole row first: when the
        winner is in the nucleus it also wins among the kept tokens (the lowest id of the
        best score over a superset); the others resolve their cut and race over the kept
        tokens, with the cut's weights as the mask (x itself stays unmasked)."""
        bp = blk.plan
        record, at = self.common_cut(blk, rows)
        if record is None:
            self.apply_cuts(blk, rows)
        x = pick_rows(blk.x, rows, bp)
        row_keys = keys[bp.r0:bp.r1][bp.index(rows)]
        race = lambda x, keys, kept=None: draw_seeded_rows(                      # noqa: E731
            x, keys, self.offsets(x.shape[1]), self.workspace, self.NOISE_CHUNK, kept)
        if record is None:
            return race(x, row_keys)
        if record.pending(at) != at:
            self.resolve(record, at)
            return race(x, row_keys, rows_of(record.weights, at))
        ids, ok = race(x, row_keys)
        top_p = torch.tensor([record.top_p[j] for j in at], dtype=torch.float32)
        settled = nucleus_contains(rows_of(record.weights, at), ids, top_p)
        if not bool(settled.all()):
            redo = (~settled).nonzero()[:, 0]
            places = [at[j] for j in redo.tolist()]
            self.resolve(record, places)
            ids[redo], ok[redo] = race(x[redo], row_keys[redo], rows_of(record.weights, places))
        return ids, ok

    @staticmethod
    def common_cut(blk: Block, rows: list):
        """(the Cut every given row belongs to and the rows' places in it), or (None, None)."""
        cuts = [blk.cuts.get(row) for row in rows]
        first = cuts[0]
        if first is None or any(c is None or c[0] is not first[0] for c in cuts):
            return None, None
        return first[0], [j for _, j in cuts]

    def weights_of(self, blk: Block, rows: list) -> torch.Tensor:
        """float32 [m, V]: the draw weights of whole rows: their cut's kept probabilities
        (cuts resolved first), or exp(x - max) for rows no probability filter touched."""
        record, at = self.common_cut(blk, rows)
        if record is not None:
            self.resolve(record, at)
            return rows_of(record.weights, at)
        cuts = [blk.cuts.get(row) for row in rows]
        if all(c is None for c in cuts):
            x = pick_rows(blk.x, rows, blk.plan)
            top = None if blk.top is None else pick_rows(blk.top, rows, blk.plan)
            return exp_weights(x, self.workspace.take("weights", tuple(x.shape)), top)
        weights = self.workspace.take("weights", (len(rows), blk.x.shape[1]))
        for j, (row, c) in enumerate(zip(rows, cuts)):
            if c is None:
                exp_weights(blk.x[row:row + 1], weights[j:j + 1])
            else:
                self.resolve(c[0], [c[1]])
                weights[j].copy_(c[0].weights[c[1]])
        return weights

    def offsets(self, V: int) -> torch.Tensor:
        """int32 [V]: every token's share of the seeded hash (``token_offsets``), made once."""
        offsets = self._offsets.get(V)
        if offsets is None:
            offsets = self._offsets[V] = token_offsets(torch.arange(V))
        return offsets

    # ------------------------------------------------------------------ step 15
    def block_logprobs(self, blk: Block, token_ids: torch.Tensor, s: StepState) -> Logprobs:
        """Step 15 for a block: from the raw logprobs, or from the final distribution."""
        source = blk.raw if blk.raw is not None else torch.log_softmax(self.materialize(blk), dim=-1)
        return self.gather_logprobs(source, token_ids, s.num_logprobs)

    def gather_logprobs(self, logprobs: torch.Tensor, token_ids: torch.Tensor,
                        num_logprobs: int) -> Logprobs:
        """Step 15 as the reference computes it (``Sampler.gather_logprobs``), with the
        top-N by group maxima and the rank by sign arithmetic (see ``rowops``)."""
        V = logprobs.shape[-1]
        safe = token_ids.clamp(min=0)[:, None]
        sampled = logprobs.gather(1, safe)                                  # (n, 1)
        ranks = count_at_least(logprobs, sampled)
        ids, values = [safe], [sampled]
        available = min(num_logprobs, V)
        if available > 0:
            top, top_ids, _ = top_values(logprobs, available)
            ids.append(top_ids)
            values.append(top)
        if available < num_logprobs:  # a vocabulary smaller than N: pad with id -1, -inf
            missing = (logprobs.shape[0], num_logprobs - available)
            ids.append(torch.full(missing, -1, dtype=torch.long))
            values.append(torch.full(missing, NEG_INF))
        return Logprobs(torch.cat(ids, dim=1), torch.cat(values, dim=1), ranks)

    def materialize(self, blk: Block) -> torch.Tensor:
        """float32 [n, V]: the block's final logits (cuts applied, candidate rows written out
        in full, -inf for dropped tokens). Reuses blk.x."""
        self.apply_cuts(blk, list(blk.cuts))
        x = self.own(blk)
        if blk.cand is not None:
            c = blk.cand
            full = torch.full((c.values.shape[0], x.shape[1]), NEG_INF)
            full.scatter_(1, c.ids, c.values)
            x.index_copy_(0, c.index, full)
            blk.cand = None
            blk.changed()
        return x


_INF = torch.tensor(float("inf"))


def take_rows(x: torch.Tensor, rows: list, bp: BlockPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(x's rows as a tensor, their indices int64). All rows: x itself (a view, so in-place
    changes land in x); otherwise a copy (to be written back by the caller)."""
    index = bp.index(rows)
    if len(rows) == x.shape[0]:
        return x, index
    return x.index_select(0, index), index


def rows_of(x: torch.Tensor, at: list) -> torch.Tensor:
    """x[at] for places ``at`` (ascending), without a copy when they are all of x's rows."""
    return x if at == list(range(x.shape[0])) else x[at]


def pick_rows(x: torch.Tensor, rows: list, bp: BlockPlan) -> torch.Tensor:
    """x[rows] for block-local rows (ascending), without a copy when they are all of x's."""
    return x if len(rows) == x.shape[0] else x.index_select(0, bp.index(rows))


def join_logprobs(pieces: list) -> Logprobs:
    return Logprobs(torch.cat([p.token_ids for p in pieces]),
                    torch.cat([p.logprobs for p in pieces]),
                    torch.cat([p.ranks for p in pieces]))
