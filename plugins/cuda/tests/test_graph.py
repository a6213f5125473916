"""The graph runner: padded persistent buffers, capture keys, replay with new logits and new
parameter values. On CPU the captured step state is replayed eagerly (the buffer logic); on a
GPU the same tests capture and replay real CUDA graphs."""

from __future__ import annotations

import pytest
import torch
from corelib import SamplingParams

from corelib_cuda import CudaSampler, GraphedSampler
from corelib_cuda.probe import cuda_availability

GPU = cuda_availability()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not GPU.available, reason=f"cuda backend unavailable: {GPU.reason}"))]
V = 1024


@pytest.fixture(params=DEVICES)
def pair(request):
    """(graph runner, eager sampler) on one device; both torch path, so seeded rows must match
    exactly and unseeded rows come from the same kernels."""
    device = request.param
    sampler = CudaSampler(device, use_flashinfer=False)
    return GraphedSampler(sampler, sizes=(4, 8, 16)), CudaSampler(device, use_flashinfer=False)


def logits_for(step: int, rows: int, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return (torch.randn((rows, V), generator=gen) * 3).to(device)


def seeded_requests():
    return [
        ("a", SamplingParams(seed=1, top_k=40, top_p=0.9, temperature=0.8), [1, 2], None),
        ("b", SamplingParams(seed=2, n=2, min_p=0.05), [3], None),
        ("g", SamplingParams(temperature=0.0), [], None),
    ]


def build(sampler, requests, **kwargs):
    batch = sampler.new_batch(V, **kwargs)
    for rid, params, prompt, outputs in requests:
        batch.add(rid, params, prompt_token_ids=prompt, output_token_ids=outputs)
    return batch


def run_both(runner, eager, b_graph, b_eager, steps, start=0):
    for step in range(start, start + steps):
        logits = logits_for(step, len(b_graph), runner.device)
        got = runner.step(logits, b_graph)
        want = eager.step(logits, b_eager)
        assert got.token_ids.shape == (len(b_graph),)
        assert got.token_ids.tolist() == want.token_ids.tolist(), f"step {step}"
        assert got.valid.tolist() == want.valid.tolist()


def test_replays_match_the_eager_sampler_over_steps(pair):
    runner, eager = pair
    b_graph, b_eager = build(runner, seeded_requests()), build(eager, seeded_requests())
    run_both(runner, eager, b_graph, b_eager, steps=4)      # 4 rows, padded size 4
    assert runner.captures == 1


def test_new_parameter_values_replay_without_a_new_capture(pair):
    runner, eager = pair
    b_graph, b_eager = build(runner, seeded_requests()), build(eager, seeded_requests())
    run_both(runner, eager, b_graph, b_eager, steps=2)
    for batch in (b_graph, b_eager):      # same flags and bounds bucket, other values
        batch.remove("a")
        batch.add("a2", SamplingParams(seed=9, top_k=33, top_p=0.5, temperature=1.4), [5])
    run_both(runner, eager, b_graph, b_eager, steps=3, start=2)
    assert runner.captures == 1


def test_host_state_changes_recapture(pair):
    runner, eager = pair
    b_graph, b_eager = build(runner, seeded_requests()), build(eager, seeded_requests())
    run_both(runner, eager, b_graph, b_eager, steps=1)
    penalised = SamplingParams(seed=4, repetition_penalty=1.5, frequency_penalty=1.0,
                               logit_bias={0: 50.0})   # new optional tensors: new addresses
    for batch in (b_graph, b_eager):
        batch.add("p", penalised, [7, 8, 9])
    run_both(runner, eager, b_graph, b_eager, steps=2, start=1)
    assert runner.captures == 2                    # 5 rows: padded size 8, a new key
    for batch in (b_graph, b_eager):
        batch.add("k", SamplingParams(seed=5, top_k=300), [])   # candidates 64 -> 512
    run_both(runner, eager, b_graph, b_eager, steps=1, start=3)
    assert runner.captures == 3


def test_min_tokens_flip_inside_one_capture(pair):
    runner, eager = pair
    eos = 6
    requests = [("m", SamplingParams(seed=3, min_tokens=3, stop_token_ids=[5]), [], None),
                ("n", SamplingParams(seed=4), [], None)]
    b_graph, b_eager = build(runner, requests, eos_token_id=eos), build(eager, requests, eos_token_id=eos)
    for step in range(5):
        logits = logits_for(step, 2, runner.device)
        logits[:, [5, eos]] = 100.0               # stop tokens win as soon as they are allowed
        got = runner.step(logits, b_graph).token_ids.tolist()
        want = eager.step(logits, b_eager).token_ids.tolist()
        assert got == want
        if step < 3:
            assert got[0] not in (5, eos), f"stop token drawn at step {step}"
        else:
            assert got[0] in (5, eos)
    assert runner.captures == 1


def test_per_request_logits_and_oversized_batches(pair):
    runner, eager = pair
    requests = [("a", SamplingParams(seed=1, n=3), [], None), ("b", SamplingParams(seed=2), [], None)]
    b_graph, b_eager = build(runner, requests), build(eager, requests)
    per_request = logits_for(0, 2, runner.device)
    assert runner.sample(per_request, b_graph).token_ids.tolist() == \
        eager.sample(per_request, b_eager).token_ids.tolist()
    big = [(f"r{i}", SamplingParams(seed=i), [], None) for i in range(20)]   # > largest size 16
    b_big, b_big_eager = build(runner, big), build(eager, big)
    before = runner.captures
    logits = logits_for(1, 20, runner.device)
    assert runner.sample(logits, b_big).token_ids.tolist() == eager.sample(logits, b_big_eager).token_ids.tolist()
    assert runner.captures == before


def test_stale_padding_rows_are_inert(pair):
    runner, eager = pair
    full = [(f"r{i}", SamplingParams(seed=i), [], None) for i in range(4)]
    b_graph = build(runner, full)
    nan_logits = torch.full((4, V), float("nan"), device=runner.device)
    assert runner.sample(nan_logits, b_graph).valid.tolist() == [False] * 4
    b_graph.remove("r3")                 # 3 rows: the 4th buffer row still holds NaNs
    b_eager = build(eager, full[:3])
    logits = logits_for(2, 3, runner.device)
    out = runner.sample(logits, b_graph)
    assert out.valid.tolist() == [True] * 3
    assert out.token_ids.tolist() == eager.sample(logits, b_eager).token_ids.tolist()
    assert runner.captures == 1


def test_rejects_bad_arguments():
    with pytest.raises(TypeError, match="CudaSampler"):
        GraphedSampler(object())
    with pytest.raises(ValueError, match="sizes"):
        GraphedSampler(CudaSampler("cpu"), sizes=(0, 4))
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        GraphedSampler(CudaSampler("cpu"), use_graphs=True)


# ---------------------------------------------------------------------------- bitmask
def random_mask(rows: int, seed: int, slots: int = 0) -> torch.Tensor:
    from corelib.bitmask import pack_bitmask
    gen = torch.Generator().manual_seed(seed)
    shape = (rows, slots, V) if slots else (rows, V)
    allowed = torch.rand(shape, generator=gen) < 0.5
    return pack_bitmask(allowed)


def test_bitmask_replays_and_stays_on_without_a_new_capture(pair):
    runner, eager = pair
    b_graph, b_eager = build(runner, seeded_requests()), build(eager, seeded_requests())
    for step in range(4):
        logits = logits_for(step, 4, runner.device)
        mask = random_mask(4, seed=step).to(runner.device) if step % 2 == 1 else None
        got = runner.step(logits, b_graph, token_bitmask=mask)
        want = eager.sample(logits, b_eager, token_bitmask=mask)
        b_eager.append(want.token_ids)
        assert got.token_ids.tolist() == want.token_ids.tolist(), f"step {step}"
    assert runner.captures == 2          # the first unmasked step, then the masked capture


# ---------------------------------------------------------------------------- verify
def verify_requests():
    return [
        ("a", SamplingParams(seed=1, top_k=40, top_p=0.9, temperature=0.8, repetition_penalty=1.2,
                             dry_multiplier=0.5, typical_p=0.95, xtc_probability=0.5, logprobs=2), [1, 2], None),
        ("b", SamplingParams(seed=2, n=2, min_p=0.05, min_tokens=2, stop_token_ids=[5]), [3], None),
        ("g", SamplingParams(temperature=0.0, frequency_penalty=0.5), [], None),
    ]


def drafts_for(step: int, rows: int, K: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2000 + step)
    ids = torch.randint(V, (rows, K), generator=gen)
    ids[0, K // 2:] = -1                                     # a short row
    probs = torch.softmax(torch.randn((rows, K, V), generator=gen), dim=-1)
    return ids.to(device), probs.to(device)


@pytest.mark.parametrize("with_probs", [False, True], ids=["match", "ratio"])
def test_verify_replays_match_the_eager_sampler(pair, with_probs):
    runner, eager = pair
    b_graph, b_eager = build(runner, verify_requests(), eos_token_id=6), build(eager, verify_requests(), eos_token_id=6)
    K = 3
    for step in range(4):
        rows = len(b_graph)
        logits = torch.stack([logits_for(10 * step + j, rows, runner.device) for j in range(K + 1)], dim=1)
        ids, probs = drafts_for(step, rows, K, runner.device)
        if step == 1:                                        # the drafts the target would emit
            ids = torch.argmax(logits, dim=-1)[:, :K]
        probs = probs if with_probs else None
        mask = random_mask(rows, seed=step, slots=K + 1).to(runner.device) if step >= 2 else None
        got = runner.verify(logits, b_graph, ids, probs, token_bitmask=mask)
        want = eager.verify(logits, b_eager, ids, probs, token_bitmask=mask)
        assert got.token_ids.tolist() == want.token_ids.tolist(), f"step {step}"
        assert got.num_emitted.tolist() == want.num_emitted.tolist()
        assert torch.allclose(got.logprobs.logprobs.nan_to_num(), want.logprobs.logprobs.nan_to_num())
        b_graph.append(got.token_ids)
        b_eager.append(want.token_ids)
    assert runner.captures == 2          # unmasked, then masked (4 rows, K = 3)


def test_verify_captures_per_size_and_k(pair):
    runner, eager = pair
    b_graph, b_eager = build(runner, verify_requests()), build(eager, verify_requests())
    for K in (2, 4, 2):
        logits = torch.stack([logits_for(j, 4, runner.device) for j in range(K + 1)], dim=1)
        ids, _ = drafts_for(K, 4, K, runner.device)
        got = runner.verify(logits, b_graph, ids)
        want = eager.verify(logits, b_eager, ids)
        assert got.token_ids.tolist() == want.token_ids.tolist()
    assert runner.captures == 2          # K = 2 and K = 4; the second K = 2 call replays
    b_graph.remove("g")                  # 3 rows: still padded to 4, same key
    b_eager.remove("g")
    logits = torch.stack([logits_for(j, 3, runner.device) for j in range(3)], dim=1)
    ids, _ = drafts_for(7, 3, 2, runner.device)
    assert runner.verify(logits, b_graph, ids).token_ids.tolist() == \
        eager.verify(logits, b_eager, ids).token_ids.tolist()


def test_verify_checks_arguments_before_any_replay(pair):
    runner, _ = pair
    batch = build(runner, verify_requests())
    logits = torch.stack([logits_for(j, 4, runner.device) for j in range(3)], dim=1)
    with pytest.raises(ValueError, match="draft_token_ids"):
        runner.verify(logits, batch, torch.zeros((4, 3), dtype=torch.long, device=runner.device))
    with pytest.raises(ValueError, match="token_bitmask"):
        runner.verify(logits, batch, torch.zeros((4, 2), dtype=torch.long, device=runner.device),
                      token_bitmask=torch.zeros((4, 2, V // 32), dtype=torch.int32))
    assert batch.generated_counts() == [0, 0, 0, 0]


# ---------------------------------------------------------------------------- fourth release
def fourth_requests():
    """The new filters, a request's own order and both stateful selectors, seeded (so the
    graph's tokens must be the eager sampler's), beside a greedy row."""
    return [
        ("f", SamplingParams(seed=1, dynatemp_range=0.5, smoothing_factor=0.3, top_a=0.05,
                             epsilon_cutoff=0.0005, eta_cutoff=0.001, tfs=0.95, p_less="norm",
                             top_k=64, logprobs=2), [1, 2], None),
        ("o", SamplingParams(seed=2, sampler_order=["top_p", "min_p", "temperature", "top_k"],
                             top_p=0.8, min_p=0.02, temperature=0.7, top_k=30), [3], None),
        ("m", SamplingParams(seed=3, mirostat_tau=2.0, mirostat_eta=0.3, n=2), [], None),
        ("a", SamplingParams(seed=4, adaptive_p_target=0.2, adaptive_p_decay=0.8, min_p=0.01), [4], None),
        ("g", SamplingParams(temperature=0.0), [], None),
    ]


def selector_states(batch):
    return [batch.sampler_state(rid) for rid in ("m", "a")]


def test_replays_with_the_fourth_releases_samplers_match_the_eager_sampler(pair):
    """Sample and verify steps with the new filters, a custom order and both selectors: the
    tokens and, after every append, the selectors' state are the eager sampler's; the state
    moves every step (an input the replays read from the batch, so no step captures again)."""
    runner, eager = pair
    b_graph, b_eager = build(runner, fourth_requests()), build(eager, fourth_requests())
    seen = [selector_states(b_graph)]
    for step in range(4):
        logits = logits_for(step, len(b_graph), runner.device)
        assert runner.step(logits, b_graph).token_ids.tolist() == eager.step(logits, b_eager).token_ids.tolist()
        assert selector_states(b_graph) == selector_states(b_eager), f"step {step}"
        seen.append(selector_states(b_graph))
    assert runner.captures == 1
    K = 3
    for step in range(3):
        rows = len(b_graph)
        logits = torch.stack([logits_for(30 + 10 * step + j, rows, runner.device) for j in range(K + 1)], dim=1)
        ids = torch.argmax(logits, dim=-1)[:, :K] if step == 0 else drafts_for(step, rows, K, runner.device)[0]
        got = runner.verify(logits, b_graph, ids)
        want = eager.verify(logits, b_eager, ids)
        assert got.token_ids.tolist() == want.token_ids.tolist(), f"verify step {step}"
        assert got.selector_source.shape == (rows * (K + 1), V)
        b_graph.append(got.token_ids)
        b_eager.append(want.token_ids)
        assert selector_states(b_graph) == selector_states(b_eager), f"verify step {step}"
        seen.append(selector_states(b_graph))
    assert runner.captures == 2
    mu = [state[0][0][0] for state in seen]
    assert len(set(mu)) == len(mu), "mirostat's mu must move at every step"


def test_replays_hand_the_batch_a_copy_of_the_selector_source():
    """A replay's outputs live in the graphs' shared pool, which the next replay of another
    graph may reuse before ``append`` reads the source: the runner returns copies."""
    from corelib_cuda.graph import _first_rows, _first_verify_rows
    from corelib.outputs import SamplerOutput, VerifyOutput
    source = torch.randn(8, 16)
    static = SamplerOutput(torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.bool), None, source[:4])
    out = _first_rows(static, 3)
    assert out.selector_source.shape == (3, 16) and out.selector_source.data_ptr() != source.data_ptr()
    static = VerifyOutput(torch.zeros(4, 2, dtype=torch.long), torch.ones(4, dtype=torch.long),
                          torch.ones(4, dtype=torch.bool), None, source)
    out = _first_verify_rows(static, 3, 2)
    assert torch.equal(out.selector_source, source[:6]) and out.selector_source.data_ptr() != source.data_ptr()
    assert _first_rows(SamplerOutput(torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.bool)), 1).selector_source is None


# ---------------------------------------------------------------------------- kept sets, score
def kept_requests():
    """Seeded rows that ask for their kept sets (top-k with top-p, XTC's coin, mirostat's
    truncation), a greedy one; the rows of ``seeded_requests`` do not ask."""
    return [
        ("ka", SamplingParams(seed=11, top_k=40, top_p=0.9, temperature=0.8, return_kept=True), [1, 2], None),
        ("kx", SamplingParams(seed=12, min_p=0.02, xtc_probability=0.5, xtc_threshold=0.01,
                              return_kept=True), [3], None),
        ("km", SamplingParams(seed=13, mirostat_tau=2.0, mirostat_eta=0.3, return_kept=True), [], None),
        ("kg", SamplingParams(temperature=0.0, repetition_penalty=1.2, return_kept=True), [], None),
    ]


def assert_same_kept(got, want, shape, where):
    assert got.kept is not None and tuple(got.kept.shape) == shape, where
    assert torch.equal(got.kept.cpu(), want.kept.cpu()), f"{where}: kept sets differ from the eager sampler's"


def test_kept_sets_are_an_output_of_the_captured_steps(pair):
    """Sample and verify replays give the eager sampler's tokens and kept bits, for every kind
    of row (a kept set with a random part, XTC's coin and mirostat's, included)."""
    from corelib.bitmask import bitmask_width, unpack_bitmask
    runner, eager = pair
    W = bitmask_width(V)
    requests = kept_requests() + seeded_requests()     # 4 + 4 rows: padded size 8
    b_graph, b_eager = build(runner, requests), build(eager, requests)
    rows = len(b_graph)
    for step in range(3):
        logits = logits_for(step, rows, runner.device)
        got, want = runner.step(logits, b_graph), eager.step(logits, b_eager)
        assert got.token_ids.tolist() == want.token_ids.tolist(), f"step {step}"
        assert_same_kept(got, want, (rows, W), f"step {step}")
    kept = unpack_bitmask(got.kept.cpu(), V)
    asking = {rid for rid, *_ in kept_requests()}
    for row, (rid, _) in enumerate(b_graph.rows):
        if rid not in asking:
            assert not bool(kept[row].any()), f"row {rid!r} did not ask"
        else:
            assert bool(kept[row, got.token_ids[row]]), f"row {rid!r}: its token is outside its kept set"
        if rid == "kg":
            assert int(kept[row].sum()) == 1, "a greedy row keeps its argmax alone"
    K = 3
    for step in range(2):
        logits = torch.stack([logits_for(40 + 10 * step + j, rows, runner.device) for j in range(K + 1)], dim=1)
        ids, probs = drafts_for(step, rows, K, runner.device)
        if step == 0:                            # drafts the target would emit: slots reached
            ids = torch.argmax(logits, dim=-1)[:, :K]
        got, want = runner.verify(logits, b_graph, ids, probs), eager.verify(logits, b_eager, ids, probs)
        assert got.token_ids.tolist() == want.token_ids.tolist(), f"verify step {step}"
        assert_same_kept(got, want, (rows, K + 1, W), f"verify step {step}")
        b_graph.append(got.token_ids)
        b_eager.append(want.token_ids)
    assert runner.captures == 2 and runner.stats["eager_steps"] == 0


def test_asking_for_kept_sets_is_part_of_the_capture_key(pair):
    """Whether any row asks (``any_kept``) is host state: a row that asks, joining rows that
    do not (same size, same flags otherwise), captures the step again, and so does its
    leaving; each capture's outputs say so (kept bits, then None)."""
    runner, eager = pair
    plain = seeded_requests()[:2]                          # 3 rows: padded size 4
    asking = ("ka", SamplingParams(seed=11, top_k=40, top_p=0.9, temperature=0.8, return_kept=True), [1], None)
    b_graph, b_eager = build(runner, plain), build(eager, plain)
    outs = []
    for step, change in enumerate((None, "add", None, "remove", None)):
        for batch in (b_graph, b_eager):
            if change == "add":
                batch.add(asking[0], asking[1], prompt_token_ids=asking[2])
            elif change == "remove":
                batch.remove(asking[0])
        logits = logits_for(step, len(b_graph), runner.device)
        got, want = runner.step(logits, b_graph), eager.step(logits, b_eager)
        assert got.token_ids.tolist() == want.token_ids.tolist(), f"step {step}"
        assert (got.kept is None) == (want.kept is None), f"step {step}"
        if got.kept is not None:
            assert torch.equal(got.kept.cpu(), want.kept.cpu()), f"step {step}"
        outs.append((got.kept is not None, runner.captures))
    assert outs == [(False, 1), (True, 2), (True, 2), (False, 3), (False, 3)]


def test_score_runs_the_eager_sampler():
    """``score`` is not a decode step: the runner hands it to its sampler, counted as an eager
    step, with the sampler's values and gradients."""
    runner = GraphedSampler(CudaSampler("cpu", use_flashinfer=False), sizes=(4,), use_graphs=False)
    eager = CudaSampler("cpu", use_flashinfer=False)
    requests = [("a", SamplingParams(seed=1, top_k=40, top_p=0.9, dry_multiplier=0.8), [1, 2, 1], None),
                ("g", SamplingParams(temperature=0.0), [], None)]
    logits = torch.stack([logits_for(j, 2, "cpu") for j in range(3)], dim=1)
    tokens = torch.argmax(logits, dim=-1)
    outs, grads = [], []
    for sampler in (runner, eager):
        x = logits.clone().requires_grad_()
        out = sampler.score(x, build(sampler, requests), tokens)
        out.logprobs.sum().backward()
        outs.append(out.logprobs.detach())
        grads.append(x.grad)
    assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1])
    assert bool(grads[0].abs().sum() > 0)
    assert runner.stats["eager_steps"] == 1 and runner.captures == 0
    assert GraphedSampler.differentiable_score == CudaSampler.differentiable_score


# ---------------------------------------------------------------------------- graph limit, stats
def test_at_most_max_graphs_are_held_and_further_steps_run_eagerly():
    """Two graphs at most: a third size runs eagerly (and gives the eager tokens); a new key in
    a slot that has a graph still captures again, replacing it."""
    runner = GraphedSampler(CudaSampler("cpu", use_flashinfer=False), sizes=(1, 2, 4), use_graphs=False,
                            max_graphs=2)
    eager = CudaSampler("cpu", use_flashinfer=False)
    for rows in (1, 2, 3):
        requests = [(f"r{i}", SamplingParams(seed=i), [], None) for i in range(rows)]
        b_graph, b_eager = build(runner, requests), build(eager, requests)
        logits = logits_for(rows, rows, "cpu")
        assert runner.sample(logits, b_graph).token_ids.tolist() == eager.sample(logits, b_eager).token_ids.tolist()
    stats = runner.stats
    assert (stats["captures"], stats["graphs"], stats["replays"], stats["eager_steps"]) == (2, 2, 2, 1)
    assert stats["max_graphs"] == 2 and stats["capture_bytes"] == 0
    b_new = build(runner, [("p", SamplingParams(seed=1, repetition_penalty=1.3), [4], None)])
    runner.sample(logits_for(9, 1, "cpu"), b_new)                 # size 1, a new key: recaptured
    assert (runner.stats["captures"], runner.stats["graphs"], runner.stats["eager_steps"]) == (3, 2, 1)
    with pytest.raises(ValueError, match="max_graphs"):
        GraphedSampler(CudaSampler("cpu"), max_graphs=0)


def test_oversized_batches_count_as_eager_steps():
    runner = GraphedSampler(CudaSampler("cpu", use_flashinfer=False), sizes=(2,), use_graphs=False)
    batch = build(runner, [(f"r{i}", SamplingParams(seed=i), [], None) for i in range(3)])
    runner.sample(logits_for(0, 3, "cpu"), batch)
    ids = torch.zeros((3, 2), dtype=torch.long)
    runner.verify(torch.stack([logits_for(j, 3, "cpu") for j in range(3)], dim=1), batch, ids)
    assert runner.stats["eager_steps"] == 2 and runner.stats["captures"] == 0


class FakeCudaGraphApi:
    """torch.cuda's device, stream and graph API as recorded calls, for a machine without a
    GPU: which device and stream were current at each capture, warm-up and replay, which pool
    each capture used, and every device synchronisation or cache flush."""

    def __init__(self, monkeypatch):
        api = self
        self.current_device = 0
        self.current_stream = None
        self.synchronized, self.emptied, self.pools = [], 0, []
        self.reserved = 0

        class Stream:
            def __init__(self, device=None, priority=0):
                self.device = torch.device(device) if device is not None else torch.device("cuda", api.current_device)

            def wait_stream(self, other):
                pass

        class device:
            def __init__(self, d):
                self.index = torch.device(d).index

            def __enter__(self):
                self.previous, api.current_device = api.current_device, self.index

            def __exit__(self, *exc):
                api.current_device = self.previous

        class stream:
            def __init__(self, s):
                self.s = s

            def __enter__(self):
                self.previous, api.current_stream = api.current_stream, self.s

            def __exit__(self, *exc):
                api.current_stream = self.previous

        class CUDAGraph:
            def __init__(self):
                self.captured_on, self.replayed_on, self.ended = None, [], False

            def register_generator_state(self, generator):
                self.generator = generator

            def capture_begin(self, pool=None, capture_error_mode="global"):
                self.captured_on = (api.current_device, api.current_stream.device.index, pool)

            def capture_end(self):
                self.ended = True
                api.reserved += 4096                     # what the graph's pool took

            def replay(self):
                self.replayed_on.append(api.current_device)

        def graph_pool_handle():
            handle = ("pool", api.current_device, len(api.pools))
            api.pools.append(handle)
            return handle

        def forbidden(*args, **kwargs):
            raise AssertionError("torch.cuda.graph synchronises and empties the cache: not used")

        self.Stream, self.device = Stream, device
        for name, value in dict(Stream=Stream, device=device, stream=stream, CUDAGraph=CUDAGraph,
                                graph_pool_handle=graph_pool_handle, graph=forbidden,
                                current_stream=lambda d=None: Stream(d),
                                memory_reserved=lambda d=None: api.reserved,
                                synchronize=lambda d=None: api.synchronized.append(d),
                                empty_cache=lambda: setattr(api, "emptied", api.emptied + 1)).items():
            monkeypatch.setattr(torch.cuda, name, value)


@pytest.fixture
def fake_cuda(monkeypatch):
    return FakeCudaGraphApi(monkeypatch)


def test_captures_warm_ups_and_replays_run_on_the_samplers_device(fake_cuda):
    """A runner on cuda:1 while cuda:0 is current: every warm-up, capture and replay runs with
    cuda:1 current and on a stream of cuda:1; all graphs share one pool; the device is never
    synchronised and no cache is emptied; cuda:0 is current again afterwards."""
    from corelib_cuda.graph import CudaGraphs
    graphs = CudaGraphs(torch.device("cuda", 1), warmup=2)
    seen = []

    def run():
        seen.append((fake_cuda.current_device, fake_cuda.current_stream.device.index))
        return "outputs"

    first, out = graphs.capture(run)
    second, _ = graphs.capture(run)
    graphs.replay(first)
    graphs.replay(second)
    assert out == "outputs" and seen == [(1, 1)] * 6            # 2 x (2 warm-ups + 1 capture)
    assert first.captured_on[:2] == second.captured_on[:2] == (1, 1)
    assert first.captured_on[2] == second.captured_on[2] == graphs.pool == fake_cuda.pools[0]
    assert len(fake_cuda.pools) == 1 and fake_cuda.pools[0][1] == 1   # one pool, made on cuda:1
    assert first.replayed_on == second.replayed_on == [1]
    assert fake_cuda.synchronized == [] and fake_cuda.emptied == 0
    assert fake_cuda.current_device == 0
    assert (graphs.captures, graphs.replays, graphs.capture_bytes) == (2, 2, 8192)


def test_a_capture_that_fails_ends_the_capture_and_raises(fake_cuda):
    from corelib_cuda.graph import CudaGraphs
    graphs = CudaGraphs(torch.device("cuda", 1), warmup=0)
    began = []

    def failing():
        began.append(True)
        raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.raises(RuntimeError, match="capturing"):
        graphs.capture(failing)
    assert began and graphs.captures == 0 and fake_cuda.current_device == 0


def test_the_device_guard_makes_a_cuda_device_current_and_restores_it(fake_cuda):
    """What Triton launches and graph calls run under (``corelib_cuda.device``); the GPU check
    runs the launches themselves on a second GPU when the machine has one."""
    from corelib_cuda.device import device_guard
    with device_guard(torch.device("cuda", 2)):
        assert fake_cuda.current_device == 2
        with device_guard(torch.device("cpu")):
            assert fake_cuda.current_device == 2
    assert fake_cuda.current_device == 0


def test_the_capture_key_is_built_once_per_kept_step_state(monkeypatch):
    """Steady steps reuse the key of the step state the batch keeps; a request joining makes
    a new one (and a new key), which replays the same capture when nothing host-side moved."""
    runner = GraphedSampler(CudaSampler("cpu", use_flashinfer=False), sizes=(4, 8), use_graphs=False)
    built = []
    key_of = GraphedSampler.capture_key
    monkeypatch.setattr(GraphedSampler, "capture_key", staticmethod(lambda s: built.append(1) or key_of(s)))
    batch = build(runner, seeded_requests())
    for step in range(3):
        batch.append(runner.sample(logits_for(step, 4, "cpu"), batch).token_ids)
    assert len(built) == 1 and runner.captures == 1
    batch.add("c", SamplingParams(seed=9, top_k=40, top_p=0.9, temperature=0.8))
    batch.append(runner.sample(logits_for(3, 5, "cpu"), batch).token_ids)
    assert len(built) == 2
