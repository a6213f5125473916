"""The FlashInfer path's glue (``FlashInferDraw``, ``CudaSampler.sample_random`` and
``rejection_sample``), checked on the CPU against a stand-in for ``flashinfer.sampling``
(``fake_flashinfer/flashinfer/sampling.py``: the real functions' signatures, input checks and
results, degenerate rows included, transcribed in torch): FlashInfer needs a GPU, and this is
the code that decides which rows and steps FlashInfer takes, which entry point it calls with
what (the filtered target for the ratio test, clamped draft ids, contiguous draft
probabilities), and how its output (accepted prefix, residual draw, -1 padding, rows without
a token) becomes the contract's result, with rows of fewer drafts than K and seeded rows mixed
in. The whole conformance suite runs on this path too; the self-test runs in a child process
that imports the stand-in as ``flashinfer``. ``test_gpu.py`` runs the real kernels through the
same checks."""

from __future__ import annotations

import importlib.util
import inspect
import os
from pathlib import Path

import pytest
import torch
from corelib import Sampler, SamplingParams
from corelib.bitmask import unpack_bitmask
from corelib.testing import ConformanceSuite, chi_square_p_value

from corelib_cuda import CudaSampler
from corelib_cuda.flashinfer_ops import FlashInferDraw, self_test_in_subprocess
from corelib_cuda.probe import import_flashinfer

FAKE_ROOT = Path(__file__).parent / "fake_flashinfer"
ENTRY_POINTS = ("sampling_from_logits", "top_p_sampling_from_probs", "top_k_mask_logits",
                "top_k_top_p_sampling_from_logits", "chain_speculative_sampling")


def load_fake_sampling():
    spec = importlib.util.spec_from_file_location("fake_flashinfer_sampling",
                                                  FAKE_ROOT / "flashinfer" / "sampling.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fake = load_fake_sampling()


def flashinfer_sampler(**kwargs) -> CudaSampler:
    """The torch path on CPU with FlashInferDraw driving the stand-in kernels: FlashInfer
    draws the unseeded rows of every step and judges their drafts, as on a GPU."""
    sampler = CudaSampler("cpu", use_flashinfer=False, **kwargs)
    sampler.flashinfer = FlashInferDraw(sampler.device, seed=1234, sampling=fake)
    return sampler


def calls() -> list[str]:
    return [name for name, _ in fake.CALLS]


@pytest.fixture
def sampler():
    fake.CALLS.clear()
    return flashinfer_sampler()


@pytest.mark.skipif(import_flashinfer()[1] is not None, reason=f"{import_flashinfer()[1]}")
@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_the_stand_in_has_the_real_signatures(name):
    import flashinfer.sampling as real
    ours, theirs = inspect.signature(getattr(fake, name)), inspect.signature(getattr(real, name))
    assert [(p.name, p.default, p.kind) for p in ours.parameters.values()] == \
        [(p.name, p.default, p.kind) for p in theirs.parameters.values()]


class TestConformanceOnTheFlashInferPath(ConformanceSuite):
    backend = "cuda"
    draw_rows, draw_calls = 1000, 8
    verify_rows = 2000

    def make_sampler(self):
        return flashinfer_sampler()


@pytest.mark.parametrize("params", [{}, {"top_k": 6, "top_p": 0.9}], ids=["plain", "top_k_top_p"])
def test_unseeded_rows_keep_the_target_distribution_short_rows_included(sampler, params):
    """With top-k and top-p the target at each slot is the filtered distribution (FlashInfer
    draws the slots' tokens with both fused, so the ratio test needs them applied to p too)."""
    vocab, K, R = 16, 3, 3000
    gen = torch.Generator().manual_seed(5)
    target = torch.randn((K + 1, vocab), generator=gen) * 1.5
    q = torch.softmax(torch.randn((K, vocab), generator=gen) * 1.5, dim=-1)
    reference = Sampler("cpu")
    slots = reference.new_batch(vocab)
    for j in range(K + 1):                                  # one row per slot's target
        slots.add(f"slot{j}", SamplingParams(**params))
    p = torch.softmax(reference.processed_logits(target, slots), dim=-1)
    ids = torch.stack([torch.multinomial(q[j], R, replacement=True, generator=gen) for j in range(K)], dim=1)
    ids[R // 2:, 1:] = -1
    batch = sampler.new_batch(vocab)
    for i in range(R):
        batch.add(f"v{i}", SamplingParams(**params))
    torch.manual_seed(6)
    out = sampler.verify(target.expand(R, -1, -1).contiguous(), batch, ids, q.expand(R, -1, -1).contiguous())
    tokens, count = out.token_ids, out.num_emitted
    assert int(sampler.flashinfer.offset) > 0, "the kernel's Philox offset must advance"
    assert chi_square_p_value(torch.bincount(tokens[:, 0], minlength=vocab), p[0]) > 1e-6
    accepted = (count >= 2).double().mean()
    expected = torch.minimum(p[0], q[0]).sum().double()
    assert (accepted - expected).abs() <= 5 * (expected * (1 - expected) / R).sqrt()
    for rows in (slice(0, R // 2), slice(R // 2, R)):       # K drafts; one draft (slot 1's draw)
        second = tokens[rows][count[rows] >= 2, 1]
        assert chi_square_p_value(torch.bincount(second, minlength=vocab), p[1]) > 1e-6
    assert int(count[R // 2:].max()) <= 2 and int(count[: R // 2].max()) <= K + 1


def test_seeded_and_greedy_rows_keep_the_reference_tokens_in_a_mixed_batch(sampler):
    vocab, K = 64, 3
    requests = [("s", SamplingParams(seed=3, top_k=20)), ("u", SamplingParams()),
                ("g", SamplingParams(temperature=0.0)), ("s2", SamplingParams(seed=4, n=2))]
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn((5, K + 1, vocab), generator=gen) * 2
    ids = torch.randint(vocab, (5, K), generator=gen)
    ids[4, 2:] = -1
    probs = torch.softmax(torch.randn((5, K, vocab), generator=gen), dim=-1)
    reference = Sampler("cpu")
    batches = []
    for s in (sampler, reference):
        batch = s.new_batch(vocab)
        for rid, params in requests:
            batch.add(rid, params)
        batches.append(batch)
    got = sampler.verify(logits, batches[0], ids, probs)
    want = reference.verify(logits, batches[1], ids, probs)
    for row in (0, 2, 3, 4):                                # seeded and greedy rows
        assert got.token_ids[row].tolist() == want.token_ids[row].tolist(), row
    assert 1 <= int(got.num_emitted[1]) <= K + 1 and bool(got.valid.all())


def test_unusable_and_out_of_range_drafts_do_not_reach_the_kernel_as_indices(sampler):
    vocab, K = 32, 2
    batch = sampler.new_batch(vocab)
    batch.add("a", SamplingParams())
    batch.add("b", SamplingParams())
    logits = torch.randn((2, K + 1, vocab))
    probs = torch.full((2, K, vocab), 1.0 / vocab)
    checked = sampler.check_drafts(logits, batch, torch.tensor([[1, 2], [3, -1]]), probs)
    checked.token_ids[0, 1] = vocab + 5                    # as a device tensor would carry it
    passed, recovered = sampler.flashinfer.verify(torch.softmax(logits, -1), checked)
    assert passed.shape == recovered.shape == (2, K)
    assert bool(((recovered >= 0) & (recovered < vocab)).all())


# ---------------------------------------------------------------------------- rows without a token
def overflow_logits(rows: int, vocab: int = 64) -> torch.Tensor:
    """Finite logits whose leader overflows float32 to +inf at temperature 0.1 (3e38 / 0.1);
    token 0's logit stays finite, so reading it cannot tell that the row has no token."""
    logits = torch.randn((rows, vocab), generator=torch.Generator().manual_seed(3))
    logits[:, 5] = 3e38
    return logits


@pytest.mark.parametrize("params", [dict(top_k=8, top_p=0.9), dict(top_p=0.9), dict(top_k=8)],
                         ids=["top_k_top_p", "top_p", "top_k"])
def test_a_row_whose_logits_overflow_is_flagged_as_on_the_torch_path(sampler, params):
    """FlashInfer's softmax of a +inf row is NaN; its top-p kernel then writes token 0 with
    valid = False. The row must be flagged (-1, valid False), as the torch path flags it, and
    the other rows keep their tokens."""
    vocab = 64
    requests = [("inf", SamplingParams(temperature=0.1, **params)), ("ok", SamplingParams(**params))]
    torch_path = CudaSampler("cpu", use_flashinfer=False)
    logits = overflow_logits(2, vocab)
    logits[1] = torch.randn(vocab)
    outs = []
    for s in (sampler, torch_path):
        batch = s.new_batch(vocab)
        for rid, p in requests:
            batch.add(rid, p)
        outs.append(s.sample(logits, batch))
    got, want = outs
    assert "top_p_sampling_from_probs" in calls()
    assert want.valid.tolist() == [False, True], "the torch path flags the overflowing row"
    assert got.valid.tolist() == want.valid.tolist()
    assert int(got.token_ids[0]) == -1 and 0 <= int(got.token_ids[1]) < vocab


def test_the_stand_in_kernel_reports_no_token_as_the_real_one_does():
    """What the fix relies on: token 0 from the fused entry point (no flag), valid = False from
    top_p_sampling_from_probs(return_valid=True), for a row whose probabilities are NaN."""
    probs = torch.softmax(overflow_logits(1) / 0.1, dim=-1)
    seed, offset = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    assert torch.isnan(probs).all()
    ids, valid = fake.top_p_sampling_from_probs(probs, torch.tensor([0.9]), seed=seed, offset=offset,
                                                return_valid=True)
    assert ids.tolist() == [0] and valid.tolist() == [False]
    fused = fake.top_k_top_p_sampling_from_logits(overflow_logits(1) / 0.1, torch.tensor([8], dtype=torch.int32),
                                                  torch.tensor([0.9]), seed=seed, offset=offset)
    assert fused.tolist() == [0]


# ---------------------------------------------------------------------------- which entry point
def entry_point_batch(sampler, params_list, vocab=64, **kwargs):
    batch = sampler.new_batch(vocab, **kwargs)
    for i, params in enumerate(params_list):
        batch.add(f"r{i}", params)
    return batch


def test_top_p_without_any_top_k_calls_the_top_p_kernel_on_the_softmax(sampler):
    """No row has a top_k: no top-k mask (no [B, V] copy with k = V), one top-p kernel on
    softmax(x), with the rows' top_p and the sampler's device seed and offset."""
    batch = entry_point_batch(sampler, [SamplingParams(top_p=0.8), SamplingParams(top_p=0.5, temperature=0.5)])
    logits = torch.randn(2, 64)
    sampler.sample(logits, batch)
    assert calls() == ["top_p_sampling_from_probs"]
    args = fake.CALLS[0][1]
    assert torch.allclose(args["probs"], torch.softmax(logits / torch.tensor([[1.0], [0.5]]), dim=-1))
    assert args["top_p"].tolist() == pytest.approx([0.8, 0.5]) and args["return_valid"]
    assert args["seed"] is sampler.flashinfer.seed and args["offset"] is sampler.flashinfer.offset


def test_a_top_k_row_masks_with_v_for_rows_without_one(sampler):
    batch = entry_point_batch(sampler, [SamplingParams(top_k=5, top_p=0.9), SamplingParams(top_p=0.7)])
    sampler.sample(torch.randn(2, 64), batch)
    assert calls() == ["top_k_mask_logits", "top_p_sampling_from_probs"]
    assert fake.CALLS[0][1]["top_k"].tolist() == [5, 64]


def test_no_filter_draws_by_the_gumbel_kernel_alone(sampler):
    batch = entry_point_batch(sampler, [SamplingParams(temperature=0.7)] * 3)
    sampler.sample(torch.randn(3, 64), batch)
    assert calls() == ["sampling_from_logits"]


@pytest.mark.parametrize("why", ["seeded", "processed_logprobs", "kept"])
def test_when_the_final_logits_are_read_flashinfer_only_draws_from_them(sampler, why):
    """Seeded rows, processed logprobs or a kept set need steps 12-13 in torch: then FlashInfer
    draws the unseeded rows from those final logits (one Gumbel kernel) instead of filtering
    again, and a kept set is the finite part of exactly what it drew from."""
    params = [SamplingParams(top_k=5, top_p=0.9, return_kept=why == "kept"),
              SamplingParams(top_p=0.7, seed=3 if why == "seeded" else None, logprobs=2)]
    mode = "processed" if why == "processed_logprobs" else "raw"
    batch = entry_point_batch(sampler, params, logprobs_mode=mode)
    logits = torch.randn(2, 64)
    out = sampler.sample(logits, batch)
    assert calls() == ["sampling_from_logits"]
    reference = Sampler("cpu")
    final = reference.processed_logits(logits, entry_point_batch(reference, params, logprobs_mode=mode))
    drawn_from = fake.CALLS[0][1]["logits"]
    assert torch.equal(torch.isfinite(drawn_from), torch.isfinite(final)), "not the filtered logits"
    assert bool(torch.isfinite(final.gather(1, out.token_ids[:, None])).all())
    if why == "kept":
        kept = unpack_bitmask(out.kept, 64)
        assert torch.equal(kept[0], torch.isfinite(drawn_from[0])) and not bool(kept[1].any())


def test_unseeded_kept_sets_hold_every_flashinfer_draw_and_its_distribution(sampler):
    """Unseeded rows asking for their kept sets: each is the reference's set for the same
    logits (top-k, top-p and min-p drop no token at random), FlashInfer draws inside it, and
    its draws follow the softmax over it (chi-square, fixed seeds)."""
    vocab, R = 48, 4000
    params = SamplingParams(top_k=12, top_p=0.85, min_p=0.02, temperature=0.9, return_kept=True)
    logits = (torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 2).expand(R, -1).contiguous()
    batch = entry_point_batch(sampler, [params] * R, vocab=vocab)
    out = sampler.sample(logits, batch)
    assert calls() == ["sampling_from_logits"]
    reference = Sampler("cpu")
    final = reference.processed_logits(logits[:1], entry_point_batch(reference, [params], vocab=vocab))[0]
    kept = unpack_bitmask(out.kept, vocab)
    assert bool((kept == torch.isfinite(final)).all()), "a kept set differs from the reference's"
    assert bool(kept.gather(1, out.token_ids[:, None]).all()), "FlashInfer drew outside a kept set"
    counts = torch.bincount(out.token_ids, minlength=vocab)
    assert chi_square_p_value(counts, torch.softmax(final, dim=-1)) > 1e-6


@pytest.mark.parametrize("method", ["token", "block"])
def test_verify_kept_sets_per_slot_when_flashinfer_judges_the_drafts(sampler, method):
    """Unseeded rows with draft probabilities (FlashInfer judges or draws them) asking for
    their kept sets: slot j's is the reference's kept set of slot j's target, at every slot
    the row reached, with the emitted token inside; zeros past them and for rows that did not
    ask. Without penalties a slot's target does not depend on the drafts before it."""
    vocab, K, R = 64, 3, 400
    params = [SamplingParams(top_k=10, top_p=0.9, return_kept=True), SamplingParams(min_p=0.05)]
    gen = torch.Generator().manual_seed(21)
    logits = torch.randn((R, K + 1, vocab), generator=gen) * 2
    drafts = torch.where(torch.rand((R, K), generator=gen) < 0.6, logits[:, :K].argmax(-1),
                         torch.randint(vocab, (R, K), generator=gen))
    probs = torch.softmax(torch.randn((R, K, vocab), generator=gen), dim=-1)
    batch = entry_point_batch(sampler, [params[i % 2] for i in range(R)], vocab=vocab)
    out = sampler.verify(logits, batch, drafts, probs, method=method)
    # token verification judges by the chain kernel; block verification draws each slot by
    # FlashInfer's Gumbel kernel from the filtered target
    assert ("chain_speculative_sampling" if method == "token" else "sampling_from_logits") in calls()
    reference = Sampler("cpu")
    one = entry_point_batch(reference, [params[0]], vocab=vocab)
    kept = unpack_bitmask(out.kept, vocab)                              # (R, K + 1, vocab)
    emitted = out.num_emitted
    assert int(emitted[::2].max()) > 1, "no row accepted a draft: the slots past 0 go unchecked"
    for row in range(0, R, 2):
        n = int(emitted[row])
        for j in range(n):
            want = torch.isfinite(reference.processed_logits(logits[row, j][None], one)[0])
            assert torch.equal(kept[row, j], want), f"row {row}, slot {j}"
            assert bool(kept[row, j, out.token_ids[row, j]]), f"row {row}: slot {j}'s token is not kept"
        assert not bool(kept[row, n:].any()), f"row {row} reached {n} slots"
    assert not bool(kept[1::2].any()), "rows that did not ask have kept sets"


def test_the_fast_path_is_the_fused_entry_point_with_top_k_max():
    fake.CALLS.clear()
    fast = flashinfer_sampler(top_k_first=True)
    vocab = 65536
    batch = entry_point_batch(fast, [SamplingParams(top_k=40, top_p=0.9), SamplingParams(top_k=100)], vocab=vocab)
    fast.sample(torch.randn(2, vocab), batch)
    assert calls() == ["top_k_top_p_sampling_from_logits"]
    assert fake.CALLS[0][1]["top_k_max"] == 100


# ---------------------------------------------------------------------------- contiguity
def test_strided_draft_probs_reach_the_chain_kernel_contiguous(sampler):
    """The chain kernel checks that its inputs are contiguous (CHECK_INPUT); draft
    probabilities sliced out of a larger buffer (every other slot) must still verify."""
    vocab, K = 32, 2
    batch = entry_point_batch(sampler, [SamplingParams(), SamplingParams()], vocab=vocab)
    logits = torch.randn((2, K + 1, vocab))
    buffer = torch.softmax(torch.randn((2, 2 * K, vocab)), dim=-1)
    strided = buffer[:, ::2]
    assert not strided.is_contiguous()
    with pytest.raises(RuntimeError, match="contiguous"):   # the stand-in checks as the kernel does
        fake.chain_speculative_sampling(strided, torch.zeros((2, K), dtype=torch.int32),
                                        torch.softmax(logits, -1), seed=sampler.flashinfer.seed,
                                        offset=sampler.flashinfer.offset)
    out = sampler.verify(logits, batch, torch.tensor([[1, 2], [3, 4]]), strided)
    assert "chain_speculative_sampling" in calls()
    assert bool(out.valid.all()) and bool(((out.num_emitted >= 1) & (out.num_emitted <= K + 1)).all())


# ---------------------------------------------------------------------------- self-test
@pytest.fixture
def stand_in_on_path(monkeypatch):
    """Child processes import the stand-in as ``flashinfer``; the self-test cache is cleared."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKE_ROOT), os.environ.get("PYTHONPATH", "")]))
    self_test_in_subprocess.cache_clear()
    yield monkeypatch
    self_test_in_subprocess.cache_clear()


def test_the_self_test_runs_in_a_child_process(stand_in_on_path):
    assert self_test_in_subprocess("cpu") is None


@pytest.mark.parametrize("failure, says", [("abort", "killed by signal"),
                                           ("bad_ids", "out-of-range token ids")])
def test_a_kernel_that_crashes_or_misbehaves_leaves_this_process_on_the_torch_path(stand_in_on_path, failure, says):
    """A kernel that takes its process down (as an illegal memory access poisons a CUDA
    context) or returns garbage fails the child's self-test: the sampler reports why, keeps
    the torch path, and this process still samples."""
    stand_in_on_path.setenv("FAKE_FLASHINFER_FAIL", failure)
    sampler = CudaSampler("cpu", use_flashinfer=False)
    problem = sampler._start_flashinfer(sampling=fake)
    assert problem is not None and says in problem
    assert sampler.flashinfer is None and "subprocess" in sampler.flashinfer_setup_s
    stand_in_on_path.delenv("FAKE_FLASHINFER_FAIL")
    batch = entry_point_batch(sampler, [SamplingParams(top_k=5)])
    assert bool(sampler.sample(torch.randn(1, 64), batch).valid.all())


def test_a_passing_self_test_starts_flashinfer_and_times_both_runs(stand_in_on_path):
    sampler = CudaSampler("cpu", use_flashinfer=False)
    assert sampler._start_flashinfer(sampling=fake) is None
    assert isinstance(sampler.flashinfer, FlashInferDraw)
    assert set(sampler.flashinfer_setup_s) == {"subprocess", "in_process"}


def test_the_flashinfer_seed_comes_from_the_samplers_own_generator():
    """Drawn from ``generator`` (so it follows that generator's seed), never from torch's
    global CPU generator, whose state stays as it was."""
    seeds = []
    for seed in (7, 7, 8):
        sampler = CudaSampler("cpu", generator=torch.Generator().manual_seed(seed), use_flashinfer=False)
        state = torch.get_rng_state()
        seeds.append(sampler._flashinfer_seed())
        assert torch.equal(torch.get_rng_state(), state), "the global CPU generator was used"
    assert seeds[0] == seeds[1] != seeds[2]


# ---------------------------------------------------------------------------- fourth release
#: What FlashInfer's fused top-k / top-p / draw cannot serve: a filter after steps 12-13, a
#: stateful selector (the draw takes its reshaped distribution), an order of the filter group
#: in which top-k or top-p come before other filters.
NOT_FUSED = {
    "tail-free": dict(tfs=0.9),
    "p-less": dict(p_less="norm"),
    "mirostat": dict(mirostat_tau=3.0),
    "adaptive-p": dict(adaptive_p_target=0.3),
    "own-order": dict(sampler_order=["top_k", "min_p", "top_p"], min_p=0.02),
    "temperature-last": dict(temperature_last=True, temperature=0.7, min_p=0.02),
}
#: The fourth release's filters before steps 12-13, with the older ones there.
BEFORE_TOP_K = dict(temperature=0.8, dynatemp_range=0.5, dynatemp_exponent=1.5, smoothing_factor=0.3,
                    smoothing_curve=2.0, top_a=0.05, epsilon_cutoff=0.002, eta_cutoff=0.003,
                    min_p=0.01, top_n_sigma=2.5)


@pytest.mark.parametrize("name", sorted(NOT_FUSED))
def test_what_flashinfer_cannot_fuse_takes_the_torch_path_for_the_whole_batch(sampler, name):
    """One such row beside a row FlashInfer could serve: no FlashInfer kernel runs, and the
    batch's seeded tokens and kept sets are the reference's."""
    vocab = 64
    params = [SamplingParams(top_k=5, top_p=0.9), SamplingParams(top_k=12, top_p=0.8, **NOT_FUSED[name]),
              SamplingParams(top_k=12, top_p=0.8, seed=4, **NOT_FUSED[name])]
    batch = entry_point_batch(sampler, params, vocab)
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(2)) * 2
    assert not sampler.flashinfer_draws(sampler.step_state(logits, batch))
    out = sampler.sample(logits, batch)
    assert calls() == []
    reference = Sampler("cpu")
    ref_batch = entry_point_batch(reference, params, vocab)
    assert int(out.token_ids[2]) == int(reference.sample(logits, ref_batch).token_ids[2])
    final = reference.processed_logits(logits, entry_point_batch(reference, params, vocab))
    assert torch.equal(torch.isfinite(sampler.processed_logits(logits, batch)), torch.isfinite(final))
    assert bool(torch.isfinite(final.gather(1, out.token_ids[:, None])).all())


def test_the_filters_before_top_k_run_in_torch_before_the_fused_kernels(sampler):
    """Dynamic temperature, smoothing, top-a, epsilon and eta keep the fused path: they run
    in torch, in the reference's order, and FlashInfer's top-k, top-p and draw follow. The
    kernels get the reference's logits after steps 10-11 and draw from its final
    distribution (chi-square over 8000 draws, fixed seeds; nothing outside the kept set)."""
    vocab, rows, rounds = 64, 4000, 2
    params = SamplingParams(top_k=20, top_p=0.9, **BEFORE_TOP_K)
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(21)) * 2
    reference = Sampler("cpu")
    final = reference.processed_logits(logits, entry_point_batch(reference, [params], vocab))[0]
    unfused = params.model_copy(update=dict(top_k=0, top_p=1.0))
    before = reference.processed_logits(logits, entry_point_batch(reference, [unfused], vocab))[0]
    assert 1 < int(torch.isfinite(final).sum()) < int(torch.isfinite(before).sum()) < vocab
    batch = entry_point_batch(sampler, [params] * rows, vocab)
    assert sampler.flashinfer_draws(sampler.step_state(logits.expand(rows, -1), batch))
    counts = torch.zeros(vocab, dtype=torch.long)
    for _ in range(rounds):
        fake.CALLS.clear()
        ids = sampler.sample(logits.expand(rows, -1), batch).token_ids
        counts += torch.bincount(ids, minlength=vocab)
    assert calls() == ["top_k_mask_logits", "top_p_sampling_from_probs"]
    given = fake.CALLS[0][1]["logits"][0]
    assert torch.equal(torch.isfinite(given), torch.isfinite(before))
    assert torch.allclose(given[torch.isfinite(before)], before[torch.isfinite(before)])
    kept = torch.isfinite(final)
    assert int(counts[~kept].sum()) == 0
    assert chi_square_p_value(counts[kept], torch.softmax(final, dim=-1)[kept]) > 1e-3
