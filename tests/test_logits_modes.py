"""Step 15's four sources: logprobs or logits, of the model's logits or the final distribution."""

import pytest
import torch

from corelib import Sampler, SamplingParams

V = 64


def batch_for(sampler, mode):
    batch = sampler.new_batch(V, logprobs_mode=mode)
    batch.add("g", SamplingParams(temperature=0.0, logprobs=-1, presence_penalty=1.0), [1, 2], [3])
    batch.add("s", SamplingParams(seed=5, logprobs=30, temperature=0.5, top_k=10), [1, 2], [3])
    return batch


@pytest.fixture
def sampler():
    return Sampler("cpu")


def test_raw_logits_are_the_models_logits_as_given(sampler):
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    out = sampler.sample(logits, batch_for(sampler, "raw_logits"))
    lp = out.logprobs
    top = torch.sort(logits.float(), dim=-1, descending=True)
    assert torch.equal(lp.logprobs[0, 1:], top.values[0])                 # every token, best first
    assert torch.equal(lp.logprobs[1, 1:31], top.values[1, :30])
    assert torch.equal(lp.logprobs[:, 0], logits.float().gather(1, out.token_ids[:, None])[:, 0])


@pytest.mark.parametrize("mode", ["processed", "processed_logits"])
def test_processed_modes_describe_the_final_distribution(sampler, mode):
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(2)) * 3
    out = sampler.sample(logits, batch_for(sampler, mode))
    final = sampler.processed_logits(logits, batch_for(sampler, mode))
    values = final if mode == "processed_logits" else torch.log_softmax(final, dim=-1)
    assert torch.equal(out.logprobs.logprobs[:, 0], values.gather(1, out.token_ids[:, None])[:, 0])
    assert torch.equal(out.logprobs.logprobs[0, 1:], torch.sort(values[0], descending=True).values)
    assert int((values[1] > float("-inf")).sum()) == 10                   # top-k 10: dropped -inf
    assert torch.equal(out.logprobs.logprobs[1, 11:31], torch.full((20,), float("-inf")))
    ranks = (values >= values.gather(1, out.token_ids[:, None])).sum(dim=-1)
    assert torch.equal(out.logprobs.ranks, ranks)


def test_an_unknown_logprobs_mode_is_refused(sampler):
    with pytest.raises(ValueError, match="logprobs_mode must be one of .*'raw_logits', 'processed_logits'.*got 'logits'"):
        sampler.new_batch(V, logprobs_mode="logits")
