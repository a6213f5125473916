"""Parallel sampling (n > 1) inside vLLM: vLLM's front end splits the request into n requests,
and with CORELIB_VLLM set child i draws what row (request, i) of corelib's own n-completion
request draws, not what a request seeded seed + i draws (vLLM's own rule)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from vllm import SamplingParams as VllmParams
from vllm.v1.engine.parallel_sampling import ParentRequest

import corelib
from corelib.integrations.vllm.params import CHILD_OFFSET, child_params, corelib_params

from conftest import KV_CACHE_BYTES, PROMPTS, SEEDED, TOKENS, corelib_vllm, first, hf_generate, run, vllm_params


def test_seeded_children_equal_corelib_children_in_transformers(corelib_llm, hf_model):
    """Seeds 7, 8, 9 with n = 3 in one batch: every child equals the same child of corelib's
    transformers loop (where child 1 of seed 7 and child 0 of seed 8 never collide)."""
    prompts, seeds = PROMPTS[:3], [7, 8, 9]
    ours = run(corelib_llm, prompts, [vllm_params(n=3, seed=s, **SEEDED) for s in seeds])
    theirs = hf_generate(hf_model, prompts, [corelib.SamplingParams(n=3, seed=s, **SEEDED)
                                             for s in seeds])
    assert ours == theirs
    assert all(len({tuple(c) for c in children}) == 3 for children in ours)


def test_child_one_of_seed_s_is_not_child_zero_of_seed_s_plus_one(corelib_llm):
    children = run(corelib_llm, PROMPTS[:1], vllm_params(n=2, seed=7, **SEEDED))[0]
    assert children[0] == first(run(corelib_llm, PROMPTS[:1], vllm_params(seed=7, **SEEDED)))[0]
    assert children[1] != first(run(corelib_llm, PROMPTS[:1], vllm_params(seed=8, **SEEDED)))[0]


def test_unseeded_children_are_independent(corelib_llm):
    children = run(corelib_llm, PROMPTS[:1], vllm_params(n=4, temperature=1.0))[0]
    assert len({tuple(c) for c in children}) == 4


def test_a_child_keeps_the_parent_seed_and_carries_its_index():
    parent = VllmParams(n=3, seed=5, temperature=0.8, extra_args={"dry_multiplier": 0.5})
    child = child_params(parent, 2)
    assert (child.n, child.seed, child.temperature) == (1, 5, 0.8)
    assert child.extra_args == {"dry_multiplier": 0.5, CHILD_OFFSET: 2}
    assert parent.extra_args == {"dry_multiplier": 0.5} and parent.n == 3
    assert corelib_params(child) == corelib.SamplingParams(seed=5, temperature=0.8, dry_multiplier=0.5)
    # a request that is itself child 4 of something: its children go on from there
    assert child_params(VllmParams(n=2, seed=5, extra_args={CHILD_OFFSET: 4}), 1).extra_args == {
        CHILD_OFFSET: 5}


@pytest.mark.parametrize("value", [-1, True, 1.0, "2", 2**31])
def test_a_bad_child_offset_is_an_error(value):
    with pytest.raises(ValueError, match=r"extra_args\['child_offset'\] must be an int in \[0, 2\*\*31\)"):
        corelib_params(VllmParams(extra_args={CHILD_OFFSET: value}))
    with pytest.raises(ValueError, match=r"extra_args\['child_offset'\]: 2147483647 \+ n - 1"):
        corelib_params(VllmParams(n=2, seed=1, extra_args={CHILD_OFFSET: 2**31 - 1}))


def _children_of(seed):
    """vLLM's own child parameters (``ParentRequest``) of a request with n = 3."""
    parent = ParentRequest.__new__(ParentRequest)
    parent.sampling_params = VllmParams(n=3, seed=seed, temperature=0.5)
    parent.cached_child_sampling_params = None
    return [parent._get_child_sampling_params(i) for i in range(3)]


def test_the_front_end_splits_children_the_corelib_way_only_with_the_variable(corelib_llm):
    """(corelib_llm: the plugin's hooks are installed in this process.)"""
    assert [(c.seed, c.extra_args) for c in _children_of(7)] == [
        (7, {CHILD_OFFSET: 0}), (7, {CHILD_OFFSET: 1}), (7, {CHILD_OFFSET: 2})]
    assert {c.seed for c in _children_of(None)} == {None}
    with corelib_vllm(None):
        assert [(c.seed, c.extra_args) for c in _children_of(7)] == [(7, None), (8, None), (9, None)]


MULTIPROCESS_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=256,
          max_num_seqs=4, seed=0, kv_cache_memory_bytes=int(sys.argv[3]))
prompts, params = json.loads(sys.argv[2])
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                    [SamplingParams(**p) for p in params], use_tqdm=False)
print("TOKENS " + json.dumps([[list(c.token_ids) for c in sorted(o.outputs, key=lambda c: c.index)]
                              for o in outs]))
"""


def test_children_with_the_engine_core_in_its_own_process(model_dir, hf_model):
    """VLLM_ENABLE_V1_MULTIPROCESSING=1: the front end (which splits the request) and the
    engine core with its worker run in two processes; the children are still corelib's."""
    prompts = PROMPTS[:2]
    params = [dict(n=2, seed=7, max_tokens=TOKENS, ignore_eos=True, **SEEDED),
              dict(n=3, seed=8, max_tokens=TOKENS, ignore_eos=True, **SEEDED)]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", CORELIB_VLLM="cpu")
    result = subprocess.run([sys.executable, "-c", MULTIPROCESS_SCRIPT, str(model_dir),
                             json.dumps([prompts, params]), str(KV_CACHE_BYTES)], env=env,
                            capture_output=True, text=True, timeout=600)
    lines = [line for line in result.stdout.splitlines() if line.startswith("TOKENS ")]
    assert result.returncode == 0 and lines, result.stderr[-3000:]
    ours = json.loads(lines[-1][len("TOKENS "):])
    theirs = hf_generate(hf_model, prompts, [corelib.SamplingParams(n=2, seed=7, **SEEDED),
                                             corelib.SamplingParams(n=3, seed=8, **SEEDED)])
    assert ours == theirs
    assert "samples with corelib backend 'cpu'" in result.stderr + result.stdout
