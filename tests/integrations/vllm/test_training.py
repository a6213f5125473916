"""A trainer next to vLLM: vLLM's V1 runner has no output channel for kept sets, so a trainer
that samples rollouts with vLLM (corelib as its sampler) recomputes the rollout's processed
log-probabilities with ``corelib.Sampler.score`` on its own forward pass, building the batch
from the same vLLM parameters (``corelib_params``). Checked against what vLLM returned in
``processed_logprobs`` mode, on the tiny model run in transformers as the trainer's model."""

from __future__ import annotations

import pytest
import torch

import corelib
from corelib.integrations.vllm.params import corelib_params

from conftest import PROMPTS, SEEDED, generate, vllm_params
from tiny_llama import VOCAB_SIZE

ROLLOUT = [dict(seed=21, **SEEDED), dict(seed=22, temperature=0.8, top_k=20, repetition_penalty=1.2,
                                         frequency_penalty=0.3),
           dict(temperature=0.0, presence_penalty=0.5),
           dict(seed=23, temperature=1.1, min_p=0.05, extra_args={"corelib": {"top_a": 0.05, "tfs": 0.95}})]


def trainer_logits(hf_model, prompt: list[int], tokens: list[int], grad: bool) -> torch.Tensor:
    """float32 ``[len(tokens), V]``: the trainer's full-sequence forward pass, each position's
    logits before its token (with grad when ``grad``)."""
    with torch.set_grad_enabled(grad):
        return hf_model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: -1].float()


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_score_reproduces_vllms_processed_logprobs_from_the_trainers_forward_pass(
        processed_llm, hf_model, backend):
    params = [vllm_params(logprobs=0, **p) for p in ROLLOUT]
    outs = generate(processed_llm, PROMPTS[:len(params)], params)
    sampler = corelib.get_sampler(backend)
    for prompt, p, (completion,) in zip(PROMPTS, params, outs):
        tokens = list(completion.token_ids)
        reported = torch.tensor([position[t].logprob for t, position in zip(tokens, completion.logprobs)])
        batch = sampler.new_batch(VOCAB_SIZE)
        batch.add("r", corelib_params(p, VOCAB_SIZE), prompt_token_ids=prompt)
        logits = trainer_logits(hf_model, prompt, tokens, grad=False)
        out = sampler.score(logits[None], batch, torch.tensor([tokens]))
        assert out.kept_token.all() and out.valid.all()
        # two forward passes (vLLM's incremental, transformers' full-sequence): within float32
        torch.testing.assert_close(out.logprobs[0], reported, rtol=1e-5, atol=2e-4)


def test_a_policy_gradient_flows_from_score_into_the_trainers_model(processed_llm, hf_model):
    p = vllm_params(logprobs=0, **ROLLOUT[0])
    (completion,), = generate(processed_llm, PROMPTS[:1], [p])
    tokens = list(completion.token_ids)
    sampler = corelib.get_sampler("cpu")          # its score hands gradients to the reference
    batch = sampler.new_batch(VOCAB_SIZE)
    batch.add("r", corelib_params(p, VOCAB_SIZE), prompt_token_ids=PROMPTS[0])
    hf_model.zero_grad()
    logits = trainer_logits(hf_model, PROMPTS[0], tokens, grad=True)
    out = sampler.score(logits[None], batch, torch.tensor([tokens]))
    advantage = 1.0
    loss = -(advantage * out.logprobs).sum()
    loss.backward()
    grads = [q.grad for q in hf_model.parameters() if q.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0
    hf_model.zero_grad()


@pytest.mark.parametrize("extra", [{"corelib": {"return_kept": True}}, {"return_kept": True}])
def test_return_kept_through_vllm_is_refused_naming_what_to_do(extra):
    """vLLM's outputs have no place for kept sets: asking through extra_args is an error that
    says so (under corelib's key), not a mask computed and dropped (at the top level, a key
    corelib does not read is other code's, and changes nothing)."""
    from corelib.integrations.vllm.params import corelib_params as mapped
    params = vllm_params(extra_args=extra)
    if "corelib" in extra:
        with pytest.raises(ValueError, match="no output for kept sets.*score"):
            mapped(params)
    else:
        assert not mapped(params).return_kept
