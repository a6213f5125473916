"""Steps 12-13 against the reference's sorts: hand-checked cases first, then random ones."""

from __future__ import annotations

import pytest
import torch
from corelib import Sampler

from corelib_cpu.select import (
    nucleus_contains,
    top_p_candidates_fast,
    nucleus_threshold,
    select_by_histogram,
    threshold_by_sort,
    top_k_candidates,
    top_p_candidates,
)

NEG_INF = float("-inf")


def kept_by_threshold(probs, top_p):
    return probs >= nucleus_threshold(probs, top_p)[:, None]


def kept_by_sort(probs, top_p):
    return probs >= threshold_by_sort(probs, top_p)[:, None]


# ---------------------------------------------------------------------- hand-checked
@pytest.mark.parametrize("top_p, kept", [
    (0.5, [True, False, False, False]),    # mass before token 1 is 0.5: not < 0.5
    (0.6, [True, True, False, False]),
    (0.75, [True, True, False, False]),    # mass before token 2 is exactly 0.75: dropped
    (0.76, [True, True, True, True]),      # token 2 enters; token 3 ties with it: kept
    (0.01, [True, False, False, False]),   # never fewer than one token
])
def test_nucleus_hand_checked(top_p, kept):
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.125]])
    got = kept_by_threshold(probs, torch.tensor([top_p]))
    assert got[0].tolist() == kept
    assert kept_by_sort(probs, torch.tensor([top_p]))[0].tolist() == kept


def test_nucleus_ties_at_the_top_are_all_kept():
    probs = torch.full((1, 1000), 1.0 / 1000)
    got = kept_by_threshold(probs, torch.tensor([0.1]))
    assert bool(got.all())


def test_top_k_candidates_keep_ties_and_flag_overflowing_ties(kernel_path):
    x = torch.tensor([[5.0, 1.0, 3.0, 3.0, 3.0, 0.0, -1.0, 2.0],
                      [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]])
    values, ids, complete = top_k_candidates(x, torch.tensor([2, 3]), width=4)
    # row 0: k=2 -> the 2nd largest is 3.0, tied three times: 4 kept, the 4 columns are full
    assert sorted(ids[0][torch.isfinite(values[0])].tolist()) == [0, 2, 3, 4]
    assert not bool(complete[0])      # column 4 holds 3.0 too: more ties may lie beyond
    assert sorted(ids[1][torch.isfinite(values[1])].tolist()) == [5, 6, 7]
    assert bool(complete[1])


# ---------------------------------------------------------------------- random, vs the sort
def distributions(V: int, seed: int):
    """Rows of probabilities of several shapes (each a softmax, as the sampler feeds it)."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, V + 1, dtype=torch.float32)
    rows = [
        torch.randn(V, generator=g),                                  # flat
        torch.randn(V, generator=g) * 4,                              # spread
        -1.1 * torch.log(ranks)[torch.randperm(V, generator=g)],      # Zipf, peaked
        torch.zeros(V),                                               # all tied
        torch.randint(0, 4, (V,), generator=g).float(),               # four tie levels
        torch.where(torch.rand(V, generator=g) < 0.5, NEG_INF, torch.randn(V, generator=g)),
        torch.cat([torch.tensor([30.0]), torch.randn(V - 1, generator=g)]),   # one dominant token
    ]
    return torch.softmax(torch.stack(rows), dim=-1)


@pytest.mark.parametrize("V", [7, 300, 20000, 128256])
def test_nucleus_matches_the_sort_on_random_rows(V):
    probs = distributions(V, seed=V)
    for top_p in (0.05, 0.3, 0.5, 0.9, 0.95, 0.999):
        p = torch.full((probs.shape[0],), top_p)
        got, want = kept_by_threshold(probs, p), kept_by_sort(probs, p)
        for row in range(probs.shape[0]):
            assert torch.equal(got[row], want[row]), f"V={V} top_p={top_p} row {row}"


def test_histogram_settles_ordinary_rows_without_the_sort():
    probs = distributions(128256, seed=1)[:3]            # flat, spread, Zipf
    _, exact = select_by_histogram(probs, torch.full((3,), 0.9))
    assert exact.tolist() == [True, True, True]


def test_rows_the_histogram_cannot_settle_take_the_sort():
    # The nucleus {0.5, 0.25} ends exactly at top_p and values below 2**-29 follow, which
    # the reference's float64 cumsum may add with rounding: the row must go to the sort.
    for tiny in (2.0 ** -40, 2.0 ** -70):
        probs = torch.cat([torch.tensor([0.5, 0.25]), torch.full((64,), tiny)])[None, :]
        p = torch.tensor([0.75])
        _, exact = select_by_histogram(probs, p)
        assert not bool(exact[0])
        got = kept_by_threshold(probs, p)
        assert torch.equal(got, kept_by_sort(probs, p))
        assert got[0, :2].tolist() == [True, True] and not bool(got[0, 2:].any())


@pytest.mark.parametrize("seed", range(3))
def test_top_k_then_top_p_on_candidates_match_the_reference(seed, kernel_path):
    reference = Sampler("cpu")
    g = torch.Generator().manual_seed(seed)
    V = 5000
    x = torch.randn(6, V, generator=g) * 2
    x[1, :40] = 3.0                                   # ties at the k-th value inside the width
    k = torch.tensor([1, 20, 50, 50, 64, 5])
    top_p = torch.tensor([0.9, 0.5, 0.9, 1.0, 0.3, 0.999])
    state = type("S", (), {"top_k": k.int(), "top_p": top_p, "any_top_k": True, "any_top_p": True})()
    want = reference.apply_top_p(reference.apply_top_k(x, state), state)

    values, ids, complete = top_k_candidates(x, k, width=int(k.max()) + 8)
    masked = torch.full_like(x, NEG_INF).scatter_(1, ids, values)
    probs = torch.softmax(masked, dim=-1).gather(1, ids)
    values = top_p_candidates(values, probs, top_p)
    got = torch.full_like(x, NEG_INF).scatter_(1, ids, values)
    assert bool(complete.all())
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    assert torch.equal(got[torch.isfinite(want)], want[torch.isfinite(want)])


def test_candidate_softmax_settles_most_rows_and_never_disagrees_with_the_reference(kernel_path):
    g = torch.Generator().manual_seed(11)
    rows, settled_rows = 0, 0
    for scale in (0.3, 1.0, 3.0, 10.0):
        x = torch.randn(64, 4000, generator=g) * scale
        x[:8, :60] = x[:8, :1]                           # ties across the threshold
        k = torch.randint(1, 80, (64,), generator=g)
        top_p = torch.rand(64, generator=g).clamp(0.01, 0.999)
        values, ids, _ = top_k_candidates(x, k, width=int(k.max()) + 8)
        masked = torch.full_like(x, NEG_INF).scatter_(1, ids, values)
        want = top_p_candidates(values, torch.softmax(masked, dim=-1).gather(1, ids), top_p)
        got, settled = top_p_candidates_fast(values, top_p)
        same = (torch.isfinite(got) == torch.isfinite(want)).all(dim=-1)
        assert bool(same[settled].all())
        rows += 64
        settled_rows += int(settled.sum())
    assert settled_rows >= 0.9 * rows


def test_candidate_softmax_leaves_exact_boundaries_to_the_reference(kernel_path):
    # probabilities 1/2, 1/4, 1/4 (logits log 2, 0, 0) and top_p = 0.75: the mass before the
    # third token equals top_p up to rounding, which only the reference's own sum settles
    values = torch.tensor([[0.6931471805599453, 0.0, 0.0, NEG_INF]])
    _, settled = top_p_candidates_fast(values, torch.tensor([0.75]))
    assert not bool(settled[0])


def test_nucleus_membership_of_single_tokens_agrees_with_the_threshold():
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.125]])
    for top_p, kept in [(0.5, [0]), (0.75, [0, 1]), (0.76, [0, 1, 2, 3])]:
        for token in range(4):
            got = nucleus_contains(probs, torch.tensor([token]), torch.tensor([top_p]))
            assert bool(got[0]) == (token in kept), (top_p, token)
    probs = distributions(20000, seed=3)
    g = torch.Generator().manual_seed(0)
    for top_p in (0.05, 0.5, 0.9, 0.999):
        p = torch.full((probs.shape[0],), top_p)
        kept = kept_by_sort(probs, p)
        for _ in range(30):
            tokens = torch.randint(0, 20000, (probs.shape[0],), generator=g)
            tokens[::2] = torch.multinomial(probs[::2], 1, generator=g)[:, 0]   # likely tokens too
            got = nucleus_contains(probs, tokens, p)
            want = kept.gather(1, tokens[:, None])[:, 0]
            decided = probs.gather(1, tokens[:, None])[:, 0] >= 2.0 ** -29
            assert torch.equal(got[decided], want[decided]), top_p
            assert not bool(got[~decided].any())
