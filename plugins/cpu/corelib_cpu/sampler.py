"""The ``cpu`` backend's sampler: the contract's stages at close to memory speed on CPUs.

How it is built on the core. The stage order lives in one place, the core template
(``Sampler.sample_state``, ``verify_state``, ``processed_state`` with ``prepare``,
``choose_tokens`` and ``filter``); this class overrides stages, never the order:

- ``sample_state``, ``verify_state`` and ``processed_state`` cut the rows into blocks of about
  ``BLOCK_ELEMENTS`` logits (a verification block holds whole rows, all their slots) and run
  the core template on each block, with the block's view of the step state
  (:class:`~corelib_cpu.state.BlockState`: tensors sliced to the block, the block's own
  flags). One block (B = 1 to 8 at V = 128256) is one template run, nothing more.
- The value the template passes between stages is a :class:`Block`: the block's dense logits
  (the caller's rows until a stage writes, then a copy in the per-thread workspace) plus, once
  step 12 ran, a candidate set for the rows with a top-k, and pending probability cuts of
  min-p and top-p. The template only hands it from stage to stage; every stage here reads and
  updates it in place, and returns it. ``draw``, ``drawn_is_finite``, ``processed_source``,
  ``gather_logprobs`` and ``rejection_sample`` read it as well.

What the stages do differently from the reference (``corelib.Sampler``):

- nothing is allocated per step and no temporary reaches ``B x V``: every block-sized buffer
  lives in the workspace, so every stage of a block runs on data still in the cache;
- the facts of a step that only change when requests join or leave (which rows use which
  stage, effective parameters, blocks) are kept by the batch (``plan.StepPlan``);
- step 2's copy is made only when a stage writes: rows that only read the logits (top-k
  candidates, the draws, softmax) read the caller's tensor, which is never modified;
- steps 3-8a work in place: the token bitmask is added while the logits are copied
  (``bitmask``: a byte table, no [B, V] boolean), penalties touch only the tokens a row has
  seen, from the running slots kept by :class:`~corelib_cpu.batch.CpuBatch`, DRY only the
  tokens of the history entries that extend a repeat (``filters.dry_``);
- step 8b (the reasoning budget) writes a forced row in place, -inf but its token's logit 0,
  and updates that row's group and row maxima, so the other rows keep theirs; step 1 of
  ``raw_logits`` reads the caller's rows while no stage has copied them;
- step 9 and step 15's top-N use group maxima (``rowops``) instead of torch.argmax/topk;
- step 10a (top-n-sigma) computes the reference's mean and deviation with the same float32
  reductions, and cuts each row with one threshold pass;
- step 12 selects candidates (k-th value and ties as the reference) from group maxima;
  when every random row of a block has a top-k, step 10 divides the candidates only;
- step 13 on candidates uses the candidates' own softmax when an error bound proves it picks
  the reference's tokens (else the reference's softmax of the masked row); on whole rows it
  keeps the probabilities as a pending cut (:class:`Cut`): the draw tries a token first
  and keeps it when it is in the nucleus (``select.nucleus_contains``), and only rows that
  miss, or a later stage that reads the row, find the threshold by a radix select over
  the probabilities' bits (``select.nucleus_threshold``); masks use thresholds and
  copysign/min, never boolean fills (which run ~10-40x slower than arithmetic on CPUs);
- step 13a (typical-p) computes the reference's log-softmax, entropy and scores and replaces
  its sort by a radix select over the scores' bits with float64 masses (``filters``);
- step 13b (XTC) first tosses each row's coin, and only rows whose coin says so compute
  anything: the reference's softmax, and the rule on the row's few largest logits;
- step 14 draws candidate rows with noise for the candidates only (seeded rows with the
  contract's noise, so their tokens are the reference's), whole unseeded rows with one
  uniform per row through the inverse CDF, and whole seeded rows with the contract's noise
  for the tokens that can still win (``draw.draw_seeded_rows``);
- verification (:class:`~corelib_cpu.judge.SlotJudge`): a row's slots are judged up to its
  first rejected draft and only that slot draws its residual (the template emits nothing after it); candidate
  rows judge with the candidates' softmax (seeded decisions within its rounding bound, and
  seeded residuals, take the reference's softmax), whole rows with the reference's softmax
  (seeded) or their draw weights (unseeded); seeded residual draws race with the contract's
  noise over the residual's support, unseeded ones draw from the residual itself; the draft
  probabilities are checked by two integer reductions over their bits. Block verification
  (:class:`~corelib_cpu.judge.BlockJudge`) computes the reference's weights and residual
  masses for seeded rows, from the longest prefix down, summing a residual only where a
  bound cannot settle the test, and draws only at the row's stopping slot.

Every kept set equals the reference's (the conformance suite checks it), and so do seeded
tokens. Shapes: ``B`` rows, ``V`` vocabulary, ``n`` rows of a block, ``W`` candidates.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch
from corelib import Logprobs, Sampler, SamplerOutput, SamplingBatch, StepState
from corelib.noise import STREAM_BLOCK, STREAM_XTC, token_offsets
from corelib.sampler import NEG_INF, Drafts, VerifyOutput
from corelib.stages import run_stage

from .batch import CpuBatch
from .bitmask import apply_bitmask_rows
from .draw import (
    draw_from_weights,
    draw_seeded_rows,
    exp_weights,
    race_seeded_candidates,
    race_unseeded_candidates,
)
from .filters import dry_, top_n_sigma_thresholds, typical_rows_, xtc_rows_
from .judge import BlockJudge, SlotJudge
from .plan import BlockPlan, StepPlan, make_plan
from .rowops import GROUP, count_at_least, first_argmax, group_maxima, is_finite, top_values
from .select import (
    kth_largest,
    mask_below,
    nucleus_contains,
    nucleus_threshold,
    top_k_candidates,
    top_p_candidates,
    top_p_candidates_fast,
)
from .state import BlockState, block_states
from .workspace import Workspace

_TRUE = torch.tensor(True)


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
class SourceRows:
    """A block's logits not gathered yet: its row r is ``source[rows[r]]`` (the caller's
    float32 rows, per-request logits or verify's flat slots), until a stage reads ``Block.x``
    and they are gathered into ``buffer`` (float32 [n, V], the workspace's)."""

    source: torch.Tensor
    rows: torch.Tensor
    buffer: torch.Tensor

    def gather(self) -> torch.Tensor:
        return torch.index_select(self.source, 0, self.rows, out=self.buffer)

    def maxima(self) -> torch.Tensor:
        """The block's group maxima, from the source rows it reads (each once, however many
        block rows read it), never gathering the rows themselves."""
        low, high = (int(v) for v in torch.aminmax(self.rows))
        return group_maxima(self.source[low:high + 1]).index_select(0, self.rows - low)


@dataclass
class Block:
    """What the template passes between the stages of one block: its logits and what the
    filters have decided so far (see the module docstring)."""

    state: BlockState
    _x: Optional[torch.Tensor]           # see x
    owned: bool                          # x is ours to write (else the caller's rows)
    cand: Optional[Candidates] = None
    cuts: dict = field(default_factory=dict)     # block row -> (its latest Cut, place in it)
    masked: set = field(default_factory=set)     # rows whose cut is applied to x
    top: Optional[torch.Tensor] = None           # float32 [n, 1]: x's row maxima, or None
    finite_pending: bool = False                 # the NaN/+inf check waits for step 5's maxima
    finite: Optional[torch.Tensor] = None        # bool [n]: that check's result, written by
                                                 # any_token_left (steps with a thinking budget)
    row_max: Optional[torch.Tensor] = None       # float32 [n]: maxima after steps 3-5
    drawn_finite: Optional[torch.Tensor] = None  # bool [n]: step 14's token has a finite logit
    weights: list = field(default_factory=list)  # (whole rows, float32 [m, V] their draw
                                                 # weights: the final distribution, unnormalised)
    dropped: bool = False                        # a stage dropped tokens in bulk (-inf)
    unread: Optional[SourceRows] = None          # x's rows while not gathered (_x None)
    _maxima: Optional[torch.Tensor] = None

    @property
    def x(self) -> torch.Tensor:
        """float32 [n, V]: the logits after the stages so far; candidate rows: see cand; rows
        with a cut: masked when read, see cuts; undivided when the block divides candidates
        only (plan.candidates_only). Gathered on first read when ``unread`` holds them
        (``maxima`` and ``argmax`` read them where they are)."""
        if self._x is None:
            self._x, self.unread = self.unread.gather(), None
        return self._x

    @x.setter
    def x(self, value: torch.Tensor) -> None:
        self._x, self.unread = value, None

    @property
    def plan(self) -> BlockPlan:
        return self.state.plan

    @property
    def candidate_rows(self) -> set:
        return set(self.cand.rows) if self.cand is not None else set()

    def maxima(self) -> torch.Tensor:
        """x's group maxima (``rowops.group_maxima``), computed once until x changes."""
        if self._maxima is None:
            self._maxima = self.unread.maxima() if self.unread is not None else group_maxima(self.x)
        return self._maxima

    def changed(self) -> None:
        """x was written: forget what was derived from it."""
        self._maxima = None
        self.top = None

    def force(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Step 8b on x (ours to write): each of ``rows`` (int64 [m]) keeps only its token of
        ``tokens`` (int64 [m]), with logit 0; every other token -inf. The group maxima and row
        maxima known so far are updated, not dropped: the other rows keep theirs."""
        maxima, top = self._maxima, self.top
        self.x.index_fill_(0, rows, NEG_INF)
        self.x[rows, tokens] = 0.0
        self.changed()
        if maxima is not None:
            maxima.index_fill_(0, rows, NEG_INF)
            maxima[rows, tokens // GROUP] = 0.0
            self._maxima = maxima
        if top is not None:
            self.top = top.index_fill(0, rows, 0.0)
        self.dropped = True


class CpuSampler(Sampler):
    """The ``cpu`` backend (see the module docstring). Block-sized buffers live in
    ``self.workspace`` (one set per thread) and serve every step.

    ``block_elements``: logits per block (rows per block = block_elements // V, at least 1;
    a verification block holds whole rows: block_elements / (V (K + 1)) rounded, at least 1).
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

    # ------------------------------------------------------------------ the template, per block
    def sample_state(self, logits: torch.Tensor, batch: SamplingBatch, s: StepState) -> SamplerOutput:
        """Steps 1-15: the core template (``Sampler.sample_state``) on each block of rows."""
        outputs = []
        for bs in self.block_states(logits, batch, s):
            outputs.append(Sampler.sample_state(self, logits, batch, bs))
        return outputs[0] if len(outputs) == 1 else join_samples(outputs)

    def verify_state(self, logits: torch.Tensor, batch: SamplingBatch, s: StepState,
                     drafts: Drafts) -> VerifyOutput:
        """Verification: the core template (``Sampler.verify_state``) on each block of whole
        rows (every slot of a row in the same block), with the block's drafts."""
        S = drafts.slots
        outputs = []
        for bs in self.block_states(logits, batch, s, slots=S):
            rows = slice(bs.plan.r0 // S, bs.plan.r1 // S)
            block_drafts = drafts_of(drafts, rows)
            bs.undrawn = undrawn_slots(bs.plan, block_drafts)
            outputs.append(Sampler.verify_state(self, logits, batch, bs, block_drafts))
        return outputs[0] if len(outputs) == 1 else join_verifications(outputs)

    def processed_state(self, logits: torch.Tensor, batch: SamplingBatch, s: StepState) -> torch.Tensor:
        """Steps 2-13b (``Sampler.processed_state``) on each block, into a new float32 [B, V]."""
        out = torch.empty((s.num_rows, s.vocab_size), dtype=torch.float32)
        if s.num_rows == 0:
            return out
        for bs in self.block_states(logits, batch, s):
            out[bs.plan.r0:bs.plan.r1] = Sampler.processed_state(self, logits, batch, bs)
        return out

    def speculative_step_state(self, batch: SamplingBatch, drafts: Drafts) -> StepState:
        """The verification state; a ``CpuBatch`` gives each slot its penalty slots and leaves
        out the dense penalty state (``[B (K+1), V]`` copies this backend never reads)."""
        if isinstance(batch, CpuBatch):
            return batch.speculative_state(drafts.token_ids, slots_only=True)
        return super().speculative_step_state(batch, drafts)

    def block_states(self, logits: torch.Tensor, batch: SamplingBatch, s: StepState,
                     slots: int = 1) -> list[BlockState]:
        """The step's blocks, each as the state the template runs on (``slots``: verification
        slots per row, which a block never splits)."""
        plan = self.plan(logits, batch, s, slots)
        keys = plan.row_keys(s)
        logits_rows = s.logits_rows
        if logits_rows is None and logits.shape[0] != s.num_rows:
            logits_rows = batch.request_index(s.num_rows)
        return block_states(s, plan.blocks, keys, logits_rows)

    def plan(self, logits: torch.Tensor, batch: SamplingBatch, s: StepState, slots: int = 1) -> StepPlan:
        """The step's host facts (see ``plan.StepPlan``), kept by a ``CpuBatch`` until its
        rows change."""
        if reads_logits_once(s):      # blocks would buy no cache reuse, only their overhead
            rows_per_block = max(1, s.num_rows)
        elif slots == 1:
            rows_per_block = max(1, self.block_elements // s.vocab_size)
        else:   # whole rows of K + 1 slots: the nearest count to block_elements
            rows_per_block = max(1, round(self.block_elements / (s.vocab_size * slots))) * slots
        sparse = s.any_penalties and getattr(s, "slot_ids", None) is not None
        build = lambda: make_plan(s, rows_per_block, sparse)                   # noqa: E731
        if isinstance(batch, CpuBatch):
            return batch.cached_plan((s.num_rows, rows_per_block, slots), build)
        return build()

    # ------------------------------------------------------------------ steps 1-8a
    def working_copy(self, logits: torch.Tensor, batch: SamplingBatch, s: BlockState) -> Block:
        """Step 2, lazily: a Block whose x is the caller's float32 rows when they can be read
        as they are (copied into the workspace by :meth:`own` before any write), else a
        float32 copy in the workspace (the rows ``s.logits_rows`` names: per-request logits
        expanded to rows, verify's flat slots). Never writes ``logits``."""
        bp = s.plan
        if s.logits_rows is None:
            rows = logits[bp.r0:bp.r1]
            if rows.dtype == torch.float32 and rows.is_contiguous():
                return Block(s, rows, owned=False)
        x = self.workspace.take("x", (bp.n, logits.shape[1]))
        if s.logits_rows is None:
            return Block(s, x.copy_(rows), owned=True)
        if logits.dtype != torch.float32:
            return Block(s, x.copy_(logits.index_select(0, s.logits_rows)), owned=True)
        unread = SourceRows(logits, s.logits_rows, x)
        if reads_logits_once(s):        # group maxima and argmax read the rows where they are
            return Block(s, None, owned=True, unread=unread)
        return Block(s, unread.gather(), owned=True)

    def own(self, blk: Block) -> torch.Tensor:
        """blk.x as our copy, ready to be written in place."""
        if not blk.owned:
            blk.x = self.workspace.take("x", tuple(blk.x.shape)).copy_(blk.x)
            blk.owned = True
        return blk.x

    def copy_logits(self, x: Block) -> torch.Tensor:
        """Step 1 of ``logprobs_mode="raw_logits"``: float32 [n, V], the block's logits before
        any stage. While x is still the caller's rows (which no stage writes: :meth:`own`
        copies them first) those rows themselves; else a copy into the workspace."""
        if not x.owned:
            return x.x
        return self.workspace.take("raw", tuple(x.x.shape)).copy_(x.x)

    def log_softmax(self, x) -> torch.Tensor:
        """float32 [n, V] log-probabilities of a Block's logits (into the workspace; step 1's
        raw logprobs) or of a tensor (new). Not in place."""
        if isinstance(x, Block):
            return torch.log_softmax(x.x, dim=-1, out=self.workspace.take("raw", tuple(x.x.shape)))
        return torch.log_softmax(x, dim=-1)

    def finite_rows(self, x: Block) -> torch.Tensor:
        """bool [n]: rows free of NaN and +inf. Only step 3's allowed ids can hide them (a
        fill overwrites); the other masks of steps 3-5 add -inf, which keeps NaN and turns
        +inf into NaN. Without allowed ids the check is left to ``any_token_left``, which
        reads the rows' maxima after the masks anyway: a 0-dim True then, folded into the
        rows left. A step with a thinking budget keeps the two apart (the template counts a
        forced row as having a token left, never as finite): the tensor returned here is
        written by ``any_token_left``, which the template calls before it reads this one."""
        if x.state.any_allowed:
            return not_overflowed(x.x.amax(dim=-1))
        x.finite_pending = True
        if x.state.any_thinking:
            x.finite = torch.ones(x.x.shape[0], dtype=torch.bool)
            return x.finite
        return _TRUE

    def apply_allowed_ids(self, x: Block, s: StepState) -> Block:
        """Step 3: tokens outside a row's allowed set (``s.allowed_mask`` bool [n, V]) -> -inf,
        in place on the block's copy."""
        self.own(x).masked_fill_(~s.allowed_mask, NEG_INF)
        x.changed()
        x.dropped = True
        return x

    def apply_token_bitmask(self, x: Block, s: StepState) -> Block:
        """Step 3, structured output: tokens whose bit is 0 in ``s.token_bitmask`` (int32
        [n, ceil(V / 32)]; a row of -1 words is unconstrained) -> -inf, in place on the block's
        copy, made by this stage when no earlier one made it (``bitmask.apply_bitmask_rows``:
        a table lookup per byte and one addition per row, no [n, V] boolean)."""
        out = x.x if x.owned else self.workspace.take("x", tuple(x.x.shape))
        x.x = apply_bitmask_rows(x.x, s.token_bitmask, out, self.workspace)
        x.owned = True
        x.changed()
        x.dropped = True
        return x

    def apply_bad_words(self, x: Block, s: StepState) -> Block:
        """Step 4 (the reference's rule, ``Sampler.apply_bad_words``), in place: -inf is added
        at each banned word's last token."""
        recent = s.recent[:, None, :]
        hits = ((s.bad_prefix == recent) | (s.bad_prefix == -2)).all(dim=-1) & s.bad_valid
        ban_in_place(self.own(x), s.bad_last, hits)
        x.changed()
        return x

    def apply_min_tokens(self, x: Block, s: StepState) -> Block:
        """Step 5, in place: while ``position < min_tokens``, -inf is added at the stop ids."""
        pending = (s.position < s.min_tokens)[:, None]
        ban_in_place(self.own(x), s.stop_ids, s.stop_valid & pending)
        x.changed()
        return x

    def any_token_left(self, x: Block) -> torch.Tensor:
        """bool [n]: rows with a token above -inf; where ``finite_rows`` left the check here,
        also free of NaN/+inf. From one maximum per row, taken from the group maxima when a
        later stage reads those anyway (greedy rows, candidates of undivided rows) and steps
        6-8a leave x as it is."""
        s, bp = x.state, x.plan
        later = (s.any_bias or s.any_penalties or s.any_dry
                 or bool(s.stages and s.stages_at("after_penalties")))
        wants_maxima = (bp.any_greedy or bp.candidates_only) and not later
        top = x.maxima().amax(dim=-1) if wants_maxima else x.x.amax(dim=-1)
        x.row_max = top
        if x.finite is not None:                    # see finite_rows
            x.finite.copy_(not_overflowed(top))
            return top > NEG_INF
        return is_finite(top) if x.finite_pending else top > NEG_INF

    def neutralise_rows(self, x: Block, valid: torch.Tensor) -> Block:
        """Invalid rows become zeros (uniform), in place, so they cannot disturb later stages;
        when every row is valid, the maxima just read are kept for later stages."""
        if not bool(valid.all()):
            self.own(x).masked_fill_(~valid[:, None], 0.0)
            x.changed()
        else:
            x.top = x.row_max[:, None]
        return x

    def apply_logit_bias(self, x: Block, s: StepState) -> Block:
        """Step 6, in place: ``x[row, bias_ids] += bias_values``."""
        self.own(x).scatter_add_(1, s.bias_ids, s.bias_values)
        x.changed()
        return x

    def apply_penalties(self, x: Block, s: StepState) -> Block:
        """Steps 7-8 in place on the block's copy: repetition penalty over seen tokens, then
        frequency and presence penalties over generated ones. From the batch's slots when it
        keeps them (``s.slot_ids`` int64 [n, S], ``slot_counts`` int32 [n, S], ``slot_len``
        int64 [n]: only the seen tokens are read and written), else from the dense counts.
        Penalties 1, 0, 0 disable them."""
        xx = self.own(x)
        x.changed()
        if getattr(s, "slot_ids", None) is None:
            xx.copy_(Sampler.apply_penalties(self, xx, s))
            return x
        ids, counts, length = s.slot_ids, s.slot_counts, s.slot_len
        width = int(length.max())
        if width == 0:
            return x
        # Rows' free slots read and write their first slot again, with its own new value (or,
        # in a row without slots, the logit as it is): duplicates of a scatter then agree, and
        # the step needs no list of the real slots.
        real = torch.arange(width) < length[:, None]                            # (n, width)
        idx = torch.where(real, ids[:, :width], ids[:, :1])
        c = torch.where(real, counts[:, :width], counts[:, :1]).to(torch.float32)
        v = xx.gather(1, idx)
        r = s.repetition_penalty[:, None]
        p = torch.where(v > 0, v / r, v * r)                                    # step 7
        # Same expression, in the same order, as the reference's dense step 8.
        occurred = (c > 0).to(torch.float32)
        new = p - s.frequency_penalty[:, None] * c - s.presence_penalty[:, None] * occurred
        xx.scatter_(1, idx, torch.where(length[:, None] > 0, new, v))
        return x

    def apply_dry(self, x: Block, s: StepState) -> Block:
        """Step 8a, DRY, in place on the block's copy: the penalties of the history entries
        that extend a repeat (``filters.dry_``: O(n H), the reference's values) with the same
        amin per token, so only the history's tokens are touched. ``dry_multiplier`` 0
        disables it."""
        dry_(self.own(x), s)
        x.changed()
        return x

    def apply_thinking_budget(self, x: Block, forced: torch.Tensor) -> Block:
        """Step 8b, in place on the block's copy: a forced row (``forced`` int64 [n], -1 = not
        forced) keeps only its forced token, with logit 0; every other token -inf. The group
        and row maxima of the other rows stay known (``Block.force``), so a forced row costs
        its own row, and the block's copy when no earlier stage made it."""
        rows = (forced >= 0).nonzero()[:, 0]
        if rows.numel():
            self.own(x)
            x.force(rows, forced[rows])
        return x

    def apply_custom_stages(self, x: Block, s: StepState, slot: str) -> Block:
        """The plugins' stages at ``slot`` on the block's rows (``corelib.stages.run_stage``:
        rows that do not use a stage keep their logits; a failing stage raises
        ``StageError``). After the filters they run on the final logits of the random rows
        (candidates and cuts written out first); greedy rows skip them, as in the reference
        (whose greedy results never read them)."""
        entries = s.stages_at(slot)
        if not entries:
            return x
        bp = x.plan
        if slot == "after_filters":
            self.densify(x, bp.random_rows)
        y = self.own(x)
        for spec, inputs, plugin in entries:
            if slot == "after_filters" and bp.any_greedy:
                inputs = dataclasses.replace(inputs, active=inputs.active & ~s.greedy)
            y = run_stage(spec, self.stage_implementation(spec), y, inputs, plugin)
        x.x = y
        x.changed()
        x.dropped = True
        return x

    # ------------------------------------------------------------------ steps 9-13b
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
        xx = self.own(x)
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
        row's largest are cut (a :class:`Cut`; x is masked when a later stage reads it)."""
        rows = x.plan.min_p_rows
        sub, index = take_rows(x.x, rows, x.plan)
        probs = torch.softmax(sub, dim=-1, out=self.workspace.take("min_p_probs", tuple(sub.shape)))
        # amax is NaN when probs hold a NaN: the row then keeps nothing
        cut = x.plan.min_p[index][:, None] * probs.amax(dim=-1, keepdim=True)
        self.set_cut(x, rows, probs, cut)
        later = set(x.plan.top_k_rows) | set(x.plan.top_p_rows)
        self.apply_cuts(x, [row for row in rows if row in later])
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
        self.densify(x, rows)
        xx = self.own(x)
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
        self.densify(x, rows)
        xx = self.own(x)
        changed = False
        for r0, r1 in runs(rows):
            changed |= xtc_rows_(xx[r0:r1], s.xtc_threshold[r0:r1], self.workspace)
        if changed:
            x.changed()
        return x

    # ------------------------------------------------------------------ steps 11-13 on rows
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
        whole = at == list(range(len(record.rows)))        # every place, in the record's order
        probs = record.weights if whole else record.weights.index_select(0, index)
        top_p = torch.tensor([record.top_p[j] for j in at], dtype=torch.float32)
        threshold = nucleus_threshold(probs, top_p, self.workspace)
        # a row with a NaN (float32 overflow upstream) is NaN throughout: it keeps nothing
        threshold = torch.where(torch.isnan(probs[:, 0]), float("nan"), threshold)
        self.threshold_rows(record, at, threshold.tolist())

    def apply_cuts(self, blk: Block, rows: list) -> None:
        """Mask x where the cut of the given rows drops tokens (-inf), for stages that read
        x itself. A positive cut keeps exactly the tokens with positive weight; a cut of 0
        keeps every token; a NaN cut none."""
        if not blk.cuts:
            return
        pending = [row for row in rows if row in blk.cuts and row not in blk.masked]
        if not pending:
            return
        x = self.own(blk)
        places = {}                           # each record's pending places, resolved together
        for row in pending:
            record, j = blk.cuts[row]
            places.setdefault(id(record), (record, []))[1].append(j)
        for record, at in places.values():
            self.resolve(record, at)
        masking = []                          # (row, record, place) of the cuts that drop tokens
        for row in pending:
            record, j = blk.cuts[row]
            if record.cut[j] != 0.0:
                masking.append((row, record, j))
        for (r0, r1), (record, j0) in _aligned_runs(masking):
            # sign(w) - 0.5 is -0.5 where w == 0 and 0.5 where w > 0; copysign makes that
            # -inf / +inf and min() masks. (No subtraction of a tiny value: subnormal results
            # cost a microcode assist each on x86, ~100x an ordinary one.) One run of rows
            # whose cut places are consecutive too is masked in four operator calls.
            weights = record.weights[j0:j0 + r1 - r0]
            sign = torch.sign(weights, out=self.workspace.take("sign", tuple(weights.shape)))
            torch.minimum(x[r0:r1], torch.copysign(_INF, sign.sub_(0.5), out=sign), out=x[r0:r1])
        blk.masked.update(pending)
        blk.changed()

    def densify(self, blk: Block, rows: list) -> None:
        """Make the given rows whole rows of x holding their final logits so far (their cuts
        applied, their candidates written out and dropped from the candidate set), for a
        stage that reads them in full."""
        self.apply_cuts(blk, rows)
        cand = blk.cand
        if cand is None:
            return
        wanted = set(rows)
        inside = [j for j, row in enumerate(cand.rows) if row in wanted]
        if not inside:
            return
        x = self.own(blk)
        if len(inside) == len(cand.rows):
            at, rest = None, []
        else:
            at = torch.tensor(inside, dtype=torch.long)
            rest = [j for j in range(len(cand.rows)) if j not in set(inside)]
        ids = cand.ids if at is None else cand.ids[at]
        values = cand.values if at is None else cand.values[at]
        index = cand.index if at is None else cand.index[at]
        full = torch.full((len(inside), x.shape[1]), NEG_INF)
        full.scatter_(1, ids, values)
        x.index_copy_(0, index, full)
        if rest:
            keep = torch.tensor(rest, dtype=torch.long)
            blk.cand = Candidates([cand.rows[j] for j in rest], cand.index[keep], cand.values[keep],
                                  cand.ids[keep])
        else:
            blk.cand = None
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
                return _TRUE
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
        """(int64 [m] ids, bool [m] ok): inverse-CDF draws for unseeded whole rows."""
        record, at = self.common_cut(blk, rows)
        if record is not None and record.pending(at) == at:
            return self.draw_in_nucleus(record, at)
        return draw_from_weights(self.weights_of(blk, rows), self.generator, self.workspace)

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
            self.resolve(record, places)
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
        record, at = self.common_cut(blk, rows)
        row_keys = pick_rows(keys, rows, bp)
        pending = None if record is None else record.pending(at)
        if pending == [] and not any(row in blk.masked for row in rows):
            return self.race_rows(pick_rows(blk.x, rows, bp), row_keys, rows_of(record.weights, at))
        if pending is None or pending != at:
            self.apply_cuts(blk, rows)
            return self.race_rows(pick_rows(blk.x, rows, bp), row_keys)
        x = pick_rows(blk.x, rows, bp)
        ids, ok = self.race_rows(x, row_keys)
        top_p = torch.tensor([record.top_p[j] for j in at], dtype=torch.float32)
        settled = nucleus_contains(rows_of(record.weights, at), ids, top_p)
        if not bool(settled.all()):
            redo = (~settled).nonzero()[:, 0]
            places = [at[j] for j in redo.tolist()]
            self.resolve(record, places)
            ids[redo], ok[redo] = self.race_rows(x[redo], row_keys[redo], rows_of(record.weights, places))
        return ids, ok

    def race_rows(self, x: torch.Tensor, keys: torch.Tensor, kept: Optional[torch.Tensor] = None):
        """The contract's seeded race over whole rows x float32 [m, V] with keys int32 [m]
        (``draw.draw_seeded_rows``; ``kept``: weights whose zeros drop tokens too)."""
        return draw_seeded_rows(x, keys, self.offsets(x.shape[1]), self.workspace, self.NOISE_CHUNK, kept)

    @staticmethod
    def common_cut(blk: Block, rows: list):
        """(the Cut every given row belongs to and the rows' places in it), or (None, None)."""
        if not blk.cuts:
            return None, None
        cuts = [blk.cuts.get(row) for row in rows]
        first = cuts[0]
        if first is None or any(c is None or c[0] is not first[0] for c in cuts):
            return None, None
        return first[0], [j for _, j in cuts]

    def weights_of(self, blk: Block, rows: list, buffer: str = "weights") -> torch.Tensor:
        """float32 [m, V]: the draw weights of whole rows: their cut's kept probabilities
        (cuts resolved first), or exp(x - max) for rows no probability filter touched (into
        the workspace buffer ``buffer``). Recorded in ``blk.weights`` for verification."""
        weights = self.row_weights(blk, rows, buffer)
        blk.weights.append((rows, weights))
        return weights

    def row_weights(self, blk: Block, rows: list, buffer: str) -> torch.Tensor:
        """``weights_of`` without the record (for a one-off read of a row's distribution)."""
        record, at = self.common_cut(blk, rows)
        if record is not None:
            self.resolve(record, at)
            return rows_of(record.weights, at)
        cuts = [blk.cuts.get(row) for row in rows] if blk.cuts else None
        if cuts is None or all(c is None for c in cuts):
            x = pick_rows(blk.x, rows, blk.plan)
            top = None if blk.top is None else pick_rows(blk.top, rows, blk.plan)
            return exp_weights(x, self.workspace.take(buffer, tuple(x.shape)), top, self.sparse(blk))
        weights = self.workspace.take(buffer, (len(rows), blk.x.shape[1]))
        for j, (row, c) in enumerate(zip(rows, cuts)):
            if c is None:
                exp_weights(blk.x[row:row + 1], weights[j:j + 1], sparse=self.sparse(blk))
            else:
                self.resolve(c[0], [c[1]])
                weights[j].copy_(c[0].weights[c[1]])
        return weights

    @staticmethod
    def sparse(blk: Block) -> bool:
        """Whether the block's rows may hold many tokens far below their maxima (see
        ``draw.exp_weights``): a stage dropped tokens in bulk, or a random row's temperature
        is below 1."""
        return blk.dropped or bool(blk.plan.temperature_below_one)

    def offsets(self, V: int) -> torch.Tensor:
        """int32 [V]: every token's share of the seeded hash (``token_offsets``), made once."""
        offsets = self._offsets.get(V)
        if offsets is None:
            offsets = self._offsets[V] = token_offsets(torch.arange(V))
        return offsets

    # ------------------------------------------------------------------ verification
    def draft_probs_sane(self, probs: torch.Tensor) -> torch.Tensor:
        """bool [B, K]: each slot's draft distribution (float32 [B, K, V]) is free of NaN,
        +-inf and negative values, from two integer reductions over the float bits (torch's
        float min/max run ~2x slower, and torch.isfinite makes four [B, K, V] temporaries):
        as int32, non-negative finite floats are exactly the values in [0, 0x7F800000), +inf
        and NaN lie above, negative floats below 0, and so does -0.0 (INT_MIN), which is sane:
        slots holding a negative sign bit take the float check. Not in place."""
        bits = probs.view(torch.int32)
        signed = bits.amin(dim=-1) < 0
        sane = ~signed & (bits.amax(dim=-1) < _INF_BITS)
        if bool(signed.any()):
            at = signed.nonzero(as_tuple=True)
            sane[at] = super().draft_probs_sane(probs[at])
        return sane

    def rejection_sample(self, final: Block, s: StepState, drafts: Drafts) -> tuple[torch.Tensor, torch.Tensor]:
        """Lossless speculative sampling at the draft slots of the block's random rows, by
        ``Sampler.rejection_sample``'s rule: with p the slot's final distribution, draft d
        passes when ``u * q(d) < p(d)``, and a rejected slot draws from max(p - q, 0)
        renormalised (p where that is all zero) with step 14's own noise. Returns (bool
        [b, K] passed, int64 [b, K] recovered); greedy rows' entries are unused.

        A row stops at its first rejected draft, so only the slots up to it are judged and
        only that slot draws (the template emits nothing of the slots after it); see
        :class:`SlotJudge` for how p is found."""
        B, K = drafts.token_ids.shape
        S = K + 1
        bp = final.plan
        passed = torch.zeros((B, K), dtype=torch.bool)
        recovered = torch.zeros((B, K), dtype=torch.long)
        count = drafts.count.tolist()
        rows = [r for r in range(B) if not bp.greedy[r * S] and count[r] > 0]
        if not rows:
            return passed, recovered
        u = self.acceptance_uniforms(s).view(B, S)[:, :K]
        d = drafts.token_ids.clamp(min=0)
        uq = (u * drafts.probs.gather(2, d[..., None])[..., 0]).tolist()      # the ratio test's u q(d)
        judge = SlotJudge(self, final, torch.cat([d, torch.zeros_like(d[:, :1])], dim=1).view(-1))
        d = d.tolist()
        q = drafts.probs.view(B * K, -1)
        for r in rows:
            for j in range(count[r]):
                row = r * S + j
                if judge.passes(row, d[r][j], uq[r][j]):
                    passed[r, j] = True
                    continue
                judge.reject(row, q[r * K + j], (r, j))
                break
        for (r, j), token in judge.residual_draws():
            recovered[r, j] = token
        return passed, recovered

    def block_verify(self, final: Block, s: StepState, drafts: Drafts,
                     valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Block verification at the draft slots of the block's random rows, by
        ``Sampler.block_verify``'s rule and arithmetic (see :class:`BlockJudge`). valid bool
        [b (K+1)]: the slot has a token. Returns (bool [b, K] accepted: the first tau drafts;
        int64 [b, K] recovered, of which only slot tau is read: the template emits the
        residual draw there when tau < k). Greedy rows' entries, and those of rows whose
        drafts are unusable (flagged), are unused and left False / 0.

        A row is judged over its drafts up to the first slot without a token (no draft at or
        after it is kept); only its stopping slot draws."""
        B, K = drafts.token_ids.shape
        S = K + 1
        bp = final.plan
        accepted = torch.zeros((B, K), dtype=torch.bool)
        recovered = torch.zeros((B, K), dtype=torch.long)
        count, usable, has_token = drafts.count.tolist(), drafts.usable.tolist(), valid.view(B, S).tolist()
        spans = {}
        for r in range(B):
            if bp.greedy[r * S] or not usable[r]:
                continue
            k = 0
            while k < count[r] and has_token[r][k]:
                k += 1
            if k:
                spans[r] = k
        if not spans:
            return accepted, recovered
        u = self.row_uniforms(s, STREAM_BLOCK).view(B, S)[:, :K].tolist()
        judge = BlockJudge(self, final, drafts, spans)
        for r, tau in judge.judge(u).items():
            accepted[r, :tau] = True
            if tau < spans[r]:
                judge.draw(r, tau)
        for (r, j), token in judge.residual_draws():
            recovered[r, j] = token
        return accepted, recovered

    # ------------------------------------------------------------------ step 15
    def processed_source(self, x: Block, final: Block, s: StepState, normalise: bool = True) -> torch.Tensor:
        """The final distribution's logits of the block (greedy rows: step 8a's), float32
        [n, V]; its log_softmax when ``normalise``. A view of the block's copy."""
        out = self.materialize(final)
        return torch.log_softmax(out, dim=-1) if normalise else out

    def gather_logprobs(self, logprobs: torch.Tensor, token_ids: torch.Tensor,
                        num_logprobs: int) -> Logprobs:
        """Step 15 as the reference computes it (``Sampler.gather_logprobs``), with the
        top-N by group maxima and the rank by sign arithmetic (see ``rowops``)."""
        V = logprobs.shape[-1]
        safe = token_ids.clamp(min=0)[:, None]
        sampled = logprobs.gather(1, safe)                                  # (n, 1)
        ranks = count_at_least(logprobs, sampled,
                               self.workspace.take("ranks", tuple(logprobs.shape)))
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
        self.densify(blk, list(blk.cuts) + (blk.cand.rows if blk.cand is not None else []))
        return self.own(blk)


_INF = torch.tensor(float("inf"))
_INF_BITS = 0x7F800000


def reads_logits_once(s: StepState) -> bool:
    """Whether the step reads its logits in one pass: every row greedy, no logprobs, and no
    stage that writes a copy (step 9's group maxima find each row's token and check step 3 at
    once)."""
    return (s.all_greedy and s.num_logprobs is None and not s.stages
            and not (s.any_penalties or s.any_bias or s.any_allowed or s.any_bad_words
                     or s.any_bitmask or s.any_dry or s.any_min_tokens or s.any_thinking))


def _aligned_runs(masking: list) -> list:
    """``[((r0, r1), (record, j0)), ...]``: ``masking``'s (row, record, place) triples cut into
    runs of consecutive rows whose places in one record are consecutive too, so that rows
    r0..r1-1 take places j0.. of the record."""
    runs = []
    for row, record, j in masking:
        if runs:
            (r0, r1), (last, j0) = runs[-1]
            if row == r1 and last is record and j == j0 + (r1 - r0):
                runs[-1] = ((r0, r1 + 1), (last, j0))
                continue
        runs.append(((row, row + 1), (record, j)))
    return runs


def not_overflowed(top: torch.Tensor) -> torch.Tensor:
    """bool, top's shape: neither NaN nor +inf (rows' maxima: -inf is a row fully masked)."""
    return ~(torch.isnan(top) | (top == float("inf")))


def ban_in_place(x: torch.Tensor, ids: torch.Tensor, banned: torch.Tensor) -> None:
    """x[row, ids[row, j]] += -inf where banned[row, j] (the reference's ``_add_at``, in
    place). ids int64 [n, J], banned bool [n, J]."""
    x.scatter_add_(1, ids, torch.where(banned, NEG_INF, 0.0).to(x.dtype))


def runs(rows: list) -> list[tuple[int, int]]:
    """Ascending rows as runs of consecutive ones: [(r0, r1), ...], rows r0..r1-1 each."""
    out = []
    for row in rows:
        if out and out[-1][1] == row:
            out[-1] = (out[-1][0], row + 1)
        else:
            out.append((row, row + 1))
    return out


def take_rows(x: torch.Tensor, rows: list, bp: BlockPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(x's rows as a tensor, their indices int64). All rows: x itself (a view, so in-place
    changes land in x); otherwise a copy (to be written back by the caller)."""
    index = bp.index(rows)
    if len(rows) == x.shape[0]:
        return x, index
    return x.index_select(0, index), index


def rows_of(x: torch.Tensor, at: list) -> torch.Tensor:
    """x[at] for places ``at`` (ascending), without a copy (a view of x) when they are
    consecutive, as a single row always is."""
    first = at[0]
    return x[first:first + len(at)] if at[-1] - first == len(at) - 1 else x[at]


def pick_rows(x: torch.Tensor, rows: list, bp: BlockPlan) -> torch.Tensor:
    """x[rows] for block-local rows (ascending), without a copy when they are all of x's."""
    return x if len(rows) == x.shape[0] else x.index_select(0, bp.index(rows))


def undrawn_slots(bp: BlockPlan, drafts: Drafts) -> frozenset:
    """Block-local rows whose step-14 draw verification never reads: with draft
    probabilities, a random row's slot j < k (its k drafts) emits either its draft or the
    residual draw of the ratio test, never the slot's own draw (slot k's, the bonus or a
    short row's next token, is drawn)."""
    if drafts.probs is None:
        return frozenset()
    S = drafts.slots
    return frozenset(r * S + j for r, k in enumerate(drafts.count.tolist()) for j in range(k)
                     if not bp.greedy[r * S + j])


def drafts_of(drafts: Drafts, rows: slice) -> Drafts:
    """The drafts of the rows ``rows`` (views)."""
    return Drafts(drafts.token_ids[rows], drafts.count[rows],
                  None if drafts.probs is None else drafts.probs[rows], drafts.usable[rows],
                  drafts.method)


def join_logprobs(pieces: list) -> Logprobs:
    return Logprobs(torch.cat([p.token_ids for p in pieces]),
                    torch.cat([p.logprobs for p in pieces]),
                    torch.cat([p.ranks for p in pieces]))


def join_samples(outputs: list) -> SamplerOutput:
    """The blocks' outputs as one, in row order."""
    logprobs = None if outputs[0].logprobs is None else join_logprobs([o.logprobs for o in outputs])
    return SamplerOutput(torch.cat([o.token_ids for o in outputs]), torch.cat([o.valid for o in outputs]),
                         logprobs)


def join_verifications(outputs: list) -> VerifyOutput:
    """The blocks' verification outputs as one, in row order."""
    logprobs = None if outputs[0].logprobs is None else join_logprobs([o.logprobs for o in outputs])
    return VerifyOutput(torch.cat([o.token_ids for o in outputs]), torch.cat([o.num_emitted for o in outputs]),
                        torch.cat([o.valid for o in outputs]), logprobs)
