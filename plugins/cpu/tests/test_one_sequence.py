"""The B = 1 routes of the cpu backend against the reference: filters judged on the few
candidates an earlier cut left (min-p inside top-k), with the reference's kept sets and
seeded tokens on rows built to reach every branch (ties, near-threshold tokens, dropped
tokens, spills past the candidate columns)."""

from __future__ import annotations

import math

import pytest
import torch
from corelib import Sampler, SamplingParams

from corelib_cpu import kernels
from corelib_cpu.sampler import CpuSampler
from corelib_cpu.select import min_p_of_candidates

NEG_INF = float("-inf")
REFERENCE = Sampler("cpu")


def rows_of_every_kind(V: int, seed: int) -> torch.Tensor:
    """float32 [6, V]: language-model-like, flat, rounded to bfloat16 (ties), rounded to
    integers (many ties), a third of the tokens dropped, and a row with a token on min-p
    0.05's threshold (after a temperature of 1)."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, V + 1, dtype=torch.float32)
    peaked = (-1.1 * torch.log(ranks) + 0.3 * torch.randn(V, generator=g))[torch.randperm(V, generator=g)]
    flat = torch.randn(V, generator=g) * 2.0
    dropped = torch.randn(V, generator=g) * 3.0
    dropped[: V // 3] = NEG_INF
    edge = torch.randn(V, generator=g)
    edge[7] = float(edge.max()) + 1.0
    edge[11] = edge[7] + math.log(0.05)          # x - max == ln(min_p), to float32 rounding
    return torch.stack([peaked, flat, peaked.bfloat16().float(), torch.round(flat), dropped, edge])


def one_request(sampler, V: int, params: SamplingParams):
    batch = sampler.new_batch(V)
    batch.add("r", params)
    return batch


CHAINS = [
    dict(top_k=40, top_p=0.95, min_p=0.05, temperature=0.8),
    dict(top_k=5, min_p=0.3, temperature=2.3),
    dict(top_k=300, min_p=0.01),
    dict(top_k=1, min_p=0.5, temperature=0.3),
    dict(top_k=40, min_p=1.0),
    dict(top_k=64, min_p=1e-20, top_p=0.5),
    dict(top_k=50, min_p=1e-30, temperature=0.7),      # below the candidates' floor: whole rows
    # min-p without top-k makes the candidates (one-row blocks, numba)
    dict(min_p=0.05),
    dict(min_p=0.3, temperature=2.3, top_p=0.8),
    dict(min_p=0.01, temperature=0.5),
    dict(min_p=1.0),
    dict(min_p=0.05, typical_p=0.9, temperature=0.9),
    dict(min_p=0.1, xtc_probability=1.0, xtc_threshold=0.05),
    dict(min_p=1e-20, temperature=1.5),                # too many candidates: the whole row
    dict(min_p=1e-20, top_p=0.9, temperature=0.8),     # the same, with top-p after
    # typical-p after the cut, on the candidates
    dict(top_k=40, typical_p=0.9),
    dict(top_k=50, top_p=0.95, typical_p=0.5, temperature=0.7),
    dict(top_k=1, typical_p=0.2),
    dict(top_k=300, min_p=0.01, typical_p=0.999),
]


def assert_as_the_reference(row: torch.Tensor, params: SamplingParams, steps: int, label: str) -> None:
    """One request on a fresh cpu sampler and on the reference: the same kept set, the same
    kept logits, and the same seeded token at each of ``steps`` positions."""
    V = row.shape[-1]
    cpu = CpuSampler()
    mine, ref = one_request(cpu, V, params), one_request(REFERENCE, V, params)
    got, want = cpu.processed_logits(row, mine), REFERENCE.processed_logits(row, ref)
    kept = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), kept), f"{label}: kept sets differ"
    assert torch.equal(got[kept], want[kept]), f"{label}: kept logits differ"
    for step in range(steps):
        a, b = cpu.step(row, mine), REFERENCE.step(row, ref)
        assert torch.equal(a.token_ids, b.token_ids), f"{label} step {step}: seeded tokens differ"


@pytest.mark.parametrize("V", [1000, 32000])
@pytest.mark.parametrize("chain", CHAINS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_min_p_inside_top_k_keeps_the_references_set_and_tokens(chain, V):
    logits = rows_of_every_kind(V, seed=V)
    for r in range(logits.shape[0]):
        row = logits[r:r + 1]
        params = SamplingParams(**chain, seed=1000 + r)
        assert_as_the_reference(row, params, steps=3, label=f"row {r}")


@pytest.mark.skipif(not kernels.wanted(), reason="the min-p route is compiled only")
def test_min_p_alone_runs_as_one_compiled_call_where_it_settles(monkeypatch):
    """A one-row min-p step whose block keeps its group maxima's numpy view (V a multiple of
    the group) makes its candidates in one compiled call (``kernels.min_p_chain``), with the
    reference's kept set and seeded tokens (the chains above check every kind of row);
    a row with a candidate on min-p's threshold is left to the steps one by one."""
    results = []
    chain = kernels.min_p_chain

    def counted(*args, **kwargs):
        out = chain(*args, **kwargs)
        results.append(out is not None)
        return out
    monkeypatch.setattr(kernels, "min_p_chain", counted)
    V = 32000
    logits = rows_of_every_kind(V, seed=3)
    for r, label in ((0, "peaked"), (5, "on the threshold")):
        results.clear()
        assert_as_the_reference(logits[r:r + 1], SamplingParams(min_p=0.05, seed=r), steps=3, label=label)
        assert results and all(results) == (label == "peaked"), (label, results)


def test_the_plan_judges_min_p_on_candidates_only_above_its_floor():
    V = 1000
    cpu = CpuSampler()
    row = rows_of_every_kind(V, 0)[:1]
    for min_p, expected in ((0.05, True), (1e-30, False)):
        batch = one_request(cpu, V, SamplingParams(top_k=40, min_p=min_p, temperature=0.8))
        cpu.sample(row, batch)
        plan = batch.cached_plan((1, cpu.block_elements // V, 1), lambda: None)
        assert plan.blocks[0].min_p_on_candidates is expected
    # a min-p row without top-k makes the candidates in a one-row block (with numba), and
    # reads whole rows in a block of several
    batch = one_request(cpu, V, SamplingParams(min_p=0.05))
    cpu.sample(row, batch)
    block = batch.cached_plan((1, cpu.block_elements // V, 1), lambda: None).blocks[0]
    assert block.min_p_makes_candidates is kernels.wanted()
    batch.add("other", SamplingParams(min_p=0.05))
    cpu.sample(row.expand(2, V), batch)
    block = batch.cached_plan((2, cpu.block_elements // V, 1), lambda: None).blocks[0]
    assert not block.min_p_on_candidates and not block.min_p_makes_candidates


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_min_p_candidates_give_the_references_logprobs(mode):
    V = 32000
    logits = rows_of_every_kind(V, seed=5)
    for r in range(logits.shape[0]):
        params = SamplingParams(min_p=0.05, temperature=0.7, logprobs=5, seed=r)
        outs = []
        for sampler in (CpuSampler(), REFERENCE):
            batch = sampler.new_batch(V, logprobs_mode=mode)
            batch.add("r", params)
            outs.append(sampler.sample(logits[r:r + 1], batch))
        got, want = outs
        assert torch.equal(got.token_ids, want.token_ids), r
        assert torch.equal(got.logprobs.ranks, want.logprobs.ranks), r
        # the same values; among tied ones (-inf past the kept set) the ids may differ
        assert torch.allclose(got.logprobs.logprobs, want.logprobs.logprobs, atol=1e-5), r
        assert got.logprobs.token_ids[0, 0] == want.logprobs.token_ids[0, 0], r


def test_candidates_near_min_ps_threshold_are_left_to_the_reference():
    values = torch.tensor([[2.0, 2.0 + math.log(0.05), 0.0, NEG_INF],
                           [2.0, 1.0, -1.5, NEG_INF],
                           [float("nan"), 1.0, 0.0, -1.0]])
    out, settled = min_p_of_candidates(values, torch.tensor([0.05, 0.05, 0.05]))
    assert settled.tolist() == [False, True, False]
    assert torch.isfinite(out[1]).tolist() == [True, True, False, False]   # -1.5 - 2 < ln 0.05


def test_small_steps_run_on_one_thread_and_restore_the_callers_count():
    V = 1000
    seen = []
    cpu = CpuSampler()
    original = cpu.draw
    cpu.draw = lambda *a: (seen.append(torch.get_num_threads()), original(*a))[1]
    batch = one_request(cpu, V, SamplingParams(top_k=40, seed=3))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        want = REFERENCE.sample(rows_of_every_kind(V, 1)[:1], one_request(REFERENCE, V, SamplingParams(top_k=40, seed=3)))
        got = cpu.sample(rows_of_every_kind(V, 1)[:1], batch)
        assert seen == [1] and torch.get_num_threads() == 2
        assert torch.equal(got.token_ids, want.token_ids)
        cpu.ONE_THREAD_ELEMENTS = 0                # the caller's threads on every step
        cpu.sample(rows_of_every_kind(V, 1)[:1], batch)
        assert seen == [1, 2]
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not kernels.wanted(), reason="the candidates' typical set is compiled (numba)")
def test_typical_after_a_cut_reads_the_candidates_and_keeps_the_references_set(monkeypatch):
    """Typical-p on top-k's candidates: the reference's kept set on many rows and parameters,
    most rows settled by the candidates alone, most of those inside the one compiled call of
    steps 11-13a (``kernels.candidate_chain``); the rest, a prefix mass on typical_p among
    them, by the whole row."""
    from corelib_cpu import filter_stages
    applied, whole, chained = [], [], []
    real_apply, real_whole, real_chain = CpuSampler.apply_typical_p, filter_stages.typical_rows_, kernels.candidate_chain

    def apply(self, x, s):
        applied.append(x.plan.typical_p_rows)
        return real_apply(self, x, s)

    def whole_rows(*args):
        whole.append(len(applied))
        return real_whole(*args)

    def chain(*args, **kwargs):
        out = real_chain(*args, **kwargs)
        chained.append(out is not None)
        return out
    monkeypatch.setattr(CpuSampler, "apply_typical_p", apply)
    monkeypatch.setattr(filter_stages, "typical_rows_", whole_rows)
    monkeypatch.setattr(kernels, "candidate_chain", chain)
    V = 32000
    g = torch.Generator().manual_seed(4)
    for r in range(60):
        logits = rows_of_every_kind(V, seed=r)[r % 6:r % 6 + 1]
        k = int(torch.randint(1, 80, (1,), generator=g))
        typical = (0.2, 0.5, 0.9, 0.95, 0.999)[r % 5]
        params = SamplingParams(top_k=k, typical_p=typical, temperature=(1.0, 0.6, 1.7)[r % 3], seed=r)
        if r == 59:                                  # a prefix mass exactly on typical_p
            params = SamplingParams(top_k=2, typical_p=0.5, seed=r)
            logits = torch.full((1, V), NEG_INF)
            logits[0, :2] = 0.0
        assert_as_the_reference(logits, params, steps=1, label=f"row {r}")
    assert len(applied) == 120 and all(rows == [0] for rows in applied)
    settled = len(applied) - len(set(whole))
    assert settled >= 0.8 * len(applied) and sum(chained) >= 0.6 * len(applied), (settled, sum(chained))
    assert whole[-1] == len(applied)                 # the exact prefix mass: the whole row


@pytest.mark.parametrize("params", [dict(top_k=40), dict(temperature=0.0), dict(min_p=0.05), dict(top_p=0.9, seed=3)],
                         ids=["top_k", "greedy", "min_p", "top_p"])
def test_few_row_blocks_flag_nan_inf_and_empty_rows_as_the_reference(params):
    """Blocks of one and two rows check their rows' maxima on the host (``any_token_left``):
    a row holding NaN, one holding +inf and one of -inf only are flagged as the reference
    flags them, a valid row beside them samples the reference's way, and append of the
    step's ids advances the valid rows only."""
    V = 4096
    logits = torch.randn((4, V), generator=torch.Generator().manual_seed(2))
    logits[0, 17] = float("nan")
    logits[1, 5] = float("inf")
    logits[2] = NEG_INF
    for rows in (1, 2):
        cpu = CpuSampler(block_elements=rows * V)
        for r in range(4):
            row = logits[r:r + 1].expand(rows, V).contiguous()
            mine, ref = cpu.new_batch(V), REFERENCE.new_batch(V)
            for i in range(rows):
                mine.add(f"r{i}", SamplingParams(**params))
                ref.add(f"r{i}", SamplingParams(**params))
            got, want = cpu.sample(row, mine), REFERENCE.sample(row, ref)
            assert torch.equal(got.valid, want.valid), (rows, r)
            assert torch.equal(got.token_ids[~want.valid], want.token_ids[~want.valid]), (rows, r)
            if "seed" in params or params.get("temperature") == 0.0:
                assert torch.equal(got.token_ids, want.token_ids), (rows, r)
            # the step's ids go to append as they came (marked on the batch when every row
            # was valid): flagged rows stay where they were, the others advance
            mine.append(got.token_ids)
            assert mine.generated_counts() == [int(v) for v in want.valid.tolist()], (rows, r)


@pytest.mark.parametrize("params", [dict(top_k=40), dict(top_k=40, seed=5), dict(temperature=0.0)],
                         ids=["top_k", "top_k_seeded", "greedy"])
def test_each_step_returns_tensors_of_its_own(params):
    """A B = 1 step's ids and valid flags are new tensors (the race's own, or made for the
    step): writing one step's output never changes another's, nor the next step."""
    V = 4096
    logits = torch.randn((2, V), generator=torch.Generator().manual_seed(6))
    cpu = CpuSampler()
    batch = one_request(cpu, V, SamplingParams(**params))
    first = cpu.step(logits[:1], batch)
    second = cpu.step(logits[1:], batch)
    kept = (first.token_ids.clone(), second.token_ids.clone())
    first.valid[0] = False
    first.token_ids[0] = -1
    assert second.valid.tolist() == [True] and torch.equal(second.token_ids, kept[1])
    third = cpu.step(logits[:1], batch)
    assert third.valid.tolist() == [True] and 0 <= int(third.token_ids[0]) < V
    assert batch.generated_counts() == [3]


@pytest.mark.parametrize("params", [dict(top_k=40), dict(top_k=40, seed=5), dict(temperature=0.0)],
                         ids=["top_k", "top_k_seeded", "greedy"])
def test_step_outputs_stay_the_callers_over_many_steps_and_across_inference_mode(params):
    """The ids and valid flags of many steps (past the chunks ``Workspace.fresh`` makes at a
    time) are each their own: writing any of them leaves every other as it came. A step under
    ``torch.inference_mode`` and the next outside it both return tensors the caller may
    write outside it."""
    V = 1 << 17                    # past ARGMAX_ELEMENTS: greedy takes the compiled search
    logits = torch.randn((4, V), generator=torch.Generator().manual_seed(7))
    cpu = CpuSampler()
    batch = one_request(cpu, V, SamplingParams(**params))
    outputs = [cpu.step(logits[i % 4:i % 4 + 1], batch) for i in range(150)]
    assert all(out.valid.tolist() == [True] for out in outputs)
    for i, out in enumerate(outputs):
        out.token_ids.fill_(i)
        out.valid.fill_(i % 2 == 0)
    for i, out in enumerate(outputs):
        assert out.token_ids.tolist() == [i] and out.valid.tolist() == [i % 2 == 0], i
    cpu = CpuSampler()                       # its first outputs made under inference mode
    batch = one_request(cpu, V, SamplingParams(**params))
    with torch.inference_mode():
        inside = cpu.step(logits[:1], batch)
    outside = cpu.step(logits[1:2], batch)
    outside.token_ids.add_(0)
    outside.valid.logical_and_(outside.valid)
    assert 0 <= int(inside.token_ids[0]) < V and 0 <= int(outside.token_ids[0]) < V


@pytest.mark.skipif(not kernels.wanted(), reason="the candidates' typical-p is compiled only")
def test_typical_on_candidates_settles_by_the_candidates_margin_and_keeps_the_references_set():
    """The score margin follows the candidates' count (``select.typical_score_margin``): rows
    whose nearest score lies between it and the old fixed margin (2^-12) are settled now, and
    every row's kept set is still the reference's, on language-model-like rows, rows rounded
    to bfloat16 (ties) and flat rows, over many top-k, temperatures and typical_p."""
    from corelib.filter_stages import typical_keep
    from corelib_cpu.select import TYPICAL_LOWEST, TYPICAL_MASS_MARGIN, typical_candidates
    V = 4096
    g = torch.Generator().manual_seed(35)
    newly, settled_rows = 0, 0
    for r in range(500):
        k = int(torch.randint(2, 200, (1,), generator=g))
        t = float(torch.empty(1).uniform_(0.3, 2.0, generator=g))
        tp = float(torch.empty(1).uniform_(0.05, 0.99, generator=g))
        row = rows_of_every_kind(V, seed=r)[(0, 1, 2)[r % 3]] / t
        kth = torch.topk(row, k).values[-1]
        values = torch.sort(row[row >= kth], descending=True).values[None]     # ties at the k-th kept
        cand = torch.cat([values, torch.full((1, 8), NEG_INF)], dim=1)
        found = typical_candidates(cand, torch.tensor([tp]))
        old = kernels.typical_of_candidates(cand, torch.tensor([tp]), TYPICAL_MASS_MARGIN, 2.0 ** -12, TYPICAL_LOWEST)
        if not bool(found[1][0]):
            continue
        settled_rows += 1
        newly += not bool(old[1][0])
        masked = torch.full((1, V), NEG_INF)
        masked[0, row >= kth] = row[row >= kth]
        want = typical_keep(masked, torch.tensor([tp])) & torch.isfinite(masked)
        kept_values = found[0][0][torch.isfinite(found[0][0])]
        assert torch.equal(torch.sort(masked[want]).values, torch.sort(kept_values).values), f"row {r}"
    assert settled_rows >= 400 and newly >= 8, (settled_rows, newly)


def test_typical_score_margin_bounds_the_references_rounding():
    """``select.typical_score_margin(W)`` is eight times E, the bound on how far the reference's
    float32 score ``|-log p - H|`` of a token lies from its exact value, relative to
    1 + H + |log p|, when W candidates are all the row keeps. Measured here against float64 on
    language-model-like, bfloat16-tied and flat rows, several temperatures and cuts: every
    token's error is within E, so a margin below it (0 included) fails."""
    from corelib_cpu.select import typical_score_margin
    V = 4096
    g = torch.Generator().manual_seed(36)
    worst = 0.0
    for r in range(150):
        k = int(torch.randint(2, 400, (1,), generator=g))
        t = float(torch.empty(1).uniform_(0.3, 2.0, generator=g))
        row = rows_of_every_kind(V, seed=r)[(0, 1, 2)[r % 3]] / t
        kth = torch.topk(row, k).values[-1]
        masked = torch.where(row >= kth, row, NEG_INF)[None]
        W = int(torch.isfinite(masked).sum())
        logp = torch.log_softmax(masked, dim=-1)            # the reference's float32 score
        p = logp.exp()
        entropy = -torch.where(p > 0, p * logp, 0.0).sum(dim=-1, keepdim=True)
        score = (-logp - entropy).abs()
        exact_logp = torch.log_softmax(masked.double(), dim=-1)
        exact_p = exact_logp.exp()
        exact_entropy = -torch.where(exact_p > 0, exact_p * exact_logp, 0.0).sum(dim=-1, keepdim=True)
        exact = (-exact_logp - exact_entropy).abs()
        kept = (p > 0) & torch.isfinite(masked)
        scale = 1.0 + exact_entropy + exact_logp.abs()
        error = ((score.double() - exact).abs() / scale)[kept]
        E = typical_score_margin(W) / 8
        assert float(error.max()) <= E, (r, W, float(error.max()), E)
        worst = max(worst, float(error.max()) / E)
    assert worst > 0.0       # the rows do round: the bound is tested, not vacuous (the
    # largest error measured is about 2% of E: the bound holds with room)


@pytest.mark.parametrize("params", [dict(top_k=40), dict(temperature=0.0), dict(top_k=40, seed=4)],
                         ids=["top_k", "greedy", "top_k seeded"])
def test_one_row_steps_known_valid_on_the_host_return_flags_of_their_own(params):
    """A one-row step whose rows the host knows to be valid returns new all-true flags and the
    drawn ids (``CpuSampler.flag_invalid``): the caller may write them without touching the
    next step's; a row flagged between two such steps (NaN logits, then a drawn logit that
    overflowed float32) is flagged as the reference flags it, on the same sampler and batch."""
    V = 70000
    g = torch.Generator().manual_seed(6)
    good = torch.randn((1, V), generator=g)
    nan = good.clone()
    nan[0, 11] = float("nan")
    huge = good.clone()
    huge[0, :3] = 3e38          # finite logits whose division by the temperature overflows
    cpu = CpuSampler()
    mine, ref = cpu.new_batch(V), REFERENCE.new_batch(V)
    both = dict(params, temperature=params.get("temperature", 0.5))
    mine.add("r", SamplingParams(**both))
    ref.add("r", SamplingParams(**both))
    earlier, valid = None, []
    for step, logits in enumerate((good, nan, good, huge, good)):
        got, want = cpu.sample(logits, mine), REFERENCE.sample(logits, ref)
        valid.append(bool(got.valid[0]))
        assert torch.equal(got.valid, want.valid), step
        assert torch.equal(got.token_ids[~want.valid], want.token_ids[~want.valid]), step
        if "seed" in params or both["temperature"] == 0.0:
            assert torch.equal(got.token_ids, want.token_ids), step
        if earlier is not None:
            keep = (earlier.valid.clone(), earlier.token_ids.clone())
            got.valid.fill_(False)
            got.token_ids.fill_(-7)
            assert torch.equal(earlier.valid, keep[0]) and torch.equal(earlier.token_ids, keep[1]), step
        earlier = got
        append = want.token_ids.clamp(min=0)
        mine.append(append)
        ref.append(append)
    assert valid[0] and not valid[1] and valid[2] and valid[4]
    assert valid[3] == (both["temperature"] == 0.0)      # greedy rows divide by nothing


@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(top_k=40, seed=5), dict(top_k=3, temperature=0.5, seed=6),
                                    dict(min_p=0.05, seed=7), dict(top_k=40, min_p=0.05, top_p=0.9, temperature=0.8)],
                         ids=["greedy", "top_k seeded", "top_k T seeded", "min_p seeded", "defaults"])
def test_one_row_maxima_read_on_the_host_keep_the_references_bits(params):
    """One-row blocks read their row maximum from the group maxima's numpy view
    (``rows_valid_on_host``); a row whose maximum is zero, held as +0 and -0 in either
    order, a row of one finite token, and ordinary rows give the reference's kept logits (the
    sign of zero included) and, seeded or greedy, its tokens."""
    V = 70000
    g = torch.Generator().manual_seed(8)
    rows = []
    for first, second in ((0.0, -0.0), (-0.0, 0.0), (-0.0, -0.0)):
        row = -torch.rand(V, generator=g) * 5.0 - 0.5
        row[300], row[40000] = first, second
        rows.append(row)
    lone = torch.full((V,), NEG_INF)
    lone[12345] = -3.0
    rows += [lone, torch.randn(V, generator=g), torch.randn(V, generator=g) * 4.0 - 20.0]
    for r, row in enumerate(rows):
        row = row[None, :]
        cpu = CpuSampler()
        mine = one_request(cpu, V, SamplingParams(**params))
        ref = one_request(REFERENCE, V, SamplingParams(**params))
        got, want = cpu.processed_logits(row, mine), REFERENCE.processed_logits(row, ref)
        assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want)), r
        for step in range(3):
            a, b = cpu.step(row, mine), REFERENCE.step(row, ref)
            assert torch.equal(a.valid, b.valid), (r, step)
            if "seed" in params or params.get("temperature") == 0.0:
                assert torch.equal(a.token_ids, b.token_ids), (r, step)
