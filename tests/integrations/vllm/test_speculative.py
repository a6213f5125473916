"""Speculative decoding verified by corelib's ``verify``: with vLLM's ngram drafter (no draft
probabilities) greedy and seeded completions are the tokens of plain decoding, and of
``corelib.integrations.hf.generate``; with a draft model's probabilities, corelib's rejection
sampling accepts what it must; acceptance statistics agree with vLLM's; grammars, penalties,
DRY and custom stages hold at every verification slot."""

from __future__ import annotations

import re

import pytest
from vllm.sampling_params import StructuredOutputsParams

import corelib
from corelib.integrations.vllm.sampler import CorelibSampler
from corelib.integrations.vllm.speculative import CorelibRejectionSampler

from conftest import (
    NGRAM,
    PROMPTS,
    SEEDED,
    Speculation,
    first,
    generate,
    hf_generate,
    run,
    runner_of,
    vllm_params,
)

LENGTH = 20
# Prompts whose continuations repeat (ngram finds proposals), and the plain ones; more prompts
# than max_num_seqs, so requests join and leave while others speculate.
SPEC_PROMPTS = [[1, 17, 42, 99, 7, 17, 42, 99, 7], [1, 300, 301, 300, 301]] + PROMPTS


def test_drafts_are_verified_by_corelib(ngram_llm):
    runner = runner_of(ngram_llm)
    assert isinstance(runner.sampler, CorelibSampler)
    assert isinstance(runner.rejection_sampler, CorelibRejectionSampler)
    assert runner.rejection_sampler.sampler is runner.sampler


def test_vllms_flat_tensors_reach_verify_unpadded_or_padded_for_older_backends(ngram_llm, monkeypatch):
    """The sampler hands vLLM's flat tensors to verify's flat form; a backend whose verify has
    no num_drafts argument gets them padded to [rows, K + 1, ...] instead: the same tokens."""
    import torch

    sampler = runner_of(ngram_llm).sampler
    assert sampler.takes_flat_drafts
    backend, counts, V = sampler.corelib, [2, 0, 3, 1], 512
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(sum(counts) + 4, V, generator=g) * 3
    drafts = torch.randint(0, V, (sum(counts),), generator=g, dtype=torch.int32)
    drafts[0] = int(logits[0].argmax())                      # row 0 accepts its first draft
    drafts[3] = -1                                           # vLLM ends row 2's drafts early

    def batch():
        rows = backend.new_batch(V)
        for i in range(4):
            rows.add(f"r{i}", corelib.SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8, seed=i),
                     prompt_token_ids=[1])
        return rows

    # Under inference mode, as vLLM's runner calls it: the engine's earlier steps may have left
    # the backend buffers made there, which torch allows to update only inside it.
    with torch.inference_mode():
        flat = sampler._verify(batch(), (logits, drafts, None, None), counts)
        monkeypatch.setattr(sampler, "takes_flat_drafts", False)
        padded = sampler._verify(batch(), (logits, drafts, None, None), counts)
    assert flat.token_ids.tolist() == padded.token_ids.tolist()
    assert flat.num_emitted[0] >= 2 and flat.num_emitted[2] == 1


# ---------------------------------------------------------------------- ngram: no draft probs
def test_greedy_with_speculation_equals_plain_decoding(ngram_llm, corelib_llm, vllm_llm):
    params = vllm_params(temperature=0.0, max_tokens=LENGTH)
    spec = Speculation(ngram_llm, SPEC_PROMPTS, params)
    assert spec.stats["accepted_tokens"] > 0
    assert spec.tokens == first(run(corelib_llm, SPEC_PROMPTS, params))
    assert spec.tokens == first(run(vllm_llm, SPEC_PROMPTS, params))


def test_seeded_with_speculation_equals_plain_decoding_and_hf(ngram_llm, corelib_llm, hf_model):
    """corelib's contract: a seeded row draws at each slot what ``sample`` draws at that
    position, so speculation changes no seeded token, in vLLM or in corelib's transformers
    loop."""
    params = [vllm_params(seed=40 + i, max_tokens=LENGTH, **SEEDED) for i in range(len(SPEC_PROMPTS))]
    spec = Speculation(ngram_llm, SPEC_PROMPTS, params)
    assert spec.stats["accepted_tokens"] > 0
    assert spec.tokens == first(run(corelib_llm, SPEC_PROMPTS, params))
    hf = hf_generate(hf_model, SPEC_PROMPTS,
                     [corelib.SamplingParams(seed=40 + i, **SEEDED) for i in range(len(SPEC_PROMPTS))],
                     max_new_tokens=LENGTH)
    assert spec.tokens == first(hf)


def test_acceptance_statistics_agree_with_vllms(ngram_llm):
    """corelib's running totals equal vLLM's per-request metrics; acceptance falls with the
    draft position and stays within the drafts."""
    params = [vllm_params(temperature=0.0 if i % 2 else 0.8, seed=60 + i, max_tokens=LENGTH)
              for i in range(len(SPEC_PROMPTS))]
    spec = Speculation(ngram_llm, SPEC_PROMPTS, params)
    assert spec.stats == spec.vllm_totals()
    stats = spec.stats
    assert 0 < stats["accepted_tokens"] <= stats["draft_tokens"] <= NGRAM["num_speculative_tokens"] * stats["verified_rows"]
    positions = spec.by_position[:NGRAM["num_speculative_tokens"]]
    assert sum(positions) == stats["accepted_tokens"]
    assert positions == sorted(positions, reverse=True)


def test_logprobs_with_speculation_equal_plain_decoding(ngram_llm, corelib_llm):
    params = [vllm_params(seed=80 + i, logprobs=3, max_tokens=LENGTH, **SEEDED) for i in range(3)]
    spec = Speculation(ngram_llm, SPEC_PROMPTS[:3], params)
    plain = first(generate(corelib_llm, SPEC_PROMPTS[:3], params))
    assert spec.stats["accepted_tokens"] > 0
    for ours, theirs in zip(spec.completions, plain):
        assert list(ours.token_ids) == list(theirs.token_ids)
        assert len(ours.logprobs) == len(ours.token_ids)
        for a, b in zip(ours.logprobs, theirs.logprobs):
            assert {t: e.rank for t, e in a.items()} == {t: e.rank for t, e in b.items()}
            for t in a:
                assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)


# ---------------------------------------------------------------------- draft model: probs
@pytest.mark.parametrize("method, engines", [
    ("token", ("draft_llm", "corelib_llm")),
    ("block", ("block_draft_llm", "new_llm")),      # test_block_verification.py
])
def test_draft_probabilities_reach_the_verification(method, engines, request):
    """The draft model is the target model, so each draft's probability equals the target's
    (p = q): corelib's ratio test, and its block verification, accept every draft of random
    rows. Without the draft probabilities, or with those of another slot or row, a draft
    would pass only when it equals the slot's own draw (about 3% of them). Greedy rows emit
    the tokens of plain decoding."""
    draft_llm, plain_llm = (request.getfixturevalue(name) for name in engines)
    assert runner_of(draft_llm).sampler.verify_method == method
    greedy = vllm_params(temperature=0.0, max_tokens=LENGTH)
    assert first(run(draft_llm, SPEC_PROMPTS, greedy)) == first(run(plain_llm, SPEC_PROMPTS, greedy))
    params = [vllm_params(temperature=1.0, seed=90 + i, max_tokens=LENGTH)
              for i in range(len(SPEC_PROMPTS))]
    spec = Speculation(draft_llm, SPEC_PROMPTS, params)
    assert spec.stats == spec.vllm_totals()
    assert spec.stats["draft_tokens"] >= len(SPEC_PROMPTS) * 3
    assert spec.stats["accepted_tokens"] >= 0.97 * spec.stats["draft_tokens"]
    assert all(len(tokens) == LENGTH for tokens in spec.tokens)


# ---------------------------------------------------------------------- every slot
def test_grammar_holds_at_every_slot(ngram_llm, corelib_llm):
    """ngram proposes words the grammar allows; each slot's bitmask (the grammar after the
    slot's drafts) reaches corelib's verify, and the seeded constrained completions equal
    those without speculation."""
    tokenizer = corelib_llm.get_tokenizer()
    prompt = tokenizer.encode("the of and the of and the of and the of and ")
    regex = "((the|of|and) ){12}"
    params = [vllm_params(temperature=1.0, seed=seed, max_tokens=40, ignore_eos=False,
                          structured_outputs=StructuredOutputsParams(regex=regex))
              for seed in range(3)]
    spec = Speculation(ngram_llm, [prompt] * 3, params)
    assert spec.stats["accepted_tokens"] > 0
    assert spec.tokens == first(run(corelib_llm, [prompt] * 3, params))
    for completion in spec.completions:
        assert re.fullmatch(regex, completion.text)


STAGES = [
    dict(temperature=0.9, seed=21, presence_penalty=0.8, frequency_penalty=0.4,
         repetition_penalty=1.2, extra_args=dict(dry_multiplier=0.8, dry_allowed_length=2)),
    dict(temperature=1.0, seed=22, min_tokens=6, logit_bias={428: 3.0},
         extra_args=dict(stage_args={"ban-repeats": {"times": 3}}, xtc_probability=0.5,
                         xtc_threshold=0.05)),
    dict(temperature=0.0, extra_args=dict(dry_multiplier=1.0, dry_allowed_length=2)),
    dict(temperature=1.2, seed=23, top_k=20, min_p=0.05,
         extra_args=dict(typical_p=0.8, top_n_sigma=2.0,
                                                             stage_args={"floor-prob": {"prob": 0.02}})),
]


def test_every_stage_at_every_slot_equals_plain_decoding(ngram_llm, corelib_llm):
    """Penalties, min_tokens, logit bias, min_p, DRY, XTC, typical-p, top-n-sigma and custom
    stages (one with per-row state) see at each slot the state as if the slot's drafts had
    been generated: seeded and greedy completions equal those without speculation. (vLLM's
    own sampler refuses min_p and logit_bias under speculative decoding.)"""
    prompts = SPEC_PROMPTS[:len(STAGES)]
    params = [vllm_params(max_tokens=LENGTH, **case) for case in STAGES]
    spec = Speculation(ngram_llm, prompts, params)
    assert spec.stats["accepted_tokens"] > 0
    assert spec.tokens == first(run(corelib_llm, prompts, params))
