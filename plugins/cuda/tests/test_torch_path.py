"""The torch path on CPU tensors: the same code the GPU runs, checked against the reference.

The conformance suite covers the contract on a small vocabulary; these tests aim at what this
backend does differently: candidate-based top-k / top-p (exact sets, ties beyond the
candidates, a sort only when a row needs the whole vocabulary), seeded tokens in mixed batches,
and no host reads in a whole step.
"""

from __future__ import annotations

import pytest
import torch
from corelib import Sampler, SamplingParams
from corelib.testing import chi_square_p_value
from torch.utils._python_dispatch import TorchDispatchMode

from corelib.transfer import staged, upload

from corelib_cuda import CudaBatch, CudaSampler, GraphedSampler
from corelib_cuda.batch import exact_top_p_limit
from corelib_cuda.sync_check import HostSyncError, no_host_sync

V = 2048


@pytest.fixture(scope="module")
def sampler():
    return CudaSampler("cpu", use_flashinfer=False)


@pytest.fixture(scope="module")
def reference():
    return Sampler("cpu")


def build(sampler, requests, vocab=V, **kwargs):
    batch = sampler.new_batch(vocab, **kwargs)
    for rid, params, prompt, outputs in requests:
        batch.add(rid, params, prompt_token_ids=prompt, output_token_ids=outputs)
    return batch


def random_params(gen: torch.Generator, seeded: bool) -> SamplingParams:
    """A mix of filter settings, including top-p without top-k (which forces the sort)."""
    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]
    return SamplingParams(
        temperature=pick([0.5, 0.8, 1.0, 1.3]),
        top_k=pick([0, 1, 5, 40, 200, -1]),
        top_p=pick([1.0, 0.95, 0.7, 0.3]),
        min_p=pick([0.0, 0.0, 0.02]),
        seed=int(torch.randint(2**62, (1,), generator=gen)) if seeded else None,
    )


def bf16_logits(rows: int, seed: int, vocab: int = V) -> torch.Tensor:
    """Logits rounded to bfloat16, as many models produce: exact ties near the top are common."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn((rows, vocab), generator=gen) * 4).to(torch.bfloat16)


class Recorder(TorchDispatchMode):
    """Records each op's name, and the widths of the tensors each sort was given."""

    def __init__(self):
        super().__init__()
        self.ops = set()
        self.sort_widths = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops.add(name)
        if name == "sort" and args and isinstance(args[0], torch.Tensor):
            self.sort_widths.add(args[0].shape[-1])
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------------------- kept sets
@pytest.mark.parametrize("trial", range(6))
def test_kept_sets_equal_the_reference_on_tie_heavy_logits(sampler, reference, trial):
    gen = torch.Generator().manual_seed(100 + trial)
    requests = [(f"r{i}", random_params(gen, seeded=False), [1, 2], None) for i in range(12)]
    logits = bf16_logits(12, seed=trial)
    got = sampler.processed_logits(logits, build(sampler, requests))
    want = reference.processed_logits(logits, build(reference, requests))
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    assert torch.equal(got[torch.isfinite(want)], want[torch.isfinite(want)])


def test_top_k_keeps_ties_beyond_the_candidates(sampler, reference):
    logits = torch.randn(3, V)
    logits[0, 100:140] = 9.0          # 40 tokens tied at the top, top_k=5: all 40 kept
    logits[1, :] = 0.0                # every token tied
    logits[2, 7] = 20.0
    logits[2, 300:320] = 8.0          # ties at the k-th place behind one leader
    params = SamplingParams(top_k=5, top_p=0.99)
    requests = [(f"t{i}", params, [], None) for i in range(3)]
    got = sampler.processed_logits(logits, build(sampler, requests))
    want = reference.processed_logits(logits, build(reference, requests))
    kept = torch.isfinite(got).sum(dim=-1).tolist()
    assert torch.equal(torch.isfinite(got), torch.isfinite(want)), kept
    assert kept[0] == 40 and kept[1] == V


def test_top_k_path_sorts_nothing_and_top_p_alone_sorts_only_past_the_exact_limit(sampler):
    logits = torch.randn(4, V)
    with_k = build(sampler, [(f"k{i}", SamplingParams(top_k=50, top_p=0.9), [], None) for i in range(4)])
    with Recorder() as rec:
        sampler.sample(logits, with_k)
    assert "sort" not in rec.ops and "topk" in rec.ops
    only_p = build(sampler, [("p", SamplingParams(top_p=0.9), [], None),
                             ("k", SamplingParams(top_k=50), [], None)])
    with Recorder() as rec:
        sampler.sample(logits[:2], only_p)
    assert "sort" not in rec.ops and "scatter_add_" in rec.ops     # the radix select
    limit = exact_top_p_limit(V)
    near_one = build(sampler, [("p", SamplingParams(top_p=limit + (1 - limit) / 2), [], None)])
    with Recorder() as rec:
        sampler.sample(logits[:1], near_one)
    assert "sort" in rec.ops      # past the limit the sums could round: the reference's sort


def nucleus_rows(gen: torch.Generator, V: int) -> torch.Tensor:
    """Rows whose nuclei end in every way: flat, peaked, heavy ties, dropped tokens, one
    token, probabilities of every magnitude."""
    rows = [torch.randn(V, generator=gen) * scale for scale in (0.01, 0.3, 1.0, 3.0, 10.0, 40.0)]
    rows.append(torch.round(torch.randn(V, generator=gen) * 2))              # ties everywhere
    rows.append(torch.zeros(V))                                               # all tied
    dropped = torch.randn(V, generator=gen) * 2
    dropped[torch.rand(V, generator=gen) < 0.9] = float("-inf")
    rows.append(dropped)
    single = torch.full((V,), float("-inf"))
    single[V // 3] = 0.0
    rows.append(single)
    rows.append(torch.linspace(-80.0, 0.0, V))                                # down to ~1e-35
    return torch.stack(rows)


@pytest.mark.parametrize("vocab", [97, 2048, 128256])
def test_top_p_by_radix_select_keeps_the_references_sets(sampler, reference, vocab):
    """Step 13 without top-k: the radix select's kept sets equal the reference's sort, at
    top_p values across (0, 1], the exact limit included, with and without a top-k row."""
    gen = torch.Generator().manual_seed(vocab)
    x = nucleus_rows(gen, vocab)
    limit = exact_top_p_limit(vocab)
    tops = [0.05, 0.3, 0.5, 0.9, 0.95, 0.999, limit, 1.0] + torch.rand(3, generator=gen).tolist()
    calls = []
    select = sampler.top_p_threshold
    sampler.top_p_threshold = lambda probs, top_p: calls.append(1) or select(probs, top_p)
    try:
        for top_p in tops:
            for with_k in (False, True):
                params = [SamplingParams(top_p=top_p, temperature=0.9)] * len(x)
                if with_k:
                    params = params[:-1] + [SamplingParams(top_k=7, top_p=top_p)]
                got = sampler.processed_logits(x, build(sampler, [(f"r{i}", p, [], None) for i, p in enumerate(params)], vocab))
                want = reference.processed_logits(x, build(reference, [(f"r{i}", p, [], None) for i, p in enumerate(params)], vocab))
                assert torch.equal(torch.isinf(got), torch.isinf(want)), (top_p, with_k)
    finally:
        del sampler.top_p_threshold
    assert len(calls) == 2 * (len(tops) - 1)          # top_p 1 alone: no filter at all


def test_filter_bounds_follow_membership(sampler):
    batch = build(sampler, [("a", SamplingParams(top_k=30), [], None),
                            ("g", SamplingParams(temperature=0.0, top_k=900), [], None)])
    assert batch.filter_bounds().candidates == 30          # greedy rows do not count
    batch.add("b", SamplingParams(top_k=5000), [])
    assert batch.filter_bounds().candidates == V            # clamped to the vocabulary
    batch.remove("b")
    batch.add("c", SamplingParams(top_p=0.5), [])
    bounds = batch.filter_bounds()
    assert bounds.candidates == V and not bounds.every_row_top_k and bounds.max_top_k == 30
    batch.remove("c")
    assert batch.filter_bounds().candidates == 30 and batch.filter_bounds().every_row_top_k


# ---------------------------------------------------------------------------- draws
def test_seeded_tokens_equal_the_reference_in_mixed_batches(sampler, reference):
    gen = torch.Generator().manual_seed(7)
    requests = []
    for i in range(24):
        params = random_params(gen, seeded=i % 3 != 0)
        if i % 5 == 0:
            params = params.model_copy(update=dict(temperature=0.0))
        if i % 4 == 1:
            params = params.model_copy(update=dict(repetition_penalty=1.2, presence_penalty=0.5,
                                                   logit_bias={3: 4.0}, bad_words=[[5, 6]]))
        requests.append((f"m{i}", params, [1, 2, 3], None))
    mine, ref = build(sampler, requests), build(reference, requests)
    seeded_rows = [i for i, (_, p, _, _) in enumerate(requests) if p.seed is not None or p.temperature == 0]
    for step in range(5):
        logits = bf16_logits(len(requests), seed=50 + step)
        got = sampler.sample(logits, mine).token_ids
        want = reference.sample(logits, ref).token_ids
        assert got[seeded_rows].tolist() == want[seeded_rows].tolist(), f"step {step}"
        # Both batches continue with the same history (the reference's tokens).
        mine.append(want)
        ref.append(want)


def test_unseeded_draws_reach_ties_beyond_the_candidates(sampler, reference):
    """top_k=2 over 6 tied leaders: all six must be drawn, uniformly."""
    vocab = 64
    logits = torch.full((1, vocab), -5.0)
    logits[0, [3, 10, 20, 30, 40, 50]] = 2.0
    params = SamplingParams(top_k=2, temperature=0.9)
    probe = build(reference, [("p", params, [], None)], vocab=vocab)
    probs = torch.softmax(reference.processed_logits(logits, probe)[0], dim=-1)
    rows = 4000
    batch = build(sampler, [(f"u{i}", params, [], None) for i in range(rows)], vocab=vocab)
    torch.manual_seed(3)
    ids = sampler.sample(logits.expand(rows, -1), batch).token_ids
    counts = torch.bincount(ids, minlength=vocab)
    kept = probs > 0
    assert int(kept.sum()) == 6 and not counts[~kept].any()
    assert chi_square_p_value(counts[kept], probs[kept]) > 1e-6


def test_a_row_keeping_one_token_always_draws_it(sampler):
    batch = build(sampler, [(f"o{i}", SamplingParams(top_k=1), [], None) for i in range(512)])
    logits = torch.randn(1, V).expand(512, -1)
    ids = sampler.sample(logits, batch).token_ids
    assert torch.equal(ids, logits.argmax(dim=-1))


# ---------------------------------------------------------------------------- no host reads
FULL = dict(temperature=0.7, top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.1,
            frequency_penalty=0.2, presence_penalty=0.1, logit_bias={7: 1.5, 99: -2.0},
            min_tokens=3, stop_token_ids=[2], allowed_token_ids=list(range(0, V, 2)),
            bad_words=[[4], [8, 10]], logprobs=5)


NEW_SAMPLERS = dict(dry_multiplier=0.8, dry_allowed_length=1, dry_sequence_breakers=[3],
                    top_n_sigma=2.0, typical_p=0.9, xtc_probability=0.5, xtc_threshold=0.01,
                    top_k=30)

#: Step 8b: a budget already spent (the end is forced now) and one still counting.
THINKING = dict(thinking_start_token_ids=[11], thinking_end_token_ids=[12, 13],
                thinking_forced_token_ids=[14, 12, 13])


@pytest.mark.parametrize("mode", ["raw", "processed", "raw_logits", "processed_logits"])
def test_a_full_step_reads_nothing_on_the_host(sampler, mode):
    requests = [("full", SamplingParams(**FULL), [1, 2, 3], None),
                ("seeded", SamplingParams(**FULL, seed=5), [1], [4, 8]),
                ("greedy", SamplingParams(temperature=0.0, logprobs=-1), [], None),
                ("top_p", SamplingParams(top_p=0.8, n=2, logprobs=40), [], None),
                ("new", SamplingParams(**NEW_SAMPLERS, seed=6), [1, 2, 1, 2], [1]),
                ("new-unseeded", SamplingParams(**NEW_SAMPLERS), [3, 4, 3], None),
                ("forced", SamplingParams(seed=7, thinking_budget=1, **THINKING), [11, 5], None),
                ("thinking", SamplingParams(top_p=0.9, thinking_budget=4, **THINKING), [11], [6])]
    batch = build(sampler, requests, eos_token_id=9, logprobs_mode=mode)
    logits = torch.randn(len(batch), V)
    mask = torch.full((len(batch), V // 32), -1, dtype=torch.int32)
    mask[0, :5] = 0
    sampler.sample(logits, batch)                         # warm caches (request index, flags)
    with no_host_sync():
        out = sampler.sample(logits, batch)
        per_request = sampler.sample(logits[: batch.num_requests], batch)
        masked = sampler.sample(logits, batch, token_bitmask=mask)
    assert out.token_ids.shape == per_request.token_ids.shape == masked.token_ids.shape == (9,)
    assert out.token_ids[7] == 14                         # the forced phrase begins (step 8b)


def test_the_detector_catches_host_reads(sampler):
    x = torch.randn(4, 8)
    for read in (lambda: x.sum().item(), lambda: x.tolist(), lambda: bool(x[0, 0] > 0),
                 lambda: x[x > 0], lambda: torch.multinomial(x.softmax(-1), 1),
                 lambda: (x > 0).nonzero()):
        with pytest.raises(HostSyncError):
            with no_host_sync():
                read()
    assert isinstance(x.tolist(), list)                   # restored afterwards


def test_reference_batches_still_work(sampler, reference):
    """A plain SamplingBatch (no host bounds) falls back to the sort and stays correct."""
    from corelib import SamplingBatch
    requests = [("a", SamplingParams(top_k=20, top_p=0.8, seed=1), [], None)]
    plain = SamplingBatch(V, "cpu")
    plain.add("a", requests[0][1])
    assert not isinstance(plain, CudaBatch)
    logits = torch.randn(1, V)
    got = sampler.sample(logits, plain).token_ids
    want = reference.sample(logits, build(reference, requests)).token_ids
    assert torch.equal(got, want)


def test_row_checks_match_the_reference(sampler, reference):
    x = torch.randn(7, 64)
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    x[3, 5], x[3, 6] = float("inf"), float("-inf")
    x[4, :] = 3e38                                   # finite, but a float32 sum would overflow
    x[5, :] = float("-inf")
    x[6, :10] = float("-inf")
    assert torch.equal(sampler.finite_rows(x), reference.finite_rows(x))
    finite = reference.finite_rows(x)               # NaN rows are flagged either way
    assert torch.equal(sampler.any_token_left(x)[finite], reference.any_token_left(x)[finite])
    assert sampler.finite_rows(x).tolist() == [True, False, False, False, True, True, True]


# ---------------------------------------------------------------------------- new samplers
def typical_requests(gen: torch.Generator, rows: int, with_top_k: bool = True):
    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]
    return [(f"t{i}", SamplingParams(typical_p=pick([0.2, 0.5, 0.9, 0.99, 1.0]),
                                     top_k=pick([3, 20, 64]) if with_top_k else 0,
                                     top_p=pick([1.0, 0.9]), temperature=pick([0.7, 1.0, 1.5])),
             [1, 2], None) for i in range(rows)]


@pytest.mark.parametrize("trial", range(4))
def test_typical_p_from_candidates_keeps_the_reference_sets(sampler, reference, trial):
    """Every row has a top_k: the threshold comes from the candidates (no vocabulary sort),
    on bf16 logits where ties at the k-th place push survivors past the candidates."""
    gen = torch.Generator().manual_seed(300 + trial)
    requests = typical_requests(gen, 16)
    logits = bf16_logits(16, seed=400 + trial)
    logits[0, 50:90] = logits[0].max()                  # 40 tokens tied at the top, top_k <= 64
    logits[1, 10:30] = 1.0
    logits[1, 5] = 9.0                                  # one leader, then 20 tied tokens
    batch = build(sampler, requests)
    with Recorder() as rec:
        got = sampler.processed_logits(logits, batch)
    assert V not in rec.sort_widths, "typical-p sorted the vocabulary although every row has a top_k"
    want = reference.processed_logits(logits, build(reference, requests))
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    assert torch.equal(got[torch.isfinite(want)], want[torch.isfinite(want)])


def test_typical_p_without_top_k_takes_the_reference_sort(sampler, reference):
    gen = torch.Generator().manual_seed(5)
    requests = typical_requests(gen, 6, with_top_k=False)
    logits = bf16_logits(6, seed=6)
    with Recorder() as rec:
        got = sampler.processed_logits(logits, build(sampler, requests))
    assert V in rec.sort_widths
    want = reference.processed_logits(logits, build(reference, requests))
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))


def test_dry_in_place_matches_the_reference_on_a_long_history(sampler, reference):
    gen = torch.Generator().manual_seed(8)
    phrase = torch.randint(V, (12,), generator=gen).tolist()
    history = (phrase * 30)[:300]                        # long repeats of one phrase
    requests = [("d", SamplingParams(dry_multiplier=0.8, dry_allowed_length=2, seed=1), history, phrase[:2]),
                ("r", SamplingParams(dry_multiplier=1.5, dry_range=40, dry_sequence_breakers=[phrase[5]],
                                     temperature=0.0), history, None),
                ("off", SamplingParams(), history, None)]
    logits = torch.randn((3, V), generator=gen)
    got = sampler.processed_logits(logits, build(sampler, requests))
    want = reference.processed_logits(logits, build(reference, requests))
    assert torch.allclose(got, want, atol=1e-5, rtol=0) and torch.equal(torch.isinf(got), torch.isinf(want))
    assert not torch.equal(got[0], logits[0]), "DRY changed nothing on a repeating history"
    assert torch.equal(got[2], logits[2])


# ---------------------------------------------------------------------------- bitmask
def test_bitmask_is_applied_in_place_on_the_working_copy_only(sampler, reference):
    from corelib.bitmask import pack_bitmask
    allowed = torch.rand((3, V), generator=torch.Generator().manual_seed(9)) < 0.3
    mask = pack_bitmask(allowed)
    mask[2] = -1
    logits = torch.randn(3, V)
    before = logits.clone()
    requests = [(f"b{i}", SamplingParams(seed=i), [], None) for i in range(3)]
    got = sampler.processed_logits(logits, build(sampler, requests), token_bitmask=mask)
    assert torch.equal(logits, before), "the caller's logits were modified"
    assert torch.equal(torch.isfinite(got[:2]), allowed[:2]) and torch.isfinite(got[2]).all()
    assert sampler.bitmask_path.startswith("torch (the device is cpu")


# ---------------------------------------------------------------------------- verification
def test_verify_state_reads_nothing_on_the_host(sampler):
    """Everything after the argument checks (which read draft ids only when the caller passes
    them on the host): the speculative state, every stage at every slot, the ratio test,
    the residual draws, the emitted tokens and logprobs."""
    requests = [("full", SamplingParams(**FULL, dry_multiplier=0.5, typical_p=0.9, xtc_probability=0.5,
                                        top_n_sigma=2.0), [1, 2, 3], None),
                ("seeded", SamplingParams(**FULL, seed=5), [1], [4, 8]),
                ("greedy", SamplingParams(temperature=0.0, logprobs=2), [], None),
                ("plain", SamplingParams(n=2), [], None),
                ("forced", SamplingParams(seed=7, thinking_budget=1, **THINKING), [11, 5], None)]
    batch = build(sampler, requests, eos_token_id=9)
    K = 3
    logits = torch.randn(len(batch), K + 1, V)
    drafts = torch.randint(V, (len(batch), K))
    drafts[1, 2:] = -1
    probs = torch.softmax(torch.randn(len(batch), K, V), dim=-1)
    bitmask = torch.full((len(batch), K + 1, V // 32), -1, dtype=torch.int32)
    bitmask[0, 1, :10] = 0
    for q, method in ((None, "token"), (probs, "token"), (None, "block"), (probs, "block")):
        checked = sampler.check_drafts(logits, batch, drafts, q, method=method)
        with no_host_sync():
            s = sampler.speculative_step_state(batch, checked)
            s = sampler.with_bitmask(s, batch, bitmask, slots=K + 1)
            out = sampler.verify_state(logits.view(-1, V), batch, s, checked)
        assert out.token_ids.shape == (6, K + 1)


def test_verify_and_append_read_nothing_on_the_host_with_device_tensors():
    """The whole cycle on the meta device: requests join (add), rows move (swap_rows,
    remove), verify (padded and flat) + append + sample + append, per-request logits, device
    and host bitmasks.
    Meta tensors are not on the host, so the code takes its accelerator branches (draft and
    appended ids are not validated on the host), no value can be read, and every upload the
    batch and the sampler make is checked: pageable or blocking copies, host data built into
    a device tensor, host indices on device tensors would raise."""
    meta = CudaSampler("meta", use_flashinfer=False)
    requests = [("full", SamplingParams(**dict(FULL, **NEW_SAMPLERS)), [1, 2, 3], None),
                ("seeded", SamplingParams(**FULL, seed=5, n=2), [1], [[4, 8], [5]]),
                ("greedy", SamplingParams(temperature=0.0, logprobs=2), [], None),
                ("thinking", SamplingParams(seed=7, thinking_budget=1, **THINKING), [11, 5], None)]
    K = 4
    for runner in (meta, GraphedSampler(meta, sizes=(4, 8), use_graphs=False)):
        batch = runner.new_batch(V, eos_token_id=9)
        with no_host_sync():
            for rid, params, prompt, outputs in requests:
                batch.add(rid, params, prompt_token_ids=prompt, output_token_ids=outputs)
            batch.swap_rows(0, 3)
            for with_probs in (False, True):
                logits = torch.randn(5, K + 1, V, device="meta")
                drafts = torch.zeros(5, K, dtype=torch.long, device="meta")
                probs = torch.rand(5, K, V, device="meta") if with_probs else None
                mask = torch.zeros(5, K + 1, V // 32, dtype=torch.int32, device="meta")
                out = runner.verify(logits, batch, drafts, probs, token_bitmask=mask,
                                    method="block" if with_probs else "token")
                batch.append(out.token_ids)
                counts = [4, 0, 2, 1, 3]                # the flat form, as engines hold it
                flat = runner.verify(torch.randn(15, V, device="meta"), batch,
                                     torch.zeros(10, dtype=torch.long, device="meta"),
                                     torch.rand(10, V, device="meta") if with_probs else None,
                                     token_bitmask=torch.zeros(15, V // 32, dtype=torch.int32, device="meta"),
                                     num_drafts=counts)
                batch.append(flat.token_ids)
                host_mask = torch.full((5, V // 32), -1, dtype=torch.int32)
                step = runner.sample(torch.randn(5, V, device="meta"), batch, token_bitmask=host_mask)
                batch.append(step.token_ids)
                runner.sample(torch.randn(batch.num_requests, V, device="meta"), batch)   # per request
            batch.remove("seeded")
            batch.add("late", SamplingParams(top_p=0.9, repetition_penalty=1.2), prompt_token_ids=[7])
            runner.step(torch.randn(4, V, device="meta"), batch)
        assert out.token_ids.shape == (5, K + 1) and out.logprobs.token_ids.shape == (5, K + 1, 6)


def test_kept_sets_and_score_read_nothing_on_the_host_with_device_tensors():
    """Kept sets out of sample and verify (the sampler's and the graph runner's), and ``score``
    over T positions, with and without given kept sets, on the meta device: nothing read on
    the host, nothing uploaded in a way that waits. Score's ids are on the device (ids on the
    host are validated there, by design)."""
    meta = CudaSampler("meta", use_flashinfer=False)
    requests = [("full", SamplingParams(**dict(FULL, **NEW_SAMPLERS), return_kept=True), [1, 2, 3], None),
                ("seeded", SamplingParams(**FULL, seed=5, n=2, return_kept=True), [1], None),
                ("mirostat", SamplingParams(seed=6, mirostat_tau=3.0, return_kept=True), [], None),
                ("greedy", SamplingParams(temperature=0.0, return_kept=True), [], None),
                ("silent", SamplingParams(top_p=0.9), [], None),
                ("thinking", SamplingParams(seed=7, thinking_budget=1, return_kept=True, **THINKING), [11, 5], None)]
    K, T, W = 3, 4, V // 32
    for runner in (meta, GraphedSampler(meta, sizes=(8,), use_graphs=False)):
        batch = runner.new_batch(V, eos_token_id=9)
        with no_host_sync():
            for rid, params, prompt, outputs in requests:
                batch.add(rid, params, prompt_token_ids=prompt, output_token_ids=outputs)
            rows = batch.num_rows
            out = runner.step(torch.randn(rows, V, device="meta"), batch)
            spec = runner.verify(torch.randn(rows, K + 1, V, device="meta"), batch,
                                 torch.zeros(rows, K, dtype=torch.long, device="meta"),
                                 torch.rand(rows, K, V, device="meta"))
            batch.append(spec.token_ids)
            tokens = torch.zeros(rows, T, dtype=torch.long, device="meta")
            scored = runner.score(torch.randn(rows, T, V, device="meta"), batch, tokens)
            replayed = runner.score(torch.randn(rows, T, V, device="meta"), batch, tokens,
                                    torch.zeros(rows, T, W, dtype=torch.int32, device="meta"))
        assert out.kept.shape == (rows, W) and spec.kept.shape == (rows, K + 1, W)
        assert scored.logprobs.shape == replayed.logprobs.shape == (rows, T)


META_UPLOADS_THAT_WAIT = {
    "torch.tensor(list, device=...)": lambda m: torch.tensor([1, 2], device=m.device),
    "torch.as_tensor(list, device=...)": lambda m: torch.as_tensor([1, 2], device=m.device),
    "torch.asarray(list, device=...)": lambda m: torch.asarray([1, 2], device=m.device),
    "Tensor.new_tensor(list)": lambda m: m.new_tensor([1, 2]),
    "cpu_tensor.to(device)": lambda m: torch.arange(3).to(m.device),
    "pageable, non_blocking=True": lambda m: torch.arange(3).to(m.device, non_blocking=True),
    "staged but blocking": lambda m: staged(torch.arange(3)).to(m.device),
    "host rows moved per tensor": lambda m: m.index_copy_(0, torch.tensor([1, 0]), m.index_select(0, torch.tensor([0, 1]))),
    "host index on a device tensor": lambda m: m[torch.tensor([0, 1])],
    "host values written into a slice": lambda m: m.__setitem__(slice(0, 2), torch.ones(2, 8)),
    "host values through index_put_": lambda m: m.index_put_((upload([0, 1], m.device, torch.long),), torch.ones(2, 8)),
    "device values read on the host": lambda m: m.cpu(),
}


@pytest.mark.parametrize("pattern", sorted(META_UPLOADS_THAT_WAIT))
def test_the_detector_catches_uploads_that_wait(pattern):
    """The patterns the batch and the sampler used before their uploads were staged (the
    request index, row moves and host bitmasks built with torch.tensor(..., device=) or
    moved with .to(device)), on the meta device, where they dispatch no real copy."""
    m = torch.zeros(4, 8, device="meta")
    with pytest.raises(HostSyncError):
        with no_host_sync():
            META_UPLOADS_THAT_WAIT[pattern](m)
    assert torch.tensor([1]).device.type == "cpu"              # factories restored afterwards


def test_staged_non_blocking_uploads_pass_the_detector():
    m = torch.zeros(4, 8, device="meta")
    with no_host_sync():
        upload([1, 2], m.device, torch.long)
        upload(torch.ones(2, 8), m.device)
        staged(torch.arange(3)).to(m.device, non_blocking=True)
        m[upload([0, 1], m.device, torch.long)] = upload(torch.ones(2, 8), m.device)
        m[0:2] = 1.0                                            # a scalar: no copy
        torch.tensor([1, 2])                                    # host data staying on the host
        torch.as_tensor(m)                                      # already on the device


def test_a_short_row_with_draft_probs_emits_its_slot_draw(sampler, reference):
    """k < K drafts with probabilities: after they are accepted, slot k's own draw (the seeded
    token of plain sampling), whatever the padding slots of draft_probs hold."""
    vocab, K = 64, 3
    logits = torch.randn((2, K + 1, vocab), generator=torch.Generator().manual_seed(12))
    requests = [("short", SamplingParams(seed=3), [], None), ("full", SamplingParams(seed=4), [], None)]
    plain = build(sampler, requests, vocab=vocab)
    first = sampler.sample(logits[:, 0], plain).token_ids
    plain.append(first)
    second = sampler.sample(logits[:, 1], plain).token_ids
    drafts = torch.full((2, K), -1, dtype=torch.long)
    drafts[:, 0] = first
    drafts[1, 1:] = 0
    q = torch.full((2, K, vocab), 1.0 / vocab)
    q[:, 0] = 0.0
    q[:, 0, 63] = 1.0
    q[torch.arange(2), 0, first] = 1e-30               # accepted for sure
    q[0, 1] = 0.0
    q[0, 1, second[0]] = 1.0                           # padding that excludes the slot's draw
    out = sampler.verify(logits, build(sampler, requests, vocab=vocab), drafts, q)
    assert out.token_ids[0].tolist() == [int(first[0]), int(second[0]), -1, -1]
    want = reference.verify(logits, build(reference, requests, vocab=vocab), drafts, q)
    assert torch.equal(out.token_ids, want.token_ids)


def test_typical_p_counts_the_mass_of_ties_beyond_the_candidates(sampler, reference):
    """One leader (p = 0.3) and 100 tokens tied behind it (0.007 each) with top_k = 2: all 100
    survive step 12, more than the 64 candidates. The tied tokens are the more typical ones and
    hold 0.7 of the mass, so typical_p = 0.5 keeps them and drops the leader; counting only
    the 63 tied candidates (0.441) would keep the leader too."""
    logits = torch.full((2, V), -float("inf"))
    logits[:, 200:300] = 0.0
    logits[:, 7] = torch.log(torch.tensor(0.3 / 0.007))
    requests = [("ties", SamplingParams(top_k=2, typical_p=0.5), [], None),
                ("wide", SamplingParams(top_k=64), [], None)]       # the batch's K is 64
    got = sampler.processed_logits(logits, build(sampler, requests))
    want = reference.processed_logits(logits, build(reference, requests))
    kept = torch.isfinite(got[0])
    assert int(kept.sum()) == 100 and not kept[7]
    assert torch.equal(kept, torch.isfinite(want[0]))


# ---------------------------------------------------------------------------- fourth release
def fourth_params(gen: torch.Generator, seeded: bool) -> SamplingParams:
    """The filters of the fourth release mixed with the older ones, top-k on most rows (so
    typical-p and top-p take their candidate paths) but not all."""
    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]
    return SamplingParams(
        temperature=pick([0.7, 1.0, 1.3]), dynatemp_range=pick([0.0, 0.3, 0.6]),
        dynatemp_exponent=pick([0.5, 1.0, 2.0]), smoothing_factor=pick([0.0, 0.2, 0.5]),
        smoothing_curve=pick([1.0, 2.0]), top_a=pick([0.0, 0.1, 0.3]),
        epsilon_cutoff=pick([0.0, 0.0003]), eta_cutoff=pick([0.0, 0.0009]),
        top_k=pick([0, 8, 40, 64]), top_p=pick([1.0, 0.9]), min_p=pick([0.0, 0.02]),
        typical_p=pick([1.0, 0.8]), tfs=pick([1.0, 0.95, 0.7]), p_less=pick([None, "plain", "norm"]),
        seed=int(torch.randint(2**62, (1,), generator=gen)) if seeded else None)


@pytest.mark.parametrize("trial", range(4))
def test_the_fourth_releases_filters_keep_the_reference_sets(sampler, reference, trial):
    """Dynamic temperature, smoothing, top-a, epsilon, eta, tail-free and p-less among the
    candidate-based top-k / top-p / typical-p, on bf16 logits (ties at every boundary):
    the reference's kept sets and values, and the reference's seeded tokens."""
    gen = torch.Generator().manual_seed(700 + trial)
    requests = [(f"r{i}", fourth_params(gen, seeded=True), [1, 2], None) for i in range(12)]
    logits = bf16_logits(12, seed=800 + trial)
    logits[0, 20:60] = logits[0].max()                  # 40 tokens tied at the top
    got = sampler.processed_logits(logits, build(sampler, requests))
    want = reference.processed_logits(logits, build(reference, requests))
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    assert torch.equal(got[torch.isfinite(want)], want[torch.isfinite(want)])
    got_ids = sampler.sample(logits, build(sampler, requests)).token_ids
    assert torch.equal(got_ids, reference.sample(logits, build(reference, requests)).token_ids)


#: Orders where the batch's filter bounds (made for the default order) would be wrong: top-p
#: over the whole vocabulary before top-k (its nucleus holds more tokens than the batch's
#: largest top_k, and epsilon's renormalised cut after it sees them all), typical-p and
#: tail-free before top-k; and orders where they hold: top-k alone, then top-p after another
#: filter.
ORDERED_REQUESTS = [
    ("default", SamplingParams(top_k=20, top_p=0.9, typical_p=0.9), [], None),
    ("top-p-first", SamplingParams(sampler_order=["top_p", "epsilon", "top_k"], top_p=0.6,
                                   epsilon_cutoff=0.001, top_k=300), [], None),
    ("typical-first", SamplingParams(sampler_order=["typical_p", "top_k", "top_p"], typical_p=0.5,
                                     top_k=8, top_p=0.9), [], None),
    ("top-k-first", SamplingParams(sampler_order=["top_k", "min_p", "top_p"], top_k=200, min_p=0.001,
                                   top_p=0.7), [], None),
    ("temperature-last", SamplingParams(temperature_last=True, temperature=0.6, min_p=0.05,
                                        top_k=100, tfs=0.9), [], None),
    ("tfs-first", SamplingParams(sampler_order=["tfs", "top_k"], tfs=0.5, top_k=250), [], None),
]


def test_custom_filter_orders_keep_the_reference_sets(sampler, reference):
    """Rows with their own order of the filter group in one batch with a default-order row:
    each keeps the reference's set; with the core's ``switch_state`` (the batch's bounds as
    they are) the same batch keeps other sets, so the bounds this backend gives each named
    filter are what makes them right."""
    vocab = 16384
    logits = torch.randn(len(ORDERED_REQUESTS), vocab, generator=torch.Generator().manual_seed(3))
    want = torch.isfinite(reference.processed_logits(logits, build(reference, ORDERED_REQUESTS, vocab)))
    got = torch.isfinite(sampler.processed_logits(logits, build(sampler, ORDERED_REQUESTS, vocab)))
    assert (got == want).all(dim=-1).tolist() == [True] * len(ORDERED_REQUESTS)
    plain_bounds = CudaSampler("cpu", use_flashinfer=False)
    plain_bounds.switch_state = lambda s, stage, switch: Sampler.switch_state(plain_bounds, s, stage, switch)
    mutant = torch.isfinite(plain_bounds.processed_logits(logits, build(plain_bounds, ORDERED_REQUESTS, vocab)))
    assert (mutant != want).any(dim=-1).tolist() == [False, True, True, False, False, True]


@pytest.mark.parametrize("trial", range(4))
def test_tail_free_from_candidates_keeps_the_reference_sets(sampler, reference, trial):
    """Every row has a top_k: tail-free's sorted head comes from the top-k candidates (no
    vocabulary sort), on bf16 logits where ties of the K-th candidate reach past the
    candidates (their second differences are zeros, and a cut there keeps them all)."""
    gen = torch.Generator().manual_seed(900 + trial)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]
    requests = [(f"t{i}", SamplingParams(tfs=pick([0.5, 0.7, 0.9, 0.99, 1.0]), top_k=pick([1, 2, 3, 20, 64]),
                                         typical_p=pick([1.0, 0.9]), temperature=pick([0.5, 1.0, 2.0]),
                                         min_p=pick([0.0, 0.05])), [], None) for i in range(16)]
    logits = bf16_logits(16, seed=1000 + trial)
    logits[0, 10:100] = logits[0].max()                 # 90 tokens tied at the top, top_k <= 64
    logits[1] = 0.0                                      # every token tied
    logits[2, :5] = 30.0                                 # a flat head of five
    # one leader, 100 tokens tied behind it, top_k 2: 101 survivors, past the 64 candidates;
    # the cut falls after the leader only when the ties' zero differences are counted as such
    logits[3] = -20.0
    logits[3, 100:200] = 8.0
    logits[3, 7] = 9.0
    requests[3] = ("t3", SamplingParams(tfs=0.9, top_k=2), [], None)
    requests[4] = ("t4", SamplingParams(tfs=0.7, top_k=64), [], None)
    with Recorder() as rec:
        got = sampler.processed_logits(logits, build(sampler, requests))
    assert V not in rec.sort_widths, "tail-free sorted the vocabulary although every row has a top_k"
    want = reference.processed_logits(logits, build(reference, requests))
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))


def test_tail_free_without_top_k_on_every_row_takes_the_reference_sort(sampler, reference):
    requests = [("k", SamplingParams(tfs=0.9, top_k=20), [], None), ("all", SamplingParams(tfs=0.8), [], None)]
    logits = bf16_logits(2, seed=7)
    with Recorder() as rec:
        got = sampler.processed_logits(logits, build(sampler, requests))
    assert V in rec.sort_widths
    want = reference.processed_logits(logits, build(reference, requests))
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))


FOURTH = dict(dynatemp_range=0.4, smoothing_factor=0.3, top_a=0.1, epsilon_cutoff=0.0005,
              eta_cutoff=0.001, tfs=0.95, p_less="norm", top_k=40, logprobs=3)
ORDERED = dict(sampler_order=["top_p", "min_p", "temperature", "top_k"], top_p=0.9, min_p=0.02,
               top_k=30, temperature=0.8)
MIROSTAT = dict(mirostat_tau=3.0, mirostat_eta=0.1, top_k=60)
ADAPTIVE = dict(adaptive_p_target=0.4, adaptive_p_decay=0.9, min_p=0.01)


def fourth_requests():
    """Rows of the fourth release: the new filters, their own order, both selectors."""
    return [("fourth", SamplingParams(**FOURTH), [1, 2], None),
            ("fourth-seeded", SamplingParams(**FOURTH, seed=11), [1], [3]),
            ("ordered", SamplingParams(**ORDERED, seed=12), [], None),
            ("mirostat", SamplingParams(**MIROSTAT, seed=13, n=2), [4], None),
            ("adaptive", SamplingParams(**ADAPTIVE), [5], [6])]


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_a_step_with_the_fourth_releases_samplers_reads_nothing_on_the_host(sampler, mode):
    """New filters, a custom order and both selectors (the selectors' source included), with
    the older samplers beside them. ``append`` on host tensors checks the ids on the host; its
    advance of the state is checked on the meta device below."""
    requests = fourth_requests() + [("new", SamplingParams(**NEW_SAMPLERS, seed=6), [1, 2, 1, 2], [1]),
                                    ("greedy", SamplingParams(temperature=0.0), [], None)]
    batch = build(sampler, requests, eos_token_id=9, logprobs_mode=mode)
    logits = torch.randn(len(batch), V)
    sampler.step(logits, batch)                           # warm caches (request index, flags)
    with no_host_sync():
        out = sampler.sample(logits, batch)
        per_request = sampler.sample(logits[: batch.num_requests], batch)
    assert out.selector_source.shape == per_request.selector_source.shape == (len(batch), V)
    assert batch.sampler_state("mirostat")[0][0] != pytest.approx(6.0)   # mu moved from 2 tau


def test_the_fourth_releases_cycle_reads_nothing_on_the_host_with_device_tensors():
    """As the cycle test above, on the meta device, with the fourth release's rows: sample,
    verify (the selectors' state advanced per slot inside it) and the appends that advance
    the state from the kept source, a request joining with a ``sampler_state``, and the graph
    runner's replays of the same."""
    meta = CudaSampler("meta", use_flashinfer=False)
    K = 3
    for runner in (meta, GraphedSampler(meta, sizes=(8,), use_graphs=False)):
        batch = runner.new_batch(V, eos_token_id=9)
        with no_host_sync():
            for rid, params, prompt, outputs in fourth_requests():
                batch.add(rid, params, prompt_token_ids=prompt, output_token_ids=outputs)
            rows = len(batch)
            for with_probs in (False, True):
                out = runner.verify(torch.randn(rows, K + 1, V, device="meta"), batch,
                                    torch.zeros(rows, K, dtype=torch.long, device="meta"),
                                    torch.rand(rows, K, V, device="meta") if with_probs else None)
                batch.append(out.token_ids)
                step = runner.sample(torch.randn(rows, V, device="meta"), batch)
                batch.append(step.token_ids)
            batch.remove("adaptive")
            batch.add("resumed", SamplingParams(**ADAPTIVE), prompt_token_ids=[5], output_token_ids=[6],
                      sampler_state=[[2.5, 4.0]])
            runner.step(torch.randn(len(batch), V, device="meta"), batch)
        assert out.selector_source.shape == (rows * (K + 1), V)
