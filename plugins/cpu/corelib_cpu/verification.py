"""Speculative verification on the ``cpu`` backend: the draft checks and the ratio test's and
block verification's judges, on a block of whole rows (every slot of a row).

Mixed into :class:`~corelib_cpu.sampler.CpuSampler`. Token verification
(:class:`~corelib_cpu.judge.SlotJudge`): a row's slots are judged up to its first rejected
draft and only that slot draws its residual (the template emits nothing after it); candidate
rows judge with the candidates' softmax (seeded decisions within its rounding bound, and
seeded residuals, take the reference's softmax), whole rows with the reference's softmax
(seeded) or their draw weights (unseeded); seeded residual draws race with the contract's
noise over the residual's support, unseeded ones draw from the residual itself; the draft
probabilities are checked by two integer reductions over their bits. Block verification
(:class:`~corelib_cpu.judge.BlockJudge`) computes the reference's weights and residual
masses for seeded rows, from the longest prefix down, summing a residual only where a bound
cannot settle the test, and draws only at the row's stopping slot. Shapes: ``B`` rows, ``K``
draft slots, ``V`` vocabulary.
"""

from __future__ import annotations

import torch
from corelib import Sampler, StepState
from corelib.noise import STREAM_BLOCK
from corelib.sampler import Drafts

from .block import Block
from .judge import BlockJudge, SlotJudge
from .plan import BlockPlan

_INF_BITS = 0x7F800000


class Verification:
    """Verification of :class:`~corelib_cpu.sampler.CpuSampler` (which provides
    ``generator`` and the core's ``acceptance_uniforms`` and ``row_uniforms``)."""

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
            sane[at] = Sampler.draft_probs_sane(self, probs[at])
        return sane

    def rejection_sample(self, final: Block, s: StepState, drafts: Drafts) -> tuple[torch.Tensor, torch.Tensor]:
        """Lossless speculative sampling at the draft slots of the block's random rows, by
        ``Sampler.rejection_sample``'s rule: with p the slot's final distribution, draft d
        passes when ``u * q(d) < p(d)``, and a rejected slot draws from max(p - q, 0)
        renormalised (p where that is all zero) with step 14's own noise. Returns (bool
        [b, K] passed, int64 [b, K] recovered); greedy rows' entries are unused.

        A row stops at its first rejected draft, so only the slots up to it are judged and
        only that slot draws (the template emits nothing of the slots after it); see
        :class:`~corelib_cpu.judge.SlotJudge` for how p is found."""
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
        judge = SlotJudge(final, torch.cat([d, torch.zeros_like(d[:, :1])], dim=1).view(-1), self.generator)
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
        ``Sampler.block_verify``'s rule and arithmetic (see :class:`~corelib_cpu.judge.BlockJudge`). valid bool
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
        judge = BlockJudge(final, drafts, spans, self.generator)
        for r, tau in judge.judge(u).items():
            accepted[r, :tau] = True
            if tau < spans[r]:
                judge.draw(r, tau)
        for (r, j), token in judge.residual_draws():
            recovered[r, j] = token
        return accepted, recovered



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
