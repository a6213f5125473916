"""vLLM's custom logits processors run inside corelib's pipeline: fed by vLLM's batch updates,
applied at corelib's matching slots, with the tokens vLLM's own sampler gives; a processor
that raises fails the requests it ran on and the engine goes on."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import corelib
from corelib.integrations.vllm.sampler import CorelibSampler, traces_its_steps

from conftest import MAX_NUM_SEQS, PROMPTS, generate, run, runner_of, vllm_params
from logits_processors import ForceToken, Recorder

# More prompts than max_num_seqs, finishing at different lengths: requests join the batch
# in freed rows, leave it, and vLLM's condense moves rows.
CHURN_PROMPTS = [PROMPTS[i % len(PROMPTS)] + [30 + i] * (i % 3) for i in range(2 * MAX_NUM_SEQS)]


def processor(llm, kind):
    return next(p for p in runner_of(llm).input_batch.logitsprocs.all if isinstance(p, kind))


def churn_params(**sampling):
    """One setting per prompt in turn: a forced token, banned recent tokens, the best few,
    nothing; lengths 4 to 12."""
    settings = [lambda i: {"target_token": 100 + i}, lambda i: {"ban_recent": 3},
                lambda i: {"keep_best": 3}, lambda i: None]
    return [vllm_params(max_tokens=4 + (3 * i) % 9, extra_args=settings[i % 4](i), **sampling)
            for i in range(len(CHURN_PROMPTS))]


def test_the_processors_run_as_corelib_stages(processors_llm):
    stages = runner_of(processors_llm).sampler.processors.specs()
    slots = {spec.name.rsplit(".", 1)[-1]: spec.slot for spec in stages}
    assert slots == {"ForceToken": "after_penalties", "BanRecent": "after_penalties",
                     "KeepBest": "after_filters", "Recorder": "after_filters",
                     "FailBeforePenalties": "after_penalties",
                     "FailAfterTemperature": "after_filters"}


def test_greedy_equals_vllms_sampler_with_the_same_processors(processors_llm, processors_vllm_llm):
    params = churn_params(temperature=0.0)
    ours = [c[0] for c in run(processors_llm, CHURN_PROMPTS, params)]
    assert ours == [c[0] for c in run(processors_vllm_llm, CHURN_PROMPTS, params)]
    plain = [c[0] for c in run(processors_llm, CHURN_PROMPTS,
                               [vllm_params(max_tokens=p.max_tokens, temperature=0.0) for p in params])]
    for i, tokens in enumerate(ours):
        if i % 4 == 0:
            assert tokens == [100 + i] * len(tokens)
        if i % 4 == 1:
            assert all(t not in tokens[max(0, j - 3):j] for j, t in enumerate(tokens))
            assert tokens != plain[i]          # the greedy tiny model repeats itself
        if i % 4 in (2, 3):
            assert tokens == plain[i]          # greedy rows skip argmax-invariant processors


def test_seeded_equals_vllms_sampler_where_the_processors_decide(processors_llm, processors_vllm_llm):
    """Seeded random rows whose processors leave one token (a forced token; the best token;
    banned recent tokens under top_k=1) give vLLM's tokens, although the two samplers draw
    from different noise; the other seeded requests in the batch sample as if alone."""
    decided = [dict(extra_args={"target_token": 77}), dict(extra_args={"keep_best": 1}),
               dict(extra_args={"ban_recent": 2}, top_k=1)]
    free = [dict(extra_args={"keep_best": 3}), dict(extra_args={"ban_recent": 2}), dict()]
    params = [vllm_params(seed=40 + i, temperature=0.9, **kw) for i, kw in enumerate(decided + free)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    ours = [c[0] for c in run(processors_llm, prompts, params)]
    theirs = [c[0] for c in run(processors_vllm_llm, prompts, params)]
    assert ours[:3] == theirs[:3]
    assert ours[0] == [77] * len(ours[0])
    alone = [run(processors_llm, [p], q)[0][0] for p, q in zip(prompts[3:], params[3:])]
    assert ours[3:] == alone


def test_processors_get_the_batch_updates_vllm_sends(processors_llm, processors_vllm_llm):
    """The same adds (rows, prompts), removes and moves, step by step, as with vLLM's sampler."""
    params = churn_params(temperature=0.0)
    recorded = []
    for llm in (processors_llm, processors_vllm_llm):
        run(llm, PROMPTS[:1], vllm_params(max_tokens=2))     # the same batch before, empty
        recorder = processor(llm, Recorder)
        recorder.updates.clear()
        run(llm, CHURN_PROMPTS, params)
        recorded.append(list(recorder.updates))
    assert recorded[0] == recorded[1]
    assert any(moved for _, _, _, moved in recorded[0])        # condense moved rows
    assert any(row < 3 for _, _, added, _ in recorded[0][1:] for row, _ in added)  # freed rows reused


def test_blocks_of_rows_see_their_batch_rows(processors_llm):
    """The cpu backend runs its stages per block of rows (here two rows a block): each block's
    rows reach the processors at their batch indices."""
    sampler = runner_of(processors_llm).sampler.corelib
    params = churn_params(temperature=0.0) + churn_params(seed=3, temperature=0.8, top_k=1)
    prompts = CHURN_PROMPTS * 2
    whole = run(processors_llm, prompts, params)
    saved = sampler.block_elements
    sampler.block_elements = 2 * processors_llm.llm_engine.model_config.get_vocab_size()
    try:
        blocks = run(processors_llm, prompts, params)
    finally:
        sampler.block_elements = saved
    assert blocks == whole


# ---------------------------------------------------------------------- a processor that raises
def test_a_raising_processor_fails_the_requests_it_ran_on_and_the_engine_goes_on(processors_llm):
    """FailBeforePenalties runs on every row (before the penalties, as vLLM runs it): every
    request of the steps it raised in ends with an error naming it; the next batch is served."""
    good = [vllm_params(temperature=0.0), vllm_params(seed=2, temperature=0.8)]
    before = run(processors_llm, PROMPTS[:2], good)
    outs = generate(processors_llm, PROMPTS[:3], good + [vllm_params(extra_args={"fail": True})])
    for completions in outs:
        (completion,) = completions
        assert completion.finish_reason == "error" and list(completion.token_ids) == []
        assert ("vLLM logits processor logits_processors.FailBeforePenalties raised RuntimeError: "
                "the processor's lookup table is gone" in completion.stop_reason)
    assert run(processors_llm, PROMPTS[:2], good) == before


def test_an_argmax_invariant_processor_that_raises_spares_greedy_rows(processors_llm):
    """FailAfterTemperature runs on random rows only: they fail, the greedy row's tokens are
    those it has alone."""
    greedy = vllm_params(temperature=0.0)
    alone = run(processors_llm, PROMPTS[:1], greedy)[0]
    outs = generate(processors_llm, PROMPTS[:3],
                    [greedy, vllm_params(seed=5, temperature=0.8),
                     vllm_params(temperature=0.8, extra_args={"fail_late": True})])
    assert [list(c.token_ids) for c in outs[0]] == alone and outs[0][0].finish_reason == "length"
    for (completion,) in outs[1:]:
        assert completion.finish_reason == "error"
        assert "logits_processors.FailAfterTemperature raised RuntimeError" in completion.stop_reason


# ---------------------------------------------------------------------- backends
@pytest.mark.skipif(importlib.util.find_spec("corelib_cuda") is None,
                    reason="needs the cuda plugin (its GraphedSampler runs on the CPU without graphs)")
def test_backends_that_trace_or_capture_refuse_processors_naming_them():
    from corelib_cuda import CudaSampler, GraphedSampler
    graphed = GraphedSampler(CudaSampler("cpu", use_flashinfer=False), use_graphs=False)
    assert traces_its_steps(graphed)
    assert not traces_its_steps(CudaSampler("cpu", use_flashinfer=False))
    sampler = CorelibSampler.__new__(CorelibSampler)      # the refusal, on a graphed backend
    sampler.corelib = graphed
    with pytest.raises(ValueError, match="vLLM logits processors \\['logits_processors.ForceToken'\\] "
                                         "cannot run on corelib backend 'cuda': it traces or captures"):
        sampler._processor_stages([ForceToken(None, torch.device("cpu"), False)])


def test_eager_backends_run_processors():
    assert not traces_its_steps(corelib.get_sampler("cpu"))
    assert not traces_its_steps(corelib.get_sampler("reference"))
