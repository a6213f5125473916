"""Step 14: seeded candidate draws equal the reference's whole-row race; unseeded draws follow
the kept distribution (chi-square, fixed seeds) and never return a dropped token."""

from __future__ import annotations

import pytest
import torch
from corelib.noise import row_keys, seeded_gumbel
from corelib.testing import chi_square_p_value

from corelib_cpu import draw
from corelib_cpu.draw import (
    CDF_BLOCK,
    NOISE_SPREAD,
    draw_by_inverse_cdf,
    draw_seeded_rows,
    race_seeded_candidates,
    race_unseeded_candidates,
    race_unseeded_rows,
)
from corelib_cpu.rowops import GROUP, group_maxima

NEG_INF = float("-inf")
MIN_P_VALUE = 1e-6


def reference_seeded(x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    vocab = torch.arange(x.shape[1], dtype=torch.int32)[None, :]
    return torch.argmax(x + seeded_gumbel(keys[:, None], vocab), dim=-1)


def draw_seeded_candidates(values, ids, keys):
    return ids.gather(1, race_seeded_candidates(values, ids, keys))[:, 0]


def draw_unseeded_candidates(values, ids, generator):
    return ids.gather(1, race_unseeded_candidates(values, generator))[:, 0]


def keys_for(rows: int, seed: int = 0) -> torch.Tensor:
    r = torch.arange(rows, dtype=torch.int32)
    return row_keys(r + seed, r * 3, r % 2, r * 7)



def assert_draws_follow_softmax(draw_rows, x: torch.Tensor, calls: int, seed: int, rows: int = 4000):
    """``draw_rows(x [rows, V], generator) -> (ids, ok)`` called ``calls`` times on copies of
    the row x float32 [V]: every row ok, no dropped token drawn, and the draws follow
    softmax(x) (chi-square, p > MIN_P_VALUE)."""
    V = x.shape[0]
    probs = torch.softmax(x, dim=-1)
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, dtype=torch.long)
    for _ in range(calls):
        ids, ok = draw_rows(x.expand(rows, V).contiguous(), gen)
        assert bool(ok.all())
        counts += torch.bincount(ids, minlength=V)
    kept = probs > 0
    assert int(counts[~kept].sum()) == 0
    assert chi_square_p_value(counts[kept], probs[kept]) > MIN_P_VALUE

def test_seeded_candidates_equal_the_whole_row_race():
    g = torch.Generator().manual_seed(0)
    V, W, rows = 3000, 40, 64
    x = torch.randn(rows, V, generator=g) * 2
    values, ids = torch.topk(x, W, dim=-1)
    values[:, 25:] = NEG_INF                       # dropped candidates stay in the columns
    masked = torch.full_like(x, NEG_INF).scatter_(1, ids, values)
    keys = keys_for(rows)
    assert torch.equal(draw_seeded_candidates(values, ids, keys), reference_seeded(masked, keys))


def test_seeded_candidate_ties_go_to_the_lowest_id():
    key = keys_for(1, seed=5)
    ids = torch.tensor([[900, 12]])                # the higher id first in the columns
    noise = seeded_gumbel(key[:, None], ids.to(torch.int32))[0]
    target = float(2.0 + noise[0])
    # find a value for token 12 whose score equals token 900's bit for bit
    v = torch.tensor(target) - noise[1]
    for _ in range(8):
        if float(v + noise[1]) == target:
            break
        v = torch.nextafter(v, torch.tensor(float("inf") if float(v + noise[1]) < target else NEG_INF))
    assert float(v + noise[1]) == target, "could not build an exact tie"
    values = torch.tensor([[2.0, float(v)]])
    assert int(draw_seeded_candidates(values, ids, key)[0]) == 12
    masked = torch.full((1, 1000), NEG_INF)
    masked[0, 900], masked[0, 12] = 2.0, float(v)
    assert int(reference_seeded(masked, key)[0]) == 12


def test_inverse_cdf_follows_softmax_and_never_draws_dropped_tokens():
    g = torch.Generator().manual_seed(1)
    V = 3 * CDF_BLOCK + 37                         # a short last block
    x = torch.randn(V, generator=g)
    x[torch.rand(V, generator=g) < 0.4] = NEG_INF
    x[CDF_BLOCK: 2 * CDF_BLOCK] = NEG_INF          # a whole block without mass
    assert_draws_follow_softmax(draw_by_inverse_cdf, x, calls=25, seed=2)


def test_inverse_cdf_single_kept_token_anywhere():
    V = 2 * CDF_BLOCK + 5
    for token in (0, CDF_BLOCK - 1, CDF_BLOCK, V - 1):
        x = torch.full((50, V), NEG_INF)
        x[:, token] = 0.0
        ids, ok = draw_by_inverse_cdf(x, None)
        assert ids.tolist() == [token] * 50 and bool(ok.all())


def test_inverse_cdf_reports_rows_it_cannot_draw_from():
    # +inf logits (float32 overflow upstream) make softmax NaN: the row is reported, never
    # answered with an id that looks valid, and the other rows are untouched.
    x = torch.zeros(3, 700)
    x[1, 5] = float("inf")
    ids, ok = draw_by_inverse_cdf(x, torch.Generator().manual_seed(0))
    assert ok.tolist() == [True, False, True]
    assert 0 <= int(ids[1]) < 700


def test_unseeded_candidates_follow_the_kept_distribution():
    g = torch.Generator().manual_seed(3)
    W = 30
    values = torch.sort(torch.randn(W, generator=g) * 1.5, descending=True).values
    values[20:] = NEG_INF
    ids = torch.randperm(1000, generator=g)[:W]
    rows = 5000
    gen = torch.Generator().manual_seed(4)
    counts = torch.zeros(1000, dtype=torch.long)
    for _ in range(10):
        drawn = draw_unseeded_candidates(values.expand(rows, W), ids.expand(rows, W), gen)
        counts += torch.bincount(drawn, minlength=1000)
    probs = torch.zeros(1000).scatter_(0, ids, torch.softmax(values, dim=-1))
    kept = probs > 0
    assert int(counts[~kept].sum()) == 0
    assert chi_square_p_value(counts[kept], probs[kept]) > MIN_P_VALUE


def test_noise_spread_bounds_every_value_the_hash_can_produce():
    # all 2**23 uniforms of the 23-bit hash, through the same float32 functions
    u = (torch.arange(2**23, dtype=torch.float32) + 0.5) * 2.0**-23
    g = -torch.log(-torch.log(u))
    assert float(g.max() - g.min()) < NOISE_SPREAD < float(g.max() - g.min()) + 0.01


def seeded_rows_cases(V: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, V, generator=g)
    x[1] *= 40.0                                   # a wide row: most groups cannot win
    x[2] = torch.where(torch.rand(V, generator=g) < 0.7, NEG_INF, x[2] * 25.0)
    x[3] = NEG_INF
    x[3, V - 1] = 0.0                              # the only kept token is the last one
    x[4] = torch.round(x[4] * 30.0)                # wide and full of ties
    x[5] = -1e4 * torch.rand(V, generator=g)       # far from 0: the bound's slack matters
    return x


def test_seeded_rows_equal_the_reference_race_with_and_without_pruning():
    for V in (1000, 4096 + 77, 50257):
        x = seeded_rows_cases(V, V)
        for position in range(4):
            keys = keys_for(x.shape[0], seed=position)
            ids, ok = draw_seeded_rows(x, keys, chunk_elements=V)
            assert torch.equal(ids, reference_seeded(x, keys)), (V, position)
            assert ok.tolist() == [True, True, True, True, True, True]


def test_wide_rows_race_over_few_groups():
    from corelib_cpu.draw import race_live_groups
    x = seeded_rows_cases(50257, 3)[[1, 2, 4, 5]]
    maxima = group_maxima(x)
    top = maxima.amax(dim=-1, keepdim=True)
    live = maxima >= top - NOISE_SPREAD - (top.abs() + NOISE_SPREAD) * 2.0**-16
    assert int(live.sum(dim=-1).max()) <= maxima.shape[1] // 2       # the pruned path is taken
    keys = keys_for(4, seed=9)
    most = int(live.sum(dim=-1).max())
    ids, ok = race_live_groups(x, keys, live, most)
    assert torch.equal(ids, reference_seeded(x, keys)) and bool(ok.all())


def probability_cut(x: torch.Tensor, min_p: float) -> torch.Tensor:
    """The kept probabilities of a min-p cut of x, 0 where dropped (what the sampler passes)."""
    probs = torch.softmax(x, dim=-1)
    return torch.where(probs >= min_p * probs.amax(dim=-1, keepdim=True), probs, 0.0)


def test_seeded_rows_with_a_cut_race_over_the_kept_tokens_only():
    V = 4096 + 77
    x = seeded_rows_cases(V, 5)
    kept = probability_cut(x, 0.2)
    kept[5] = 0.0                              # a row that keeps nothing is reported
    masked = x.masked_fill(kept == 0, NEG_INF)
    keys = keys_for(x.shape[0], seed=2)
    for chunk in (V, 1 << 30):
        ids, ok = draw_seeded_rows(x, keys, chunk_elements=chunk, kept=kept)
        assert torch.equal(ids[:5], reference_seeded(masked, keys)[:5])
        assert ok.tolist() == [True, True, True, True, True, False]
    wide = [1, 2, 4]                            # only wide rows: the race over live groups
    ids, ok = draw_seeded_rows(x[wide], keys[wide], kept=kept[wide])
    assert torch.equal(ids, reference_seeded(masked[wide], keys[wide])) and bool(ok.all())


@pytest.mark.parametrize("listing", [True, False])
def test_each_way_of_racing_with_a_cut_gives_the_masked_rows_winner(monkeypatch, listing):
    # (logit scale, min_p, way): most of the mass kept, so the rows race without the cut
    # first and those whose winner it drops race again; little mass kept, so they race with
    # the cut; peaked rows, so only the groups holding kept tokens race. Those few kept
    # tokens race as a list of them; with the list refused, they take the group path.
    if not listing:
        monkeypatch.setattr(draw, "kept_ids", lambda kept, cap: None)
    V = 4096 + 77
    g = torch.Generator().manual_seed(11)
    for scale, min_p, way in ((0.3, 0.3, "again"), (2.0, 0.05, "masked"), (8.0, 0.05, "pruned")):
        x = torch.randn(8, V, generator=g) * scale
        kept = probability_cut(x, min_p)
        masked = x.masked_fill(kept == 0, NEG_INF)
        keys = keys_for(8, seed=3)
        unmasked_winner_dropped = kept.gather(1, reference_seeded(x, keys)[:, None]) == 0
        mass = float(kept.sum(dim=-1).mean())
        maxima = group_maxima(masked)
        top = maxima.amax(dim=-1, keepdim=True)
        live = maxima >= top - NOISE_SPREAD - (top.abs() + NOISE_SPREAD) * 2.0**-16
        pruned = int(live.sum(dim=-1).max()) <= maxima.shape[1] // 2
        assert pruned == (way == "pruned"), way
        if way == "again":
            assert mass >= 0.6 and bool(unmasked_winner_dropped.any())
        if way == "masked":
            assert mass < 0.6
        few = int((kept > 0).sum(dim=-1).max()) <= max(GROUP, V // draw.KEPT_LIST_SHARE)
        assert few == (way == "pruned"), way
        for chunk in (V, 1 << 30):
            ids, ok = draw_seeded_rows(x, keys, chunk_elements=chunk, kept=kept)
            assert torch.equal(ids, reference_seeded(masked, keys)), (way, chunk)
            assert bool(ok.all())


@pytest.mark.parametrize("path", ["", "torch"])
def test_kept_ids_list_each_rows_positive_weights_in_order(monkeypatch, path):
    from corelib_cpu import kernels
    monkeypatch.setenv(kernels.KERNELS_ENV, path)
    kernels.reset()
    try:
        V = 64 * 3 + 5                                   # whole blocks of 64 and a short tail
        kept = torch.zeros(5, V)
        kept[0, [0, 63, 64, V - 1]] = torch.tensor([0.5, 1e-45, float("inf"), 0.25])  # subnormal, +inf
        kept[1, 10] = float("nan")                       # NaN is not positive
        kept[1, 11] = -0.0
        kept[1, 12] = -1.0
        kept[2, 100:110] = 0.1
        kept[4, :] = 0.01                                # every token
        ids, present = draw.kept_ids(kept[:4], cap=16)
        assert ids.shape == (4, 10)
        assert ids[0, :4].tolist() == [0, 63, 64, V - 1] and present[0].tolist() == [True] * 4 + [False] * 6
        assert not bool(present[1].any()) and not bool(present[3].any())
        assert ids[2].tolist() == list(range(100, 110)) and bool(present[2].all())
        assert bool((ids[~present] == V - 1).all())      # padding: the last token, not present
        assert draw.kept_ids(kept, cap=16) is None       # row 4 keeps more than 16
        ids, present = draw.kept_ids(kept, cap=V)
        assert ids[4].tolist() == list(range(V)) and bool(present[4].all())
        ids, present = draw.kept_ids(torch.zeros(2, V), cap=4)
        assert ids.shape == (2, 1) and not bool(present.any())
    finally:
        kernels.reset()


def test_unseeded_whole_rows_race_follows_softmax_and_never_draws_dropped_tokens():
    """``race_unseeded_rows``: rows of one step draw independently (keys from the generator),
    each token with its softmax probability (chi-square, fixed seeds, p > 1e-6; 40000 draws
    over a vocabulary that is not a whole number of groups, 30% of it dropped)."""
    g = torch.Generator().manual_seed(11)
    V = draw.UNSEEDED_RACE_MIN_VOCAB + 51
    x = torch.randn(V, generator=g) * 2.5
    x[torch.rand(V, generator=g) < 0.3] = NEG_INF
    assert_draws_follow_softmax(race_unseeded_rows, x, calls=10, seed=12)


def test_unseeded_whole_rows_race_is_the_generators_and_declines_what_it_cannot_serve():
    """The same generator state gives the same tokens and the next state others; a row with
    a NaN or +inf logit, or a row with nothing left, is left to the caller (None), and so is a
    vocabulary below ``UNSEEDED_RACE_MIN_VOCAB``, without a draw from the generator."""
    V = draw.UNSEEDED_RACE_MIN_VOCAB + 3
    x = torch.randn(64, V, generator=torch.Generator().manual_seed(13))
    first = race_unseeded_rows(x, torch.Generator().manual_seed(14))[0]
    gen = torch.Generator().manual_seed(14)
    assert torch.equal(race_unseeded_rows(x, gen)[0], first)
    assert not torch.equal(race_unseeded_rows(x, gen)[0], first)
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[5, 17] = bad
        assert race_unseeded_rows(y, gen) is None
    y = x.clone()
    y[3] = NEG_INF
    assert race_unseeded_rows(y, gen) is None
    small = torch.Generator().manual_seed(15)
    assert race_unseeded_rows(x[:, :draw.UNSEEDED_RACE_MIN_VOCAB - 1].contiguous(), small) is None
    assert torch.equal(small.get_state(), torch.Generator().manual_seed(15).get_state())


def test_unseeded_whole_rows_of_a_sampler_race_without_building_weights(monkeypatch):
    """A ``CpuSampler`` draws unseeded rows with no probability cut (plain temperature) by the
    race: no inverse CDF runs, and its tokens follow the softmax of x / T (chi-square)."""
    from corelib import SamplingParams

    from corelib_cpu import CpuSampler, draw_stage

    def no_weights(*args, **kwargs):
        raise AssertionError("the inverse CDF ran")

    monkeypatch.setattr(draw_stage, "draw_from_weights", no_weights)
    V, rows = draw.UNSEEDED_RACE_MIN_VOCAB, 512
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(16)) * 2
    sampler = CpuSampler(generator=torch.Generator().manual_seed(17))
    batch = sampler.new_batch(V)
    for i in range(rows):
        batch.add(f"r{i}", SamplingParams(temperature=0.7))
    counts = torch.zeros(V, dtype=torch.long)
    for _ in range(40):
        out = sampler.sample(logits.expand(rows, V), batch)
        assert bool(out.valid.all())
        counts += torch.bincount(out.token_ids, minlength=V)
    assert chi_square_p_value(counts, torch.softmax(logits[0] / 0.7, dim=-1)) > MIN_P_VALUE
