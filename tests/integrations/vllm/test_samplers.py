"""corelib's own samplers, which vLLM has no field for, through vLLM's ``extra_args``: DRY,
top-n-sigma, typical-p, XTC and custom stages (the example stage plugin) act, and sample in
vLLM exactly what corelib samples in its transformers loop."""

from __future__ import annotations

import pytest

import corelib

from conftest import PROMPTS, first, hf_generate, run, vllm_params

# The tiny model's greedy continuation of this prompt repeats one token for 20 steps.
LOOP = [1, 17, 42, 99, 7, 17, 42, 99, 7]
SAMPLER_PROMPTS = [LOOP, PROMPTS[0], PROMPTS[2]]
LENGTH = 24

CASES = {
    "dry": dict(temperature=0.0, dry_multiplier=1.0, dry_base=1.75, dry_allowed_length=2),
    "dry-range-breakers": dict(temperature=0.0, dry_multiplier=1.0, dry_allowed_length=1,
                               dry_range=8, dry_sequence_breakers=[255]),
    "top-n-sigma": dict(temperature=1.5, seed=3, top_n_sigma=1.0),
    "typical-p": dict(temperature=1.0, seed=4, typical_p=0.5),
    "xtc": dict(temperature=1.0, seed=5, xtc_probability=0.5, xtc_threshold=0.05),
    "ban-repeats": dict(temperature=0.0, stage_args={"ban-repeats": {"times": 2}}),
    "floor-prob": dict(temperature=1.0, seed=6, stage_args={"floor-prob": {"prob": 0.05}}),
    # The fourth release's filters, filter orders and stateful selectors.
    "dynatemp": dict(temperature=1.5, seed=7, dynatemp_range=1.0, dynatemp_exponent=0.5),
    "smoothing": dict(temperature=1.5, seed=8, smoothing_factor=0.3, smoothing_curve=2.0),
    "top-a": dict(temperature=1.5, seed=9, top_a=0.3),
    "epsilon": dict(temperature=1.5, seed=10, epsilon_cutoff=0.03),
    "eta": dict(temperature=1.5, seed=11, eta_cutoff=0.03),
    "tfs": dict(temperature=1.5, seed=12, tfs=0.7),
    "p-less": dict(temperature=1.5, seed=13, p_less="plain"),
    "p-less-norm": dict(temperature=1.5, seed=14, p_less="norm"),
    "sampler-order": dict(temperature=2.0, seed=15, top_k=8, min_p=0.2,
                          sampler_order=["top_k", "min_p", "temperature"]),
    "temperature-last": dict(temperature=2.0, seed=16, min_p=0.2, temperature_last=True),
    "mirostat": dict(temperature=1.5, seed=17, mirostat_tau=2.0, mirostat_eta=0.5),
    "adaptive-p": dict(temperature=1.5, seed=18, adaptive_p_target=0.2, adaptive_p_decay=0.7),
}
VLLM_FIELDS = {"temperature", "seed", "top_k", "min_p"}


def through_extra_args(case: dict):
    """vLLM's parameters for a case: its vLLM fields as fields, corelib's under corelib's key
    of ``extra_args``."""
    fields = {k: v for k, v in case.items() if k in VLLM_FIELDS}
    extra = {k: v for k, v in case.items() if k not in VLLM_FIELDS}
    return vllm_params(max_tokens=LENGTH, extra_args={"corelib": extra}, **fields)


def plain(case: dict):
    return vllm_params(max_tokens=LENGTH, **{k: v for k, v in case.items() if k in VLLM_FIELDS})


def longest_run(tokens: list[int]) -> int:
    best = run_length = 1
    for a, b in zip(tokens, tokens[1:]):
        run_length = run_length + 1 if a == b else 1
        best = max(best, run_length)
    return best


@pytest.mark.parametrize("name", sorted(CASES))
def test_sampler_acts_as_in_corelibs_own_loop(name, corelib_llm, hf_model):
    """With the sampler on, vLLM's completions differ from those without it and equal corelib's
    transformers loop with the same corelib parameters (seeded draws included)."""
    case = CASES[name]
    ours = first(run(corelib_llm, SAMPLER_PROMPTS, through_extra_args(case)))
    assert ours != first(run(corelib_llm, SAMPLER_PROMPTS, plain(case)))
    theirs = first(hf_generate(hf_model, SAMPLER_PROMPTS, corelib.SamplingParams(**case),
                               max_new_tokens=LENGTH, backend="reference"))
    assert ours == theirs


def test_dry_breaks_the_repeat(corelib_llm):
    """Greedy decoding of LOOP repeats one token 20 times; DRY penalises extending the repeat
    and the run breaks early."""
    loop = run(corelib_llm, [LOOP], plain(CASES["dry"]))[0][0]
    dry = run(corelib_llm, [LOOP], through_extra_args(CASES["dry"]))[0][0]
    assert longest_run(loop) >= 15
    assert longest_run(dry) <= 6


def test_ban_repeats_stage_bans_a_third_occurrence(corelib_llm):
    for tokens in first(run(corelib_llm, SAMPLER_PROMPTS, through_extra_args(CASES["ban-repeats"]))):
        assert max(tokens.count(t) for t in tokens) <= 2


def test_seeded_xtc_reproduces_whatever_the_batch(corelib_llm):
    params = through_extra_args(CASES["xtc"])
    alone = run(corelib_llm, [PROMPTS[0]], params)[0][0]
    crowd = [vllm_params(temperature=0.7, seed=1), params, through_extra_args(CASES["dry"]),
             vllm_params(temperature=1.0)]
    prompts = [PROMPTS[1], PROMPTS[0], LOOP, PROMPTS[3]]
    assert first(run(corelib_llm, prompts, crowd))[1] == alone
    assert run(corelib_llm, [PROMPTS[0]], params)[0][0] == alone
