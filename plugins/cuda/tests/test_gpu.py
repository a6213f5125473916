"""GPU-only checks (skipped without a GPU, by the plugin's own probe): no host sync in a step,
graph replays that draw fresh numbers, and FlashInfer's draws against the torch path's kept
sets and probabilities (chi-square, fixed seeds)."""

from __future__ import annotations

import pytest
import torch
from corelib import SamplingParams
from corelib.testing import chi_square_p_value

from corelib_cuda import CudaSampler, GraphedSampler
from corelib_cuda.probe import cuda_availability
from corelib_cuda.sync_check import HostSyncError, no_host_sync

GPU = cuda_availability()
pytestmark = pytest.mark.skipif(not GPU.available, reason=f"cuda backend unavailable: {GPU.reason}")

V = 32000


@pytest.fixture(scope="module")
def torch_sampler():
    return CudaSampler("cuda", use_flashinfer=False)


@pytest.fixture(scope="module")
def fi_sampler():
    sampler = CudaSampler("cuda")
    if sampler.path != "flashinfer":
        pytest.skip(sampler.path_reason)
    return sampler


@pytest.fixture(params=["torch", "flashinfer"])
def sampler(request, torch_sampler):
    return torch_sampler if request.param == "torch" else request.getfixturevalue("fi_sampler")


def build(sampler, requests, vocab=V, **kwargs):
    batch = sampler.new_batch(vocab, **kwargs)
    for rid, params, prompt, outputs in requests:
        batch.add(rid, params, prompt_token_ids=prompt, output_token_ids=outputs)
    return batch


FULL = dict(temperature=0.7, top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.1,
            frequency_penalty=0.2, presence_penalty=0.1, logit_bias={7: 1.5, 99: -2.0},
            min_tokens=2, stop_token_ids=[2], allowed_token_ids=list(range(0, V, 3)),
            bad_words=[[4], [8, 10]], logprobs=5)


def mixed_requests():
    return [("full", SamplingParams(**FULL), [1, 2, 3], None),
            ("full-seeded", SamplingParams(**FULL, seed=5, n=2), [1], None),
            ("greedy", SamplingParams(temperature=0.0, logprobs=2), [], None),
            ("top-p", SamplingParams(top_p=0.8, logprobs=40), [], None),
            ("plain", SamplingParams(), [], None),
            ("thinking", SamplingParams(seed=7, thinking_budget=1, thinking_start_token_ids=[11],
                                        thinking_end_token_ids=[12, 13]), [11], None)]


@pytest.mark.parametrize("mode", ["raw", "processed", "raw_logits", "processed_logits"])
def test_steps_never_sync(sampler, mode):
    batch = build(sampler, mixed_requests(), eos_token_id=9, logprobs_mode=mode)
    logits = torch.randn((len(batch), V), device="cuda", dtype=torch.bfloat16) * 4
    sampler.step(logits, batch)                              # warm-up: caches, lazy inits
    torch.cuda.synchronize()
    with no_host_sync("cuda"):
        for _ in range(3):
            out = sampler.step(logits, batch)
            sampler.step(logits[: batch.num_requests], batch)
    assert bool(((out.token_ids >= 0) & (out.token_ids < V)).all())


def test_graph_replays_never_sync(sampler):
    runner = GraphedSampler(sampler, sizes=(8,))
    batch = build(sampler, mixed_requests(), eos_token_id=9)
    logits = torch.randn((len(batch), V), device="cuda") * 4
    runner.step(logits, batch)                               # capture
    torch.cuda.synchronize()
    with no_host_sync("cuda"):
        for _ in range(3):
            runner.step(logits, batch)
    assert runner.captures == 1


def test_graph_replays_with_the_fourth_releases_samplers_never_sync(sampler):
    """New filters, a request's own order and both selectors in a captured step; the appends
    between replays advance the selectors' state from the graph's selector source."""
    runner = GraphedSampler(sampler, sizes=(16,))
    requests = mixed_requests() + engine_requests()[-4:]
    batch = build(sampler, requests, eos_token_id=9)
    logits = torch.randn((len(batch), V), device="cuda") * 4
    runner.step(logits, batch)                               # capture
    torch.cuda.synchronize()
    with no_host_sync("cuda"):
        for _ in range(3):
            out = runner.step(logits, batch)
    assert runner.captures == 1 and runner.stats["eager_steps"] == 0
    assert out.selector_source is not None
    assert batch.sampler_state("mirostat")[0][0] != pytest.approx(6.0)


def test_graph_replays_draw_fresh_unseeded_tokens(sampler):
    runner = GraphedSampler(sampler, sizes=(4,))
    requests = [(f"u{i}", SamplingParams(top_k=1000, top_p=0.99), [], None) for i in range(4)]
    batch = build(sampler, requests)
    flat = torch.zeros((4, V), device="cuda")                # every token equally likely
    draws = torch.stack([runner.sample(flat, batch).token_ids for _ in range(8)])
    assert runner.captures == 1
    assert len(set(draws.flatten().tolist())) > 16, "replays repeat the same random numbers"


CONFIGS = {
    "top_k_top_p_min_p": dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.01),
    # the fourth release's filters before steps 12-13 run in torch ahead of the fused kernels
    "fourth_before_top_k": dict(temperature=0.9, dynatemp_range=0.5, smoothing_factor=0.3, top_a=0.02,
                                epsilon_cutoff=0.0005, eta_cutoff=0.001, top_k=50, top_p=0.9),
    "top_p": dict(top_p=0.7, temperature=1.2),
    "top_k": dict(top_k=20),
    "plain": dict(temperature=1.5),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_flashinfer_draws_follow_the_torch_path(fi_sampler, torch_sampler, config):
    vocab, rows, calls = 1000, 4096, 10
    params = SamplingParams(**CONFIGS[config])
    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn((1, vocab), generator=gen) * 2).cuda()
    probe = build(torch_sampler, [("p", params, [], None)], vocab=vocab)
    final = torch_sampler.processed_logits(logits, probe)[0].cpu()
    probs = torch.softmax(final, dim=-1)
    kept = probs > 0
    batch = build(fi_sampler, [(f"d{i}", params, [], None) for i in range(rows)], vocab=vocab)
    counts = torch.zeros(vocab, dtype=torch.long)
    for _ in range(calls):
        ids = fi_sampler.sample(logits.expand(rows, -1), batch).token_ids.cpu()
        counts += torch.bincount(ids, minlength=vocab)
    outside = torch.nonzero((counts > 0) & ~kept).flatten().tolist()
    assert not outside, f"FlashInfer drew tokens the torch path drops: {outside[:10]}"
    p = chi_square_p_value(counts[kept], probs[kept])
    assert p > 1e-6, f"FlashInfer draws differ from the torch path's distribution (p={p:.2e})"


def test_flashinfer_top_k_first_fast_path(torch_sampler):
    fast = CudaSampler("cuda", top_k_first=True)
    if fast.path != "flashinfer":
        pytest.skip(fast.path_reason)
    vocab, rows, calls = 128256, 2048, 10
    params = SamplingParams(top_k=50, top_p=0.9, temperature=0.7)
    gen = torch.Generator().manual_seed(12)
    logits = (torch.randn((1, vocab), generator=gen) * 3).cuda()   # float32: no exact ties
    final = torch_sampler.processed_logits(logits, build(torch_sampler, [("p", params, [], None)], vocab=vocab))[0].cpu()
    probs = torch.softmax(final, dim=-1)
    kept = probs > 0
    batch = build(fast, [(f"d{i}", params, [], None) for i in range(rows)], vocab=vocab)
    counts = torch.zeros(vocab, dtype=torch.long)
    for _ in range(calls):
        counts += torch.bincount(fast.sample(logits.expand(rows, -1), batch).token_ids.cpu(), minlength=vocab)
    assert not ((counts > 0) & ~kept).any()
    assert chi_square_p_value(counts[kept], probs[kept]) > 1e-6


# ---------------------------------------------------------------------------- engine features
def verify_inputs(batch, K: int, seed: int = 0):
    """Device logits [B, K+1, V], drafts (one short row), draft probs and a bitmask."""
    from corelib.bitmask import pack_bitmask
    B = len(batch)
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn((B, K + 1, V), generator=gen) * 4).cuda()
    ids = torch.randint(V, (B, K), generator=gen)
    ids[0, 1:] = -1
    probs = torch.softmax(torch.randn((B, K, V), generator=gen), dim=-1)
    allowed = torch.rand((B, K + 1, V), generator=gen) < 0.7
    return logits, ids.cuda(), probs.cuda(), pack_bitmask(allowed).cuda()


ENGINE = dict(FULL, dry_multiplier=0.8, top_n_sigma=3.0, typical_p=0.95, xtc_probability=0.5,
              xtc_threshold=0.05)


#: The fourth release: new filters, a request's own order, both stateful selectors.
FOURTH = dict(temperature=0.8, dynatemp_range=0.4, smoothing_factor=0.3, top_a=0.02, epsilon_cutoff=0.0005,
              eta_cutoff=0.001, tfs=0.95, p_less="norm", top_k=50, top_p=0.9)
ORDERED = dict(sampler_order=["top_p", "min_p", "temperature", "top_k"], top_p=0.9, min_p=0.02, top_k=40,
               temperature=0.7)


def engine_requests():
    return mixed_requests() + [("engine", SamplingParams(**ENGINE), [1, 2, 3, 1, 2], None),
                               ("engine-seeded", SamplingParams(**ENGINE, seed=9), [1, 2], None),
                               ("fourth", SamplingParams(**FOURTH), [1, 2], None),
                               ("ordered", SamplingParams(**ORDERED, seed=10), [3], None),
                               ("mirostat", SamplingParams(mirostat_tau=3.0, seed=11), [], None),
                               ("adaptive", SamplingParams(adaptive_p_target=0.3, min_p=0.01), [4], None)]


@pytest.mark.parametrize("with_probs, method", [(False, "token"), (True, "token"), (True, "block")],
                         ids=["match", "ratio", "block"])
def test_verify_and_append_never_sync(sampler, with_probs, method):
    batch = build(sampler, engine_requests(), eos_token_id=9)
    K = 4
    logits, ids, probs, mask = verify_inputs(batch, K)
    probs = probs if with_probs else None
    batch.append(sampler.verify(logits, batch, ids, probs, token_bitmask=mask, method=method).token_ids)
    torch.cuda.synchronize()
    with no_host_sync("cuda"):
        for _ in range(3):
            out = sampler.verify(logits, batch, ids, probs, token_bitmask=mask, method=method)
            batch.append(out.token_ids)
            step = sampler.sample(logits[:, 0], batch, token_bitmask=mask[:, 0])
            batch.append(step.token_ids)
    assert bool(((out.num_emitted >= 1) & (out.num_emitted <= K + 1)).all())


def test_a_host_bitmask_is_copied_without_a_sync(sampler):
    """The host mask is pageable (as engines fill it): the sampler must stage it in pinned
    memory. torch's sync debug mode cannot see a pageable copy (the driver stages it
    synchronously without a sync call), so the check is the detector's, shown to catch the
    direct copy first."""
    batch = build(sampler, engine_requests(), eos_token_id=9)
    logits, _, _, mask = verify_inputs(batch, 0)
    host = mask[:, 0].cpu()
    assert not host.is_pinned()
    with pytest.raises(HostSyncError, match="pageable"):
        with no_host_sync("cuda"):
            host.to("cuda", non_blocking=True)
    sampler.sample(logits[:, 0], batch, token_bitmask=host)
    torch.cuda.synchronize()
    with no_host_sync("cuda"):
        sampler.step(logits[:, 0], batch)
        out = sampler.sample(logits[:, 0], batch, token_bitmask=host)
    assert bool(out.valid.any())


def test_membership_changes_upload_without_a_sync(sampler):
    """add, swap_rows, remove and per-request logits on CUDA, under the detector and torch's
    sync debug mode: every host value reaches the device through pinned memory."""
    batch = build(sampler, engine_requests()[:2], eos_token_id=9)
    torch.cuda.synchronize()
    with no_host_sync("cuda"):
        for rid, params, prompt, outputs in engine_requests()[2:]:
            batch.add(rid, params, prompt_token_ids=prompt, output_token_ids=outputs)
        batch.swap_rows(0, 2)
        batch.remove("full-seeded")
        out = sampler.sample(torch.randn((batch.num_requests, V), device="cuda"), batch)
        batch.append(out.token_ids)
    assert out.token_ids.shape == (batch.num_rows,)


def test_the_bitmask_runs_the_triton_kernel(torch_sampler):
    """Where Triton imports, its first launch (at start-up) must succeed here; the probe's
    status names the path either way."""
    from corelib_cuda.bitmask import triton_import_error
    from corelib_cuda.probe import probe
    assert f"token bitmask: {torch_sampler.bitmask_path}" in probe().reason
    if triton_import_error() is not None:
        pytest.skip(f"triton unavailable on this GPU machine: {triton_import_error()}")
    assert torch_sampler.bitmask_path == "triton"


def test_the_row_sums_run_the_triton_kernel_with_the_bits_of_the_row_alone(torch_sampler):
    """Where Triton imports, the row-sum kernel's first launch must succeed here; a row's sum
    then has the same bits alone, among 8 and among 64 rows (what keeps ``score`` over
    positions bitwise equal to single steps), within the kernel's bound of torch's sum, with
    no host sync, and the same bits replayed from a CUDA graph."""
    from corelib_cuda.bitmask import triton_import_error
    from corelib_cuda.probe import probe
    from corelib_cuda.row_sum import error_bound
    assert f"row sums: {torch_sampler.row_sum_path}" in probe().reason
    if triton_import_error() is not None:
        pytest.skip(f"triton unavailable on this GPU machine: {triton_import_error()}")
    assert torch_sampler.row_sum_path == "triton"
    gen = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.float64):
        x = (torch.randn((64, 128256), generator=gen) * 3).to(dtype).cuda()
        with no_host_sync("cuda"):
            whole = torch_sampler.row_sum(x)
            parts = [(i, torch_sampler.row_sum(x[i:i + 1])[0]) for i in (0, 7, 63)]
            parts += [(i, torch_sampler.row_sum(x[56:64])[i - 56]) for i in (56, 63)]
        for i, got in parts:
            assert torch.equal(got.cpu(), whole[i].cpu()), (dtype, i)
        off = (whole.double() - x.sum(dim=-1).double()).abs().cpu()
        assert bool((off <= 2 * error_bound(x.cpu())).all()), dtype
        static = x[:8].clone()
        eager = torch_sampler.row_sum(static, keepdim=True)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = torch_sampler.row_sum(static, keepdim=True)
        static.copy_(x[8:16])
        graph.replay()
        assert torch.equal(captured, torch_sampler.row_sum(x[8:16], keepdim=True)), dtype
        assert torch.equal(eager, whole[:8, None]), dtype


@pytest.mark.parametrize("with_probs", [False, True], ids=["match", "ratio"])
def test_graph_verify_replays_never_sync(sampler, with_probs):
    runner = GraphedSampler(sampler, sizes=(16,))          # engine_requests' 13 rows
    batch = build(sampler, engine_requests(), eos_token_id=9)
    K = 3
    logits, ids, probs, mask = verify_inputs(batch, K, seed=1)
    probs = probs if with_probs else None
    batch.append(runner.verify(logits, batch, ids, probs, token_bitmask=mask).token_ids)   # capture
    torch.cuda.synchronize()
    captures = runner.captures
    with no_host_sync("cuda"):
        for _ in range(3):
            out = runner.verify(logits, batch, ids, probs, token_bitmask=mask)
            batch.append(out.token_ids)
    assert bool((out.num_emitted >= 1).all())
    # DRY's history may outgrow its width after the appends (a new address: a new capture);
    # nothing else may.
    assert runner.captures - captures <= 1


def test_verification_keeps_the_target_distribution_on_both_paths(sampler):
    """Unseeded rows with draft probabilities: FlashInfer's chain kernel (flashinfer path) or
    the torch ratio test: the first emitted token follows p at slot 0, draft 0 is accepted at
    rate sum(min(p, q)), and the second emitted token follows p at slot 1, for rows with K
    drafts and for rows with one draft (then it is slot 1's own draw)."""
    vocab, K, R = 64, 3, 16384
    gen = torch.Generator().manual_seed(77)
    target = torch.randn((K + 1, vocab), generator=gen) * 1.5
    q = torch.softmax(torch.randn((K, vocab), generator=gen) * 1.5, dim=-1)
    p = torch.softmax(target, dim=-1)
    ids = torch.stack([torch.multinomial(q[j], R, replacement=True, generator=gen) for j in range(K)], dim=1)
    ids[R // 2:, 1:] = -1                                   # half the rows propose one draft
    batch = build(sampler, [(f"v{i}", SamplingParams(), [], None) for i in range(R)], vocab=vocab)
    out = sampler.verify(target.cuda().expand(R, -1, -1).contiguous(), batch, ids.cuda(),
                         q.cuda().expand(R, -1, -1).contiguous())
    tokens, count = out.token_ids.cpu(), out.num_emitted.cpu()
    assert chi_square_p_value(torch.bincount(tokens[:, 0], minlength=vocab), p[0]) > 1e-6
    accepted = (count >= 2).double().mean()
    expected = torch.minimum(p[0], q[0]).sum().double()
    assert (accepted - expected).abs() <= 5 * (expected * (1 - expected) / R).sqrt()
    for rows in (slice(0, R // 2), slice(R // 2, R)):
        second = tokens[rows][count[rows] >= 2, 1]
        assert chi_square_p_value(torch.bincount(second, minlength=vocab), p[1]) > 1e-6
    assert int(count[R // 2:].max()) <= 2


# ---------------------------------------------------------------------------- issue 16 checks
def test_an_overflowing_row_is_flagged_on_both_paths(sampler):
    """A top-k / top-p row whose logits overflow to +inf at its temperature has no token:
    flagged (-1), never FlashInfer's token 0."""
    vocab = 4096
    logits = torch.randn((2, vocab), device="cuda")
    logits[0, 5] = 3e38
    batch = build(sampler, [("inf", SamplingParams(temperature=0.1, top_k=8, top_p=0.9), [], None),
                            ("ok", SamplingParams(top_k=8, top_p=0.9), [], None)], vocab=vocab)
    out = sampler.sample(logits, batch)
    assert out.valid.tolist() == [False, True] and int(out.token_ids[0]) == -1


def test_strided_draft_probs_verify(sampler):
    batch = build(sampler, [(f"v{i}", SamplingParams(), [], None) for i in range(4)], vocab=1024)
    K = 2
    logits = torch.randn((4, K + 1, 1024), device="cuda")
    buffer = torch.softmax(torch.randn((4, 2 * K, 1024), device="cuda"), dim=-1)
    out = sampler.verify(logits, batch, torch.randint(1024, (4, K), device="cuda"), buffer[:, ::2])
    assert bool(out.valid.all())


def test_graphs_share_one_pool_and_report_their_cost(sampler):
    """Sample graphs at two sizes and a verify graph: one memory pool, one capture each, the
    memory they reserved in the stats; the sampler's outputs stay right after other replays."""
    runner = GraphedSampler(sampler, sizes=(4, 8))
    small = build(sampler, mixed_requests()[:3])
    large = build(sampler, mixed_requests())
    for batch in (small, large, small, large):
        out = runner.sample(torch.randn((len(batch), V), device="cuda"), batch)
        assert bool(((out.token_ids >= 0) & (out.token_ids < V)).all())
    logits, ids, _, _ = verify_inputs(large, 2)
    runner.verify(logits, large, ids)
    graphs = [slot.capture.graph for slot in runner._slots.values()]
    assert len(graphs) == 3 and all(g.pool() == runner.graphs.pool for g in graphs)
    stats = runner.stats
    assert stats["captures"] == stats["graphs"] == 3 and stats["replays"] == 5
    assert stats["capture_bytes"] >= 0 and stats["eager_steps"] == 0
    print(f"graph stats: {stats}")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (a sampler on cuda:1 while cuda:0 is current)")
def test_a_sampler_on_a_second_gpu_captures_launches_and_replays_there():
    """cuda:0 current, the sampler on cuda:1: the Triton bitmask kernel, FlashInfer, graph
    capture and replay all run on cuda:1 (seeded tokens equal the eager ones there) and
    allocate nothing on cuda:0."""
    torch.cuda.set_device(0)
    eager = CudaSampler("cuda:1")
    runner = GraphedSampler(CudaSampler("cuda:1"), sizes=(8,))
    requests = [(f"s{i}", SamplingParams(seed=i, top_k=40, top_p=0.9), [], None) for i in range(6)]
    b_graph, b_eager = build(runner, requests), build(eager, requests)
    before = torch.cuda.memory_allocated(0)
    from corelib.bitmask import pack_bitmask
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        logits = torch.randn((6, V), generator=gen).to("cuda:1")
        mask = pack_bitmask(torch.rand((6, V), generator=gen) < 0.5).to("cuda:1")
        got = runner.sample(logits, b_graph, token_bitmask=mask)
        want = eager.sample(logits, b_eager, token_bitmask=mask)
        b_graph.append(got.token_ids)
        b_eager.append(want.token_ids)
        assert got.token_ids.device == torch.device("cuda", 1)
        assert got.token_ids.tolist() == want.token_ids.tolist(), f"step {step}"
    assert runner.stats["replays"] == 3 and torch.cuda.current_device() == 0
    assert torch.cuda.memory_allocated(0) == before, "work landed on cuda:0"


# ---------------------------------------------------------------------------- kept sets, score
def kept_requests():
    """Every row of ``engine_requests`` asks for its kept set, but one."""
    requests = [(rid, params.model_copy(update={"return_kept": True}), prompt, outputs)
                for rid, params, prompt, outputs in engine_requests()]
    rid, params, prompt, outputs = requests[-1]
    return requests[:-1] + [(rid, params.model_copy(update={"return_kept": False}), prompt, outputs)]


def test_kept_sets_and_score_never_sync(sampler):
    """Kept sets out of sample and verify, and ``score`` over T positions with the rollout's
    kept sets and without (ids on the device), under torch's sync debug mode and the detector."""
    batch = build(sampler, kept_requests(), eos_token_id=9)
    K, T, W = 3, 4, (V + 31) // 32
    logits, ids, probs, mask = verify_inputs(batch, K)
    rows = len(batch)
    scored_logits = torch.randn((rows, T, V), device="cuda") * 3
    tokens = torch.randint(V, (rows, T), device="cuda")
    batch.append(sampler.verify(logits, batch, ids, probs, token_bitmask=mask).token_ids)   # warm-up
    rollout = sampler.sample(logits[:, 0], batch, token_bitmask=mask[:, 0])
    sampler.score(scored_logits, batch, tokens)
    torch.cuda.synchronize()
    with no_host_sync("cuda"):
        out = sampler.verify(logits, batch, ids, probs, token_bitmask=mask)
        batch.append(out.token_ids)
        step = sampler.sample(logits[:, 0], batch, token_bitmask=mask[:, 0])
        batch.append(step.token_ids)
        scored = sampler.score(scored_logits, batch, tokens)
        replayed = sampler.score(scored_logits[:, 0], batch, step.token_ids, step.kept)
    assert out.kept.shape == (rows, K + 1, W) and step.kept.shape == (rows, W)
    assert scored.logprobs.shape == (rows, T) and replayed.logprobs.shape == (rows,)
    assert not bool(step.kept[-1].any()) and bool(step.kept[0].any())
    drawn = step.token_ids.clamp(min=0)
    bits = (step.kept.gather(1, (drawn // 32)[:, None])[:, 0] >> (drawn % 32)) & 1
    assert bool((bits[:-1] == step.valid[:-1].int()).all()), "a drawn token is outside its kept set"


def test_graph_replays_with_kept_sets_never_sync(sampler):
    """Kept sets as an output of captured sample and verify steps, replayed without a sync;
    each replay's drawn tokens lie in their kept sets."""
    from corelib.bitmask import unpack_bitmask
    runner = GraphedSampler(sampler, sizes=(16,))
    batch = build(sampler, kept_requests(), eos_token_id=9)
    K = 3
    logits, ids, probs, mask = verify_inputs(batch, K)
    rows = len(batch)
    runner.step(logits[:, 0], batch)                                   # captures
    batch.append(runner.verify(logits, batch, ids, probs).token_ids)
    torch.cuda.synchronize()
    with no_host_sync("cuda"):
        for _ in range(3):
            step = runner.step(logits[:, 0], batch)
            out = runner.verify(logits, batch, ids, probs)
            batch.append(out.token_ids)
    assert runner.captures == 2 and runner.stats["eager_steps"] == 0
    kept = unpack_bitmask(step.kept.cpu(), V)
    tokens, valid = step.token_ids.cpu(), step.valid.cpu()
    for row in range(rows - 1):
        if bool(valid[row]):
            assert bool(kept[row, tokens[row]]), f"row {row}: the drawn token is outside its kept set"
    assert not bool(kept[-1].any())
    assert out.kept.shape == (rows, K + 1, (V + 31) // 32)


@pytest.mark.parametrize("config", ["top_k_top_p_min_p", "fourth_before_top_k", "top_p"])
def test_flashinfer_kept_sets_are_the_torch_paths(fi_sampler, torch_sampler, config):
    """Unseeded rows asking for their kept sets on the FlashInfer path: the torch path's sets
    for the same logits (these filters drop no token at random), FlashInfer's draws inside
    them."""
    from corelib.bitmask import unpack_bitmask
    rows = 64
    params = SamplingParams(**CONFIGS[config], return_kept=True)
    logits = (torch.randn((rows, V), generator=torch.Generator().manual_seed(13)) * 3).cuda()
    got = fi_sampler.sample(logits, build(fi_sampler, [(f"f{i}", params, [], None) for i in range(rows)]))
    want = torch_sampler.sample(logits, build(torch_sampler, [(f"t{i}", params, [], None) for i in range(rows)]))
    assert torch.equal(got.kept, want.kept), "FlashInfer's path keeps other sets than the torch path"
    kept = unpack_bitmask(got.kept.cpu(), V)
    assert bool(kept.gather(1, got.token_ids.cpu()[:, None]).all()), "FlashInfer drew outside a kept set"


def test_score_on_the_gpu_is_differentiable_and_matches_the_reference(torch_sampler):
    """``score`` with gradients on CUDA tensors (DRY's in-place scatter takes the reference's
    form under autograd): values and gradients against the reference's on the same GPU."""
    from corelib import Sampler
    requests = [("a", SamplingParams(seed=1, top_k=40, top_p=0.9, dry_multiplier=0.8, dry_allowed_length=1,
                                     repetition_penalty=1.2), [1, 2, 1, 2], None),
                ("g", SamplingParams(temperature=0.0, presence_penalty=0.5), [3], None)]
    T = 3
    logits = torch.randn((2, T, V), generator=torch.Generator().manual_seed(14)) * 3
    tokens = logits.argmax(-1).cuda()
    results = []
    for sampler in (torch_sampler, Sampler("cuda")):
        x = logits.cuda().requires_grad_()
        out = sampler.score(x, build(sampler, requests), tokens)
        torch.where(torch.isfinite(out.logprobs.detach()), out.logprobs, 0.0).sum().backward()
        results.append((out.logprobs.detach().cpu(), x.grad.cpu()))
    (lp, grad), (ref_lp, ref_grad) = results
    assert torch.allclose(lp, ref_lp, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert torch.allclose(grad, ref_grad, rtol=1e-4, atol=1e-5)
    assert bool(grad.abs().sum() > 0)
