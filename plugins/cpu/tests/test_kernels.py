"""The compiled seeded-noise kernel: the same bits as corelib.noise, and the torch path as its
fallback wherever it does not run."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from corelib import SamplingParams, noise

import corelib_cpu
from corelib_cpu import kernels
from corelib_cpu.draw import draw_seeded_rows

needs_numba = pytest.mark.skipif(importlib.util.find_spec("numba") is None,
                                 reason="numba is not installed (the kernels extra)")


@pytest.fixture
def torch_path(monkeypatch):
    monkeypatch.setenv(kernels.KERNELS_ENV, "torch")
    kernels.reset()
    yield
    monkeypatch.delenv(kernels.KERNELS_ENV)
    kernels.reset()


def _keys(n: int, seed: int = 0) -> torch.Tensor:
    keys = torch.randint(-2**31, 2**31, (n,), dtype=torch.int32,
                         generator=torch.Generator().manual_seed(seed))
    edges = torch.tensor([0, -1, 2**31 - 1, -2**31], dtype=torch.int32)          # int32's extremes
    keys[:4] = edges[:n]
    return keys


@needs_numba
@pytest.mark.parametrize("V", [1, 7, 1000, 32000])
def test_kernel_uniforms_are_the_contracts_bits(V):
    keys = _keys(40)
    ids = torch.arange(V, dtype=torch.int32)
    out = torch.empty((40, V))
    assert kernels.seeded_uniforms_into(out, keys)                 # whole rows: token j at j
    want = noise.uniform_noise(keys[:, None], ids[None, :])
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))


@needs_numba
def test_kernel_reads_any_token_ids_per_row():
    """Candidate ids out of order and repeated, as a gathered set of columns would be."""
    keys = _keys(9, seed=1)
    ids = torch.tensor([5, 3, 3, 127_999, 0, 2**20, 2**31 - 1])[None, :].repeat(9, 1)
    ids[1] = ids[1].flip(0)                                      # each row its own order
    out = torch.empty(ids.shape)
    assert kernels.seeded_uniforms_into(out, keys, ids)
    want = noise.uniform_noise(keys[:, None], ids.to(torch.int32))
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))


@needs_numba
@pytest.mark.parametrize("spread", [0.1, 8.0])
def test_seeded_draws_are_the_same_tokens_on_both_paths(monkeypatch, spread):
    """Whole-row races, with a cut's weights dropping tokens too: the compiled and the torch
    path pick the same ids. Flat rows race over every token; peaked rows (spread 8) over the
    few groups that can win, each row its own token ids."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn((24, 3000), generator=gen) * spread
    x[:, ::5] = float("-inf")
    keys = _keys(24, seed=3)
    kept = (torch.rand((24, 3000), generator=gen) > 0.3).to(torch.float32)
    compiled = [draw_seeded_rows(x, keys, chunk_elements=6000, kept=k) for k in (None, kept)]
    monkeypatch.setenv(kernels.KERNELS_ENV, "torch")
    kernels.reset()
    try:
        plain = [draw_seeded_rows(x, keys, chunk_elements=6000, kept=k) for k in (None, kept)]
    finally:
        monkeypatch.delenv(kernels.KERNELS_ENV)
        kernels.reset()
    for (ids, ok), (want_ids, want_ok) in zip(compiled, plain):
        assert torch.equal(ids, want_ids) and torch.equal(ok, want_ok)


@needs_numba
@pytest.mark.parametrize("V", [1, 2, 511, 1024])
def test_small_vocabulary_draws_are_the_same_on_both_paths(monkeypatch, V):
    """The compiled inverse-CDF draw against torch's (same generator seed): the same ids and
    ok flags, for rows of every kind the draw meets: ordinary, one dominant token, zeros but
    one, sparse, all zero (ok False), NaN (ok False), and weights that overflow float64's sum
    nowhere but near its rounding (huge and tiny together)."""
    from corelib_cpu.draw import _draw_one_level
    gen = torch.Generator().manual_seed(5)
    w = torch.rand((64, V), generator=gen)
    w[1] = 0.0
    w[1, V - 1] = 1.0
    w[2, ::3] = 0.0
    w[3] = 0.0
    w[4, 0] = float("nan")
    w[5, 0] = 3e38
    w[6] = torch.rand(V, generator=gen) ** 40
    w[7, : V // 2] = 1e-30
    draws = []
    for path in ("", "torch"):
        monkeypatch.setenv(kernels.KERNELS_ENV, path)
        kernels.reset()
        draws.append(_draw_one_level(w, torch.Generator().manual_seed(6)))
    kernels.reset()
    (ids, ok), (want_ids, want_ok) = draws
    assert torch.equal(ok, want_ok) and not ok[3] and not ok[4]
    assert torch.equal(ids[ok], want_ids[ok])
    assert bool(((ids >= 0) & (ids < V)).all())               # flagged rows stay in range


def test_the_torch_path_when_asked(torch_path):
    out = torch.full((2, 3), 7.0)
    assert not kernels.seeded_uniforms_into(out, _keys(2))
    assert kernels.inverse_cdf(torch.ones((2, 3)), torch.rand(2, dtype=torch.float64)) is None
    assert torch.equal(out, torch.full((2, 3), 7.0))            # nothing written
    assert kernels.describe() == f"kernels: pure torch ({kernels.KERNELS_ENV}=torch)"


def test_a_seeded_request_draws_the_same_tokens_on_the_torch_path(torch_path):
    """The sampler end to end on the fallback: seeded rows give the reference's tokens."""
    from corelib.sampler import Sampler
    V = 2000
    logits = torch.randn((6, V), generator=torch.Generator().manual_seed(4)) * 0.5
    tokens = []
    for sampler in (corelib_cpu.CpuSampler(), Sampler("cpu")):
        batch = sampler.new_batch(V)
        for i in range(6):
            batch.add(f"r{i}", SamplingParams(seed=100 + i))
        tokens.append(sampler.sample(logits, batch).token_ids)
    assert torch.equal(tokens[0], tokens[1])


def test_info_names_the_path():
    described = kernels.describe()
    if importlib.util.find_spec("numba") is None:
        assert described == "kernels: pure torch (numba not installed)"
    else:
        assert described == "kernels: numba (seeded noise, small-vocabulary draw)"
