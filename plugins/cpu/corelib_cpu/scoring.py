"""Kept sets and teacher forcing (``score``) of the ``cpu`` backend, on blocks of rows.

Mixed into :class:`~corelib_cpu.sampler.CpuSampler`. ``score`` runs the core's template parts
(``Scoring.score_state``: steps 1-8b, the filter group and the selectors, or the replay of
given kept sets, then each position's values) on each block of whole rows, as
``verify_state`` does: a row's T positions are T virtual rows of one block, never split,
because the selectors' state advances from slot to slot inside a block
(``selector_slot_state``). The blocks' outputs are joined in row order.

The stages work in place on the block's workspace buffers, so nothing here is
autograd-tracked: a ``score`` whose logits require grad goes to the reference
(``differentiable_score`` False, and so says the backend's spec). Shapes: ``B`` rows, ``T``
positions, ``V`` vocabulary, ``W = ceil(V / 32)``, ``n`` rows of a block.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from corelib import Sampler, SamplingBatch, StepState, pipeline
from corelib.outputs import ScoreOutput

from .batch import CpuBatch
from .bitmask import apply_bitmask_rows
from .block import Block
from .state import rows_state


class Scoring:
    """``score``'s parts and the kept set of :class:`~corelib_cpu.sampler.CpuSampler` (which
    provides ``block_states``, ``workspace`` and the template's stages)."""

    #: The stages write the workspace in place: no autograd graph (see the module docstring).
    differentiable_score = False

    def score_step_state(self, batch: SamplingBatch, token_ids: torch.Tensor,
                         differentiable: bool = False) -> StepState:
        """``Scoring.score_step_state``; a ``CpuBatch`` gives each position its penalty slots
        and leaves out the dense penalty state (``[B T, V]`` copies this backend never
        reads), as verification's state does."""
        if differentiable or not isinstance(batch, CpuBatch):
            return Sampler.score_step_state(self, batch, token_ids, differentiable)
        V = batch.vocab_size
        ids = torch.where((token_ids >= 0) & (token_ids < V), token_ids, -1)
        s = batch.speculative_state(ids[:, :-1], slots_only=True)
        return dataclasses.replace(s, num_logprobs=0, logprobs_mode="raw", any_kept=False)

    def score_state(self, logits: torch.Tensor, batch: SamplingBatch, s: StepState,
                    token_ids: torch.Tensor, kept: Optional[torch.Tensor]) -> ScoreOutput:
        """``Scoring.score_state`` on each block of whole rows (all T positions of a row in
        one block), joined in row order. logits float [B T, V], token_ids int64 [B T], kept
        None or int32 [B T, W]."""
        T = s.verify_slots
        outputs = []
        for bs in self.block_states(logits, batch, s, slots=T):
            rows = slice(bs.plan.r0, bs.plan.r1)
            outputs.append(self.score_block(logits, batch, bs, token_ids[rows],
                                            None if kept is None else kept[rows]))
        return outputs[0] if len(outputs) == 1 else join_scores(outputs)

    def score_block(self, logits: torch.Tensor, batch: SamplingBatch, s: StepState,
                    token_ids: torch.Tensor, kept: Optional[torch.Tensor]) -> ScoreOutput:
        """The core's ``score_state`` on one block (``s`` its state): the same parts, with the
        log-probabilities the selectors read written to a new tensor (as ``sample_selected``
        does: the workspace's buffer for them holds step 1's, which ``score_tokens`` reads)."""
        x, raw, valid = self.prepare(logits, batch, s)                     # steps 1-8b
        final, source = x, None
        if kept is not None:
            final = self.replay_kept(x, s, kept)                           # steps 10-10b, kept
            valid = valid & (kept != 0).any(dim=-1)
        elif s.any_random:
            final = self.filter(x, s)                                      # steps 10-13b
            if s.any_selector:
                final.materialize()
                source = final.source = torch.log_softmax(final.x, dim=-1)
                final = self.select(final, s, source)                      # step 14
        out = self.score_tokens(raw, x, final, token_ids, valid, s)
        out.selector_source = source
        return out

    def replay_kept(self, x: Block, s: StepState, kept: torch.Tensor) -> Block:
        """``Scoring.replay_kept`` on the block's random rows (greedy rows keep step 8b's
        logits, which their processed logprobs read): the reference's replayed stages
        (temperature, smoothing) on those rows in the default order, whatever order a row
        gave its filters, then the tokens outside ``kept`` (int32 [n, W]) -> -inf, added by
        the bitmask's byte table (``bitmask.apply_bitmask_rows``). x: the block after step
        8b, no cut or candidate yet; updated in place and returned."""
        bp = x.plan
        rows = bp.random_rows
        if not rows:
            return x
        xx = x.own()
        index = bp.index(rows)
        sub = xx.index_select(0, index)
        state = rows_state(s, index)
        reference = self.score_reference()
        for stage in pipeline.replayed_stages():
            if stage.enabled(state):
                sub = getattr(reference, stage.method)(sub, state)
        sub = apply_bitmask_rows(sub, kept.index_select(0, index), sub, self.workspace)
        xx.index_copy_(0, index, sub)
        x.changed()
        x.dropped = True
        return x


def join_scores(outputs: list) -> ScoreOutput:
    """The blocks' score outputs as one, in row order (flat ``[B T]``; ``selector_source``
    joined as ``sampler.join_sources`` joins the samples')."""
    from .sampler import join_sources
    fields = ("logprobs", "raw_logprobs", "kept_token", "ranks", "valid")
    out = ScoreOutput(*(torch.cat([getattr(o, name) for o in outputs]) for name in fields))
    out.selector_source = join_sources(outputs, lambda o: o.valid.shape[0])
    return out
