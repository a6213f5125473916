"""The adapter around FlashInfer's ``chain_speculative_sampling`` (``FlashInferDraw.verify``
and ``CudaSampler.rejection_sample``), checked on the CPU against a torch transcription of the
kernel's documented behaviour: FlashInfer's kernels need a GPU, and this is the glue that maps
their output (accepted prefix, residual draw, -1 padding) onto the contract's verification,
with rows of fewer drafts than K and seeded rows mixed in. ``test_gpu.py`` runs the real kernel
through the same checks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from corelib import Sampler, SamplingParams
from corelib.testing import chi_square_p_value

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


@pytest.fixture
def sampler():
    """The torch path on CPU with FlashInferDraw driving the transcribed kernel."""
    sampler = CudaSampler("cpu", use_flashinfer=False)
    draw = object.__new__(FlashInferDraw)
    draw._sampling = SimpleNamespace(chain_speculative_sampling=chain_kernel_as_documented)
    draw.device = sampler.device
    draw.seed = torch.full((1,), 1234, dtype=torch.int64)
    draw.offset = torch.zeros(1, dtype=torch.int64)
    sampler.flashinfer = draw
    sampler.flashinfer_draws = lambda s: False   # step 14 stays torch: only the chain is transcribed
    return sampler


def test_unseeded_rows_keep_the_target_distribution_short_rows_included(sampler):
    vocab, K, R = 16, 3, 3000
    gen = torch.Generator().manual_seed(5)
    target = torch.randn((K + 1, vocab), generator=gen) * 1.5
    q = torch.softmax(torch.randn((K, vocab), generator=gen) * 1.5, dim=-1)
    p = torch.softmax(target, dim=-1)
    ids = torch.stack([torch.multinomial(q[j], R, replacement=True, generator=gen) for j in range(K)], dim=1)
    ids[R // 2:, 1:] = -1
    batch = sampler.new_batch(vocab)
    for i in range(R):
        batch.add(f"v{i}", SamplingParams())
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
