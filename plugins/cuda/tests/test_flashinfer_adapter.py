"""The FlashInfer path's glue (``FlashInferDraw``, ``CudaSampler.sample_random`` and
``rejection_sample``), checked on the CPU against torch transcriptions of the three kernels'
documented behaviour: FlashInfer needs a GPU, and this is the code that decides which rows and
steps FlashInfer takes, what it is given (the filtered target for the ratio test, clamped draft
ids) and how its output (accepted prefix, residual draw, -1 padding) becomes the contract's
result, with rows of fewer drafts than K and seeded rows mixed in. The whole conformance suite
runs on this path too. ``test_gpu.py`` runs the real kernels through the same checks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from corelib import Sampler, SamplingParams
from corelib.testing import ConformanceSuite, chi_square_p_value

from corelib_cuda import CudaSampler
from corelib_cuda.flashinfer_ops import FlashInferDraw


def chain_kernel_as_documented(draft_probs, draft_token_ids, target_probs, accepted_num,
                               emitted_num, deterministic=True, generator=None, seed=None,
                               offset=None):
    """FlashInfer 0.7.4's ChainSpeculativeSampling, row by row: draft i passes when
    u * q(d) < p(d); at the first failure (or after K passes) one draw from relu(p - q) (p at
    the bonus slot); -1 after; -1 also when that residual is all zero."""
    B, K = draft_token_ids.shape
    out = torch.full((B, K + 1), -1, dtype=torch.int32)
    gen = torch.Generator().manual_seed(int(seed[0]) + int(offset[0]))
    for b in range(B):
        pos = K
        for i in range(K):
            d = int(draft_token_ids[b, i])
            if float(torch.rand((), generator=gen)) * float(draft_probs[b, i, d]) < float(target_probs[b, i, d]):
                out[b, i] = d
            else:
                pos = i
                break
        q = draft_probs[b, pos] if pos < K else torch.zeros_like(target_probs[b, pos])
        residual = (target_probs[b, pos] - q).clamp(min=0)
        if float(residual.sum()) > 0:
            out[b, pos] = int(torch.multinomial(residual, 1, generator=gen))
        emitted_num[b] += pos
    return out, accepted_num, emitted_num


def sampling_from_logits_as_documented(logits, seed=None, offset=None, **_):
    return torch.multinomial(torch.softmax(logits, dim=-1), 1)[:, 0].to(torch.int32)


def top_k_top_p_sampling_from_logits_as_documented(logits, top_k, top_p, seed=None, offset=None,
                                                   top_k_max=None, **_):
    """Keep logits >= the k-th largest (ties kept), softmax, keep the smallest most likely set
    with mass >= top_p, draw."""
    V = logits.shape[-1]
    ordered = torch.sort(logits, dim=-1, descending=True).values
    kth = ordered.gather(1, (top_k.long().clamp(1, V) - 1)[:, None])
    probs = torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)
    sorted_p = torch.sort(probs, dim=-1, descending=True).values
    before = sorted_p.cumsum(dim=-1) - sorted_p
    last = (before < top_p[:, None]).sum(dim=-1, keepdim=True).clamp(min=1) - 1
    probs = probs.masked_fill(probs < sorted_p.gather(1, last), 0.0)
    return torch.multinomial(probs, 1)[:, 0].to(torch.int32)


def transcribed_flashinfer_sampler() -> CudaSampler:
    """The torch path on CPU with FlashInferDraw driving the transcribed kernels: FlashInfer
    draws the unseeded rows of every step and judges their drafts, as on a GPU."""
    sampler = CudaSampler("cpu", use_flashinfer=False)
    draw = object.__new__(FlashInferDraw)
    draw._sampling = SimpleNamespace(
        chain_speculative_sampling=chain_kernel_as_documented,
        sampling_from_logits=sampling_from_logits_as_documented,
        top_k_top_p_sampling_from_logits=top_k_top_p_sampling_from_logits_as_documented)
    draw.device = sampler.device
    draw.seed = torch.full((1,), 1234, dtype=torch.int64)
    draw.offset = torch.zeros(1, dtype=torch.int64)
    sampler.flashinfer = draw
    return sampler


@pytest.fixture
def sampler():
    return transcribed_flashinfer_sampler()


class TestConformanceOnTheFlashInferPath(ConformanceSuite):
    backend = "cuda"
    draw_rows, draw_calls = 1000, 8         # the transcribed kernels loop in Python over rows
    verify_rows = 2000

    def make_sampler(self):
        return transcribed_flashinfer_sampler()


@pytest.mark.parametrize("params", [{}, {"top_k": 6, "top_p": 0.9}], ids=["plain", "top_k_top_p"])
def test_unseeded_rows_keep_the_target_distribution_short_rows_included(sampler, params):
    """With top-k and top-p the target at each slot is the filtered distribution (FlashInfer
    draws the slots' tokens with both fused, so the ratio test needs them applied to p too)."""
    vocab, K, R = 16, 3, 3000
    gen = torch.Generator().manual_seed(5)
    target = torch.randn((K + 1, vocab), generator=gen) * 1.5
    q = torch.softmax(torch.randn((K, vocab), generator=gen) * 1.5, dim=-1)
    reference = Sampler("cpu")
    slots = reference.new_batch(vocab)
    for j in range(K + 1):                                  # one row per slot's target
        slots.add(f"slot{j}", SamplingParams(**params))
    p = torch.softmax(reference.processed_logits(target, slots), dim=-1)
    ids = torch.stack([torch.multinomial(q[j], R, replacement=True, generator=gen) for j in range(K)], dim=1)
    ids[R // 2:, 1:] = -1
    batch = sampler.new_batch(vocab)
    for i in range(R):
        batch.add(f"v{i}", SamplingParams(**params))
    torch.manual_seed(6)
    out = sampler.verify(target.expand(R, -1, -1).contiguous(), batch, ids, q.expand(R, -1, -1).contiguous())
    tokens, count = out.token_ids, out.num_emitted
    assert int(sampler.flashinfer.offset) > 0, "the kernel's Philox offset must advance"
    assert chi_square_p_value(torch.bincount(tokens[:, 0], minlength=vocab), p[0]) > 1e-6
    accepted = (count >= 2).double().mean()
    expected = torch.minimum(p[0], q[0]).sum().double()
    assert (accepted - expected).abs() <= 5 * (expected * (1 - expected) / R).sqrt()
    for rows in (slice(0, R // 2), slice(R // 2, R)):       # K drafts; one draft (slot 1's draw)
        second = tokens[rows][count[rows] >= 2, 1]
        assert chi_square_p_value(torch.bincount(second, minlength=vocab), p[1]) > 1e-6
    assert int(count[R // 2:].max()) <= 2 and int(count[: R // 2].max()) <= K + 1


def test_seeded_and_greedy_rows_keep_the_reference_tokens_in_a_mixed_batch(sampler):
    vocab, K = 64, 3
    requests = [("s", SamplingParams(seed=3, top_k=20)), ("u", SamplingParams()),
                ("g", SamplingParams(temperature=0.0)), ("s2", SamplingParams(seed=4, n=2))]
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn((5, K + 1, vocab), generator=gen) * 2
    ids = torch.randint(vocab, (5, K), generator=gen)
    ids[4, 2:] = -1
    probs = torch.softmax(torch.randn((5, K, vocab), generator=gen), dim=-1)
    reference = Sampler("cpu")
    batches = []
    for s in (sampler, reference):
        batch = s.new_batch(vocab)
        for rid, params in requests:
            batch.add(rid, params)
        batches.append(batch)
    got = sampler.verify(logits, batches[0], ids, probs)
    want = reference.verify(logits, batches[1], ids, probs)
    for row in (0, 2, 3, 4):                                # seeded and greedy rows
        assert got.token_ids[row].tolist() == want.token_ids[row].tolist(), row
    assert 1 <= int(got.num_emitted[1]) <= K + 1 and bool(got.valid.all())


def test_unusable_and_out_of_range_drafts_do_not_reach_the_kernel_as_indices(sampler):
    vocab, K = 32, 2
    batch = sampler.new_batch(vocab)
    batch.add("a", SamplingParams())
    batch.add("b", SamplingParams())
    logits = torch.randn((2, K + 1, vocab))
    probs = torch.full((2, K, vocab), 1.0 / vocab)
    checked = sampler.check_drafts(logits, batch, torch.tensor([[1, 2], [3, -1]]), probs)
    checked.token_ids[0, 1] = vocab + 5                    # as a device tensor would carry it
    passed, recovered = sampler.flashinfer.verify(torch.softmax(logits, -1), checked)
    assert passed.shape == recovered.shape == (2, K)
    assert bool(((recovered >= 0) & (recovered < vocab)).all())
