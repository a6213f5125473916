"""Step 8b (the reasoning budget) on the cpu backend beyond the shared suite: a forced row
becomes one finite entry, logit 0, in place in its block, next to rows that the block's other
machinery handles (top-k candidates, pending min-p and top-p cuts, group maxima kept for the
greedy argmax, whole-row draws, seeded and not), and its validity stays the reference's when
steps 3-5 mask every token or its logits hold NaN."""

from __future__ import annotations

import pytest
import torch
from corelib import Sampler, SamplingParams

from corelib_cpu.sampler import CpuSampler

V = 3000
START, END = 200, 201
THINK = dict(thinking_start_token_ids=[START], thinking_end_token_ids=[END])
#: A prompt that leaves the row thinking: with budget 0 its next token is forced.
THINKING = [5, 6, START]

# Every kind of row the cpu stages treat differently, once forced (f-) and once not (n-).
KINDS = {
    "greedy": dict(temperature=0.0),
    "greedy-pen": dict(temperature=0.0, presence_penalty=0.5),
    "top-k": dict(top_k=20, temperature=0.8),
    "top-k-top-p": dict(top_k=30, top_p=0.8),
    "top-p": dict(top_p=0.9),
    "min-p": dict(min_p=0.05, temperature=1.3),
    "sigma": dict(top_n_sigma=1.5),
    "typical": dict(typical_p=0.8),
    "xtc": dict(xtc_threshold=0.01, xtc_probability=1.0),
    "plain": dict(),
}


def requests(seeded: bool, kinds=KINDS) -> list:
    out = []
    for i, (name, params) in enumerate(kinds.items()):
        params = dict(params)
        if seeded and params.get("temperature", 1.0) > 0:
            params["seed"] = 300 + i
        out.append((f"f-{name}", SamplingParams(thinking_budget=0, **THINK, **params), THINKING))
        out.append((f"n-{name}", SamplingParams(**params), THINKING))
    return out


def build(sampler, reqs, mode: str = "raw"):
    batch = sampler.new_batch(V, logprobs_mode=mode)
    for rid, params, prompt in reqs:
        batch.add(rid, params, prompt_token_ids=prompt)
    return batch


def forced_rows(batch) -> list:
    return [row for row, (rid, _) in enumerate(batch.rows) if rid.startswith("f-")]


@pytest.mark.parametrize("rows_per_block", [1, 3, 100])
def test_forced_rows_among_every_kind_of_row_match_the_reference(rows_per_block):
    cpu, reference = CpuSampler(block_elements=rows_per_block * V), Sampler("cpu")
    reqs = requests(seeded=True)
    mine, ref = build(cpu, reqs), build(reference, reqs)
    logits = torch.randn(mine.num_rows, V, generator=torch.Generator().manual_seed(1)) * 3
    logits[:, END] = -30.0                                   # the model would not end on its own
    got_final, want_final = cpu.processed_logits(logits, mine), reference.processed_logits(logits, ref)
    assert torch.equal(torch.isfinite(got_final), torch.isfinite(want_final))
    assert torch.equal(got_final[torch.isfinite(want_final)], want_final[torch.isfinite(want_final)])
    for row in forced_rows(mine):
        assert torch.isfinite(got_final[row]).nonzero().flatten().tolist() == [END]
        assert float(got_final[row, END]) == 0.0
    got, want = cpu.sample(logits, mine), reference.sample(logits, ref)
    assert torch.equal(got.token_ids, want.token_ids)        # seeded and greedy: the reference's
    assert got.token_ids[forced_rows(mine)].tolist() == [END] * len(KINDS)
    assert bool(got.valid.all())


@pytest.mark.parametrize("rows_per_block", [1, 4, 100])
def test_unseeded_forced_rows_emit_the_forced_token(rows_per_block):
    cpu = CpuSampler(block_elements=rows_per_block * V, generator=torch.Generator().manual_seed(2))
    batch = build(cpu, requests(seeded=False))
    logits = torch.randn(batch.num_rows, V, generator=torch.Generator().manual_seed(3)) * 3
    for _ in range(3):
        out = cpu.sample(logits, batch)
        assert out.token_ids[forced_rows(batch)].tolist() == [END] * len(KINDS)
        assert bool(out.valid.all())


@pytest.mark.parametrize("with_allowed", [False, True], ids=["deferred-check", "allowed-ids"])
def test_forced_rows_are_valid_when_masked_and_flagged_when_not_finite(with_allowed):
    """A forced row whose every token steps 3-5 mask still emits its token; a forced row
    whose logits hold NaN or +inf is flagged, as in the reference. Without allowed ids the
    cpu checks finiteness from the rows' maxima after the masks (``finite_rows`` leaves it to
    ``any_token_left``), with them before."""
    extra = dict(allowed_token_ids=[7, 8, 9]) if with_allowed else {}
    masked = dict(allowed_token_ids=[7, 8]) if with_allowed else dict(min_tokens=3, stop_token_ids=[END])
    reqs = [("masked", SamplingParams(thinking_budget=0, **THINK, temperature=0.0, **masked), THINKING),
            ("masked-seeded", SamplingParams(thinking_budget=0, **THINK, seed=1, top_k=5, **masked),
             THINKING),
            ("nan", SamplingParams(thinking_budget=0, **THINK, seed=2, **extra), THINKING),
            ("inf", SamplingParams(thinking_budget=0, **THINK, temperature=0.0, **extra), THINKING),
            ("plain", SamplingParams(seed=3, **extra), THINKING),
            ("greedy", SamplingParams(temperature=0.0, **extra), THINKING)]
    logits = torch.randn(len(reqs), V, generator=torch.Generator().manual_seed(4))
    if not with_allowed:                                   # every token of these rows masked
        logits[0, :] = float("-inf")
    logits[2, 11] = float("nan")
    logits[3, 12] = float("inf")
    for rows_per_block in (1, 2, 100):
        cpu, reference = CpuSampler(block_elements=rows_per_block * V), Sampler("cpu")
        got = cpu.sample(logits, build(cpu, reqs))
        want = reference.sample(logits, build(reference, reqs))
        assert got.valid.tolist() == want.valid.tolist() == [True, True, False, False, True, True]
        assert torch.equal(got.token_ids, want.token_ids)
        assert got.token_ids[:4].tolist() == [END, END, -1, -1]


def test_an_all_greedy_block_with_a_forced_row_keeps_its_argmax_shortcuts():
    """Greedy rows without later stages take the argmax from the group maxima of the validity
    check; a forced row in their block updates its own maxima only, so its neighbours' argmax
    still reads the kept ones and the forced row's reads the forced token."""
    reqs = [("g0", SamplingParams(temperature=0.0), THINKING),
            ("forced", SamplingParams(temperature=0.0, thinking_budget=0, **THINK), THINKING),
            ("g1", SamplingParams(temperature=0.0), THINKING)]
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(5))
    logits[:, START + 1000] = 9.0                           # each row's argmax, far from END
    logits[0, 2999] = 10.0                                  # in the short last group
    cpu = CpuSampler()
    out = cpu.sample(logits, build(cpu, reqs))
    assert out.token_ids.tolist() == [2999, END, START + 1000]
    assert out.valid.tolist() == [True, True, True]


@pytest.mark.parametrize("mode", ["raw", "processed", "raw_logits", "processed_logits"])
def test_logprobs_of_forced_rows_match_the_reference(mode):
    reqs = [(rid, params.model_copy(update=dict(logprobs=3)), prompt)
            for rid, params, prompt in requests(seeded=True, kinds={k: KINDS[k] for k in
                                                                    ("greedy", "top-k", "top-p", "plain")})]
    logits = torch.randn(len(reqs), V, generator=torch.Generator().manual_seed(6)) * 2
    for rows_per_block in (1, 100):
        cpu, reference = CpuSampler(block_elements=rows_per_block * V), Sampler("cpu")
        got = cpu.sample(logits, build(cpu, reqs, mode)).logprobs
        want = reference.sample(logits, build(reference, reqs, mode)).logprobs
        assert torch.equal(got.token_ids[:, 0], want.token_ids[:, 0])
        assert torch.allclose(got.logprobs, want.logprobs, atol=1e-5, equal_nan=True)
        assert torch.equal(got.ranks, want.ranks)
        if mode.startswith("processed"):
            assert got.logprobs[::2, 0].tolist() == [0.0] * 4      # the forced rows
        else:                                                   # the model's own values
            raw = logits[::2, END] if mode == "raw_logits" else torch.log_softmax(logits, -1)[::2, END]
            assert torch.allclose(got.logprobs[::2, 0], raw, atol=1e-5)
