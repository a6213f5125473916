"""Stages 8a (DRY over the device window), 10a (top-n-sigma), 13a (typical-p by bisection) and
13b (XTC) of the tpu backend against the reference stages, on CPU tensors and on XLA."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from corelib import SamplingParams
from corelib.sampler import Sampler

from corelib_tpu import filters
from corelib_tpu.sampler import TpuSampler

from tpu_support import needs_xla, xla_device

DEVICES = ["cpu", pytest.param("xla", marks=needs_xla)]
REF = Sampler("cpu")
V = 64


def _device(name: str) -> torch.device:
    return xla_device() if name == "xla" else torch.device("cpu")


def _rows(seed: int, vocab: int = 500) -> torch.Tensor:
    """Rows of several shapes: peaked, flat, integer-valued (big tie groups), with -inf, one
    finite token."""
    gen = torch.Generator().manual_seed(seed)
    peaked = torch.randn((3, vocab), generator=gen) * 3
    flat = torch.zeros((1, vocab))
    ties = torch.randint(0, 4, (3, vocab), generator=gen).to(torch.float32)
    masked = torch.randn((2, vocab), generator=gen)
    masked[:, ::3] = float("-inf")
    single = torch.full((1, vocab), float("-inf"))
    single[0, 7] = 1.0
    return torch.cat([peaked, flat, ties, masked, single])                 # (10, vocab)


def _assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got = got.cpu()
    for row in range(want.shape[0]):
        kept_got, kept_want = torch.isfinite(got[row]), torch.isfinite(want[row])
        if not torch.equal(kept_got, kept_want):
            extra = torch.nonzero(kept_got & ~kept_want).flatten().tolist()[:8]
            missing = torch.nonzero(kept_want & ~kept_got).flatten().tolist()[:8]
            pytest.fail(f"{what}: row {row} kept extra {extra}, dropped {missing}")
        torch.testing.assert_close(got[row][kept_want], want[row][kept_want])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n_sigma", [0.0, 0.5, 1.0, 3.0])
def test_top_n_sigma_matches_the_reference(device, n_sigma):
    x = _rows(1)
    n = torch.full((x.shape[0],), n_sigma)
    want = REF.apply_top_n_sigma(x, SimpleNamespace(top_n_sigma=n))
    got = filters.top_n_sigma_filter(x.to(_device(device)), n.to(_device(device)))
    _assert_same(got, want, f"top_n_sigma={n_sigma}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("typical_p", [0.05, 0.3, 0.6, 0.9, 0.99, 1.0])
def test_typical_p_by_bisection_matches_the_reference_sort(device, typical_p):
    """Also on rows whose scores tie in large groups (integer logits: the boundary group is
    kept whole) and rows with a single finite token (never emptied)."""
    x = _rows(2)
    p = torch.full((x.shape[0],), typical_p)
    want = REF.apply_typical_p(x, SimpleNamespace(typical_p=p))
    got = filters.typical_p_by_bisection(x.to(_device(device)), p.to(_device(device)))
    _assert_same(got, want, f"typical_p={typical_p}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("threshold", [0.0, 0.001, 0.01, 0.1, 0.5])
def test_xtc_matches_the_reference_when_the_coin_says_so(device, threshold):
    x = _rows(3)
    B = x.shape[0]
    coin = torch.arange(B) % 3 != 0                                     # some rows skip it
    s = SimpleNamespace(xtc_threshold=torch.full((B,), threshold), xtc_probability=coin.float(),
                        num_rows=B, position=torch.zeros(B, dtype=torch.int32), any_seeded=False)
    want = REF.apply_xtc(x, s)                                        # probability 0 or 1
    got = filters.xtc_filter(x.to(_device(device)), s.xtc_threshold.to(_device(device)),
                             coin.to(_device(device)))
    _assert_same(got, want, f"xtc threshold={threshold}")


def test_unseeded_xtc_coin_lands_with_its_probability():
    """Unseeded rows key the XTC coin by this step's host-drawn key: over 4000 rows with
    probability 0.3 the filter acts in 30% of them (5 sigma = 3.6 points)."""
    sampler = TpuSampler("cpu", buckets=(4000,), generator=torch.Generator().manual_seed(5))
    R = 4000
    batch = sampler.new_batch(V)
    for i in range(R):
        batch.add(f"x{i}", SamplingParams(xtc_probability=0.3, xtc_threshold=0.05))
    logits = torch.zeros((R, V))
    logits[:, :3] = torch.tensor([5.0, 4.5, 4.0])       # three likely tokens: XTC drops two
    kept = torch.isfinite(sampler.processed_logits(logits, batch))
    acted = (~kept[:, :2]).all(dim=1).double()
    assert torch.equal(acted.bool(), ~kept[:, 0]) and kept[:, 2].all()
    acted = acted.mean()
    assert abs(float(acted) - 0.3) < 5 * (0.3 * 0.7 / R) ** 0.5, float(acted)


# ---------------------------------------------------------------------- DRY's window
def _dry_batches(sampler: Sampler, reference: Sampler, params: SamplingParams, histories):
    mine, ref = sampler.new_batch(V), reference.new_batch(V)
    for i, history in enumerate(histories):
        for batch in (mine, ref):
            batch.add(f"d{i}", params, prompt_token_ids=history[:5], output_token_ids=history[5:])
    return mine, ref


def _repetitive(length: int, seed: int) -> list[int]:
    """A history that repeats phrases (long matches) with noise and breaker tokens between."""
    rng = random.Random(seed)
    phrases = [[rng.randrange(10, V) for _ in range(rng.randrange(3, 9))] for _ in range(4)]
    out: list[int] = []
    while len(out) < length:
        out += rng.choice(phrases) + ([rng.randrange(V)] if rng.random() < 0.5 else [])
    return out[:length]


def _check_dry(sampler, ref_sampler, params, ref_params, histories, steps: int, seed: int) -> None:
    mine, _ = _dry_batches(sampler, ref_sampler, params, histories)
    _, ref = _dry_batches(sampler, ref_sampler, ref_params, histories)
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        logits = torch.randn((len(histories), V), generator=gen)
        got = sampler.processed_logits(logits.to(sampler.device), mine).cpu()
        want = ref_sampler.processed_logits(logits, ref)
        torch.testing.assert_close(got, want, msg=lambda m: f"step {step}: {m}")
        if step % 2:                                  # one token, or verify's [rows, K + 1]
            tokens = torch.tensor([[h[-3], h[-2], -1] for h in histories])
        else:
            tokens = torch.tensor([h[-4] for h in histories])
        mine.append(tokens)
        ref.append(tokens)


@pytest.mark.parametrize("device", DEVICES)
def test_dry_within_the_window_equals_the_reference(device):
    sampler = TpuSampler(_device(device), buckets=(4,), dry_window=64)
    params = SamplingParams(temperature=0.0, dry_multiplier=0.9, dry_base=1.5, dry_allowed_length=2,
                            dry_sequence_breakers=[3, 4])
    histories = [_repetitive(40, seed) for seed in range(4)]
    _check_dry(sampler, REF, params, params, histories, steps=6, seed=1)


@pytest.mark.parametrize("device", DEVICES)
def test_dry_past_the_window_sees_its_last_window_tokens(device):
    """Histories longer than the window: with ``dry_range`` within the window the penalties are
    the contract's; with none, they are those of ``dry_range = dry_window`` (the documented
    limit), while the repeat lengths still count matches that began before the window."""
    sampler = TpuSampler(_device(device), buckets=(4,), dry_window=32)
    histories = [_repetitive(100, seed) for seed in range(10, 14)]
    base = dict(temperature=0.0, dry_multiplier=1.1, dry_allowed_length=1, dry_sequence_breakers=[5])
    ranged = SamplingParams(**base, dry_range=20)
    _check_dry(sampler, REF, ranged, ranged, histories, steps=4, seed=2)
    _check_dry(sampler, REF, SamplingParams(**base), SamplingParams(**base, dry_range=32), histories,
               steps=4, seed=3)


def test_dry_breakers_past_the_limit_raise_naming_the_request():
    batch = TpuSampler("cpu", buckets=(4,), max_dry_breakers=2).new_batch(V)
    with pytest.raises(ValueError, match=r"'b'.*dry_sequence_breakers holds 3 .*max_dry_breakers=2"):
        batch.add("b", SamplingParams(dry_multiplier=1.0, dry_sequence_breakers=[1, 2, 3]))
    batch.add("ok", SamplingParams(dry_sequence_breakers=[1, 2, 3]))       # DRY off: not stored
