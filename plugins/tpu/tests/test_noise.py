"""``corelib.noise`` computed on the XLA device equals the CPU bit for bit (the plugin uses it
as is)."""

from __future__ import annotations

import pytest
import torch
from corelib import noise as core

noise = core  # the module under test, run on the XLA device

from tpu_support import needs_xla, xla_device

INT32_EDGES = [0, 1, -1, 2**31 - 1, -(2**31), 65535, -65536, 0x7FEB352D, -5]


def _random_int32(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(-(2**31), 2**31, (n,), dtype=torch.int64, generator=gen).to(torch.int32)
    return torch.cat([torch.tensor(INT32_EDGES, dtype=torch.int32), values])


def _keys(device) -> tuple[torch.Tensor, ...]:
    lo, hi, child, pos = (_random_int32(500, seed) for seed in range(4))
    return tuple(t.to(device) for t in (lo, hi, child.abs() % 64, pos.abs() % 100000))


@pytest.mark.parametrize("device", ["cpu", pytest.param("xla", marks=needs_xla)])
def test_mix32_and_row_keys_equal_the_core(device):
    dev = xla_device() if device == "xla" else torch.device("cpu")
    x = _random_int32(4000, 9)
    assert torch.equal(noise.mix32(x.to(dev)).cpu(), core.mix32(x))
    lo, hi, child, pos = _keys(dev)
    want = core.row_keys(lo.cpu(), hi.cpu(), child.cpu(), pos.cpu())
    assert torch.equal(noise.row_keys(lo, hi, child, pos).cpu(), want)


@pytest.mark.parametrize("device", ["cpu", pytest.param("xla", marks=needs_xla)])
def test_uniform_and_gumbel_noise_equal_the_core(device):
    dev = xla_device() if device == "xla" else torch.device("cpu")
    lo, hi, child, pos = _keys(torch.device("cpu"))
    keys = core.row_keys(lo, hi, child, pos)[:64, None]
    tokens = torch.arange(0, 128256, 97, dtype=torch.int32)[None, :]
    want_u = core.uniform_noise(keys, tokens)
    got_u = noise.uniform_noise(keys.to(dev), tokens.to(dev)).cpu()
    assert torch.equal(got_u, want_u)
    got_g = noise.seeded_gumbel(keys.to(dev), tokens.to(dev)).cpu()
    # log on another device may round differently in the last place (docs/seeded-draw.md)
    torch.testing.assert_close(got_g, core.seeded_gumbel(keys, tokens), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("device", ["cpu", pytest.param("xla", marks=needs_xla)])
def test_documented_test_vectors(device):
    """docs/seeded-draw.md: seed 7, child 1, position 5."""
    dev = xla_device() if device == "xla" else torch.device("cpu")
    lo, hi = core.split_seed(7)
    key = noise.row_keys(*(torch.tensor([v], dtype=torch.int32, device=dev) for v in (lo, hi, 1, 5)))
    u = noise.uniform_noise(key[:, None], torch.tensor([[0, 1, 2, 1000, 128255]], dtype=torch.int32, device=dev))
    want = torch.tensor([0.812031448, 0.119650424, 0.199344575, 0.072631538, 0.998033702])
    torch.testing.assert_close(u.cpu()[0], want, rtol=0, atol=1e-8)


@needs_xla
def test_shift_operator_is_not_used_because_xla_rounds_it():
    """torch-xla 2.9 lowers ``int32 >> n`` as a division rounding toward zero, which is why
    ``corelib.noise`` shifts with ``torch.bitwise_right_shift``; if this starts failing,
    torch-xla fixed the operator (nothing to change)."""
    x = torch.tensor([-5, -123456789], dtype=torch.int32)
    on_xla = (x.to(xla_device()) >> 16).cpu()
    if torch.equal(on_xla, x >> 16):
        pytest.xfail("torch-xla now shifts int32 like the CPU")
    assert torch.equal(torch.bitwise_right_shift(x.to(xla_device()), 16).cpu(), x >> 16)


@pytest.mark.parametrize("device", ["cpu", pytest.param("xla", marks=needs_xla)])
def test_the_race_bound_holds_at_every_uniform(device):
    """``_score_bound`` is at least the race's float32 score at each of the 2**23 uniforms
    the contract's noise can take, at logits from 0 to far beyond the noise's range of
    either sign: the vocabulary-wide draw never skips a token that could win."""
    from corelib_tpu.sampler import _score_bound
    dev = xla_device() if device == "xla" else torch.device("cpu")
    u = ((torch.arange(1 << 23, dtype=torch.float32) + 0.5) * 2.0 ** -23).view(8, -1).to(dev)
    greedy = torch.zeros(8, dtype=torch.bool, device=dev)
    gumbel = core.gumbel_from_uniform(u)
    for x in (0.0, 3.7, -11.0, 1e4, -2e5):
        bound = _score_bound(torch.full_like(u, x), u, greedy)
        assert bool((bound >= x + gumbel).all().cpu()), x


@pytest.mark.parametrize("device", ["cpu", pytest.param("xla", marks=needs_xla)])
def test_the_bounded_race_draws_the_vocabulary_wide_argmax(device, monkeypatch):
    """``_draw_over_vocabulary`` (exact scores at the columns of the largest bounds only)
    draws ``first_argmax`` of the exact scores over the whole vocabulary: flat and peaked
    rows, greedy rows, a row of one finite token (settled without the fallback); and
    batches with tied greedy rows, +inf, NaN or an all -inf row, which fall back."""
    from corelib_tpu import sampler
    dev = xla_device() if device == "xla" else torch.device("cpu")
    V = 32 * 40
    gen = torch.Generator().manual_seed(11)
    x = torch.cat([torch.randn((4, V), generator=gen) * 0.01,
                   torch.randn((5, V), generator=gen) * 3, torch.full((1, V), float("-inf"))])
    x[9, 900] = -3.0
    keys = torch.randint(-(2**31), 2**31, (10,), dtype=torch.int32, generator=gen)
    greedy = torch.tensor([False, True, False, False, False, False, True, False, False, True])
    fallbacks = []
    exact = sampler._first_argmax_of_race
    if device == "cpu":
        monkeypatch.setattr(sampler, "_first_argmax_of_race",
                            lambda *a: fallbacks.append(1) or exact(*a))
    for extra in (None, "ties", float("inf"), float("nan"), "empty"):
        y, g = x.clone(), greedy.clone()
        if extra == "empty":
            y[3] = float("-inf")
        elif extra == "ties":
            y[2] = torch.randint(-2, 2, (V,), generator=gen).to(torch.float32)
            g[2] = True
        elif extra is not None:
            y[2, 5] = extra
        args = [t.to(dev) for t in (y, keys, g)]
        got = sampler._draw_over_vocabulary(*args).cpu()
        assert torch.equal(got, exact(*args).cpu()), extra
        if device == "cpu":
            assert len(fallbacks) == (extra is not None), extra
            fallbacks.clear()
