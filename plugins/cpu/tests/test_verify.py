"""Verification on the cpu backend beyond the shared suite: seeded rows emit the reference's
tokens whether a ratio test is settled by the candidates' softmax or by the reference's, with
drafts close to the target (many acceptances, several slots judged per row); the check of the
draft probabilities; each slot's penalty slots; verify's ``[rows, K+1]`` appends."""

from __future__ import annotations

import pytest
import torch
from corelib import Sampler, SamplingParams

from corelib_cpu.batch import CpuBatch
from corelib_cpu.block import Cut
from corelib_cpu.judge import SlotJudge
from corelib_cpu.sampler import CpuSampler

V = 3000
K = 3


def build(sampler, requests):
    batch = sampler.new_batch(V)
    for rid, params, prompt in requests:
        batch.add(rid, params, prompt_token_ids=prompt)
    return batch


def close_drafts(logits: torch.Tensor, g: torch.Generator):
    """Draft ids and probabilities from a distribution near the target's, so most drafts
    pass and rows are judged at several slots."""
    B = logits.shape[0]
    q = torch.softmax(logits[:, :K] + 0.3 * torch.randn((B, K, V), generator=g), dim=-1)
    ids = torch.stack([torch.multinomial(q[:, j], 1, generator=g)[:, 0] for j in range(K)], dim=1)
    return ids, q


@pytest.mark.parametrize("tolerance", [None, 1.0], ids=["bound", "always-exact"])
def test_seeded_rows_emit_the_references_tokens_with_close_drafts(monkeypatch, tolerance):
    if tolerance is not None:                      # every seeded decision takes the reference's softmax
        original = SlotJudge.__init__

        def exact_init(self, *args):
            original(self, *args)
            self.tolerance = tolerance
        monkeypatch.setattr(SlotJudge, "__init__", exact_init)
    requests = [(f"k{i}", SamplingParams(seed=10 + i, top_k=20, temperature=0.8), [1, 2]) for i in range(4)]
    requests += [(f"p{i}", SamplingParams(seed=20 + i, top_p=0.9, min_p=0.01), [3]) for i in range(3)]
    requests += [("w", SamplingParams(seed=30, repetition_penalty=1.3), [5, 5, 6]),
                 ("g", SamplingParams(temperature=0.0), [7])]
    cpu, reference = CpuSampler(block_elements=3 * V * (K + 1)), Sampler("cpu")
    mine, ref = build(cpu, requests), build(reference, requests)
    g = torch.Generator().manual_seed(0)
    accepted = 0
    for step in range(6):
        logits = torch.randn((len(requests), K + 1, V), generator=g) * 2
        ids, q = close_drafts(logits, g)
        got, want = cpu.verify(logits, mine, ids, q), reference.verify(logits, ref, ids, q)
        assert torch.equal(got.token_ids, want.token_ids), f"step {step}"
        assert torch.equal(got.num_emitted, want.num_emitted)
        accepted += int((got.num_emitted > 1).sum())
        mine.append(got.token_ids)
        ref.append(want.token_ids)
    assert accepted > 10                            # the slots past the first were judged


def test_draft_probabilities_check_matches_the_references():
    q = torch.rand((4, 3, 200))
    q[0, 0, 5] = float("nan")
    q[0, 1, 3] = -float("nan")
    q[1, 0, 0] = float("inf")
    q[1, 1, 0] = -float("inf")
    q[2, 0, 9] = -0.0                               # sane: -0.0 >= 0
    q[2, 1, 9] = -1e-30
    q[3, 2, 4] = 3e38                               # huge but finite: sane
    got = CpuSampler().draft_probs_sane(q)
    assert torch.equal(got, Sampler().draft_probs_sane(q))
    assert got.tolist() == [[False, False, True], [False, False, True], [True, False, True],
                            [True, True, True]]


def test_each_slot_carries_the_penalty_slots_after_its_drafts():
    batch = CpuBatch(V)
    batch.add("a", SamplingParams(frequency_penalty=0.5), [1, 2, 3], [4, 4])
    batch.add("plain", SamplingParams(), [9])
    batch.add("b", SamplingParams(presence_penalty=1.0, n=2), [7])
    drafts = torch.tensor([[4, 8, 8], [1, 2, -1], [7, 3, 3], [5, -1, -1]])
    s = batch.speculative_state(drafts, slots_only=True)
    assert s.prompt_mask is None and s.output_counts is None      # no [B (K+1), V] copies
    for row in range(batch.num_rows):
        for j in range(K + 1):
            after = CpuBatch(V)
            after.add("a", SamplingParams(frequency_penalty=0.5), [1, 2, 3], [4, 4])
            after.add("plain", SamplingParams(), [9])
            after.add("b", SamplingParams(presence_penalty=1.0, n=2), [7])
            for i in range(j):
                column = drafts[:, i].clone()
                column[column < 0] = 0
                after.append(column)
            ids, counts, length = after.penalty_slots(after.num_rows)
            want = dict(zip(ids[row, : length[row]].tolist(), counts[row, : length[row]].tolist()))
            v = row * (K + 1) + j
            n = int(s.slot_len[v])
            got = dict(zip(s.slot_ids[v, :n].tolist(), s.slot_counts[v, :n].tolist()))
            if (drafts[row, :j] < 0).any():
                continue                            # padding stops the row's slots
            assert got == want, f"row {row} slot {j}"


def test_verify_appends_update_the_penalty_slots_like_the_dense_state():
    batch = CpuBatch(V)
    batch.add("a", SamplingParams(frequency_penalty=0.5), [1, 2], [4])
    batch.add("b", SamplingParams(presence_penalty=1.0), [7])
    batch.add("plain", SamplingParams(), [])
    batch.append(torch.tensor([[4, 9, 9, -1], [3, -1, -1, -1], [1, 2, 3, 4]]))
    ids, counts, length = batch.penalty_slots(batch.num_rows)
    s = batch.step_state()
    for row in range(2):
        got = dict(zip(ids[row, : length[row]].tolist(), counts[row, : length[row]].tolist()))
        seen = (s.prompt_mask[row] | (s.output_counts[row] > 0)).nonzero().flatten().tolist()
        assert got == {t: int(s.output_counts[row, t]) for t in seen}
    assert int(length[2]) == 0


def nucleus_distribution(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The reference's top-p distribution of one row, by its rule: keep the tokens whose
    mass strictly before them (sorted, descending) is < top_p, renormalise."""
    p = torch.softmax(logits.double(), dim=-1)
    ordered, order = torch.sort(p, descending=True)
    keep = (ordered.cumsum(0) - ordered) < top_p
    kept = torch.zeros_like(p).index_put_((order[keep],), ordered[keep])
    return kept / kept.sum()


def test_top_p_rows_judged_before_their_threshold_keep_the_target_distribution(monkeypatch):
    """Unseeded whole rows with top-p: a slot's ratio test is settled from the probabilities
    before the cut and bounds on the nucleus mass where it can be (SlotJudge.bounded_test),
    so passed slots never find their threshold; the emitted tokens still follow the
    top-p target (chi-square, fixed seeds, p > 1e-6), and draft 0 is accepted at the rate
    sum(min(p, q)) (5 sigma)."""
    from corelib.testing.rules import chi_square_p_value
    Vs, Ks, R, top_p = 16, 2, 4000, 0.8
    gen = torch.Generator().manual_seed(70)
    target = torch.randn((Ks + 1, Vs), generator=gen) * 1.2
    q = torch.softmax(target[:Ks] + 0.8 * torch.randn((Ks, Vs), generator=gen), dim=-1)
    drafts = torch.stack([torch.multinomial(q[j], R, replacement=True, generator=gen)
                          for j in range(Ks)], dim=1)
    sampler = CpuSampler(generator=torch.Generator().manual_seed(71))
    batch = sampler.new_batch(Vs)
    for i in range(R):
        batch.add(f"r{i}", SamplingParams(top_p=top_p))
    resolved = []
    resolve = Cut.resolve
    monkeypatch.setattr(Cut, "resolve",
                        lambda self, at, workspace: (resolved.append(len(self.pending(at))),
                                                     resolve(self, at, workspace))[1])
    out = sampler.verify(target.expand(R, -1, -1).contiguous(), batch, drafts,
                         q.expand(R, -1, -1).contiguous())
    ids, count = out.token_ids, out.num_emitted
    p = [nucleus_distribution(target[j], top_p) for j in range(Ks)]
    for slot, rows in ((0, count >= 1), (1, count >= 2)):
        observed = torch.bincount(ids[rows, slot], minlength=Vs)
        assert observed[p[slot] == 0].sum() == 0, f"slot {slot} emitted a token outside the nucleus"
        assert chi_square_p_value(observed, p[slot]) > 1e-6, f"slot {slot}: {observed.tolist()}"
    accepted = (count >= 2).double().mean()
    expected = torch.minimum(p[0], q[0].double()).sum()
    assert abs(accepted - expected) <= 5 * (expected * (1 - expected) / R).sqrt()
    passed = int((count - 1).sum())
    rejected = int((count <= Ks).sum())
    print(f"passed {passed}, rejected {rejected}, thresholds found {sum(resolved)}")
    # a rejected slot draws from its residual (which needs the threshold) and a few slots fall
    # between the bounds or draw their bonus token outside the nucleus first; passed ones not
    assert sum(resolved) < rejected + passed // 4


def test_seeded_top_p_rows_settled_by_bounds_emit_the_references_tokens():
    """Seeded whole rows with top-p whose ratio tests are settled by nucleus-mass bounds
    (``SlotJudge.bounded_test``) emit exactly the reference's tokens: many rows, drafts close
    to the target, so many tests fall near p(d) where a wrong bound would flip them."""
    Vs, R = 64, 600
    g = torch.Generator().manual_seed(72)
    requests = [(f"p{i}", SamplingParams(seed=500 + i, top_p=0.8, temperature=0.9), []) for i in range(R)]
    cpu, reference = CpuSampler(), Sampler("cpu")
    mine, ref = cpu.new_batch(Vs), reference.new_batch(Vs)
    for rid, params, _ in requests:
        mine.add(rid, params)
        ref.add(rid, params)
    logits = torch.randn((R, K + 1, Vs), generator=g) * 2
    q = torch.softmax(logits[:, :K] / 0.9 + 0.2 * torch.randn((R, K, Vs), generator=g), dim=-1)
    ids = torch.stack([torch.multinomial(q[:, j], 1, generator=g)[:, 0] for j in range(K)], dim=1)
    got, want = cpu.verify(logits, mine, ids, q), reference.verify(logits, ref, ids, q)
    differ = (got.token_ids != want.token_ids).any(dim=1).nonzero()[:, 0].tolist()
    assert not differ, f"rows {differ[:10]} differ from the reference"
    assert torch.equal(got.num_emitted, want.num_emitted)
    assert int((got.num_emitted > 2).sum()) > R // 4            # later slots were judged too


def test_draft_slots_left_undrawn_flag_and_stop_like_the_reference():
    """With draft probabilities a random row's draft slots are not drawn (their draw is never
    read); their overflow check then reads the row's largest logit. Seeded rows, one slot
    overflowing to +inf after temperature, one slot of NaN logits, one clean: emitted ids,
    counts and flags equal the reference's."""
    Vs = 500
    g = torch.Generator().manual_seed(73)
    requests = [(f"s{i}", SamplingParams(seed=600 + i, temperature=0.5, top_p=[1.0, 0.9, 0.9, 1.0][i],
                                         min_p=[0.0, 0.0, 0.05, 0.0][i]), []) for i in range(4)]
    cpu, reference = CpuSampler(block_elements=2 * Vs * (K + 1)), Sampler("cpu")
    mine, ref = cpu.new_batch(Vs), reference.new_batch(Vs)
    for rid, params, _ in requests:
        mine.add(rid, params)
        ref.add(rid, params)
    logits = torch.randn((4, K + 1, Vs), generator=g)
    q = torch.softmax(logits[:, :K] / 0.5, dim=-1)                      # drafts that mostly pass
    ids = torch.stack([torch.multinomial(q[:, j], 1, generator=g)[:, 0] for j in range(K)], dim=1)
    logits[0, 1, 7] = 3e38                                               # +inf after T = 0.5
    logits[1, 2, 9] = 3e38
    logits[2, 0, 3] = float("nan")                                       # no token at slot 0
    got, want = cpu.verify(logits, mine, ids, q), reference.verify(logits, ref, ids, q)
    assert torch.equal(got.token_ids, want.token_ids)
    assert torch.equal(got.num_emitted, want.num_emitted)
    assert torch.equal(got.valid, want.valid)
    assert got.valid.tolist() == [True, True, False, True]


# ---------------------------------------------------------------------- block verification
def block_requests() -> list:
    """Seeded rows of every kind the judge reads differently (candidate rows, whole rows
    with a pending top-p cut or a min-p cut, plain whole rows, a forced thinking row) and a
    greedy row."""
    think = dict(thinking_budget=0, thinking_start_token_ids=[200], thinking_end_token_ids=[201])
    return [(f"k{i}", SamplingParams(seed=40 + i, top_k=20, temperature=0.8), [1, 2]) for i in range(3)]\
        + [(f"p{i}", SamplingParams(seed=50 + i, top_p=0.9), [3]) for i in range(2)]\
        + [("m", SamplingParams(seed=60, min_p=0.02, temperature=1.2), []),
           ("w", SamplingParams(seed=61, frequency_penalty=0.4), [5, 5, 6]),
           ("kp", SamplingParams(seed=62, top_k=40, top_p=0.8), []),
           ("forced", SamplingParams(seed=63, **think), [200]),
           ("g", SamplingParams(temperature=0.0), [7])]


@pytest.mark.parametrize("rows_per_block", [1, 3, 100])
@pytest.mark.parametrize("closeness", [0.3, 2.0], ids=["close-drafts", "far-drafts"])
def test_block_verification_of_seeded_rows_emits_the_references_tokens(rows_per_block, closeness):
    """Seeded rows verified as a block emit exactly the reference's tokens over several steps
    (drafts near the target: long accepted prefixes and residuals at late slots; far from it:
    stops at early slots), with short rows (-1 padding), a slot without a token (NaN), in
    blocks of 1, 3 and all rows."""
    requests = block_requests()
    cpu, reference = CpuSampler(block_elements=rows_per_block * V * (K + 1)), Sampler("cpu")
    mine, ref = build(cpu, requests), build(reference, requests)
    g = torch.Generator().manual_seed(80)
    stops = set()
    for step in range(5):
        logits = torch.randn((len(requests), K + 1, V), generator=g) * 2
        q = torch.softmax(logits[:, :K] + closeness * torch.randn((len(requests), K, V), generator=g), dim=-1)
        ids = torch.stack([torch.multinomial(q[:, j], 1, generator=g)[:, 0] for j in range(K)], dim=1)
        ids[1, 2:] = -1                                            # a short row
        logits[2, 2, 9] = float("nan")                             # row k2 stops before slot 2
        got = cpu.verify(logits, mine, ids, q, method="block")
        want = reference.verify(logits, ref, ids, q, method="block")
        assert torch.equal(got.token_ids, want.token_ids), f"step {step}"
        assert torch.equal(got.num_emitted, want.num_emitted), f"step {step}"
        assert torch.equal(got.valid, want.valid)
        stops |= set(got.num_emitted.tolist())
        mine.append(got.token_ids)
        ref.append(want.token_ids)
    assert stops >= ({1, 2, 3, 4} if closeness < 1 else {1, 2})


def test_block_verification_sums_residuals_only_from_the_longest_prefix_down(monkeypatch):
    """The judge tests the longest prefix first: when drafts are the target's own draws most
    rows keep them all (h_k = w_k = 1 needs no residual), so far fewer residual masses are
    summed than the reference's one per slot."""
    from corelib_cpu.judge import BlockJudge
    summed = []
    residual = BlockJudge.residual
    monkeypatch.setattr(BlockJudge, "residual",
                        lambda self, r, i, w: (summed.append((r, i)), residual(self, r, i, w))[1])
    R = 40
    cpu = CpuSampler()
    batch = cpu.new_batch(V)
    for i in range(R):
        batch.add(f"r{i}", SamplingParams(seed=90 + i))
    g = torch.Generator().manual_seed(91)
    logits = torch.randn((R, K + 1, V), generator=g)
    q = torch.softmax(logits[:, :K], dim=-1)                      # drafts from the target itself
    ids = torch.stack([torch.multinomial(q[:, j], 1, generator=g)[:, 0] for j in range(K)], dim=1)
    out = cpu.verify(logits, batch, ids, q, method="block")
    assert bool((out.num_emitted == K + 1).all())                 # p = q: every draft kept
    assert summed == []


@pytest.mark.parametrize("kind", ["candidates", "whole-top-p"])
def test_unseeded_block_verification_keeps_the_target_distribution(kind):
    """Unseeded rows verified as a block: candidate rows judge with the candidates' softmax,
    whole rows with the reference's; either way every row's two-token sequence follows the
    filtered target p_0 x p_1 (chi-square, fixed seeds, p > 1e-6; the shared suite checks
    plain rows at V = 8)."""
    from corelib.testing.rules import chi_square_p_value
    Vs, Ks, R = 600, 2, 6000
    params = SamplingParams(top_k=4, temperature=0.9) if kind == "candidates" else SamplingParams(top_p=0.7)
    gen = torch.Generator().manual_seed(92)
    target = torch.full((Ks + 1, Vs), -4.0)
    target[:, :6] = torch.randn((Ks + 1, 6), generator=gen)       # the mass on a few tokens
    reference = Sampler("cpu")
    ref_batch = reference.new_batch(Vs)
    for j in range(Ks + 1):
        ref_batch.add(f"slot{j}", params)
    p = torch.softmax(reference.processed_logits(target, ref_batch), dim=-1)   # filtered, per slot
    q = torch.softmax(target[:Ks] + torch.randn((Ks, Vs), generator=gen), dim=-1)
    drafts = torch.stack([torch.multinomial(q[j], R, replacement=True, generator=gen)
                          for j in range(Ks)], dim=1)
    cpu = CpuSampler(generator=torch.Generator().manual_seed(93))
    batch = cpu.new_batch(Vs)
    for i in range(R):
        batch.add(f"r{i}", params)
    out = cpu.verify(target.expand(R, -1, -1).contiguous(), batch, drafts,
                     q.expand(R, -1, -1).contiguous(), method="block")
    ids, count = out.token_ids, out.num_emitted
    second = torch.multinomial(p[1], R, replacement=True, generator=torch.Generator().manual_seed(94))
    second = torch.where(count >= 2, ids[:, 1], second)
    pairs = torch.bincount(ids[:, 0] * Vs + second, minlength=Vs * Vs)
    expected = (p[0][:, None] * p[1][None, :]).flatten()
    assert int(pairs[expected == 0].sum()) == 0, "a sequence outside the filtered target"
    kept = expected > 0
    assert chi_square_p_value(pairs[kept], expected[kept]) > 1e-6
    assert float((count >= 2).double().mean()) > 0.3                # blocks were kept, not only stops


@pytest.mark.parametrize("drafts_from", ["target", "uniform"])
def test_seeded_candidate_rows_settled_by_bounds_skip_the_references_softmax(monkeypatch, drafts_from):
    """Seeded top-k rows first judge with bounds from their candidates' softmax: drafts drawn
    from the target itself keep every draft (tau = k) and drafts from a uniform distribution
    keep none (tau = 0, the residual at slot 0) without the reference's softmax at the other
    slots, and the tokens stay the reference's."""
    from corelib_cpu.judge import BlockJudge
    softmaxed = []
    dense = BlockJudge.dense_probs
    monkeypatch.setattr(BlockJudge, "dense_probs", lambda self, whole, candidates: (
        softmaxed.append(len(whole) + len(candidates)), dense(self, whole, candidates))[1])
    exact = BlockJudge.exact
    monkeypatch.setattr(BlockJudge, "exact", lambda self, row: (softmaxed.append(1), exact(self, row))[1])
    R = 30
    requests = [(f"k{i}", SamplingParams(seed=100 + i, top_k=8, temperature=0.9), []) for i in range(R)]
    cpu, reference = CpuSampler(), Sampler("cpu")
    mine, ref = build(cpu, requests), build(reference, requests)
    g = torch.Generator().manual_seed(101)
    logits = torch.randn((R, K + 1, V), generator=g) * 3
    target = torch.softmax(reference.processed_logits(logits.view(R * (K + 1), V), build(reference, [
        (f"t{i}", SamplingParams(top_k=8, temperature=0.9), []) for i in range(R * (K + 1))])), dim=-1)
    if drafts_from == "target":
        q = target.view(R, K + 1, V)[:, :K].contiguous()
    else:
        q = torch.full((R, K, V), 1.0 / V)
    ids = torch.stack([torch.multinomial(q[:, j], 1, generator=g)[:, 0] for j in range(K)], dim=1)
    got = cpu.verify(logits, mine, ids, q, method="block")
    want = reference.verify(logits, ref, ids, q, method="block")
    assert torch.equal(got.token_ids, want.token_ids)
    if drafts_from == "target":
        assert int((got.num_emitted == K + 1).sum()) >= R - 2      # p = q up to rounding
        assert sum(softmaxed) <= 2 * K
    else:
        assert got.num_emitted.tolist() == [1] * R
        assert sum(softmaxed) == R                                  # slot 0's, for its residual


@pytest.mark.parametrize("kind", ["candidates", "pending-top-p"])
def test_seeded_rows_on_the_edge_of_their_bounds_take_the_references_softmax(monkeypatch, kind):
    """Uniforms set to the reference's own w_k (the largest float32 not above it: the whole
    span's test passes there, by a hair): neither the candidates' softmax nor the
    probabilities before a pending top-p cut can settle such a test, so the row must take the
    reference's p, and keep every draft as the reference does."""
    from corelib.noise import STREAM_BLOCK
    R = 24
    reference = Sampler("cpu")
    params = SamplingParams(top_k=6, temperature=0.9) if kind == "candidates" else SamplingParams(top_p=0.6)
    g = torch.Generator().manual_seed(102)
    logits = torch.randn((R, K + 1, V), generator=g) * 2
    slots = reference.new_batch(V)
    for i in range(R * (K + 1)):
        slots.add(f"t{i}", params)
    p = torch.softmax(reference.processed_logits(logits.view(R * (K + 1), V), slots), dim=-1)
    p = p.view(R, K + 1, V)
    q = torch.softmax(p[:, :K].log() + 0.3 * torch.randn((R, K, V), generator=g), dim=-1)   # on the kept set
    ids = torch.stack([torch.multinomial(q[:, j], 1, generator=g)[:, 0] for j in range(K)], dim=1)
    w = torch.ones(R, dtype=torch.float64)                         # the reference's w_K
    for j in range(K):
        d = ids[:, j:j + 1]
        ratio = p[:, j].gather(1, d)[:, 0].double() / q[:, j].gather(1, d)[:, 0].double()
        w = (w * ratio).clamp(max=1.0)
    assert bool((w > 0.05).all()) and bool((w < 1.0).any())
    edge = w.float()
    edge = torch.where(edge.double() > w, torch.nextafter(edge, torch.tensor(0.0)), edge)
    u = torch.full((R, K + 1), 0.999)
    u[:, K - 1] = edge
    original = Sampler.row_uniforms
    monkeypatch.setattr(Sampler, "row_uniforms", lambda self, s, stream: u.view(-1)[:s.num_rows].clone()
                        if stream == STREAM_BLOCK else original(self, s, stream))
    requests = [(f"k{i}", params.model_copy(update=dict(seed=200 + i)), []) for i in range(R)]
    got = CpuSampler().verify(logits, build(CpuSampler(), requests), ids, q, method="block")
    want = reference.verify(logits, build(reference, requests), ids, q, method="block")
    assert want.num_emitted.tolist() == [K + 1] * R                 # u <= h_K = w_K everywhere
    assert torch.equal(got.token_ids, want.token_ids)


@pytest.mark.parametrize("closeness", [0.2, 1.0, 3.0])
def test_many_seeded_top_p_rows_verified_as_a_block_emit_the_references_tokens(closeness):
    """Seeded whole rows with a pending top-p cut, judged from bounds on the nucleus mass
    where those settle the block (every draft kept, or none) and from the reference's softmax
    otherwise: many rows, drafts near and far, the reference's tokens."""
    Vs, R = 64, 400
    g = torch.Generator().manual_seed(103)
    cpu, reference = CpuSampler(), Sampler("cpu")
    mine, ref = cpu.new_batch(Vs), reference.new_batch(Vs)
    for i in range(R):
        params = SamplingParams(seed=700 + i, top_p=0.8, temperature=0.9)
        mine.add(f"p{i}", params)
        ref.add(f"p{i}", params)
    logits = torch.randn((R, K + 1, Vs), generator=g) * 2
    q = torch.softmax(logits[:, :K] / 0.9 + closeness * torch.randn((R, K, Vs), generator=g), dim=-1)
    ids = torch.stack([torch.multinomial(q[:, j], 1, generator=g)[:, 0] for j in range(K)], dim=1)
    got = cpu.verify(logits, mine, ids, q, method="block")
    want = reference.verify(logits, ref, ids, q, method="block")
    differ = (got.token_ids != want.token_ids).any(dim=1).nonzero()[:, 0].tolist()
    assert not differ, f"rows {differ[:10]} differ from the reference"
    assert len(set(got.num_emitted.tolist())) >= 3                 # stops at several slots
