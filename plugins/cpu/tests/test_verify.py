"""Verification on the cpu backend beyond the shared suite: seeded rows emit the reference's
tokens whether a ratio test is settled by the candidates' softmax or by the reference's, with
drafts close to the target (many acceptances, several slots judged per row); the check of the
draft probabilities; each slot's penalty slots; verify's ``[rows, K+1]`` appends."""

from __future__ import annotations

import pytest
import torch
from corelib import Sampler, SamplingParams

from corelib_cpu.batch import CpuBatch
from corelib_cpu.sampler import CpuSampler, SlotJudge

V = 3000
K = 3


def build(sampler, requests):
    batch = sampler.new_batch(V)
    for rid, params, prompt in requests:
        batch.add(rid, params, prompt_token_ids=prompt)
    return batch


def close_drafts(logits: torch.Tensor, g: torch.Generator):
    """Draft ids and probabilities from a distribution near the target's, so most drafts
    pass and rows are judged at several slots."""
    B = logits.shape[0]
    q = torch.softmax(logits[:, :K] + 0.3 * torch.randn((B, K, V), generator=g), dim=-1)
    ids = torch.stack([torch.multinomial(q[:, j], 1, generator=g)[:, 0] for j in range(K)], dim=1)
    return ids, q


@pytest.mark.parametrize("tolerance", [None, 1.0], ids=["bound", "always-exact"])
def test_seeded_rows_emit_the_references_tokens_with_close_drafts(monkeypatch, tolerance):
    if tolerance is not None:                      # every seeded decision takes the reference's softmax
        original = SlotJudge.__init__

        def exact_init(self, *args):
            original(self, *args)
            self.tolerance = tolerance
        monkeypatch.setattr(SlotJudge, "__init__", exact_init)
    requests = [(f"k{i}", SamplingParams(seed=10 + i, top_k=20, temperature=0.8), [1, 2]) for i in range(4)]
    requests += [(f"p{i}", SamplingParams(seed=20 + i, top_p=0.9, min_p=0.01), [3]) for i in range(3)]
    requests += [("w", SamplingParams(seed=30, repetition_penalty=1.3), [5, 5, 6]),
                 ("g", SamplingParams(temperature=0.0), [7])]
    cpu, reference = CpuSampler(block_elements=3 * V * (K + 1)), Sampler("cpu")
    mine, ref = build(cpu, requests), build(reference, requests)
    g = torch.Generator().manual_seed(0)
    accepted = 0
    for step in range(6):
        logits = torch.randn((len(requests), K + 1, V), generator=g) * 2
        ids, q = close_drafts(logits, g)
        got, want = cpu.verify(logits, mine, ids, q), reference.verify(logits, ref, ids, q)
        assert torch.equal(got.token_ids, want.token_ids), f"step {step}"
        assert torch.equal(got.num_emitted, want.num_emitted)
        accepted += int((got.num_emitted > 1).sum())
        mine.append(got.token_ids)
        ref.append(want.token_ids)
    assert accepted > 10                            # the slots past the first were judged


def test_draft_probabilities_check_matches_the_references():
    q = torch.rand((4, 3, 200))
    q[0, 0, 5] = float("nan")
    q[0, 1, 3] = -float("nan")
    q[1, 0, 0] = float("inf")
    q[1, 1, 0] = -float("inf")
    q[2, 0, 9] = -0.0                               # sane: -0.0 >= 0
    q[2, 1, 9] = -1e-30
    q[3, 2, 4] = 3e38                               # huge but finite: sane
    got = CpuSampler().draft_probs_sane(q)
    assert torch.equal(got, Sampler().draft_probs_sane(q))
    assert got.tolist() == [[False, False, True], [False, False, True], [True, False, True],
                            [True, True, True]]


def test_each_slot_carries_the_penalty_slots_after_its_drafts():
    batch = CpuBatch(V)
    batch.add("a", SamplingParams(frequency_penalty=0.5), [1, 2, 3], [4, 4])
    batch.add("plain", SamplingParams(), [9])
    batch.add("b", SamplingParams(presence_penalty=1.0, n=2), [7])
    drafts = torch.tensor([[4, 8, 8], [1, 2, -1], [7, 3, 3], [5, -1, -1]])
    s = batch.speculative_state(drafts, slots_only=True)
    assert s.prompt_mask is None and s.output_counts is None      # no [B (K+1), V] copies
    for row in range(batch.num_rows):
        for j in range(K + 1):
            after = CpuBatch(V)
            after.add("a", SamplingParams(frequency_penalty=0.5), [1, 2, 3], [4, 4])
            after.add("plain", SamplingParams(), [9])
            after.add("b", SamplingParams(presence_penalty=1.0, n=2), [7])
            for i in range(j):
                column = drafts[:, i].clone()
                column[column < 0] = 0
                after.append(column)
            ids, counts, length = after.penalty_slots(after.num_rows)
            want = dict(zip(ids[row, : length[row]].tolist(), counts[row, : length[row]].tolist()))
            v = row * (K + 1) + j
            n = int(s.slot_len[v])
            got = dict(zip(s.slot_ids[v, :n].tolist(), s.slot_counts[v, :n].tolist()))
            if (drafts[row, :j] < 0).any():
                continue                            # padding stops the row's slots
            assert got == want, f"row {row} slot {j}"


def test_verify_appends_update_the_penalty_slots_like_the_dense_state():
    batch = CpuBatch(V)
    batch.add("a", SamplingParams(frequency_penalty=0.5), [1, 2], [4])
    batch.add("b", SamplingParams(presence_penalty=1.0), [7])
    batch.add("plain", SamplingParams(), [])
    batch.append(torch.tensor([[4, 9, 9, -1], [3, -1, -1, -1], [1, 2, 3, 4]]))
    ids, counts, length = batch.penalty_slots(batch.num_rows)
    s = batch.step_state()
    for row in range(2):
        got = dict(zip(ids[row, : length[row]].tolist(), counts[row, : length[row]].tolist()))
        seen = (s.prompt_mask[row] | (s.output_counts[row] > 0)).nonzero().flatten().tolist()
        assert got == {t: int(s.output_counts[row, t]) for t in seen}
    assert int(length[2]) == 0
