"""Verification with draft probabilities for a row with fewer drafts than K: after its k
drafts are accepted, the row emits slot k's own draw (the contract's "after k acceptances,
slot k's draw"), whatever the padding slots of ``draft_probs`` hold."""

from __future__ import annotations

import torch
from corelib import Sampler, SamplingParams


def test_a_short_row_emits_the_slot_draw_after_its_drafts_not_a_residual():
    V, K = 16, 3
    sampler = Sampler("cpu")
    logits = torch.randn((1, K + 1, V), generator=torch.Generator().manual_seed(0))
    plain = sampler.new_batch(V)
    plain.add("r", SamplingParams(seed=9))
    first = sampler.sample(logits[:, 0], plain).token_ids
    plain.append(first)
    second = int(sampler.sample(logits[:, 1], plain).token_ids)
    drafts = torch.tensor([[int(first), -1, -1]])
    q = torch.full((1, K, V), 1.0 / V)
    q[0, 0] = 0.0
    q[0, 0, (int(first) + 1) % V] = 1.0
    q[0, 0, int(first)] = 1e-30          # p / q is huge: the draft is always accepted
    q[0, 1] = 0.0
    q[0, 1, second] = 1.0                # padding that would remove the slot's draw from a residual
    batch = sampler.new_batch(V)
    batch.add("r", SamplingParams(seed=9))
    out = sampler.verify(logits, batch, drafts, q)
    assert out.num_emitted.tolist() == [2]
    assert out.token_ids.tolist() == [[int(first), second, -1, -1]]
