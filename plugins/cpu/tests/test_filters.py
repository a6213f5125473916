"""Steps 3 (token bitmask), 8a (DRY), 10a (top-n-sigma), 13a (typical-p) and 13b (XTC) as the
cpu backend computes them, against the reference's stages on many random rows: masked rows,
ties, extreme parameters, vocabularies that are not multiples of 32 or of the vector width."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from corelib import Sampler, SamplingParams
from corelib.bitmask import pack_bitmask, unpack_bitmask

import corelib_cpu.filters as filters
from corelib_cpu.bitmask import apply_bitmask_rows
from corelib_cpu.workspace import Workspace

NEG_INF = float("-inf")
REFERENCE = Sampler("cpu")


def random_rows(g: torch.Generator, rows: int, V: int, case: int) -> torch.Tensor:
    """float32 [rows, V] logits of several shapes: flat or wide, ties, dropped tokens."""
    x = torch.randn((rows, V), generator=g) * [0.3, 1.0, 3.0, 12.0][case % 4]
    if case % 3 == 0:
        x = torch.round(x)                     # many ties
    if case % 5 == 0:
        x[:, : V // 3] = NEG_INF               # tokens an earlier stage dropped
    return x


# ---------------------------------------------------------------------- step 3: bitmask
@pytest.mark.parametrize("V", [5, 32, 1000, 8199])
@pytest.mark.parametrize("in_place", [False, True])
def test_bitmask_rows_set_exactly_the_banned_tokens_to_minus_inf(V, in_place):
    g = torch.Generator().manual_seed(V)
    x = torch.randn((6, V), generator=g)
    allowed = torch.rand((6, V), generator=g) < 0.4
    allowed[2] = True                          # an unconstrained row: all -1 words
    words = pack_bitmask(allowed)
    assert bool((words[2] == -1).all())
    want = x.masked_fill(~allowed, NEG_INF)
    src = x.clone()
    out = src if in_place else torch.full_like(x, 7.0)
    got = apply_bitmask_rows(src, words, out, Workspace())
    assert got is out
    assert torch.equal(got, want)
    if not in_place:
        assert torch.equal(src, x)             # the caller's logits are never written


def test_bitmask_keeps_nan_and_plus_inf_visible_to_the_validity_check():
    V = 64
    x = torch.zeros((2, V))
    x[0, 3] = float("nan")
    x[1, 5] = float("inf")
    allowed = torch.zeros((2, V), dtype=torch.bool)
    allowed[:, 0] = True                       # the bad tokens themselves are banned
    got = apply_bitmask_rows(x, pack_bitmask(allowed), torch.empty_like(x), Workspace())
    assert bool(torch.isnan(got[0, 3])) and bool(torch.isnan(got[1, 5]))
    assert torch.equal(unpack_bitmask(pack_bitmask(allowed), V), allowed)


# ---------------------------------------------------------------------- step 8a: DRY
def test_dry_equals_the_reference_on_random_histories():
    rng = random.Random(0)
    for trial in range(40):
        V = rng.choice([50, 1000, 32000])
        batch = REFERENCE.new_batch(V)
        for i in range(rng.randrange(1, 6)):
            pool = [rng.randrange(V) for _ in range(8)]
            prompt = [rng.choice(pool) for _ in range(rng.choice([0, 5, 100, 700]))]
            batch.add(f"r{i}", SamplingParams(
                dry_multiplier=rng.choice([0.0, 0.5, 2.0]), dry_base=rng.uniform(1.1, 3.0),
                dry_allowed_length=rng.choice([1, 2, 3]), dry_range=rng.choice([0, 0, 7, 50]),
                dry_sequence_breakers=[rng.choice(pool) for _ in range(rng.randrange(0, 3))]),
                prompt_token_ids=prompt)
        if trial % 4 == 0:                     # a verification state: K padding columns
            s = batch.speculative_state(torch.randint(0, V, (batch.num_rows, 3)))
        else:
            s = batch.step_state()
        if s.dry_history is None:
            continue
        x = torch.randn((s.num_rows, V))
        assert torch.equal(filters.dry_(x.clone(), s), REFERENCE.apply_dry(x, s)), f"trial {trial}"


# ---------------------------------------------------------------------- step 10a: top-n-sigma
def test_top_n_sigma_thresholds_are_the_references():
    g = torch.Generator().manual_seed(1)
    workspace = Workspace()
    for case in range(24):
        V = [16, 300, 5000, 128256][case % 4]
        x = random_rows(g, 3, V, case)
        if case % 7 == 0:
            x[1, 2] = float("inf")             # float32 overflow upstream
        n_sigma = torch.rand(3, generator=g) * 3 + 0.1
        top = x.amax(dim=-1, keepdim=True) if case % 2 else None
        cut = filters.top_n_sigma_thresholds(x, n_sigma, top, workspace)
        want = REFERENCE.apply_top_n_sigma(x, SimpleNamespace(top_n_sigma=n_sigma))
        got = x.clone().masked_fill_(~(x >= cut[:, None]), NEG_INF)
        assert torch.equal(torch.isfinite(got), torch.isfinite(want)), f"case {case}"


# ---------------------------------------------------------------------- step 13a: typical-p
def typical_reference(x, typical_p):
    return REFERENCE.apply_typical_p(x, SimpleNamespace(typical_p=typical_p))


def test_typical_p_keeps_the_references_set_without_sorting(monkeypatch):
    sorts = []
    original = filters._typical_by_sort
    monkeypatch.setattr(filters, "_typical_by_sort", lambda *a: sorts.append(1) or original(*a))
    g = torch.Generator().manual_seed(2)
    workspace = Workspace()
    for case in range(40):
        V = [16, 100, 5000, 128256][case % 4]
        x = random_rows(g, 4, V, case)
        typical_p = torch.rand(4, generator=g) * 0.98 + 0.01
        typical_p[0] = [0.999, 0.05, 0.9, 0.5][case % 4]
        got = filters.typical_rows_(x.clone(), typical_p, workspace)
        want = typical_reference(x, typical_p)
        assert torch.equal(torch.isfinite(got), torch.isfinite(want)), f"case {case}"
        assert torch.equal(got[torch.isfinite(got)], x[torch.isfinite(want)]), f"case {case}"
    assert len(sorts) <= 4, f"{len(sorts)} of 160 rows needed the sort"


def test_typical_p_sets_reaching_tiny_probabilities_take_the_sort(monkeypatch):
    # 1,000,000 tokens of probability ~8e-11 (log p < -20), then 10 likely ones, which hold
    # 0.999924 of the mass, so with typical_p = 0.99999 the set ends among the tiny ones,
    # whose float64 running sums may round: the reference's sort. (The likely tokens come
    # last: ahead of the tiny ones, a float32 log-softmax may add the tiny ones to a partial
    # sum of 10 and lose them, depending on the CPU's vector width, and the premise fails.)
    sorts = []
    original = filters._typical_by_sort
    monkeypatch.setattr(filters, "_typical_by_sort", lambda *a: sorts.append(1) or original(*a))
    x = torch.full((1, 1_000_010), -21.0)
    x[0, -10:] = 0.0
    typical_p = torch.tensor([0.99999])
    got = filters.typical_rows_(x.clone(), typical_p, Workspace())
    assert torch.equal(torch.isfinite(got), torch.isfinite(typical_reference(x, typical_p)))
    assert sorts


# ---------------------------------------------------------------------- step 13b: XTC
def test_xtc_on_the_largest_logits_drops_what_the_reference_drops():
    g = torch.Generator().manual_seed(3)
    workspace = Workspace()
    for case in range(200):
        V = [16, 300, 5000, 128256][case % 4]
        x = random_rows(g, 5, V, case)
        threshold = torch.rand(5, generator=g) * [0.02, 0.3, 1.0][case % 3]
        if case % 11 == 0:
            threshold[0] = 0.0                 # every kept token reaches it
        want = x.clone()
        drop = filters.xtc_drops(x, threshold)
        if drop is not None:
            want.masked_fill_(drop, NEG_INF)
        got = x.clone()
        filters.xtc_rows_(got, threshold, workspace)
        assert torch.equal(got, want), f"case {case}"
