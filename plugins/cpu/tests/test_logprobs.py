"""Step 15 on the cpu backend beyond the shared suite: ``raw_logits`` are the logits as given
even where the block's working copy is made before any stage (per-request logits, half
precision) and the stages then write it in place; top-N above 20 through both of the cpu's
top-N paths (group maxima, and a full top-k once N covers the groups); ``logprobs=-1`` at a
real vocabulary size."""

from __future__ import annotations

import pytest
import torch
from corelib import Sampler, SamplingParams

from corelib_cpu.rowops import GROUP
from corelib_cpu.sampler import CpuSampler

WRITERS = dict(presence_penalty=1.5, repetition_penalty=1.3, logit_bias={4: 5.0}, temperature=0.7,
               top_p=0.9, bad_words=[[3, 4]])


def build(sampler, vocab: int, requests, mode: str):
    batch = sampler.new_batch(vocab, logprobs_mode=mode)
    for rid, params, prompt, output in requests:
        batch.add(rid, params, prompt_token_ids=prompt, output_token_ids=output)
    return batch


@pytest.mark.parametrize("source", ["per-request", "float16"])
def test_raw_logits_are_the_given_logits_when_the_copy_is_made_up_front(source):
    vocab = 2000
    requests = [("a", SamplingParams(n=2, seed=1, logprobs=4, **WRITERS), [4, 9, 9], [[3], [3, 4]]),
                ("b", SamplingParams(temperature=0.0, logprobs=4, presence_penalty=2.0), [7], None)]
    g = torch.Generator().manual_seed(1)
    per_request = torch.randn(2, vocab, generator=g) * 3
    expanded = per_request[torch.tensor([0, 0, 1])]
    logits = per_request if source == "per-request" else expanded.half()
    given = expanded if source == "per-request" else expanded.half().float()
    for rows_per_block in (1, 100):
        cpu, reference = CpuSampler(block_elements=rows_per_block * vocab), Sampler("cpu")
        got = cpu.sample(logits, build(cpu, vocab, requests, "raw_logits"))
        want = reference.sample(given, build(reference, vocab, requests, "raw_logits"))
        assert torch.equal(got.token_ids, want.token_ids)
        assert torch.equal(got.logprobs.logprobs, want.logprobs.logprobs)
        assert torch.equal(got.logprobs.logprobs[:, 1:], given.topk(4, dim=-1).values)
        assert torch.equal(got.logprobs.logprobs[:, 0], given.gather(1, got.token_ids[:, None])[:, 0])


@pytest.mark.parametrize("n", [21, 64, 249, 250, 1000])
@pytest.mark.parametrize("mode", ["raw", "processed", "raw_logits", "processed_logits"])
def test_top_n_above_twenty_matches_the_reference(n, mode):
    vocab = 32000                                 # 250 groups: n < 250 reads the group maxima
    assert vocab // GROUP == 250
    requests = [("seeded", SamplingParams(seed=5, logprobs=n, top_k=400, temperature=0.9), [1, 2], None),
                ("greedy", SamplingParams(temperature=0.0, logprobs=n, frequency_penalty=0.4), [3], [3, 3]),
                ("few", SamplingParams(seed=6, logprobs=2, min_p=0.001), [], None)]
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(n)) * 2
    for rows_per_block in (1, 100):
        cpu, reference = CpuSampler(block_elements=rows_per_block * vocab), Sampler("cpu")
        got = cpu.sample(logits, build(cpu, vocab, requests, mode))
        want = reference.sample(logits, build(reference, vocab, requests, mode))
        assert got.logprobs.token_ids.shape == (3, n + 1)
        assert torch.equal(got.token_ids, want.token_ids)
        assert torch.equal(got.logprobs.ranks, want.logprobs.ranks)
        assert torch.allclose(got.logprobs.logprobs, want.logprobs.logprobs, atol=1e-5, equal_nan=True)
        finite = torch.isfinite(want.logprobs.logprobs)      # ties at -inf come in any order
        assert torch.equal(got.logprobs.token_ids[finite], want.logprobs.token_ids[finite])


@pytest.mark.parametrize("mode", ["raw", "processed_logits"])
def test_every_logprob_at_a_real_vocabulary(mode):
    vocab, B = 128256, 2
    requests = [("all", SamplingParams(seed=7, logprobs=-1, top_k=50), [], None),
                ("greedy", SamplingParams(temperature=0.0, logprobs=3), [], None)]
    logits = torch.randn(B, vocab, generator=torch.Generator().manual_seed(8)) * 2
    got = CpuSampler().sample(logits, build(CpuSampler(), vocab, requests, mode))
    want = Sampler("cpu").sample(logits, build(Sampler("cpu"), vocab, requests, mode))
    lp = got.logprobs
    assert lp.token_ids.shape == lp.logprobs.shape == (B, vocab + 1)
    assert torch.equal(torch.sort(lp.token_ids[0, 1:]).values, torch.arange(vocab))   # every token once
    assert not bool((lp.logprobs[0, 1:-1] < lp.logprobs[0, 2:]).any())               # descending
    assert torch.equal(lp.logprobs[:, :4], want.logprobs.logprobs[:, :4])
    assert torch.equal(lp.ranks, want.logprobs.ranks)
    assert torch.equal(lp.logprobs[0], want.logprobs.logprobs[0])
