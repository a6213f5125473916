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
from corelib.bitmask import bitmask_width, pack_kept
from corelib.outputs import ScoreOutput
from corelib.sampler import NEG_INF

from . import kernels
from .batch import CpuBatch
from .bitmask import apply_bitmask_rows
from .joins import join_scores
from .block import Block, Candidates, runs
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
        """``Scoring.score_state`` (the core's template parts) on each block of whole rows
        (all T positions of a row in one block), joined in row order. logits float [B T, V],
        token_ids int64 [B T], kept None or int32 [B T, W]."""
        T = s.verify_slots
        outputs = []
        for bs in self.block_states(logits, batch, s, slots=T):
            rows = slice(bs.plan.r0, bs.plan.r1)
            outputs.append(Sampler.score_state(self, logits, batch, bs, token_ids[rows],
                                               None if kept is None else kept[rows]))
        return outputs[0] if len(outputs) == 1 else join_scores(outputs)

    def kept_set(self, x: Block, final: Block, token_ids: torch.Tensor, valid: torch.Tensor,
                 s: StepState) -> torch.Tensor:
        """``Sampler.kept_set`` of a block: int32 [n, W], the packed bits of the final
        distribution's tokens of each asking, valid row (``s.return_kept``, ``valid`` bool
        [n]); zeros for the others. Read from what the filters left, never writing the final
        logits out: a greedy row's drawn token (token_ids int64 [n]); a candidate row's kept
        candidates; a row with a pending probability cut its kept weights (> 0; a cut of 0
        keeps every finite logit: x then); any other random row its finite logits, packed by
        the compiled kernel in one read (``kernels.pack_above``). Not in place."""
        bp = final.plan
        W = bitmask_width(s.vocab_size)
        out = torch.zeros((bp.n, W), dtype=torch.int32)
        ask = (valid & s.return_kept).tolist()
        greedy = [r for r in bp.greedy_rows if ask[r]]
        if greedy:
            index = torch.tensor(greedy, dtype=torch.long)
            tokens = token_ids.index_select(0, index)
            bit = torch.bitwise_left_shift(torch.ones_like(tokens), tokens & 31)
            out[index, tokens >> 5] = torch.where(bit >= 2**31, bit - 2**32, bit).to(torch.int32)
        rows = [r for r in bp.random_rows if ask[r]]
        if not rows:
            return out
        cand = final.cand
        place = {row: j for j, row in enumerate(cand.rows)} if cand is not None else {}
        at = [place[r] for r in rows if r in place]
        if at:
            out.index_copy_(0, cand.index[at], candidate_words(cand, at, W))
        dense, cuts = [], {}
        for r in rows:
            if r in place:
                continue
            c = final.cuts.get(r)
            if c is None or r in final.masked:
                dense.append(r)
            else:
                cuts.setdefault(id(c[0]), (c[0], []))[1].append((r, c[1]))
        for record, members in cuts.values():
            record.resolve([j for _, j in members], self.workspace)
            for r, j in members:
                if record.cut[j] == 0.0:           # keeps every token x holds
                    dense.append(r)
                else:
                    pack_rows(record.weights[j:j + 1], 0.0, out[r:r + 1])
        xx = final.x
        for r0, r1 in runs(sorted(dense)):
            pack_rows(xx[r0:r1], NEG_INF, out[r0:r1])
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


def pack_rows(x: torch.Tensor, floor: float, out: torch.Tensor) -> None:
    """out int32 [m, W] = the packed bits of ``x > floor`` (x float32 [m, V]): the compiled
    kernel (one read of x) where it runs, else the core's ``pack_kept``."""
    if not kernels.pack_above(x, floor, out):
        out.copy_(pack_kept(x > floor))


def candidate_words(cand: Candidates, at: list, W: int) -> torch.Tensor:
    """int32 [m, W]: the packed bits of the candidates still kept (value > -inf) of places
    ``at`` of ``cand``. A row's candidate ids are distinct, so each word is the sum of its
    bits' weights (in int64, then wrapped to int32)."""
    index = torch.tensor(at, dtype=torch.long)
    ids, values = cand.ids.index_select(0, index), cand.values.index_select(0, index)
    bits = torch.where(values > NEG_INF, torch.bitwise_left_shift(torch.ones_like(ids), ids & 31), 0)
    words = torch.zeros((len(at), W), dtype=torch.long).scatter_add_(1, ids >> 5, bits)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
