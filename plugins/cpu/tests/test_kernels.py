"""The compiled seeded-noise kernel: the same bits as corelib.noise, and the torch path as its
fallback wherever it does not run."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from corelib import SamplingParams, noise
from corelib.sampler import Sampler
from corelib.testing import chi_square_p_value

import corelib_cpu
from corelib_cpu import kernels
from corelib_cpu.draw import draw_seeded_rows
from corelib_cpu.workspace import Workspace

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
def test_kernel_row_keys_are_the_contracts_bits():
    prefix, position = _keys(64, seed=4), _keys(64, seed=5)
    out = torch.empty(64, dtype=torch.int32)
    assert kernels.row_keys_into(out, prefix, position)
    assert torch.equal(out, noise.mix32(prefix ^ position))
    lo, hi, child = _keys(64, seed=6), _keys(64, seed=7), torch.arange(64, dtype=torch.int32)
    assert kernels.row_keys_into(out, noise.row_key_prefix(lo, hi, child), position)
    assert torch.equal(out, noise.row_keys(lo, hi, child, position))


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


def _race_scores(x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The reference race's float32 scores x + noise over whole rows."""
    return x + noise.seeded_gumbel(keys[:, None], torch.arange(x.shape[1], dtype=torch.int32)[None, :])


@needs_numba
@pytest.mark.parametrize("V", [129, 1000, 50257, 128256])
def test_seeded_race_candidates_hold_every_maximiser_of_the_reference_race(V):
    """``kernels.seeded_race_candidates``: every token whose float32 score is the row's largest
    is among the candidates (ties of scores included), for logits of tiny to huge scale, far
    from 0 (the slack grows with |x|), tied logits and rows mostly -inf; the candidates' race
    is the reference's token. They are few: one token in most rows."""
    from corelib_cpu.draw import candidate_winners
    from corelib_cpu.rowops import GROUP
    g = torch.Generator().manual_seed(V)
    widths = []
    for case in range(24):
        n = 1 + case % 3
        x = torch.randn((n, V), generator=g) * (0.001, 0.1, 1.0, 4.0, 30.0, 300.0)[case % 6]
        if case % 4 == 1:
            x = torch.round(x)                                   # tied logits
        if case % 5 == 2:
            x = x - 1e4                                          # far from 0
        if case % 7 == 3:
            x[:, torch.rand(V, generator=g) < 0.9] = float("-inf")
            x[:, V - 1] = 0.5                                    # a live token in every row
        keys = _keys(n, seed=case)
        found = kernels.seeded_race_candidates(x, keys, GROUP, 64)
        assert found is not None, case
        values, ids = found
        scores = _race_scores(x, keys)
        for r in range(n):
            best = scores[r].amax()
            maximisers = set((scores[r] == best).nonzero()[:, 0].tolist())
            live = values[r] > float("-inf")
            listed = set(ids[r][live].tolist())
            assert maximisers <= listed, (case, r)
            assert torch.equal(values[r][live], x[r, ids[r][live]])        # each id's own logit
            widths.append(len(listed))
        won, finite, _ = candidate_winners(values, ids, keys, None)
        assert torch.equal(won, scores.argmax(dim=-1)) and bool(finite.all()), case
    assert sorted(widths)[len(widths) // 2] == 1 and max(widths) <= 8


@needs_numba
def test_seeded_race_candidates_decline_rows_they_cannot_serve():
    """None (the race over every token answers) for a NaN of either sign or +inf anywhere, a
    row of -inf only, and more candidates than the room (huge tied logits: every token is
    within the slack); a row with one live token lists it alone, -inf padding after it."""
    from corelib_cpu.rowops import GROUP
    keys = _keys(2, seed=5)
    for bad in (float("nan"), -float("nan"), float("inf")):
        x = torch.randn(2, 4000)
        x[1, 3001] = bad
        assert kernels.seeded_race_candidates(x, keys, GROUP, 64) is None
    x = torch.randn(2, 4000)
    x[0] = float("-inf")
    assert kernels.seeded_race_candidates(x, keys, GROUP, 64) is None
    assert kernels.seeded_race_candidates(torch.full((2, 4000), 3e38), keys, GROUP, 64) is None
    x = torch.full((2, 4000), float("-inf"))
    x[0, 17], x[1, 3999], x[1, 5] = 2.0, -1.0, -80.0
    values, ids = kernels.seeded_race_candidates(x, keys, GROUP, 64)
    assert ids[0, 0] == 17 and ids[1, 0] == 3999
    assert values[0, 0] == 2.0 and bool((values[0, 1:] == float("-inf")).all())


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


def _both_paths(monkeypatch, fn):
    """fn() on the compiled path, then on the torch path."""
    results = []
    for path in ("", "torch"):
        monkeypatch.setenv(kernels.KERNELS_ENV, path)
        kernels.reset()
        results.append(fn())
    kernels.reset()
    return results


def _candidate_rows(n: int, W: int, seed: int) -> torch.Tensor:
    """Descending candidate values as top-k leaves them: ordinary rows, ties, -inf tails, a
    NaN row, a row of -inf only, and a row that overflowed to +inf."""
    gen = torch.Generator().manual_seed(seed)
    values = (torch.randn((n, W), generator=gen) * torch.rand((n, 1), generator=gen) * 6)
    values = values.sort(dim=-1, descending=True).values
    values[1, 3:20] = values[1, min(3, W - 1)]               # ties across the threshold
    values[2, W // 2:] = float("-inf")
    values[3, W // 2] = float("nan")
    values[4] = float("-inf")
    values[5, 0] = float("inf")
    return values


@needs_numba
def test_candidate_top_k_is_the_same_bits_on_both_paths(monkeypatch):
    from corelib_cpu.select import top_k_candidates
    gen = torch.Generator().manual_seed(8)
    x = torch.randn((40, 3000), generator=gen) * 3
    x[1, :60] = x[1, 0]                                      # ties spill past the width
    x[2, ::2] = float("-inf")
    x[3, 7] = float("nan")
    k = torch.randint(1, 60, (40,), generator=gen)
    temperature = torch.rand((40, 1), generator=gen) * 1.5 + 0.05
    for t in (None, temperature):
        for width in (int(k.max()) + 8, 3000):
            compiled, plain = _both_paths(monkeypatch, lambda: top_k_candidates(x, k, width, t))
            for got, want in zip(compiled, plain):
                assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8),
                                                              want.view(torch.uint8))


@needs_numba
@pytest.mark.parametrize("W", [2, 58, 300])
def test_candidate_top_p_settles_the_same_nuclei_on_both_paths(monkeypatch, W):
    """Where both paths settle a row, they keep the same candidates (each then the
    reference's: test_select checks that on both paths); they settle nearly the same rows,
    never a row holding a NaN or nothing finite, always a row with top_p = 1."""
    from corelib_cpu.select import top_p_candidates_fast
    values = _candidate_rows(200, W, seed=W)
    top_p = torch.rand(200, generator=torch.Generator().manual_seed(9)).clamp(0.01, 0.999)
    top_p[6] = 1.0
    (got, settled), (want, want_settled) = _both_paths(
        monkeypatch, lambda: top_p_candidates_fast(values, top_p))
    both = settled & want_settled
    assert torch.equal(torch.isfinite(got[both]), torch.isfinite(want[both]))
    assert torch.equal(got[both][torch.isfinite(got[both])], want[both][torch.isfinite(want[both])])
    assert int((settled != want_settled).sum()) <= 4
    assert not settled[3] and not settled[4] and not settled[5] and settled[6]
    assert torch.equal(got[6].view(torch.int32), values[6].view(torch.int32))


@needs_numba
@pytest.mark.parametrize("seeded", [False, True])
def test_top_k_top_p_requests_draw_the_same_tokens_on_both_paths(monkeypatch, seeded):
    """The sampler end to end (top-k + top-p + temperature, every row a candidate row): the
    same tokens from the compiled and the torch path when seeded; unseeded (the compiled
    race has noise of its own), tokens of the reference's kept sets on both."""
    V = 5000
    logits = torch.randn((12, V), generator=torch.Generator().manual_seed(10)) * 2

    def tokens():
        sampler = corelib_cpu.CpuSampler(generator=torch.Generator().manual_seed(3))
        batch = sampler.new_batch(V)
        for i in range(12):
            batch.add(f"r{i}", SamplingParams(top_k=5 + 7 * i, top_p=0.5 + 0.04 * i, temperature=0.7,
                                              **(dict(seed=i) if seeded else {})))
        out = []
        for _ in range(6):
            out.append(sampler.step(logits, batch).token_ids)
            _assert_kept(logits, batch, out[-1])
        return torch.stack(out)

    compiled, plain = _both_paths(monkeypatch, tokens)
    assert torch.equal(compiled, plain) or not seeded


@needs_numba
@pytest.mark.parametrize("V", [70000, 128256])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("seeded", [False, True])
def test_few_row_top_k_steps_draw_the_same_tokens_on_both_paths(monkeypatch, V, rows, seeded):
    """Blocks of one or two top-k rows (the chain kernel, typical-p on the candidates and the
    race write into the workspace's buffers, the group maxima too where V is a multiple of
    the group): the same seeded tokens as the torch path, step after step (unseeded, tokens
    of the reference's kept sets on both), and the buffers reused across steps and across
    two batches of different widths."""
    logits = torch.randn((8, V), generator=torch.Generator().manual_seed(V)) * 2
    chains = [dict(top_k=40, top_p=0.95, min_p=0.05, temperature=0.8), dict(top_k=50, top_p=0.95, temperature=0.7),
              dict(top_k=40), dict(top_k=7, temperature=1.3)]
    if seeded:   # the torch path reads typical-p's rows whole and draws them another way
        chains += [dict(top_k=40, typical_p=0.9), dict(top_k=50, top_p=0.95, typical_p=0.5, temperature=0.7)]

    def tokens():
        sampler = corelib_cpu.CpuSampler(generator=torch.Generator().manual_seed(3))
        out = []
        for c, chain in enumerate(chains):
            batch = sampler.new_batch(V)
            for i in range(rows):
                batch.add(f"r{i}", SamplingParams(**chain, **(dict(seed=10 * c + i) if seeded else {})))
            for t in range(6):
                step_logits = logits[(t + c) % 7:(t + c) % 7 + rows]
                out.append(sampler.step(step_logits, batch).token_ids)
                _assert_kept(step_logits, batch, out[-1])
        return torch.stack(out)

    compiled, plain = _both_paths(monkeypatch, tokens)
    assert torch.equal(compiled, plain) or not seeded


def _assert_kept(logits, batch, token_ids):
    """Every row's token is in the reference's kept set of that row (before the step's
    append: the batch holds no penalties, so its state does not change the sets)."""
    reference = Sampler("cpu")
    kept = torch.isfinite(reference.processed_logits(logits, batch))
    assert bool(kept.gather(1, token_ids[:, None]).all())


def test_workspace_pairs_are_made_once_and_share_memory():
    """``Workspace.pair``: the same tensor and numpy view for the same key on later calls
    (nothing allocated or converted), the view the tensor's memory; another shape or dtype is
    another buffer; past ``PAIRS`` keys the pairs are dropped and made again."""
    w = Workspace()
    t, a = w.pair("v", (2, 5))
    assert w.pair("v", (2, 5))[0] is t and w.pair("v", (2, 5))[1] is a
    a[1, 3] = 7.0
    assert float(t[1, 3]) == 7.0 and t.dtype == torch.float32 and t.shape == (2, 5)
    ids = w.pair("v", (2, 5), torch.long)[0]
    assert ids.dtype == torch.long and w.pair("v", (1, 5))[0] is not t
    for i in range(Workspace.PAIRS):
        w.pair("n", (i + 1,))
    assert w.pair("v", (2, 5))[0] is not t            # dropped once PAIRS were held
    with torch.inference_mode():
        inside = w.pair("v", (2, 5))[0]
    assert w.pair("v", (2, 5))[0] is inside or not inside.is_inference()



def test_workspace_buffers_made_under_inference_mode_are_replaced_outside_it():
    """A pair or fresh chunk made inside ``torch.inference_mode`` (vLLM's steps) serves the
    calls inside it; the first call outside gets a new buffer that torch lets it write; a
    buffer made outside serves both."""
    w = Workspace()
    with torch.inference_mode():
        inside, row = w.pair("u", (3,))[0], w.fresh("f", 3, torch.long)[0]
        assert inside.is_inference() and row.is_inference()
        assert w.pair("u", (3,))[0] is inside
    outside, row = w.pair("u", (3,))[0], w.fresh("f", 3, torch.long)[0]
    assert outside is not inside and not outside.is_inference() and not row.is_inference()
    outside.add_(1)
    row.add_(1)
    assert w.pair("u", (3,))[0] is outside
    with torch.inference_mode():
        assert w.pair("u", (3,))[0] is outside

def test_the_torch_path_when_asked(torch_path):
    out = torch.full((2, 3), 7.0)
    assert not kernels.seeded_uniforms_into(out, _keys(2))
    assert not kernels.row_keys_into(torch.zeros(2, dtype=torch.int32), _keys(2), _keys(2))
    assert kernels.top_k_of_candidates(out, torch.ones(2, dtype=torch.long), None, out[:, 0], False) is None
    assert kernels.top_p_of_candidates(out, torch.ones(2), 0.0) is None
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
        assert described == ("kernels: numba (seeded noise and row keys, small-vocabulary draw, group maxima and "
                             "top values of a few rows, min-p candidates, top-k/top-p/typical of candidates, "
                             "steps 11-13a of a few rows in one call, candidate races (unseeded: their noise too; "
                             "seeded: settled from float64 estimates where they can be), "
                             "the seeded race's candidates over whole rows, "
                             "logprobs (top-N and rank in one pass), "
                             "quadratic smoothing, tail-free, adaptive-p, kept-set packing, nucleus histogram)")


@needs_numba
@pytest.mark.parametrize("V", [1, 7, 33, 1000, 32000])
def test_kernel_packs_kept_sets_as_the_core_does(V):
    from corelib.bitmask import bitmask_width, pack_kept
    x = torch.randn((5, V), generator=torch.Generator().manual_seed(V))
    x[x < -0.5] = float("-inf")
    x[0, 0], x[1, -1], x[2, V // 2] = float("nan"), float("inf"), -0.0
    for floor in (float("-inf"), 0.0):
        out = torch.full((5, bitmask_width(V)), -1, dtype=torch.int32)     # every bit written
        assert kernels.pack_above(x, floor, out)
        assert torch.equal(out, pack_kept(x > floor))


def test_kept_set_packing_falls_back_to_torch(torch_path):
    x = torch.randn((2, 40))
    assert not kernels.pack_above(x, 0.0, torch.empty((2, 2), dtype=torch.int32))


@needs_numba
def test_nucleus_histogram_kernels_give_the_torch_paths_thresholds(monkeypatch):
    from corelib_cpu.select import select_by_histogram
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn((6, 3000), generator=gen) * torch.tensor([0.5, 1, 2, 4, 8, 16])[:, None]
    logits[1, :10] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    probs[5, 7] = float("nan")
    top_p = torch.tensor([0.5, 0.9, 0.95, 0.3, 0.99, 0.9])
    compiled = select_by_histogram(probs, top_p)
    monkeypatch.setenv(kernels.KERNELS_ENV, "torch")
    kernels.reset()
    try:
        plain = select_by_histogram(probs, top_p)
    finally:
        monkeypatch.delenv(kernels.KERNELS_ENV)
        kernels.reset()
    assert torch.equal(compiled[0].view(torch.int32), plain[0].view(torch.int32))
    assert torch.equal(compiled[1], plain[1])


@needs_numba
@pytest.mark.parametrize("V", [1000, 32000, 128256])
def test_top_group_values_are_torch_topks_values(V):
    """The compiled group search of ``rowops.top_values`` (rows <= KERNEL_ROWS): torch.topk's
    values, ids that hold them (distinct), the torch path's floor; rows of ties, of dropped
    tokens, of one value throughout, of sorted values, and a short last group."""
    from corelib_cpu import rowops
    g = torch.Generator().manual_seed(V)
    for case in range(20):
        x = torch.randn((1 + case % 2, V), generator=g) * (0.3, 3.0)[case % 2]
        if case % 3 == 0:
            x = torch.round(x)
        if case % 5 == 0:
            x[:, : V // 3] = float("-inf")
        if case % 7 == 0:
            x[:] = 1.0
        if case % 6 == 1:      # group maxima ascending (each enters the W largest), descending
            x = x.sort(dim=-1, descending=case % 12 == 7).values.contiguous()
        W = (1, 8, 48, 58, 100)[case % 5]        # up to 64 by insertion, 100 by pool and sort
        maxima = rowops.group_maxima(x)
        if W >= maxima.shape[1]:               # top_values takes torch.topk itself there
            assert kernels.top_group_values(x, maxima, W, rowops.GROUP) is None
            continue
        got = kernels.top_group_values(x, maxima, W, rowops.GROUP)
        assert got is not None
        values, ids, floor = got
        want = torch.topk(x, W, dim=-1).values
        assert torch.equal(values, want), case
        assert torch.equal(x.gather(1, ids), values), case
        assert all(len(set(row)) == W for row in ids.tolist()), case
        assert torch.equal(floor, torch.topk(maxima, W, dim=-1).values[:, -1]), case
    x[0, 5] = float("nan")                     # torch.topk ranks NaN first: the torch path
    assert kernels.top_group_values(x, rowops.group_maxima(x), 8, rowops.GROUP) is None


@needs_numba
def test_candidate_min_p_settles_the_same_rows_on_both_paths(monkeypatch):
    import math
    from corelib_cpu.select import min_p_of_candidates
    g = torch.Generator().manual_seed(3)
    values = torch.sort(torch.randn((64, 48), generator=g) * 3.0, dim=-1, descending=True).values
    values[::5, 30:] = float("-inf")
    values[3, 9] = values[3, 0] + math.log(0.05)          # on the threshold: unsettled
    values[4, 0] = float("nan")
    min_p = torch.rand(64, generator=g) * 0.5
    min_p[::7] = 0.0
    min_p[3] = 0.05
    compiled, plain = _both_paths(monkeypatch, lambda: min_p_of_candidates(values, min_p))
    assert torch.equal(compiled[1], plain[1])
    assert not bool(compiled[1][3]) and not bool(compiled[1][4])
    settled = compiled[1]
    assert torch.equal(compiled[0][settled], plain[0][settled])


@needs_numba
def test_typical_of_descending_candidates_merges_the_scores_as_a_sort_orders_them():
    """Typical-p on candidates: descending rows (as top-k leaves them) order their scores by
    a merge outward from where log p + H changes sign, other rows by a sort; both give the
    same kept set and the same settling, on ordinary rows, ties (symmetric scores too), -inf
    tails, NaN, -inf-only and +inf rows, and rows that keep all."""
    from corelib_cpu.select import TYPICAL_LOWEST, TYPICAL_MASS_MARGIN, typical_score_margin
    W = 48
    margins = (TYPICAL_MASS_MARGIN, typical_score_margin(W), TYPICAL_LOWEST)
    g = torch.Generator().manual_seed(13)
    values = torch.cat([_candidate_rows(64, W, seed=s) for s in range(4)])
    values[7, :2] = torch.tensor([1.0, 1.0])
    values[7, 2:] = float("-inf")                             # two equal tokens: H = log 2
    typical_p = torch.rand(values.shape[0], generator=g) * 0.98 + 0.01
    typical_p[::17] = 1.0
    merged, merged_settled = kernels.typical_of_candidates(values, typical_p, *margins)
    order = torch.stack([torch.randperm(W, generator=g) for _ in range(values.shape[0])])
    sorted_, sorted_settled = kernels.typical_of_candidates(values.gather(1, order), typical_p, *margins)
    assert torch.equal(merged_settled, sorted_settled)
    kept = torch.isfinite(merged) | torch.isnan(merged)
    back = torch.empty_like(sorted_).scatter_(1, order, sorted_)
    assert torch.equal(kept[merged_settled], (torch.isfinite(back) | torch.isnan(back))[merged_settled])
    assert torch.equal(merged[merged_settled & kept.all(1)], values[merged_settled & kept.all(1)])
    assert 100 <= int(merged_settled.sum()) < values.shape[0]
    assert not bool(merged_settled[3]) and bool(merged_settled[0])   # NaN row; a row that keeps all


@needs_numba
@pytest.mark.parametrize("V", [32000, 128256])
def test_candidate_chain_is_the_steps_one_by_one(V):
    """``kernels.candidate_chain`` (steps 11-13a of a few rows in one call) gives the bits of
    the kernels the steps call one by one (group search, top-k's tail, min-p, top-p,
    typical-p), and declines (None) exactly where one of them leaves a row incomplete or
    unsettled; a NaN row goes to the torch path."""
    from corelib_cpu import rowops
    from corelib_cpu.select import (MIN_P_MARGIN, TYPICAL_LOWEST, TYPICAL_MASS_MARGIN, top_p_tolerance,
                                    typical_score_margin)
    g = torch.Generator().manual_seed(V)
    served = typical_served = 0
    for case in range(40):
        n = 1 + case % 2
        x = torch.randn((n, V), generator=g) * (0.5, 2.0, 6.0)[case % 3]
        if case % 4 == 0:
            x = torch.round(x * 2) / 2                    # ties at the k-th value
        if case % 5 == 0:
            x[:, : V // 2] = float("-inf")
        k = torch.randint(1, 50 if case % 8 else 120, (n,), generator=g)   # width past 64: pool and sort
        width = int(k.max()) + 8
        t = None if case % 3 == 0 else torch.rand((n, 1), generator=g) + 0.3
        min_p = None if case % 2 else torch.rand(n, generator=g) * 0.2
        top_p = None if case % 3 == 1 else torch.rand(n, generator=g) * 0.5 + 0.5
        typical_p = None if case % 4 == 1 else torch.rand(n, generator=g) * 0.9 + 0.1
        if typical_p is not None and case % 5 == 2:
            typical_p[0] = 1.0                          # a row that keeps all
        margins = (TYPICAL_MASS_MARGIN, typical_score_margin(width), TYPICAL_LOWEST)
        maxima = rowops.group_maxima(x)
        got = kernels.candidate_chain(x, maxima, rowops.GROUP, kernels.chain_params(
            width, k, t, min_p, MIN_P_MARGIN, top_p, top_p_tolerance(width),
            None if typical_p is None else (typical_p, *margins)))
        values, ids, complete = kernels.group_top_k(x, maxima, width, rowops.GROUP, k, t)
        ok = bool(complete.all())
        if ok and min_p is not None:
            values, settled = kernels.min_p_of_candidates(values, min_p, MIN_P_MARGIN)
            ok = bool(settled.all())
        if ok and top_p is not None:
            values, settled = kernels.top_p_of_candidates(values, top_p, top_p_tolerance(width))
            ok = bool(settled.all())
        if ok and typical_p is not None:
            values, settled = kernels.typical_of_candidates(values, typical_p, *margins)
            ok = bool(settled.all())
            typical_served += ok
        assert (got is not None) == ok, case
        if got is not None:
            served += 1
            assert torch.equal(got[0], values) and torch.equal(got[1], ids), case
    assert 20 <= served < 40 and typical_served >= 10, (served, typical_served)
    x[0, 3] = float("nan")
    assert kernels.candidate_chain(x, rowops.group_maxima(x), rowops.GROUP, kernels.chain_params(
        16, torch.full((x.shape[0],), 8), None, None, MIN_P_MARGIN, None, 0.0)) is None


@needs_numba
def test_seeded_race_winners_are_the_torch_races():
    """``kernels.seeded_race_winners`` picks the torch race's winner: the lowest id among the
    largest of values - log(-log(u)) (ties made on purpose); rows of -inf tails, of one
    finite value, +inf and NaN."""
    from corelib_cpu.draw import candidate_winners, race_seeded_candidates
    values = _candidate_rows(64, 48, seed=11)
    g = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(1000, generator=g)[:48] for _ in range(64)])
    keys = _keys(64, seed=2)
    got = candidate_winners(values, ids, keys, None)
    race = race_seeded_candidates(values, ids, keys)
    assert torch.equal(got[0], ids.gather(1, race)[:, 0])
    assert torch.equal(got[1], torch.isfinite(values.gather(1, race)[:, 0]))
    # the caller's numpy views and the workspace's buffers: the same winners
    lent = candidate_winners(values, ids, keys, None, (values.numpy(), ids.numpy()), Workspace(),
                             keys.numpy())
    assert torch.equal(lent[0], got[0]) and torch.equal(lent[1], got[1])
    # equal scores: the lowest id wins
    scores = torch.zeros((2, 6))
    scores[1, 2] = float("nan")
    tied_ids = torch.tensor([[9, 4, 7, 4 + 1, 3, 8], [1, 2, 3, 4, 5, 6]])
    won = kernels.seeded_race_winners(torch.zeros((2, 6)), scores, tied_ids)
    assert won[0].tolist() == [3, 1]                        # NaN: none equal, the first column
    assert len(won) == 3 and won[2] is True                 # one shape of answer on every path


def _unseeded_winners(values, ids, generator, workspace=None):
    from corelib_cpu.draw import candidate_winners
    lent = (values.numpy(), ids.numpy()) if workspace is not None else None
    return candidate_winners(values, ids, None, generator, lent, workspace)


@needs_numba
@pytest.mark.parametrize("lent", [False, True])
def test_unseeded_race_winners_follow_the_candidates_distribution(lent):
    """The unseeded race's own noise (one key drawn from the generator per call): each row's
    winner follows the softmax of its candidates (chi-square, fixed seeds, p > 1e-6), never a
    dropped one; two rows of a call and the same row in two calls are independent (the
    joint counts of neighbours follow the product of the marginals)."""
    g = torch.Generator().manual_seed(3)
    W, V = 30, 1000
    values = torch.sort(torch.randn(W, generator=g) * 1.5, descending=True).values
    values[20:] = float("-inf")
    ids = torch.randperm(V, generator=g)[:W]
    rows, calls = 2000, 10
    wide_values, wide_ids = values.expand(rows, W).contiguous(), ids.expand(rows, W).contiguous()
    gen = torch.Generator().manual_seed(4)
    workspace = Workspace() if lent else None
    drawn = torch.stack([_unseeded_winners(wide_values, wide_ids, gen, workspace)[0].clone()
                         for _ in range(calls)])
    probs = torch.zeros(V).scatter_(0, ids, torch.softmax(values, dim=-1))
    counts = torch.bincount(drawn.flatten(), minlength=V)
    kept = probs > 0
    assert int(counts[~kept].sum()) == 0
    assert chi_square_p_value(counts[kept], probs[kept]) > 1e-6
    # neighbours: four candidates, 16 joint cells
    few = torch.tensor([1.0, 0.5, 0.0, -0.5])
    few_ids = torch.tensor([7, 3, 11, 5])
    draws = torch.stack([_unseeded_winners(few.expand(rows, 4).contiguous(), few_ids.expand(rows, 4).contiguous(),
                                           gen, workspace)[0].clone() for _ in range(calls)])
    column = {int(t): j for j, t in enumerate(few_ids)}
    cols = draws.apply_(lambda t: column[t])
    p = torch.softmax(few, dim=-1)
    joint = (p[:, None] * p[None, :]).flatten()
    for first, second in ((cols[:, 0::2], cols[:, 1::2]), (cols[:-1], cols[1:])):   # rows, calls
        cells = torch.bincount((first * 4 + second).flatten(), minlength=16)
        assert chi_square_p_value(cells, joint) > 1e-6


@needs_numba
def test_unseeded_race_winners_are_the_generators():
    """The same generator state gives the same winners, another state others, and each call
    draws one number from the generator; a NaN value wins (the first), a row of -inf only
    gives its first candidate, flagged not finite."""
    values = torch.randn((64, 40), generator=torch.Generator().manual_seed(1))
    ids = torch.stack([torch.randperm(5000, generator=torch.Generator().manual_seed(r))[:40] for r in range(64)])
    a = _unseeded_winners(values, ids, torch.Generator().manual_seed(9))[0]
    assert torch.equal(a, _unseeded_winners(values, ids, torch.Generator().manual_seed(9), Workspace())[0])
    assert not torch.equal(a, _unseeded_winners(values, ids, torch.Generator().manual_seed(10))[0])
    gen = torch.Generator().manual_seed(9)
    _unseeded_winners(values, ids, gen)
    after = torch.Generator().manual_seed(9)
    torch.empty(1, dtype=torch.long).random_(generator=after)
    assert torch.equal(gen.get_state(), after.get_state())
    odd = torch.zeros((2, 6))
    odd[0, 2] = odd[0, 4] = float("nan")
    odd[1] = float("-inf")
    won = kernels.unseeded_race_winners(odd, torch.arange(12).reshape(2, 6), torch.zeros(1, dtype=torch.long).numpy())
    assert won[0].tolist() == [2, 6] and won[1].tolist() == [False, False] and won[2] is False


@needs_numba
def test_race_winners_say_whether_every_winner_is_finite():
    """The race answers "every winner finite" in the kernel call, seeded and unseeded, with
    per-row flags that say which winners are not; ids and flags are new tensors each call
    (the step may hand both to its caller), never a buffer a later call writes."""
    from corelib_cpu.draw import candidate_winners
    values = torch.randn((2, 8), generator=torch.Generator().manual_seed(3))
    ids = torch.arange(16).reshape(2, 8)
    workspace = Workspace()
    for keys in (None, _keys(2, seed=1)):
        earlier = None
        for inf_row in (None, 0, 1):
            v = values.clone()
            if inf_row is not None:
                v[inf_row] = float("inf")
            won = candidate_winners(v, ids, keys, torch.Generator().manual_seed(1), (v.numpy(), ids.numpy()),
                                    workspace)
            assert won[2] == (inf_row is None)
            assert won[1].tolist() == [row != inf_row for row in range(2)]
            if earlier is not None:
                assert earlier[1].tolist() == [True, True]          # not written by this call
                assert won[0].data_ptr() != earlier[0].data_ptr() and won[1].data_ptr() != earlier[1].data_ptr()
            earlier = won if inf_row is None else earlier


@needs_numba
def test_group_and_row_maxima_are_torchs_and_flag_nan_inf_and_zero_rows():
    """``kernels.group_and_row_maxima``: the group maxima torch's amax gives (to the bit, for
    negative, subnormal, huge and -inf logits and any group), each row's maximum, True only
    when each is finite and nonzero; False for a NaN of either sign anywhere, +-inf or a
    zero maximum, as the test of numpy's maxima of torch's answers without numba."""
    import numpy
    from corelib_cpu.rowops import GROUP, group_maxima

    def both(x):
        n, V = x.shape
        maxima = numpy.full((n, V // GROUP), 7.0, dtype=numpy.float32)
        top = numpy.empty(n, dtype=numpy.float32)
        answer = kernels.group_and_row_maxima(x, GROUP, maxima, top)
        torch_maxima = group_maxima(x).numpy()
        torch_top = torch_maxima.max(axis=1)
        want = all(-math.inf < v < math.inf and v != 0.0 for v in torch_top.tolist())
        return answer, maxima, top, want, torch_maxima, torch_top

    g = torch.Generator().manual_seed(9)
    for case in range(6):
        x = torch.randn((1 + case % 2, 128 * GROUP), generator=g) * 10.0 ** (case - 2)
        x[0, :GROUP] = float("-inf")                                   # a group of -inf only
        x[0, 3 * GROUP:4 * GROUP] = -x[0, 3 * GROUP:4 * GROUP].abs()   # all negative
        x[-1, 5 * GROUP + 7] = 1e-42                                   # subnormal
        x[-1, 6 * GROUP:7 * GROUP] = -1e-42
        x[-1, 9 * GROUP + 1] = 3e38
        answer, maxima, top, want, torch_maxima, torch_top = both(x)
        assert answer is want is True
        assert numpy.array_equal(maxima.view(numpy.int32), torch_maxima.view(numpy.int32))
        assert numpy.array_equal(top, torch_top)
    for bad in (float("nan"), -float("nan"), float("inf"), float("-inf")):
        x = torch.full((2, 16 * GROUP), -1.0)
        x[1, 5 * GROUP + 3] = bad
        if bad == float("-inf"):
            x[1] = bad                       # a row of -inf only: no token left
        assert both(x)[0] is False and both(x)[3] is False
    for bits in (0x7F800001, 0x7FFFFFFF, 0xFF800001, 0xFFFFFFFF):   # NaNs' extreme payloads
        for fill in (-1.0, 2.0):                        # in a group of negatives, of positives
            x = torch.full((1, 16 * GROUP), fill)
            x.view(torch.int32)[0, 4 * GROUP + 11] = bits if bits < 2 ** 31 else bits - 2 ** 32
            assert both(x)[0] is False and both(x)[3] is False
    for zero in (0.0, -0.0):
        x = torch.full((1, 16 * GROUP), -3.0)
        x[0, 9] = zero
        assert both(x)[0] is False
    assert kernels.group_and_row_maxima(torch.zeros(4, 2 * GROUP).t(), GROUP, None, None) is None


@needs_numba
@pytest.mark.parametrize("V", [70000, 128256])
def test_first_max_at_is_torch_argmax(V):
    """``rowops.first_argmax`` of one or two rows through the compiled search: torch.argmax's
    lowest index of the maximum, with ties across groups and inside one, rows of -inf only,
    +inf, and a short last group (V % 128 != 0 at 70000)."""
    from corelib_cpu import rowops
    g = torch.Generator().manual_seed(V)
    for case in range(12):
        x = torch.randn((1 + case % 2, V), generator=g)
        if case % 3 == 0:
            x = torch.round(x)                             # the maximum many times over
        if case % 4 == 1:
            x[:, [V - 1, 5000]] = 9.0                      # the last token ties an earlier one
        if case == 5:
            x[:] = float("-inf")
        if case == 7:
            x[-1, V - 2] = float("inf")
        maxima = rowops.group_maxima(x)
        top = maxima.amax(dim=-1, keepdim=True)
        got = kernels.first_max_at(x, maxima, top, rowops.GROUP)
        assert torch.equal(got, torch.argmax(x, dim=-1)), case
        assert torch.equal(rowops.first_argmax(x), torch.argmax(x, dim=-1)), case
    assert kernels.first_max_at(x, maxima, top + 1.0, rowops.GROUP) is None     # not in the row


def test_rank_counts_are_the_references_on_both_paths(kernel_path):
    """``rowops.count_at_least`` (step 15's ranks) equals ``(x >= value).sum(-1)`` with NaN
    entries, infinite entries and infinite or NaN values (where sign arithmetic meets inf -
    inf), on the compiled path and the torch path."""
    from corelib_cpu import rowops
    g = torch.Generator().manual_seed(1)
    x = torch.randn((6, 70000), generator=g)
    x[:, ::7] = float("-inf")
    x[1, 5] = float("inf")
    x[2, 9] = float("nan")
    value = x[:, 3:4].clone()
    value[3] = float("-inf")
    value[4] = float("inf")
    value[5] = float("nan")
    x[4, 11] = float("inf")
    assert torch.equal(rowops.count_at_least(x, value), (x >= value).sum(dim=-1))


@needs_numba
def test_key_prefixes_are_the_contracts_bits():
    """``kernels.key_prefix`` (a plan's seeded rows' keys without their position) equals
    ``corelib.noise.row_key_prefix`` bit for bit, int32's extremes included."""
    lo, hi, child = _keys(64, seed=1), _keys(64, seed=2), _keys(64, seed=3)
    assert torch.equal(kernels.key_prefix(lo, hi, child), noise.row_key_prefix(lo, hi, child))


def test_seeded_candidate_races_settled_from_estimates_are_the_references():
    """``seeded_candidates_settled``: where it answers, every row's winner is the reference's
    (``race_seeded_candidates``: torch's noise, lowest id among ties), and it answers for the
    candidate sets a top-k step makes (40 columns, a tail dropped, logits of scale 1 to 30);
    far from 0 (-1e4) the slack grows and a row may be left to the torch race, and a row with
    an exact tie of scores, a NaN or +inf value, or nothing finite always is (None)."""
    from corelib_cpu.draw import race_seeded_candidates
    g = torch.Generator().manual_seed(21)
    for scale, shift in ((1.0, 0.0), (5.0, 0.0), (30.0, 0.0), (3.0, -1e4)):
        values = torch.sort(torch.randn(64, 40, generator=g) * scale + shift, descending=True).values
        values[:, 30:] = float("-inf")
        ids = torch.stack([torch.randperm(128256, generator=g)[:40] for _ in range(64)])
        keys = _keys(64, seed=int(scale))
        want = ids.gather(1, race_seeded_candidates(values, ids, keys))[:, 0]
        settled = 0
        for r in range(64):
            won = kernels.seeded_candidates_settled(values[r:r + 1], ids[r:r + 1], keys[r:r + 1].numpy())
            if won is not None:
                assert int(won[0][0]) == int(want[r]) and bool(won[1][0]) and won[2]
                settled += 1
        assert settled >= (64 if shift == 0.0 else 16), (scale, shift, settled)
    key = _keys(1, seed=5)
    tie_ids = torch.tensor([[900, 12]])
    noise_of = noise.seeded_gumbel(key[:, None], tie_ids.to(torch.int32))[0]
    target = float(2.0 + noise_of[0])
    v = torch.tensor(target) - noise_of[1]
    for _ in range(8):               # token 12's value whose score equals token 900's bit for bit
        if float(v + noise_of[1]) == target:
            break
        v = torch.nextafter(v, torch.tensor(math.inf if float(v + noise_of[1]) < target else -math.inf))
    assert float(v + noise_of[1]) == target
    assert kernels.seeded_candidates_settled(torch.tensor([[2.0, float(v)]]), tie_ids, key.numpy()) is None
    for bad in (float("nan"), float("inf")):
        assert kernels.seeded_candidates_settled(torch.tensor([[1.0, bad]]), tie_ids, key.numpy()) is None
    empty = torch.full((1, 2), float("-inf"))
    assert kernels.seeded_candidates_settled(empty, tie_ids, key.numpy()) is None
