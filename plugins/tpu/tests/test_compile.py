"""Compile discipline, measured with torch-xla's own counter of compiled graphs.

One module-scoped sampler (vocabulary 300, buckets 8 and 16, strict) is warmed once; the tests
then drive it through everything that varies in serving and require that nothing compiles.
"""

from __future__ import annotations

import random

import pytest
import torch
from corelib import SamplingParams

from corelib_tpu.batch import PATHS
from corelib_tpu.sampler import RecompilationError, TpuSampler

from tpu_support import compile_count, needs_xla, xla_device

pytestmark = needs_xla

V = 300            # a vocabulary no other test module uses: every graph here is compiled here
BUCKETS = (8, 16)

#: Parameters that send a batch down each static path.
PATH_PARAMS = {
    "greedy": dict(temperature=0.0),
    "plain": dict(temperature=0.7, min_p=0.05),
    "candidates": dict(top_k=20, top_p=0.9),
    "nucleus": dict(top_p=0.8),
    "exhaustive": dict(top_k=100, top_p=0.8),
}


def _logits(rows: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn((rows, V), generator=gen) * 3).to(dtype).to(xla_device())


@pytest.fixture(scope="module")
def warm():
    """(sampler, first-call compile counts per (path, logprobs), warm-up report)."""
    sampler = TpuSampler(xla_device(), buckets=BUCKETS, strict=True)
    firsts = {}
    for path, params in PATH_PARAMS.items():
        for logprobs in (None, 3):
            batch = sampler.new_batch(V)
            for i in range(8):        # full bucket: the logits need no padding graph
                batch.add(f"r{i}", SamplingParams(**params, logprobs=logprobs, seed=i))
            assert batch.path() == path
            before = compile_count()
            sampler.sample(_logits(8, 0), batch)
            first = compile_count() - before
            sampler.sample(_logits(8, 1), batch)
            firsts[(path, logprobs is not None)] = (first, compile_count() - before - first)
    report = sampler.warmup(V, logits_dtypes=(torch.float32, torch.bfloat16), per_request_logits=True)
    return sampler, firsts, report


def test_one_graph_per_bucket_path_and_logprobs(warm):
    _, firsts, _ = warm
    assert len(firsts) == len(PATHS) * 2
    for key, (first, second) in firsts.items():
        assert (first, second) == (1, 0), f"{key}: {first} graph(s) on the first call, {second} on the second"


def test_warmup_compiles_the_rest(warm):
    sampler, _, report = warm
    assert report.buckets == BUCKETS and report.paths == PATHS
    # bucket 16's 8 step graphs and 2 append graphs at least; bucket 8's steps were cached
    assert report.graphs >= len(PATHS) * 2 + 2
    assert sampler.guard.armed


def test_nothing_compiles_after_warmup_under_churn(warm):
    """Parameter values change, features switch on and off per row, requests join and leave
    (within and across buckets), seeds vary, logits come per row, per request, padded and in
    bfloat16, logprobs come and go: strict mode would raise on any compile."""
    sampler, _, _ = warm
    rng = random.Random(0)
    batch = sampler.new_batch(V, eos_token_id=1)
    before = compile_count()
    for step in range(60):
        if len(batch) < 14 and rng.random() < 0.6:
            params = dict(temperature=rng.choice([0.0, 0.5, 1.0, 1.3]), seed=rng.choice([None, rng.randrange(2**40)]))
            if params["temperature"] > 0:
                params.update(rng.choice([{}, dict(top_k=rng.randrange(1, 65)), dict(top_p=rng.uniform(0.1, 1.0)),
                                          dict(top_k=rng.randrange(1, 40), top_p=0.9), dict(top_k=200),
                                          dict(min_p=0.1), dict(n=2)]))
            params.update(rng.choice([{}, dict(logprobs=rng.randrange(0, 21)), dict(repetition_penalty=1.2),
                                      dict(logit_bias={5: 3.0}), dict(allowed_token_ids=[3, 4, 5, 6]),
                                      dict(bad_words=[[7, 8], [9]]), dict(min_tokens=2, stop_token_ids=[2])]))
            if len(batch) + params.get("n", 1) <= 16:
                batch.add(f"r{step}", SamplingParams(**params), prompt_token_ids=[1, 2, 3],
                          output_token_ids=[4] * rng.randrange(3) if params.get("n", 1) == 1 else None)
        if len(batch) > 2 and rng.random() < 0.3:
            batch.remove(rng.choice(batch.request_ids))
        if not len(batch):
            continue
        form = rng.choice(["rows", "requests", "padded", "bf16"])
        if form == "requests":
            logits = _logits(batch.num_requests, step)
        elif form == "padded":
            logits = _logits(batch.bucket(), step)
        else:
            logits = _logits(len(batch), step, torch.bfloat16 if form == "bf16" else torch.float32)
        out = sampler.sample(logits, batch)
        assert out.token_ids.shape == (len(batch),)
        batch.append(torch.where(out.valid, out.token_ids, 0))
    assert compile_count() == before
    assert sampler.guard.compiled_after_warmup == 0


def test_strict_mode_raises_on_an_unwarmed_shape(warm):
    sampler, _, _ = warm
    batch = sampler.new_batch(V)
    batch.add("a", SamplingParams(seed=1))
    with pytest.raises(RecompilationError, match=r"sample \(bucket 8"):
        sampler.sample(_logits(1, 0, torch.float16), batch)      # float16 was not warmed up
    sampler.sample(_logits(1, 0, torch.bfloat16), batch)         # bfloat16 was


def test_no_vocabulary_wide_sort_or_scatter_in_a_step():
    """Each step graph's HLO, as torch-xla lowers it, sorts and scatters only small arrays."""
    import torch_xla
    from corelib.sampler import Sampler
    from corelib_tpu.sampler import _pack
    vocab = 1000
    sampler = TpuSampler(xla_device(), buckets=(8,))
    batch = sampler.new_batch(vocab)
    logits = torch.zeros((8, vocab)).to(xla_device())
    for path in PATHS:
        for logprobs in (False, True):
            with sampler._forcing(path, logprobs):
                packed = _pack(Sampler.sample(sampler, logits, batch))
            hlo = torch_xla._XLAC._get_xla_tensors_hlo([packed])
            wide = [line.strip()[:160] for line in hlo.splitlines()
                    if (" sort(" in line or " scatter(" in line) and f",{vocab}]" in line]
            assert not wide, f"path {path}, logprobs {logprobs}: {wide}"
