"""The backend's reused buffers under ``torch.inference_mode``: an engine that runs its steps
there (vLLM does) and a caller that then samples outside it (a test, a trainer scoring with
gradients) share one sampler, so a buffer made in one mode must serve the other."""

import torch

import corelib
from corelib import SamplingParams


def _steps(sampler, batch):
    batch.add(f"s{len(batch)}", SamplingParams(seed=1, top_k=20, n=2))
    batch.add(f"g{len(batch)}", SamplingParams(temperature=0.0))
    batch.add(f"m{len(batch)}", SamplingParams(mirostat_tau=3.0, seed=2))
    batch.add(f"p{len(batch)}", SamplingParams(seed=3, min_p=0.1, top_p=0.9, logprobs=2,
                                               presence_penalty=0.5))
    rows = batch.num_rows
    gen = torch.Generator().manual_seed(len(batch))
    out = sampler.sample(torch.randn(rows, 300, generator=gen), batch)
    batch.append(out.token_ids)
    drafts = torch.randint(0, 300, (rows, 2), generator=gen)
    probs = torch.softmax(torch.randn(rows, 2, 300, generator=gen), dim=-1)
    for draft_probs in (None, probs):
        verified = sampler.verify(torch.randn(rows, 3, 300, generator=gen), batch, drafts,
                                  draft_probs=draft_probs)
        batch.append(verified.token_ids)
    return out


def test_a_sampler_used_under_inference_mode_samples_outside_it_and_back():
    sampler = corelib.get_sampler("cpu")
    with torch.inference_mode():
        inside = _steps(sampler, sampler.new_batch(300))
    outside = _steps(sampler, sampler.new_batch(300))          # raised before: buffers were inference tensors
    assert torch.equal(inside.token_ids, outside.token_ids)   # seeded rows: the same draws
    with torch.inference_mode():
        _steps(sampler, sampler.new_batch(300))
