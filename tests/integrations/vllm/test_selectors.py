"""The stateful selectors (mirostat v2, adaptive-p) inside vLLM: their per-request state moves
with every step vLLM takes, and survives vLLM's preemption (the request leaves the batch and
joins again with its output tokens) exactly."""

from __future__ import annotations

import pytest

from conftest import PROMPTS, first, make_llm, run, runner_of, vllm_params

MIROSTAT = {"mirostat_tau": 2.0, "mirostat_eta": 0.5}
ADAPTIVE_P = {"adaptive_p_target": 0.2, "adaptive_p_decay": 0.7}
# Room for 128 tokens of the tiny model in all, in blocks of 32: four requests of 40 tokens
# start together and cannot all finish together, so the scheduler preempts the later ones when
# the earlier ones need their next block, and resumes them once those finish.
SMALL_KV_CACHE_BYTES = 150_000
BLOCK_SIZE = 32
PREEMPTED_TOKENS = 40


def selector_params(extra: dict, seed: int, max_tokens: int = 24):
    return vllm_params(temperature=1.5, seed=seed, max_tokens=max_tokens,
                       extra_args={"corelib": extra})


def test_the_state_steers_the_tokens(corelib_llm):
    """A frozen state (eta 0: mu never moves) samples other tokens than a moving one, so the
    equality with corelib's own loop (test_samplers.py) covers the state's steps too."""
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[5]]
    moving = first(run(corelib_llm, prompts, selector_params(MIROSTAT, seed=17)))
    frozen = first(run(corelib_llm, prompts, selector_params({**MIROSTAT, "mirostat_eta": 0.0},
                                                             seed=17)))
    assert moving != frozen


@pytest.fixture(scope="session")
def preempting_llm(model_dir):
    """An engine whose KV cache holds 128 tokens, so that four long requests preempt. Kept
    for the session, as conftest's engines are (a shut-down engine tears down the distributed
    state every engine of the process shares)."""
    return make_llm(model_dir, "cpu", kv_cache_memory_bytes=SMALL_KV_CACHE_BYTES,
                    max_model_len=64, block_size=BLOCK_SIZE)


def test_a_preempted_request_resumes_its_selector_state(preempting_llm, reference_llm):
    """Mirostat and adaptive-p requests that vLLM preempts and resumes sample the tokens of the
    same requests run without preemption (64 MiB of KV cache), and the mirror resumed some of
    them from a kept state (without it, a resumed mirostat request here samples other tokens
    from its 23rd on)."""
    prompts = PROMPTS[:4]
    # vLLM preempts the requests that came last: every request uses a selector.
    params = [selector_params(extra, seed, PREEMPTED_TOKENS)
              for extra, seed in ((MIROSTAT, 17), (ADAPTIVE_P, 18), (MIROSTAT, 19), (MIROSTAT, 20))]
    mirror = runner_of(preempting_llm).sampler.mirror
    before = mirror.resumed
    preempted = first(run(preempting_llm, prompts, params))
    assert mirror.resumed > before, "no request was resumed: the test must preempt"
    assert preempted == first(run(reference_llm, prompts, params))


def test_selectors_under_speculation_equal_no_speculation(corelib_llm, ngram_llm):
    """With ngram drafts verified by corelib, each slot's selector state is advanced by the
    drafts before it: mirostat, adaptive-p and a filter order sample the tokens they sample
    without speculation, with drafts accepted on the way."""
    loop = [1, 17, 42, 99, 7, 17, 42, 99, 7]       # the tiny model repeats it: drafts get accepted
    params = [selector_params(MIROSTAT, 17), selector_params(ADAPTIVE_P, 18),
              vllm_params(temperature=1.0, seed=19, max_tokens=24, extra_args={"corelib": {
                  "tfs": 0.8, "sampler_order": ["tfs", "temperature"]}})]
    prompts = [loop, PROMPTS[0], loop]
    stats = runner_of(ngram_llm).sampler.speculation
    before = stats.as_dict()["accepted_tokens"]
    speculated = first(run(ngram_llm, prompts, params))
    assert stats.as_dict()["accepted_tokens"] > before
    assert speculated == first(run(corelib_llm, prompts, params))
