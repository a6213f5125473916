"""End to end: vLLM's CPU engine generating with corelib's sampler, compared with vLLM's own
sampler, transformers' greedy generate and ``corelib.integrations.hf.generate``."""

from __future__ import annotations

import math

import pytest
import torch
from vllm import SamplingParams as VllmParams
from vllm.inputs import TokensPrompt
from vllm.v1.sample.sampler import Sampler as VllmSampler

import corelib
from corelib.integrations.vllm.sampler import CorelibSampler

from conftest import (
    KV_CACHE_BYTES,
    MAX_NUM_SEQS,
    PROMPTS,
    SEEDED,
    TOKENS,
    first,
    hf_generate,
    run,
    runner_of,
    vllm_params,
)
from tiny_llama import EOS


# ---------------------------------------------------------------------- wiring
def test_runner_samples_with_corelib_only_when_asked(corelib_llm, vllm_llm):
    sampler = runner_of(corelib_llm).sampler
    assert isinstance(sampler, CorelibSampler)
    assert sampler.corelib.name == "cpu"
    assert type(runner_of(vllm_llm).sampler) is VllmSampler


# ---------------------------------------------------------------------- greedy
def test_greedy_equals_vllm_sampler_and_transformers(corelib_llm, vllm_llm, hf_model):
    from transformers import GenerationConfig
    params = vllm_params(temperature=0.0)
    ours = first(run(corelib_llm, PROMPTS, params))
    assert ours == first(run(vllm_llm, PROMPTS, params))
    config = GenerationConfig(do_sample=False, max_new_tokens=TOKENS, eos_token_id=None,
                              pad_token_id=0)
    for prompt, tokens in zip(PROMPTS, ours):
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt]), generation_config=config)
        assert out[0, len(prompt):].tolist() == tokens


# ---------------------------------------------------------------------- seeded

def test_seeded_equals_corelib_in_transformers(corelib_llm, hf_model):
    """The same seeded tokens in two engines: vLLM and corelib's transformers loop."""
    seeds = [11 + i for i in range(len(PROMPTS))]
    ours = first(run(corelib_llm, PROMPTS, [vllm_params(seed=s, **SEEDED) for s in seeds]))
    theirs = first(hf_generate(hf_model, PROMPTS,
                               [corelib.SamplingParams(seed=s, **SEEDED) for s in seeds]))
    assert ours == theirs
    assert len({tuple(t) for t in ours}) == len(PROMPTS)


def test_seeded_does_not_depend_on_the_rest_of_the_batch(corelib_llm):
    alone = run(corelib_llm, PROMPTS[:1], vllm_params(seed=5, **SEEDED))[0][0]
    crowd = [vllm_params(temperature=0.0), vllm_params(seed=5, **SEEDED),
             vllm_params(temperature=1.3, repetition_penalty=1.5, logprobs=3),
             vllm_params(seed=99, temperature=0.5, max_tokens=3),
             vllm_params(temperature=0.7, logit_bias={77: 5.0}, frequency_penalty=1.0)]
    prompts = [PROMPTS[2], PROMPTS[0], PROMPTS[1], PROMPTS[3], PROMPTS[5]]
    assert first(run(corelib_llm, prompts, crowd))[1] == alone


def test_requests_joining_and_leaving_sample_as_if_alone(corelib_llm):
    """More prompts than max_num_seqs, of different lengths and lengths of output: requests
    wait, join as others finish, and rows move; every seeded completion equals its solo run."""
    prompts = [PROMPTS[i % len(PROMPTS)] + [20 + i] * (i % 4) for i in range(3 * MAX_NUM_SEQS)]
    params = [vllm_params(seed=100 + i, max_tokens=4 + (5 * i) % 11,
                          **(SEEDED if i % 3 else dict(temperature=1.0, presence_penalty=1.5)))
              for i in range(len(prompts))]
    mirror = runner_of(corelib_llm).sampler.mirror
    before = dict(mirror.moves)
    together = first(run(corelib_llm, prompts, params))
    assert mirror.moves["added"] - before["added"] == len(prompts)
    alone = [first(run(corelib_llm, [p], q))[0] for p, q in zip(prompts, params)]
    assert together == alone


# ---------------------------------------------------------------------- the stages act
FEATURES = {
    "repetition_penalty": (dict(repetition_penalty=2.0), dict(repetition_penalty=2.0)),
    "frequency_penalty": (dict(frequency_penalty=1.5), dict(frequency_penalty=1.5)),
    "presence_penalty": (dict(presence_penalty=1.5), dict(presence_penalty=1.5)),
    "logit_bias": (dict(logit_bias={77: 8.0}), dict(logit_bias={77: 8.0})),
    "allowed_token_ids": (dict(allowed_token_ids=list(range(100, 140))),
                          dict(allowed_token_ids=list(range(100, 140)))),
}


@pytest.mark.parametrize("name", sorted(FEATURES))
def test_stage_acts_as_in_corelib(name, corelib_llm, hf_model):
    """Greedy with the stage differs from greedy without it, and equals corelib's own loop
    in transformers with the same corelib parameters."""
    vllm_kwargs, corelib_kwargs = FEATURES[name]
    plain = first(run(corelib_llm, PROMPTS, vllm_params(temperature=0.0)))
    ours = first(run(corelib_llm, PROMPTS, vllm_params(temperature=0.0, **vllm_kwargs)))
    assert ours != plain
    theirs = first(hf_generate(hf_model, PROMPTS,
                               corelib.SamplingParams(temperature=0.0, **corelib_kwargs)))
    assert ours == theirs
    if name == "allowed_token_ids":
        assert all(100 <= t < 140 for tokens in ours for t in tokens)
    if name == "logit_bias":
        assert sum(t == 77 for tokens in ours for t in tokens) > sum(
            t == 77 for tokens in plain for t in tokens)


def test_min_tokens_holds_back_eos_and_stop_ids(corelib_llm):
    """eos made the likeliest token: without min_tokens generation stops at once, with it
    only after min_tokens tokens; the same for a stop token id."""
    eager = dict(temperature=0.0, ignore_eos=False)
    assert first(run(corelib_llm, PROMPTS[:2], vllm_params(logit_bias={EOS: 50.0}, **eager))) \
        == [[EOS], [EOS]]
    held = first(run(corelib_llm, PROMPTS[:2],
                     vllm_params(logit_bias={EOS: 50.0}, min_tokens=5, **eager)))
    assert [len(t) for t in held] == [6, 6] and all(t[-1] == EOS and EOS not in t[:-1] for t in held)
    stop = 200
    held = first(run(corelib_llm, PROMPTS[:2], vllm_params(logit_bias={stop: 50.0}, min_tokens=4,
                                                           stop_token_ids=[stop], **eager)))
    assert [len(t) for t in held] == [5, 5] and all(t[-1] == stop and stop not in t[:-1] for t in held)


def test_bad_words_are_never_generated(corelib_llm, model_dir):
    """A word that greedy decoding produces (one token, as vLLM tokenises it) never appears
    once it is a bad word."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    plain = first(run(corelib_llm, PROMPTS, vllm_params(temperature=0.0)))
    generated = [t for tokens in plain for t in tokens]
    banned = next(t for t in generated
                  if tokenizer.decode([t]).isalpha()
                  and tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False) == [t])
    ours = first(run(corelib_llm, PROMPTS, vllm_params(temperature=0.0,
                                                       bad_words=[tokenizer.decode([banned])])))
    assert banned not in {t for tokens in ours for t in tokens}
    assert ours != plain


# ---------------------------------------------------------------------- logprobs
def _reference_logprobs(hf_model, prompt, tokens):
    """float32 [len(tokens), V]: the model's log-softmax before each generated token."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = hf_model(ids).logits[0, len(prompt) - 1: -1].float()
    return logits.log_softmax(-1)


def test_raw_logprobs_in_vllm_format_match_the_model(corelib_llm, vllm_llm, hf_model):
    params = vllm_params(temperature=0.8, seed=3, logprobs=4)
    outs = corelib_llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS[:3]], params,
                                use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        completion = out.outputs[0]
        reference = _reference_logprobs(hf_model, prompt, list(completion.token_ids))
        assert len(completion.logprobs) == len(completion.token_ids)
        for step, (token, entries) in enumerate(zip(completion.token_ids, completion.logprobs)):
            row = reference[step]
            top = row.topk(4)
            expected = {int(t): float(v) for t, v in zip(top.indices, top.values)}
            expected[token] = float(row[token])
            assert set(entries) == set(expected)
            for t, entry in entries.items():
                assert math.isclose(entry.logprob, expected[t], abs_tol=1e-4)
            assert entries[token].rank == int((row >= row[token]).sum())
            assert sorted(entries[t].rank for t in top.indices.tolist()) == [1, 2, 3, 4]
    # vLLM's own sampler reports the same for greedy completions (same tokens, same logprobs).
    greedy = vllm_params(temperature=0.0, logprobs=4)
    for ours, theirs in zip(corelib_llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
                                                 greedy, use_tqdm=False),
                            vllm_llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
                                              greedy, use_tqdm=False)):
        for a, b in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs):
            assert {t: e.rank for t, e in a.items()} == {t: e.rank for t, e in b.items()}
            for t in a:
                assert math.isclose(a[t].logprob, b[t].logprob, abs_tol=1e-5)


def test_processed_logprobs_describe_the_final_distribution(processed_llm, hf_model):
    params = vllm_params(temperature=0.7, top_k=5, seed=9, logprobs=5)
    out = processed_llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[0])], params,
                                 use_tqdm=False)
    completion = out[0].outputs[0]
    reference = _reference_logprobs(hf_model, PROMPTS[0], list(completion.token_ids))
    for step, (token, entries) in enumerate(zip(completion.token_ids, completion.logprobs)):
        logits = reference[step] / 0.7
        top = logits.topk(5)
        final = top.values.log_softmax(-1)
        expected = dict(zip(top.indices.tolist(), final.tolist()))
        assert token in expected
        assert set(entries) == set(expected)
        for t, entry in entries.items():
            assert math.isclose(entry.logprob, expected[t], abs_tol=1e-4)


# ---------------------------------------------------------------------- tensor parallelism
TP_SCRIPT = """
import json, os, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=256,
          max_num_seqs=4, seed=0, tensor_parallel_size=2, distributed_executor_backend="mp",
          kv_cache_memory_bytes=int(sys.argv[3]))
prompts, params = json.loads(sys.argv[2])
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                    [SamplingParams(**p) for p in params], use_tqdm=False)
print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def test_tensor_parallel_ranks_sample_the_same_tokens(model_dir, fresh_llm):
    """Two CPU workers (tensor_parallel_size=2, one process each): every rank samples with
    corelib and keeps the same tokens (each rank feeds its own sampled tokens back into the
    model), so the completions, unseeded ones included, equal a single-worker engine's."""
    import json
    import os
    import subprocess
    import sys
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("tensor parallelism on vLLM's CPU backend needs one core per rank")
    prompts = PROMPTS[:3]
    params = [dict(temperature=0.9, max_tokens=TOKENS, ignore_eos=True),
              dict(temperature=0.9, max_tokens=TOKENS, ignore_eos=True, seed=5),
              dict(temperature=0.7, top_k=20, max_tokens=TOKENS, ignore_eos=True, seed=6,
                   presence_penalty=1.0)]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1",
               VLLM_CPU_OMP_THREADS_BIND=f"{cores[0]}|{cores[1]}")
    result = subprocess.run([sys.executable, "-c", TP_SCRIPT, str(model_dir),
                             json.dumps([prompts, params]), str(KV_CACHE_BYTES)], env=env, capture_output=True,
                            text=True, timeout=600)
    lines = [line for line in result.stdout.splitlines() if line.startswith("TOKENS ")]
    assert result.returncode == 0 and lines, result.stderr[-3000:]
    parallel = json.loads(lines[-1][len("TOKENS "):])
    # A fresh engine's unseeded generator starts where the parallel engine's did.
    assert parallel == first(run(fresh_llm, prompts, [VllmParams(**p) for p in params]))
