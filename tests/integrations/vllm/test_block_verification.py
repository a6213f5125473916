"""Block verification inside vLLM: ``speculative_config={"rejection_sample_method": "block"}``
is corelib's ``verify(method="block")``. Rows without draft probabilities (ngram) keep the
token rule, so their greedy and seeded tokens are those of decoding without speculation; a
draft model sampling its drafts hands its probabilities to the block verification
(test_speculative.py checks that they arrive), whose emitted tokens have exactly the target
distribution."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import corelib
from corelib.sampler import Sampler
from corelib.integrations.vllm.speculative import CorelibRejectionSampler, verify_method
from corelib.testing import chi_square_p_value

from conftest import NGRAM, SEEDED, Speculation, first, make_llm, run, runner_of, vllm_params

LENGTH = 20
SPEC_PROMPTS = [[1, 17, 42, 99, 7, 17, 42, 99, 7], [1, 300, 301, 300, 301], [1, 64],
                [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [1, 90, 91, 92, 90, 91, 92]]


def test_block_reaches_corelibs_verify(block_ngram_llm, block_draft_llm, ngram_llm):
    for llm in (block_ngram_llm, block_draft_llm):
        runner = runner_of(llm)
        assert isinstance(runner.rejection_sampler, CorelibRejectionSampler)
        assert runner.sampler.verify_method == "block"
        assert "rejection_sampler -> corelib verify (method='block')" in runner.sampler.describe()["patched"]
    assert runner_of(ngram_llm).sampler.verify_method == "token"
    # vLLM's drafter keeps its probabilities to itself unless the method is "standard".
    assert runner_of(block_draft_llm).drafter._enable_probabilistic_draft_probs


def test_the_engines_verification_is_corelibs_block_rule(block_draft_llm):
    """The engine's sampler verifies with method="block": on seeded rows with draft
    probabilities it emits what corelib's block verification emits, which is not what the
    token rule emits (block verification draws its uniforms from a stream of its own)."""
    sampler = runner_of(block_draft_llm).sampler
    backend, (B, K, V) = sampler.corelib, (64, 3, 512)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, K + 1, V, generator=g) * 2
    draft_probs = torch.softmax(torch.randn(B, K, V, generator=g) * 2, dim=-1)
    drafts = torch.multinomial(draft_probs.reshape(-1, V), 1, generator=g).reshape(B, K)

    def batch():
        rows = backend.new_batch(V)
        for i in range(B):
            rows.add(f"r{i}", corelib.SamplingParams(seed=i), prompt_token_ids=[1])
        return rows

    flat = (logits.reshape(-1, V), drafts.reshape(-1), draft_probs.reshape(-1, V), None)
    ours = sampler._verify(batch(), flat, [K] * B)         # vLLM's flat tensors
    block = backend.verify(logits, batch(), drafts, draft_probs, method="block")
    token = backend.verify(logits, batch(), drafts, draft_probs)
    assert torch.equal(ours.token_ids, block.token_ids)
    assert not torch.equal(block.token_ids, token.token_ids)


def test_ngram_rows_keep_the_token_rule(block_ngram_llm, new_llm):
    """ngram drafts have no probabilities: greedy and seeded completions equal those of
    decoding without speculation."""
    for sampling in (dict(temperature=0.0), SEEDED):
        params = [vllm_params(max_tokens=LENGTH, seed=70 + i, **sampling)
                  for i in range(len(SPEC_PROMPTS))]
        spec = Speculation(block_ngram_llm, SPEC_PROMPTS, params)
        assert spec.stats["accepted_tokens"] > 0
        assert spec.stats == spec.vllm_totals()
        assert spec.tokens == first(run(new_llm, SPEC_PROMPTS, params))


def target_joint(hf_model, prompt: list[int], top_k: int, length: int) -> dict[tuple, float]:
    """The target distribution of the first ``length`` tokens at temperature 1 with
    ``top_k``: every sequence of kept tokens and its probability."""
    joint = {(): 1.0}
    for _ in range(length):
        grown = {}
        for seq, p in joint.items():
            with torch.no_grad():
                logits = hf_model(torch.tensor([prompt + list(seq)])).logits[0, -1].double()
            values, ids = logits.topk(top_k)
            for t, q in zip(ids.tolist(), values.softmax(-1).tolist()):
                grown[seq + (t,)] = p * q
        joint = grown
    return joint


def test_block_verified_tokens_have_the_target_distribution(block_draft_llm, hf_model):
    """top_k=2 for the target, while the drafter samples from its whole softmax: drafts
    outside the top two are rejected and residual draws replace them. The first three tokens
    (the second and third through the block verification) of 1600 seeded requests fit the
    target's eight sequences (chi-square, p > 0.001)."""
    prompt, requests = [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], 1600
    joint = target_joint(hf_model, prompt, top_k=2, length=3)
    params = [vllm_params(temperature=1.0, top_k=2, seed=s, max_tokens=3) for s in range(requests)]
    spec = Speculation(block_draft_llm, [prompt] * requests, params)
    assert spec.stats["draft_tokens"] > 0 and spec.stats["accepted_tokens"] < spec.stats["draft_tokens"]
    sequences = list(joint)
    counts = torch.zeros(len(sequences))
    for tokens in spec.tokens:
        counts[sequences.index(tuple(tokens))] += 1
    p_value = chi_square_p_value(counts, torch.tensor([joint[s] for s in sequences]))
    assert p_value > 1e-3, (p_value, counts.tolist(), [round(joint[s], 4) for s in sequences])


# ---------------------------------------------------------------------- bad input
def test_methods_corelib_does_not_implement_are_refused():
    sampler = corelib.get_sampler("reference")
    assert verify_method(None, sampler) == "token"
    assert verify_method(SimpleNamespace(rejection_sample_method="standard"), sampler) == "token"
    assert verify_method(SimpleNamespace(rejection_sample_method="block"), sampler) == "block"
    for method in ("synthetic", "blockwise"):
        with pytest.raises(ValueError, match=f"rejection_sample_method='{method}' is not supported"):
            verify_method(SimpleNamespace(rejection_sample_method=method), sampler)

    class WrittenBeforeBlockVerification(Sampler):
        def verify(self, logits, batch, draft_token_ids, draft_probs=None, token_bitmask=None):
            return super().verify(logits, batch, draft_token_ids, draft_probs, token_bitmask)

    older = WrittenBeforeBlockVerification(torch.device("cpu"))
    with pytest.raises(ValueError, match="needs block verification, which corelib backend "
                                         "'reference' does not offer"):
        verify_method(SimpleNamespace(rejection_sample_method="block"), older)
    assert verify_method(SimpleNamespace(rejection_sample_method="standard"), older) == "token"


def test_an_unknown_method_stops_the_engine_naming_the_field(model_dir):
    with pytest.raises(Exception, match="rejection_sample_method"):
        make_llm(model_dir, "cpu", speculative_config={**NGRAM, "rejection_sample_method": "blockwise"})
