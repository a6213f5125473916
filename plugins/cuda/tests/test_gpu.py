"""GPU-only checks (skipped without a GPU, by the plugin's own probe): no host sync in a step,
graph replays that draw fresh numbers, and FlashInfer's draws against the torch path's kept
sets and probabilities (chi-square, fixed seeds)."""

from __future__ import annotations

import pytest
import torch
from corelib import SamplingParams
from corelib.testing import chi_square_p_value

from corelib_cuda import CudaSampler, GraphedSampler
from corelib_cuda.probe import cuda_availability
from corelib_cuda.sync_check import no_host_sync

GPU = cuda_availability()
pytestmark = pytest.mark.skipif(not GPU.available, reason=f"cuda backend unavailable: {GPU.reason}")

V = 32000


@pytest.fixture(scope="module")
def torch_sampler():
    return CudaSampler("cuda", use_flashinfer=False)


@pytest.fixture(scope="module")
def fi_sampler():
    sampler = CudaSampler("cuda")
    if sampler.path != "flashinfer":
        pytest.skip(sampler.path_reason)
    return sampler


@pytest.fixture(params=["torch", "flashinfer"])
def sampler(request, torch_sampler):
    return torch_sampler if request.param == "torch" else request.getfixturevalue("fi_sampler")


def build(sampler, requests, vocab=V, **kwargs):
    batch = sampler.new_batch(vocab, **kwargs)
    for rid, params, prompt, outputs in requests:
        batch.add(rid, params, prompt_token_ids=prompt, output_token_ids=outputs)
    return batch


FULL = dict(temperature=0.7, top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.1,
            frequency_penalty=0.2, presence_penalty=0.1, logit_bias={7: 1.5, 99: -2.0},
            min_tokens=2, stop_token_ids=[2], allowed_token_ids=list(range(0, V, 3)),
            bad_words=[[4], [8, 10]], logprobs=5)


def mixed_requests():
    return [("full", SamplingParams(**FULL), [1, 2, 3], None),
            ("full-seeded", SamplingParams(**FULL, seed=5, n=2), [1], None),
            ("greedy", SamplingParams(temperature=0.0, logprobs=2), [], None),
            ("top-p", SamplingParams(top_p=0.8), [], None),
            ("plain", SamplingParams(), [], None)]


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_steps_never_sync(sampler, mode):
    batch = build(sampler, mixed_requests(), eos_token_id=9, logprobs_mode=mode)
    logits = torch.randn((len(batch), V), device="cuda", dtype=torch.bfloat16) * 4
    sampler.step(logits, batch)                              # warm-up: caches, lazy inits
    torch.cuda.synchronize()
    with no_host_sync("cuda"):
        for _ in range(3):
            out = sampler.step(logits, batch)
            sampler.step(logits[: batch.num_requests], batch)
    assert bool(((out.token_ids >= 0) & (out.token_ids < V)).all())


def test_graph_replays_never_sync(sampler):
    runner = GraphedSampler(sampler, sizes=(8,))
    batch = build(sampler, mixed_requests(), eos_token_id=9)
    logits = torch.randn((len(batch), V), device="cuda") * 4
    runner.step(logits, batch)                               # capture
    torch.cuda.synchronize()
    with no_host_sync("cuda"):
        for _ in range(3):
            runner.step(logits, batch)
    assert runner.captures == 1


def test_graph_replays_draw_fresh_unseeded_tokens(sampler):
    runner = GraphedSampler(sampler, sizes=(4,))
    requests = [(f"u{i}", SamplingParams(top_k=1000, top_p=0.99), [], None) for i in range(4)]
    batch = build(sampler, requests)
    flat = torch.zeros((4, V), device="cuda")                # every token equally likely
    draws = torch.stack([runner.sample(flat, batch).token_ids for _ in range(8)])
    assert runner.captures == 1
    assert len(set(draws.flatten().tolist())) > 16, "replays repeat the same random numbers"


CONFIGS = {
    "top_k_top_p_min_p": dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.01),
    "top_p": dict(top_p=0.7, temperature=1.2),
    "top_k": dict(top_k=20),
    "plain": dict(temperature=1.5),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_flashinfer_draws_follow_the_torch_path(fi_sampler, torch_sampler, config):
    vocab, rows, calls = 1000, 4096, 10
    params = SamplingParams(**CONFIGS[config])
    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn((1, vocab), generator=gen) * 2).cuda()
    probe = build(torch_sampler, [("p", params, [], None)], vocab=vocab)
    final = torch_sampler.processed_logits(logits, probe)[0].cpu()
    probs = torch.softmax(final, dim=-1)
    kept = probs > 0
    batch = build(fi_sampler, [(f"d{i}", params, [], None) for i in range(rows)], vocab=vocab)
    counts = torch.zeros(vocab, dtype=torch.long)
    for _ in range(calls):
        ids = fi_sampler.sample(logits.expand(rows, -1), batch).token_ids.cpu()
        counts += torch.bincount(ids, minlength=vocab)
    outside = torch.nonzero((counts > 0) & ~kept).flatten().tolist()
    assert not outside, f"FlashInfer drew tokens the torch path drops: {outside[:10]}"
    p = chi_square_p_value(counts[kept], probs[kept])
    assert p > 1e-6, f"FlashInfer draws differ from the torch path's distribution (p={p:.2e})"


def test_flashinfer_top_k_first_fast_path(torch_sampler):
    fast = CudaSampler("cuda", top_k_first=True)
    if fast.path != "flashinfer":
        pytest.skip(fast.path_reason)
    vocab, rows, calls = 128256, 2048, 10
    params = SamplingParams(top_k=50, top_p=0.9, temperature=0.7)
    gen = torch.Generator().manual_seed(12)
    logits = (torch.randn((1, vocab), generator=gen) * 3).cuda()   # float32: no exact ties
    final = torch_sampler.processed_logits(logits, build(torch_sampler, [("p", params, [], None)], vocab=vocab))[0].cpu()
    probs = torch.softmax(final, dim=-1)
    kept = probs > 0
    batch = build(fast, [(f"d{i}", params, [], None) for i in range(rows)], vocab=vocab)
    counts = torch.zeros(vocab, dtype=torch.long)
    for _ in range(calls):
        counts += torch.bincount(fast.sample(logits.expand(rows, -1), batch).token_ids.cpu(), minlength=vocab)
    assert not ((counts > 0) & ~kept).any()
    assert chi_square_p_value(counts[kept], probs[kept]) > 1e-6
