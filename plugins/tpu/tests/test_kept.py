"""Kept sets and ``score`` on XLA: part of the graphs warm-up compiles, nothing after it.

One strict sampler (vocabulary 330, not a multiple of 32, so the last word has bits past the
vocabulary; bucket 8; verify with K = 2; score with T = 3) warmed once. The conformance suite
checks what the kept sets and scores are; this module checks what they cost in graphs and
transfers, and what the graph itself returns for padding rows.
"""

from __future__ import annotations

import pytest
import torch
from corelib import SamplingParams
from corelib.bitmask import unpack_bitmask
from corelib.sampler import Sampler

from corelib_tpu.sampler import TpuSampler

from tpu_support import needs_xla, xla_device

pytestmark = needs_xla

V = 330
BUCKET = 8
K = 2
T = 3
ASKING = [SamplingParams(seed=1, top_k=7, return_kept=True),
          SamplingParams(seed=2, top_p=0.9, temperature=0.8),
          SamplingParams(temperature=0.0, return_kept=True)]


@pytest.fixture(scope="module")
def warm():
    sampler = TpuSampler(xla_device(), buckets=(BUCKET,), speculative_k=(K,), dry_window=32,
                         strict=True)
    report = sampler.warmup(V, score_positions=(T,))
    return sampler, report


def _logits(shape, seed):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3).to(xla_device())


def _batch(sampler, params):
    batch = sampler.new_batch(V)
    for i, p in enumerate(params):
        batch.add(f"r{i}", p, prompt_token_ids=[5, 6])
    return batch


def test_warmup_counts_the_score_graphs_and_keeps_four_step_graphs(warm):
    _, report = warm
    assert report.score_positions == (T,)
    assert report.step_graphs[("sample", BUCKET)] <= 4
    # without and with kept=, each without and with the stateful selectors
    assert 1 <= report.step_graphs[("score", BUCKET, T)] <= 4


def test_asking_for_kept_sets_and_scoring_compile_nothing_after_warmup(warm):
    sampler, _ = warm
    before = sampler.guard.compiled_after_warmup
    for params in (ASKING, ASKING[1:2], [SamplingParams(temperature=0.0, return_kept=True)] * 2,
                   [SamplingParams(seed=4, mirostat_tau=3.0, return_kept=True)] * 3):
        batch = _batch(sampler, params)
        n = len(params)
        for step in range(2):
            out = sampler.sample(_logits((n, V), step), batch)
            asks = any(p.return_kept for p in params)
            assert (out.kept is not None) == asks
            if asks:
                assert tuple(out.kept.shape) == (n, (V + 31) // 32)
            batch.append(out.token_ids)
        drafts = torch.full((BUCKET, K), -1, dtype=torch.long)     # padded to the bucket
        drafts[:n] = torch.tensor([1, 2])
        verified = sampler.verify(_logits((BUCKET, K + 1, V), 9), batch, drafts)
        assert (verified.kept is not None) == asks
        batch.append(verified.token_ids)
        # score's inputs padded to the bucket (host ids and kept sets need no padding graph)
        x = _logits((BUCKET, T, V), 11)
        ids = torch.full((BUCKET, T), -1, dtype=torch.long)
        ids[:n] = torch.tensor([[3, 4, 5]] * n)
        scored = sampler.score(x, batch, ids)
        assert tuple(scored.logprobs.shape) == (n, T)
        kept = torch.full((BUCKET, T, (V + 31) // 32), -1, dtype=torch.int32)
        replayed = sampler.score(x, batch, ids, kept=kept)
        assert bool(replayed.valid.all())
        batch.append(ids[:n])
    assert sampler.guard.compiled_after_warmup == before


def test_the_graphs_kept_output_is_zero_for_padding_and_rows_that_did_not_ask(warm):
    """The step graph's own output (``Sampler.sample`` on the padded bucket): [bucket, W],
    rows 3..7 padding, row 1 did not ask, bits past the vocabulary 0."""
    sampler, _ = warm
    batch = _batch(sampler, ASKING)
    x = _logits((BUCKET, V), 3)
    out = Sampler.sample(sampler, x, batch, batch.padded_bitmask(None, BUCKET))
    words = out.kept.cpu()
    assert tuple(words.shape) == (BUCKET, (V + 31) // 32)
    assert not bool(words[1].any()) and not bool(words[3:].any())
    kept = unpack_bitmask(words, V)
    assert int(kept[0].sum()) == 7
    assert kept[2].nonzero().flatten().tolist() == [int(out.token_ids[2].cpu())]
    assert not bool((words[:, -1] >> (V % 32)).any())


def test_kept_sets_come_back_with_the_step_in_one_transfer(warm):
    import torch_xla.debug.metrics as met
    sampler, _ = warm
    batch = _batch(sampler, ASKING)
    logits = _logits((3, V), 5)
    sampler.sample(logits, batch)
    before = met.metric_data("TransferFromDeviceTime")[0]
    out = sampler.sample(logits, batch)
    assert met.metric_data("TransferFromDeviceTime")[0] - before == 1
    assert out.kept is not None


def test_score_positions_must_be_positive_ints():
    sampler = TpuSampler("cpu", buckets=(BUCKET,))
    with pytest.raises(ValueError, match="score_positions must hold positive ints"):
        sampler.warmup(V, score_positions=(3, 0))


def test_score_is_bitwise_what_sample_reported_across_buckets():
    """The conformance suite compares within one bucket; here the rollout runs in bucket 8
    (3 rows) and the score in bucket 16 (the 3 rows after 7 others): XLA:CPU's row-wise
    reductions give each row the same bits in both graphs."""
    sampler = TpuSampler(xla_device(), buckets=(8, 16), dry_window=32)
    params = [SamplingParams(seed=11, top_k=30, temperature=0.7, logprobs=0),
              SamplingParams(seed=12, top_p=0.8, min_p=0.02, logprobs=0),
              SamplingParams(temperature=0.0, logprobs=0)]
    batch = sampler.new_batch(V, logprobs_mode="processed")
    for i, p in enumerate(params):
        batch.add(f"r{i}", p, prompt_token_ids=[5, 6])
    steps = 2
    logits = torch.randn((3, steps, V), generator=torch.Generator().manual_seed(13)) * 3
    tokens, reported = torch.zeros((3, steps), dtype=torch.long), torch.zeros((3, steps))
    for t in range(steps):
        out = sampler.sample(logits[:, t].to(xla_device()), batch)
        tokens[:, t], reported[:, t] = out.token_ids, out.logprobs.logprobs[:, 0]
        batch.append(out.token_ids)
    others = sampler.new_batch(V)
    for i in range(7):
        others.add(f"o{i}", SamplingParams(seed=20 + i, top_k=5), prompt_token_ids=[5, 6])
    for i, p in enumerate(params):
        others.add(f"r{i}", p, prompt_token_ids=[5, 6])
    assert others.bucket() == 16
    x = torch.cat([torch.randn((7, steps, V)), logits])
    ids = torch.cat([torch.zeros((7, steps), dtype=torch.long), tokens])
    scored = sampler.score(x.to(xla_device()), others, ids)
    assert torch.equal(scored.logprobs[7:], reported)
