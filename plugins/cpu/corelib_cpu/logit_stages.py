"""Steps 1-8b and the plugins' stages of the ``cpu`` backend, on a block of rows.

Mixed into :class:`~corelib_cpu.sampler.CpuSampler`; each method overrides the reference's
stage of the same name (``corelib.Sampler``) and takes and returns a
:class:`~corelib_cpu.block.Block`, updated in place. What differs from the reference:

- step 2's copy is made only when a stage writes (:meth:`Block.own`): rows that only read the
  logits (top-k candidates, the draws, softmax) read the caller's tensor, which is never
  modified;
- steps 3-8a work in place: the token bitmask is added while the logits are copied
  (``bitmask``: a byte table, no [B, V] boolean), penalties touch only the tokens a row has
  seen, from the running slots kept by :class:`~corelib_cpu.batch.CpuBatch`, DRY only the
  tokens of the history entries that extend a repeat (``filters.dry_``);
- step 8b (the reasoning budget) writes a forced row in place, -inf but its token's logit 0,
  and updates that row's group and row maxima, so the other rows keep theirs; step 1 of
  ``raw_logits`` reads the caller's rows while no stage has copied them.

Shapes: ``n`` rows of a block, ``V`` vocabulary.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from corelib import Sampler, SamplingBatch, StepState
from corelib.sampler import NEG_INF
from corelib.stages import run_stage

from .bitmask import apply_bitmask_rows
from .block import Block, SourceRows
from .filters import dry_
from .plan import reads_logits_once
from .rowops import TRUE, all_true, is_finite
from .state import BlockState

#: Blocks of up to this many rows check their rows' maxima on the host (``any_token_left``).
FEW_ROWS = 2


class LogitStages:
    """Steps 1-8b and the custom stages of :class:`~corelib_cpu.sampler.CpuSampler` (which
    provides ``workspace`` and the core's ``stage_implementation``)."""

    def working_copy(self, logits: torch.Tensor, batch: SamplingBatch, s: BlockState) -> Block:
        """Step 2, lazily: a Block whose x is the caller's float32 rows when they can be read
        as they are (copied into the workspace by :meth:`Block.own` before any write), else a
        float32 copy in the workspace (the rows ``s.logits_rows`` names: per-request logits
        expanded to rows, verify's flat slots). Never writes ``logits``."""
        bp = s.plan
        if s.logits_rows is None:
            # a one-block step reads the caller's tensor itself (a slice is two operator calls)
            rows = logits if bp.r0 == 0 and bp.r1 == logits.shape[0] else logits[bp.r0:bp.r1]
            if rows.dtype == torch.float32 and rows.is_contiguous():
                return Block(s, rows, owned=False, workspace=self.workspace)
        x = self.workspace.take("x", (bp.n, logits.shape[1]))
        if s.logits_rows is None:
            return Block(s, x.copy_(rows), owned=True, workspace=self.workspace)
        if logits.dtype != torch.float32:
            x.copy_(logits.index_select(0, s.logits_rows))
            return Block(s, x, owned=True, workspace=self.workspace)
        unread = SourceRows(logits, s.logits_rows, x)
        if reads_logits_once(s):        # group maxima and argmax read the rows where they are
            return Block(s, None, owned=True, unread=unread, workspace=self.workspace)
        return Block(s, unread.gather(), owned=True, workspace=self.workspace)

    def copy_logits(self, x: Block) -> torch.Tensor:
        """Step 1 of ``logprobs_mode="raw_logits"``: float32 [n, V], the block's logits before
        any stage. While x is still the caller's rows (which no stage writes: :meth:`Block.own`
        copies them first) those rows themselves; else a copy into the workspace."""
        if not x.owned:
            return x.x
        return self.workspace.take("raw", tuple(x.x.shape)).copy_(x.x)

    def raw_logprobs(self, x: Block, s: StepState) -> torch.Tensor:
        """Step 1 (``Sampler.raw_logprobs``): float32 [n, V], the log-probabilities of the
        block's logits before any stage, into the workspace (``"raw"`` mode), or the logits
        themselves (``copy_logits``). Not in place."""
        if s.logprobs_mode != "raw":
            return self.copy_logits(x)
        return torch.log_softmax(x.x, dim=-1, out=self.workspace.take("raw", tuple(x.x.shape)))

    def log_softmax(self, x) -> torch.Tensor:
        """float32 [n, V] log-probabilities, new (what the selectors read outlives the block:
        the batch keeps it until ``append``): of a Block's final logits (cuts applied,
        candidates written out: ``Block.materialize``), or of a tensor. Not in place."""
        if isinstance(x, Block):
            return torch.log_softmax(x.materialize(), dim=-1)
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
        return TRUE

    def apply_allowed_ids(self, x: Block, s: StepState) -> Block:
        """Step 3: tokens outside a row's allowed set (``s.allowed_mask`` bool [n, V]) -> -inf,
        in place on the block's copy."""
        x.own().masked_fill_(~s.allowed_mask, NEG_INF)
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
        ban_in_place(x.own(), s.bad_last, hits)
        x.changed()
        return x

    def apply_min_tokens(self, x: Block, s: StepState) -> Block:
        """Step 5, in place: while ``position < min_tokens``, -inf is added at the stop ids."""
        pending = (s.position < s.min_tokens)[:, None]
        ban_in_place(x.own(), s.stop_ids, s.stop_valid & pending)
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
        # the compiled pass costs less than torch's amax and its host read even where no
        # stage reads the group maxima (a later write to x drops them)
        if x.finite is None and x.finite_pending and self.rows_valid_on_host(x):
            x.all_valid = True
            return all_true(x.top.shape[0])
        top = x.maxima().amax(dim=-1) if wants_maxima else x.x.amax(dim=-1)
        x.row_max = top
        if x.finite is not None:                    # see finite_rows
            x.finite.copy_(not_overflowed(top))
            return top > NEG_INF
        if x.finite_pending and top.shape[0] <= FEW_ROWS:
            # a few rows: their maxima read on the host, where a tensor test and the template's
            # check of its result would be four operator calls
            if all(-math.inf < v < math.inf for v in top.tolist()):
                x.all_valid = True
                return all_true(top.shape[0])
        return is_finite(top) if x.finite_pending else top > NEG_INF

    def rows_valid_on_host(self, x: Block) -> bool:
        """Whether every row of a few-row block has a finite, nonzero maximum, found with the
        group maxima in one compiled pass over the logits (``Block.maxima_and_row_maxima``),
        else (no numba) by numpy's max of the group maxima's numpy view, in a workspace pair,
        and a test on the host (no operator call: amax, its host read and the [n, 1] view are
        three or four, much of a B = 1 step). If so, ``x.top``
        (float32 [n, 1]) and ``x.top_pair`` hold those maxima for later stages. Rows with a
        NaN, an infinity or a zero maximum answer False and take the torch path: the NaN and
        infinity checks stay the tensor ones, and numpy's max may return the other zero of
        a row holding both +0 and -0, where the race's and step 10's bits read that sign."""
        n = x.x.shape[0] if x.unread is None else x.unread.rows.shape[0]
        if n > FEW_ROWS:
            return False
        pair = self.workspace.pair("row_max", (n, 1))
        top = pair[1][:, 0]
        valid = x.maxima_and_row_maxima(top)                 # one compiled pass over x
        if valid is None:
            x.maxima()
            maxima = x.maxima_array()
            if maxima is None:
                return False
            maxima.max(axis=1, out=top)
            valid = all(-math.inf < v < math.inf and v != 0.0 for v in top.tolist())
        if not valid:
            return False
        x.top, x.top_pair = pair[0], pair
        return True

    def valid_rows(self, finite: torch.Tensor, left: torch.Tensor) -> torch.Tensor:
        """``Sampler.valid_rows``: where ``finite_rows`` left its check to ``any_token_left``
        (the shared ``TRUE``), ``left`` already holds both answers and is returned as it is
        (no ``finite & left``: the template's readers never write it)."""
        return left if finite is TRUE else finite & left

    def neutralise_rows(self, x: Block, valid: torch.Tensor) -> Block:
        """Invalid rows become zeros (uniform), in place, so they cannot disturb later stages;
        when every row is valid, the maxima just read are kept for later stages."""
        self.workspace.rows_valid = x.all_valid            # for flag_invalid
        if not x.all_valid and not bool(valid.all()):
            x.own().masked_fill_(~valid[:, None], 0.0)
            x.changed()
        elif x.top_pair is None or x.top is not x.top_pair[0]:
            x.top = x.row_max[:, None]
        return x

    def apply_logit_bias(self, x: Block, s: StepState) -> Block:
        """Step 6, in place: ``x[row, bias_ids] += bias_values``."""
        x.own().scatter_add_(1, s.bias_ids, s.bias_values)
        x.changed()
        return x

    def apply_penalties(self, x: Block, s: StepState) -> Block:
        """Steps 7-8 in place on the block's copy: repetition penalty over seen tokens, then
        frequency and presence penalties over generated ones. From the batch's slots when it
        keeps them (``s.slot_ids`` int64 [n, S], ``slot_counts`` int32 [n, S], ``slot_len``
        int64 [n]: only the seen tokens are read and written), else from the dense counts.
        Penalties 1, 0, 0 disable them."""
        xx = x.own()
        x.changed()
        if s.slot_ids is None:
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
        dry_(x.own(), s)
        x.changed()
        return x

    def apply_thinking_budget(self, x: Block, forced: torch.Tensor) -> Block:
        """Step 8b, in place on the block's copy: a forced row (``forced`` int64 [n], -1 = not
        forced) keeps only its forced token, with logit 0; every other token -inf. The group
        and row maxima of the other rows stay known (``Block.force``), so a forced row costs
        its own row, and the block's copy when no earlier stage made it."""
        rows = (forced >= 0).nonzero()[:, 0]
        if rows.numel():
            x.own()
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
            x.densify(bp.random_rows)
        y = x.own()
        for spec, inputs, plugin in entries:
            if slot == "after_filters" and bp.any_greedy:
                inputs = dataclasses.replace(inputs, active=inputs.active & ~s.greedy)
            y = run_stage(spec, self.stage_implementation(spec), y, inputs, plugin)
        x.x = y
        x.changed()
        x.dropped = True
        return x



def not_overflowed(top: torch.Tensor) -> torch.Tensor:
    """bool, top's shape: neither NaN nor +inf (rows' maxima: -inf is a row fully masked)."""
    return ~(torch.isnan(top) | (top == float("inf")))


def ban_in_place(x: torch.Tensor, ids: torch.Tensor, banned: torch.Tensor) -> None:
    """x[row, ids[row, j]] += -inf where banned[row, j] (the reference's ``_add_at``, in
    place). ids int64 [n, J], banned bool [n, J]."""
    x.scatter_add_(1, ids, torch.where(banned, NEG_INF, 0.0).to(x.dtype))
