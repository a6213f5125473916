"""The cpu backend's score across blocks: the selectors' state that ``append`` advances after
a T-position score (each block's log-probabilities, joined in row order) is the state T
single steps with append leave, with rows of a request split over several blocks."""

from __future__ import annotations

import torch
from corelib import SamplingParams

from corelib_cpu.sampler import CpuSampler

V = 300
ROWS = [dict(mirostat_tau=3.0, mirostat_eta=0.3, seed=1), dict(temperature=0.7, top_k=20, seed=2),
        dict(adaptive_p_target=0.4, top_p=0.9, seed=3), dict(temperature=0.0),
        dict(mirostat_tau=5.0, mirostat_eta=0.1, min_p=0.02, seed=4)]


def new_batch(sampler):
    batch = sampler.new_batch(V)
    for i, params in enumerate(ROWS):
        batch.add(f"r{i}", SamplingParams(**params), prompt_token_ids=[5, 6, 7])
    return batch


def selector_state(batch) -> dict:
    s = batch.step_state()
    return {name: getattr(s, name).clone() for name in
            ("mirostat_mu", "adaptive_p_weighted", "adaptive_p_total")}


def test_selector_state_after_a_scored_sequence_is_that_of_single_steps():
    T = 6
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn((len(ROWS), T, V), generator=gen) * 2
    tokens = torch.topk(logits, 3, dim=-1).indices[..., 1]        # kept by every row's filters
    for block_rows in (1, 2, len(ROWS)):        # a block holds whole rows: T slots each
        sampler = CpuSampler(block_elements=block_rows * T * V)
        whole = new_batch(sampler)
        out = sampler.score(logits, whole, tokens)
        whole.append(tokens)
        steps = new_batch(sampler)
        for t in range(T):
            step = sampler.score(logits[:, t], steps, tokens[:, t])
            assert torch.equal(step.logprobs, out.logprobs[:, t])
            steps.append(tokens[:, t])
        got, want = selector_state(whole), selector_state(steps)
        for name in want:
            assert torch.equal(got[name], want[name]), (block_rows, name)
        assert bool((want["mirostat_mu"][[0, 4]] != torch.tensor([6.0, 10.0])).all())   # it moved
