"""Step 15 on the cpu backend beyond the shared suite: ``raw_logits`` are the logits as given
even where the block's working copy is made before any stage (per-request logits, half
precision) and the stages then write it in place; top-N above 20 through both of the cpu's
top-N paths (group maxima, and a full top-k once N covers the groups); ``logprobs=-1`` at a
real vocabulary size; the top-N's order among equal values (lowest id first) on the compiled
pass and the torch path, with the same values and ranks."""

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
        assert_same_top(got.logprobs, want.logprobs)


def assert_same_top(got, want):
    """The top-N columns (1:) of two ``Logprobs`` list the same ids, except among equal values:
    the reference's torch.topk orders those any way it likes, and at the N-th place may keep
    other ids of the tie; the cpu backend lists them lowest id first. Ties at -inf are left
    out (the reference keeps no order there either)."""
    for row in range(want.token_ids.shape[0]):
        values = want.logprobs[row, 1:]
        ids, got_ids = want.token_ids[row, 1:], got.token_ids[row, 1:]
        start = 0
        while start < values.numel() and bool(torch.isfinite(values[start])):
            stop = start + 1
            while stop < values.numel() and bool(values[stop] == values[start]):
                stop += 1
            tie = got_ids[start:stop]
            assert torch.equal(tie, tie.sort().values), (row, start)    # lowest id first
            if stop < values.numel():   # a tie inside the top-N: the same ids
                assert torch.equal(tie, ids[start:stop].sort().values), (row, start)
            start = stop


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


def _tied_rows(V: int, seed: int) -> torch.Tensor:
    """Rows of V log-probability-like values built to tie: at the N-th place (across groups,
    inside one group, in the short last group), at the sampled value, at -inf (fewer finite
    values than N), and -0.0 against +0.0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, V, generator=g)
    x[0] = torch.round(x[0] * 2) / 2                      # a few dozen distinct values
    x[1, torch.randperm(V, generator=g)[:40]] = 9.0       # 40 tokens tied at the top
    x[2] = float("-inf")
    x[2, torch.randperm(V, generator=g)[:3]] = 1.0        # 3 finite: the rest tie at -inf
    x[3, ::7] = x[3].max()                                # ties spread over every group
    x[4] = torch.log_softmax(torch.round(x[4] * 4) * 3, dim=-1)
    x[5] = torch.where(torch.rand(V, generator=g) < 0.5, 0.0, -0.0)
    x[5, 3] = -1.0
    x[6, -3:] = x[6].max() + 1                            # ties in the last group
    x[7, :GROUP] = 5.0                                    # one group of ties
    return x


def _stable_top(x: torch.Tensor, width: int):
    """The order asked of step 15's top-N: value descending, then id ascending."""
    values, ids = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[:, :width], ids[:, :width]


@pytest.mark.parametrize("V", [300, 5000, 128256 + 5])
def test_top_logprobs_ties_come_lowest_id_first_on_both_paths(kernel_path, V):
    """Both of step 15's paths (the compiled top-N + rank pass, and the torch group search)
    list the top-N as value descending, then id ascending, for ties at the N-th place, inside
    the top-N, at -inf and at the sampled token; the values are torch.topk's and the ranks the
    reference's count, bit for bit."""
    from corelib_cpu.logprob_stage import LogprobStage
    from corelib_cpu.rowops import top_logprobs
    from corelib_cpu.workspace import Workspace

    stage = LogprobStage()
    stage.workspace = Workspace()
    for seed in range(2):
        x = _tied_rows(V, seed)
        sampled = torch.tensor([0, int(torch.nonzero(x[1] == 9.0)[3]), 5, 7, 11, 3, V - 1, 2])
        for width in (0, 1, 5, 20, 64, 65):
            want_values, want_ids = _stable_top(x, width)
            if width:
                values, ids = top_logprobs(x, width)
                assert torch.equal(values, want_values) and torch.equal(ids, want_ids), (seed, width)
                assert torch.equal(values, torch.topk(x, width, dim=-1).values)
            got = stage.gather_logprobs(x, sampled, width)
            safe = sampled.clamp(min=0)
            assert torch.equal(got.token_ids[:, 0], safe)
            assert torch.equal(got.logprobs[:, 0], x.gather(1, safe[:, None])[:, 0])
            assert torch.equal(got.token_ids[:, 1:], want_ids), (seed, width)
            assert torch.equal(got.logprobs[:, 1:], want_values)
            assert torch.equal(got.ranks, (x >= x.gather(1, safe[:, None])).sum(dim=-1))
            signs = torch.signbit(got.logprobs[5, 1:])          # -0.0 and +0.0 kept apart
            assert torch.equal(signs, torch.signbit(x[5, got.token_ids[5, 1:]]))


def test_top_logprobs_rank_nan_as_inf_in_id_order(kernel_path):
    """A row holding a NaN (flagged, but its logprobs are still returned) lists its NaNs and
    +infs first, in id order, then the rest as any row, its values as they are, on both paths
    (the compiled pass hands any block with such a row to the torch path); the other rows of
    the block are unchanged by it. Every token's list (N = V) is the stable sort."""
    from corelib_cpu import kernels
    from corelib_cpu.logprob_stage import LogprobStage
    from corelib_cpu.workspace import Workspace

    x = _tied_rows(5000, 3)[:3].clone()
    x[1, [17, 4000]] = float("nan")
    x[1, [30, 2000]] = float("inf")
    sampled = torch.tensor([4, 17, 9])
    assert kernels.top_and_rank(x, sampled, 5) is None
    stage = LogprobStage()
    stage.workspace = Workspace()
    got = stage.gather_logprobs(x, sampled, 6)
    assert got.token_ids[1, 1:5].tolist() == [17, 30, 2000, 4000]
    keyed = torch.where(torch.isnan(x), float("inf"), x)
    _, want_ids = _stable_top(keyed, 6)
    assert torch.equal(got.token_ids[:, 1:], want_ids)
    assert torch.equal(got.logprobs[:, 1:].nan_to_num(), x.gather(1, want_ids).nan_to_num())
    assert torch.equal(got.ranks, (x >= x.gather(1, sampled[:, None])).sum(dim=-1))
    every = stage.gather_logprobs(x, sampled, 5000)
    assert torch.equal(every.token_ids[:, 1:], torch.sort(x, dim=-1, descending=True, stable=True).indices)


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_logprobs_are_the_same_on_both_paths_and_every_block_size(monkeypatch, mode):
    """A step's logprobs (ids, values bit for bit, ranks) at V = 128256 are the same through the
    compiled pass and the torch path, at B = 1 and B = 8, whatever the rows per block, with
    logits tied at the top-N boundary."""
    from corelib_cpu import kernels

    vocab = 128256
    requests = [(f"r{i}", SamplingParams(seed=i, logprobs=5, top_k=50, top_p=0.95, temperature=0.8),
                 [i], None) for i in range(8)]
    logits = torch.round(torch.randn(8, vocab, generator=torch.Generator().manual_seed(4)) * 4) / 4
    outputs = []
    for path in ("compiled", "torch"):
        if path == "torch":
            monkeypatch.setenv(kernels.KERNELS_ENV, "torch")
        kernels.reset()
        for rows in (1, 8):
            cpu = CpuSampler(block_elements=rows * vocab)
            for B in (1, 8):
                out = cpu.sample(logits[:B], build(cpu, vocab, requests[:B], mode))
                outputs.append(((path, rows, B), out))
    kernels.reset()
    for B in (1, 8):
        same = [out for (key, out) in outputs if key[2] == B]
        for out in same[1:]:
            assert torch.equal(out.token_ids, same[0].token_ids)
            assert torch.equal(out.logprobs.token_ids, same[0].logprobs.token_ids)
            assert torch.equal(out.logprobs.logprobs, same[0].logprobs.logprobs)
            assert torch.equal(out.logprobs.ranks, same[0].logprobs.ranks)
        if mode == "raw":
            want_values, want_ids = _stable_top(torch.log_softmax(logits[:B], dim=-1), 5)
            assert torch.equal(same[0].logprobs.token_ids[:, 1:], want_ids)
            assert torch.equal(same[0].logprobs.logprobs[:, 1:], want_values)
