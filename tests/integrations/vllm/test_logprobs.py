"""Logprobs beyond vLLM's default: every token (``logprobs=-1``), more than 20 of them, and
vLLM's four logprobs modes (logprobs or logits, of the model or of the final distribution),
for sampled and prompt tokens, in the format vLLM's output processor reads. The values are
checked against the model run in transformers; greedy completions also against vLLM's own
sampler."""

from __future__ import annotations

import math

import pytest
import torch
from vllm.exceptions import VLLMValidationError
from vllm.inputs import TokensPrompt

from corelib.integrations.vllm.params import corelib_params

from conftest import PROMPTS, SEEDED, generate, runner_of, vllm_params
from tiny_llama import VOCAB_SIZE


def model_logits(hf_model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """float32 ``[len(tokens), V]``: the model's logits before each of ``tokens``."""
    with torch.no_grad():
        return hf_model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: -1].float()


def as_dicts(entries) -> list[dict[int, tuple[int, float]]]:
    """vLLM's logprobs of one completion: token -> (rank, value), per position."""
    return [{t: (e.rank, e.logprob) for t, e in position.items()} for position in entries]


def assert_same_entries(ours, theirs, tol=1e-5):
    for a, b in zip(as_dicts(ours), as_dicts(theirs), strict=True):
        assert {t: r for t, (r, _) in a.items()} == {t: r for t, (r, _) in b.items()}
        for t in a:
            assert math.isclose(a[t][1], b[t][1], abs_tol=tol)


def assert_entries_are(entries, token: int, values: torch.Tensor, top: int) -> None:
    """One position in vLLM's format: the sampled token and the ``top`` best tokens of
    ``values`` (float32 ``[V]``), each with its value and its rank (1 + the number of better
    tokens)."""
    best = values.topk(top).indices.tolist()
    assert set(entries) == set(best) | {token}
    for t, entry in entries.items():
        assert math.isclose(entry.logprob, float(values[t]), rel_tol=1e-5, abs_tol=2e-4)
        assert entry.rank == int((values > values[t]).sum()) + 1


# ---------------------------------------------------------------------- every token, > 20
def test_every_token_logprobs(new_llm, new_vllm_llm, hf_model):
    """logprobs=-1 in a batch with requests asking for 2 and for none: each position has all
    V tokens with the model's log-softmax and ranks 1..V; the others are unchanged; greedy
    completions equal vLLM's sampler's, entry for entry."""
    params = [vllm_params(logprobs=-1, seed=3, **SEEDED), vllm_params(logprobs=2, seed=4),
              vllm_params(seed=5), vllm_params(logprobs=-1, temperature=0.0)]
    outs = generate(new_llm, PROMPTS[:4], params)
    for prompt, (completion,), asked in zip(PROMPTS, outs, [-1, 2, None, -1]):
        if asked is None:
            assert completion.logprobs is None
            continue
        tokens = list(completion.token_ids)
        reference = model_logits(hf_model, prompt, tokens).log_softmax(-1)
        assert len(completion.logprobs) == len(tokens)
        for step, (token, entries) in enumerate(zip(tokens, completion.logprobs)):
            assert_entries_are(entries, token, reference[step], VOCAB_SIZE if asked == -1 else asked)
        assert math.isclose(completion.cumulative_logprob,
                            sum(float(reference[i, t]) for i, t in enumerate(tokens)), abs_tol=1e-3)
    greedy = [vllm_params(logprobs=-1, temperature=0.0), vllm_params(logprobs=30, temperature=0.0)]
    for (ours,), (theirs,) in zip(generate(new_llm, PROMPTS[4:6], greedy),
                                  generate(new_vllm_llm, PROMPTS[4:6], greedy)):
        assert list(ours.token_ids) == list(theirs.token_ids)
        assert_same_entries(ours.logprobs, theirs.logprobs)


def test_more_than_twenty_logprobs(new_llm, hf_model):
    """logprobs=50: the sampled token and the best 50, each with its rank."""
    (completion,), = generate(new_llm, PROMPTS[:1], vllm_params(logprobs=50, seed=8, **SEEDED))
    tokens = list(completion.token_ids)
    reference = model_logits(hf_model, PROMPTS[0], tokens).log_softmax(-1)
    for step, (token, entries) in enumerate(zip(tokens, completion.logprobs)):
        assert len(entries) in (50, 51)
        assert_entries_are(entries, token, reference[step], 50)


def test_the_engines_max_logprobs_still_limits_a_request(corelib_llm):
    """vLLM's own check (``max_logprobs``, 20 by default) runs before corelib's."""
    with pytest.raises(VLLMValidationError, match="greater than max allowed: 20"):
        generate(corelib_llm, PROMPTS[:1], vllm_params(logprobs=21))


def test_logprobs_beyond_the_vocabulary_are_an_error():
    with pytest.raises(ValueError, match="logprobs=513 exceeds the model's vocabulary of 512"):
        corelib_params(vllm_params(logprobs=513), vocab_size=512)
    assert corelib_params(vllm_params(logprobs=-1), vocab_size=512).logprobs == -1
    assert corelib_params(vllm_params(logprobs=512), vocab_size=512).logprobs == 512


# ---------------------------------------------------------------------- logits modes
def test_raw_logits_are_the_models_logits(raw_logits_llm, new_llm, hf_model):
    """logprobs_mode="raw_logits": the values are the logits as the model made them (some
    positive, as vLLM's own test of the mode checks), ranks over them; the mode changes no
    sampled token."""
    params = [vllm_params(logprobs=5, seed=11 + i, **SEEDED) for i in range(3)]
    outs = generate(raw_logits_llm, PROMPTS[:3], params)
    assert [list(c.token_ids) for (c,) in outs] == [
        list(c.token_ids) for (c,) in generate(new_llm, PROMPTS[:3], params)]
    for prompt, (completion,) in zip(PROMPTS, outs):
        tokens = list(completion.token_ids)
        logits = model_logits(hf_model, prompt, tokens)
        for step, (token, entries) in enumerate(zip(tokens, completion.logprobs)):
            assert_entries_are(entries, token, logits[step], 5)
        assert any(e.logprob > 0 for position in completion.logprobs for e in position.values())


def test_processed_logits_are_the_final_distributions_logits(processed_logits_llm, hf_model):
    """logprobs_mode="processed_logits": a random row's values are its logits after
    temperature and top-k, -inf for the dropped tokens (every token asked for: the top-k
    first); a greedy row's are its logits before temperature."""
    random_row = vllm_params(logprobs=-1, seed=13, temperature=0.7, top_k=5)
    greedy_row = vllm_params(logprobs=4, temperature=0.0)
    (sampled,), (argmax,) = generate(processed_logits_llm, PROMPTS[:2], [random_row, greedy_row])
    tokens = list(sampled.token_ids)
    logits = model_logits(hf_model, PROMPTS[0], tokens) / 0.7
    for step, (token, entries) in enumerate(zip(tokens, sampled.logprobs)):
        kept = set(logits[step].topk(5).indices.tolist())
        assert token in kept and len(entries) == VOCAB_SIZE
        assert {t for t, e in entries.items() if e.logprob > float("-inf")} == kept
        assert sorted(entries[t].rank for t in kept) == [1, 2, 3, 4, 5]
        for t in kept:
            assert math.isclose(entries[t].logprob, float(logits[step, t]), rel_tol=1e-5, abs_tol=2e-4)
    tokens = list(argmax.token_ids)
    logits = model_logits(hf_model, PROMPTS[1], tokens)
    for step, (token, entries) in enumerate(zip(tokens, argmax.logprobs)):
        assert token == int(logits[step].argmax())
        assert_entries_are(entries, token, logits[step], 4)


MODES = {"raw_logprobs": "new_llm", "processed_logprobs": "processed_llm",
         "raw_logits": "raw_logits_llm", "processed_logits": "processed_logits_llm"}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_values_of_each_mode_have_their_sign(mode, request):
    """As vLLM's own test of the modes: logprobs are never positive, logits are, somewhere."""
    llm = request.getfixturevalue(MODES[mode])
    assert runner_of(llm).model_config.logprobs_mode == mode
    (completion,), = generate(llm, PROMPTS[:1], vllm_params(logprobs=3, seed=2, **SEEDED))
    values = [e.logprob for position in completion.logprobs for e in position.values()]
    assert len(values) >= len(completion.token_ids) * 3
    if mode.endswith("logprobs"):
        assert max(values) <= 0
    else:
        assert max(values) > 0


@pytest.mark.parametrize("mode", sorted(MODES))
def test_prompt_logprobs_follow_the_mode(mode, request, hf_model):
    """vLLM computes prompt logprobs outside the sampler: the model's log-softmax in the
    logprobs modes, its logits in the logits modes; corelib's sampler leaves them so."""
    llm = request.getfixturevalue(MODES[mode])
    prompt = PROMPTS[2]
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                       vllm_params(prompt_logprobs=3, max_tokens=2, seed=1, **SEEDED),
                       use_tqdm=False)[0]
    logits = model_logits(hf_model, prompt[:1], prompt[1:])
    values = logits if mode.endswith("logits") else logits.log_softmax(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for step, (token, entries) in enumerate(zip(prompt[1:], out.prompt_logprobs[1:])):
        assert_entries_are(entries, token, values[step], 3)
