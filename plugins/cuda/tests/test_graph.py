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
