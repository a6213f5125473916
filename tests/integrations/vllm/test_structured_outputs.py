"""Structured outputs: vLLM's grammar bitmask reaches corelib as ``token_bitmask`` (backends
that take it), constrained completions hold the grammar with the xgrammar and guidance
backends, seeded constrained completions reproduce whatever else is in the batch, and a
finished grammar held open by min_tokens finishes its request with an error, never a token
nobody drew."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from vllm.sampling_params import StructuredOutputsParams

from corelib.integrations.vllm.grammar import logits_row_bitmask

from conftest import PROMPTS, first, generate, run, runner_of, vllm_params

GRAMMAR_ENGINES = ["corelib_llm", "guidance_llm"]   # xgrammar and guidance, token_bitmask path
REGEX = "[0-9]{3}-[a-z]{2}"
CHOICES = ["true", "false", "null"]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["flag", "kind"],
          "properties": {"flag": {"type": "boolean"}, "kind": {"enum": ["name", "value"]}}}
PROMPT = [1, 17, 42, 99, 7]
LOOP = [1, 17, 42, 99, 7, 17, 42, 99, 7]    # greedy: one token repeated (drafts for ngram)


def constrained(kind: str, seed: int, **kwargs):
    """Seeded random draws under one grammar (eos allowed: a finished grammar stops)."""
    grammar = {"regex": dict(regex=REGEX), "choice": dict(choice=CHOICES),
               "json": dict(json=SCHEMA, disable_any_whitespace=True)}[kind]
    return vllm_params(temperature=1.0, seed=seed, max_tokens=40, ignore_eos=False,
                       structured_outputs=StructuredOutputsParams(**grammar), **kwargs)


def holds(kind: str, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    value = json.loads(text)
    return (set(value) == {"flag", "kind"} and isinstance(value["flag"], bool)
            and value["kind"] in ("name", "value"))


# ---------------------------------------------------------------------- the bitmask's rows
def test_bitmask_rows_follow_the_logits_rows():
    """The scheduler's rows (grammar request order, one per verification slot) land on the
    rows of the logits (batch order, 1 + drafts rows per request); other rows allow all."""
    words = np.arange(1, 15, dtype=np.int32)[:, None] * np.array([[1, 100]], dtype=np.int32)
    # grammar requests "c" (2 drafts: 3 slots), then "a" (no drafts), then "gone" (left)
    mask = logits_row_bitmask(words[:6], ["c", "a", "gone"], ["a", "b", "c"],
                              {"b": [5], "c": [7, 8]}, num_logits_rows=6)
    assert mask.dtype == torch.int32 and mask.shape == (6, 2)
    assert mask[:, 0].tolist() == [4, -1, -1, 1, 2, 3]
    with pytest.raises(RuntimeError, match="account for 6"):
        logits_row_bitmask(words[:6], ["a"], ["a", "b", "c"], {"b": [5], "c": [7, 8]}, 5)


# ---------------------------------------------------------------------- through corelib
def test_the_bitmask_goes_to_corelib_not_into_the_logits(corelib_llm, vllm_llm, hf_model):
    """With a backend that takes ``token_bitmask``, vLLM no longer masks the logits: the raw
    logprob of every constrained token is the model's own log-softmax, as the contract's step
    1 says. vLLM's sampler, which samples logits masked in place, reports the logprobs
    renormalised over the grammar's tokens instead."""
    assert runner_of(corelib_llm).sampler.takes_token_bitmask
    params = vllm_params(temperature=0.0, logprobs=0, max_tokens=20, ignore_eos=False,
                         structured_outputs=StructuredOutputsParams(regex=REGEX))
    ours = generate(corelib_llm, [PROMPT], params)[0][0]
    theirs = generate(vllm_llm, [PROMPT], params)[0][0]
    tokens = list(ours.token_ids)
    assert re.fullmatch(REGEX, ours.text) and list(theirs.token_ids) == tokens
    with torch.no_grad():
        logits = hf_model(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1: -1]
    model = logits.float().log_softmax(-1)
    gaps = []
    for step, token in enumerate(tokens):
        assert ours.logprobs[step][token].logprob == pytest.approx(float(model[step, token]), abs=1e-4)
        gaps.append(theirs.logprobs[step][token].logprob - float(model[step, token]))
    assert max(gaps) > 0.1 and min(gaps) > -1e-4


@pytest.mark.parametrize("engine", GRAMMAR_ENGINES)
@pytest.mark.parametrize("kind", ["regex", "choice", "json"])
def test_constrained_completions_are_valid(engine, kind, request):
    llm = request.getfixturevalue(engine)
    outs = first(generate(llm, [PROMPT, PROMPTS[1], PROMPTS[2]],
                          [constrained(kind, seed) for seed in range(3)]))
    for completion in outs:
        assert completion.finish_reason == "stop", completion
        assert holds(kind, completion.text), completion.text


@pytest.mark.parametrize("engine", GRAMMAR_ENGINES)
def test_seeded_constrained_completions_reproduce_whatever_the_batch(engine, request):
    llm = request.getfixturevalue(engine)
    alone = run(llm, [PROMPT], constrained("json", 11))[0][0]
    crowd = [constrained("regex", 5), vllm_params(temperature=0.8, seed=1),
             constrained("json", 11), constrained("choice", 2), vllm_params(temperature=0.0)]
    together = first(run(llm, [PROMPTS[1], PROMPTS[0], PROMPT, PROMPTS[3], PROMPTS[4]], crowd))
    assert together[2] == alone
    assert run(llm, [PROMPT], constrained("json", 12))[0][0] != alone


def test_backend_without_token_bitmask_gets_vllms_masking(corelib_llm):
    """A backend whose ``sample`` has no ``token_bitmask`` argument (``takes_token_bitmask``
    False, as ``accepts_token_bitmask`` finds for one written before it) samples logits that
    vLLM masked in place: the grammar holds all the same, and the seeded tokens are those the
    backend draws when it takes the mask itself."""
    sampler = runner_of(corelib_llm).sampler
    params = [constrained("regex", 31), constrained("choice", 32), constrained("json", 33)]
    prompts = [PROMPT, PROMPT, PROMPTS[1]]
    routed = first(generate(corelib_llm, prompts, params))
    sampler.takes_token_bitmask = False
    try:
        masked = first(generate(corelib_llm, prompts, params))
    finally:
        sampler.takes_token_bitmask = True
    assert [holds(kind, out.text) for kind, out in zip(["regex", "choice", "json"], masked)] == [True] * 3
    assert [list(o.token_ids) for o in masked] == [list(o.token_ids) for o in routed]


def test_a_sample_without_token_bitmask_is_recognised():
    from corelib.integrations.vllm.sampler import accepts_token_bitmask
    from corelib_cpu.sampler import CpuSampler

    class WrittenBeforeBitmasks(CpuSampler):
        def sample(self, logits, batch):
            return super().sample(logits, batch)

    assert accepts_token_bitmask(CpuSampler())
    assert not accepts_token_bitmask(WrittenBeforeBitmasks())


def test_backends_agree_on_seeded_constrained_tokens(corelib_llm, reference_llm):
    params = [constrained("regex", 21), constrained("json", 22), constrained("choice", 23)]
    prompts = [PROMPT, PROMPTS[1], PROMPTS[3]]
    assert run(corelib_llm, prompts, params) == run(reference_llm, prompts, params)


# ---------------------------------------------------------------------- no token left
@pytest.mark.parametrize("engine", ["corelib_llm", "ngram_llm"])
def test_finished_grammar_under_min_tokens_finishes_that_request_with_an_error(engine, request):
    """The choice grammar is complete after "yes" or "no" and allows only eos, which
    min_tokens still holds back: the row has no token left. vLLM's scheduler finishes that
    request with finish reason "error" and corelib's reason; the grammar's tokens stay, token
    0 never appears, and the other requests of the batch and the engine go on. (With the
    ngram engine the greedy loop has drafts at every step: the row is flagged in verify.)"""
    llm = request.getfixturevalue(engine)
    stuck = vllm_params(temperature=1.0, seed=4, max_tokens=20, ignore_eos=False, min_tokens=10,
                        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    others = [vllm_params(temperature=0.0, max_tokens=20), constrained("regex", 6)]
    prompts = [PROMPT, LOOP, PROMPTS[2]]
    outs = first(generate(llm, prompts, [stuck] + others))
    failed = outs[0]
    assert failed.finish_reason == "error"
    assert "has no token to sample" in str(failed.stop_reason)
    assert failed.text in ("yes", "no") and 0 not in failed.token_ids
    assert [list(c.token_ids) for c in outs[1:]] == first(run(llm, prompts[1:], others))
    assert holds("regex", outs[2].text)
    assert len(run(llm, [PROMPT], vllm_params(temperature=0.0, max_tokens=3))[0][0]) == 3
