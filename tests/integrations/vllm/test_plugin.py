"""The plugin's wiring: vLLM finds it, it is inert without CORELIB_VLLM, every vLLM
parameter maps to corelib's or fails the request with a clear error, and engine settings
corelib cannot honour stop the engine at start."""

from __future__ import annotations

import json

import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
from vllm import SamplingParams as VllmParams
from vllm.exceptions import VLLMValidationError
from vllm.inputs import TokensPrompt

import corelib
from corelib.integrations.vllm import register
from corelib.integrations.vllm.params import (
    CORELIB_KEY,
    VLLM_EXTRA_ARGS,
    UnsupportedParameterError,
    corelib_params,
    extra_args_fields,
)

from conftest import PROMPTS, make_llm, run, vllm_params
from tiny_llama import EOS


def test_entry_point_is_declared_by_corelib():
    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "corelib"]
    assert len(eps) == 1
    assert eps[0].dist.name == "corelib"
    assert eps[0].load() is register


def test_inert_without_the_variable():
    """vLLM loading its plugins without CORELIB_VLLM installs none of corelib's sampling hooks:
    only the engine start check, which waits for the variable."""
    env = {k: v for k, v in os.environ.items() if k != "CORELIB_VLLM"}
    code = ("import sys; from vllm.plugins import load_general_plugins; load_general_plugins(); "
            "from corelib.integrations.vllm import patches; "
            "hooked = {f.module_name for f in sys.meta_path if type(f).__name__ == '_PatchOnImport'}; "
            "assert hooked == {patches.ENGINE_CORE_MODULE}, hooked; "
            "assert not patches._installed; "
            "assert 'corelib.integrations.vllm.sampler' not in sys.modules; "
            "print('inert')")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("inert")


# ---------------------------------------------------------------------- parameter mapping
def test_every_shared_field_keeps_its_value():
    params = VllmParams(n=2, temperature=0.7, top_k=20, top_p=0.8, min_p=0.1,
                        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.3,
                        logit_bias={5: 2.0}, min_tokens=3, stop_token_ids=[9, 4],
                        allowed_token_ids=[4, 5, 9], seed=42, logprobs=3)
    assert corelib_params(params, vocab_size=512) == corelib.SamplingParams(
        n=2, temperature=0.7, top_k=20, top_p=0.8, min_p=0.1, presence_penalty=0.5,
        frequency_penalty=-0.5, repetition_penalty=1.3, logit_bias={5: 2.0}, min_tokens=3,
        stop_token_ids=[4, 9], allowed_token_ids=[4, 5, 9], seed=42, logprobs=3)


def test_derived_fields_take_vllms_values():
    params = VllmParams(stop_token_ids=[7])
    params.temperature = 5e-6      # (vLLM's constructor raises such temperatures to 0.01)
    params.update_from_generation_config({"eos_token_id": [2, 3]}, eos_token_id=2)
    mapped = corelib_params(params)
    assert mapped.temperature == 0.0                      # below vLLM's greedy threshold
    assert mapped.stop_token_ids == [2, 3, 7]              # what vLLM's min-tokens stage masks
    params = VllmParams(bad_words=["x"])
    params._bad_words_token_ids = [[11], [12, 13]]         # what vLLM's tokenizer step writes
    assert corelib_params(params).bad_words == [[11], [12, 13]]


# A value other than the default for every corelib field vLLM's SamplingParams lacks.
EXTRA_ARGS = {
    "dry_multiplier": 0.8, "dry_base": 2.0, "dry_allowed_length": 3, "dry_range": 64,
    "dry_sequence_breakers": [5, 9], "top_n_sigma": 1.5, "typical_p": 0.9,
    "xtc_threshold": 0.2, "xtc_probability": 0.5, "stage_args": {"ban-repeats": {"times": 2}},
    "dynatemp_range": 0.5, "dynatemp_exponent": 2.0, "smoothing_factor": 0.3,
    "smoothing_curve": 2.0, "top_a": 0.2, "epsilon_cutoff": 0.01, "eta_cutoff": 0.02, "tfs": 0.9,
    "p_less": "norm", "sampler_order": ["top_k", "temperature"], "temperature_last": True,
    "mirostat_tau": 5.0, "mirostat_eta": 0.2, "adaptive_p_target": 0.5, "adaptive_p_decay": 0.5,
}


def test_extra_args_cover_every_corelib_only_field():
    assert set(EXTRA_ARGS) == extra_args_fields(VllmParams)


@pytest.mark.parametrize("spelling", ["under corelib's key", "at the top level"])
@pytest.mark.parametrize("field", sorted(EXTRA_ARGS))
def test_extra_args_pass_corelib_only_fields(field, spelling):
    """The value reaches corelib as corelib itself reads it (and differs from the default),
    under ``extra_args["corelib"]`` and in the older top-level spelling alike."""
    value = EXTRA_ARGS[field]
    extra = {CORELIB_KEY: {field: value}} if spelling.startswith("under") else {field: value}
    mapped = corelib_params(VllmParams(extra_args=extra))
    assert field in mapped.model_fields_set
    assert getattr(mapped, field) == getattr(corelib.SamplingParams(**{field: value}), field)
    assert getattr(mapped, field) != getattr(corelib.SamplingParams(), field)


def test_the_servers_spelling_a_json_string_under_corelibs_key():
    """The OpenAI server's ``vllm_xargs`` holds no dicts: the same fields come as a JSON
    object in a string under ``"corelib"``, booleans and nested dicts included."""
    fields = {"mirostat_tau": 3.0, "temperature_last": True, "p_less": "plain",
              "stage_args": {"ban-repeats": {"times": 2}}}
    as_string = corelib_params(VllmParams(extra_args={CORELIB_KEY: json.dumps(fields)}))
    assert as_string == corelib_params(VllmParams(extra_args={CORELIB_KEY: fields}))
    assert as_string == corelib.SamplingParams(**fields)


def test_the_servers_booleans_at_the_top_level():
    """``vllm_xargs`` turns a JSON ``true`` into 1: at the top level (the older spelling)
    ``temperature_last`` takes 1 and 0 as the booleans they were; other values stay errors."""
    assert corelib_params(VllmParams(extra_args={"temperature_last": 1})).temperature_last is True
    assert corelib_params(VllmParams(extra_args={"temperature_last": 0})).temperature_last is False
    with pytest.raises(ValueError, match="temperature_last"):
        corelib_params(VllmParams(extra_args={"temperature_last": 2}))
    with pytest.raises(ValueError, match="temperature_last"):
        corelib_params(VllmParams(extra_args={CORELIB_KEY: {"temperature_last": 1}}))


def test_extra_args_keys_vllm_reads_are_left_to_vllm():
    for key in VLLM_EXTRA_ARGS:
        assert corelib_params(VllmParams(extra_args={key: {"a": 1}})) == corelib.SamplingParams()


@pytest.mark.parametrize("kwargs, match", [
    (dict(extra_args={CORELIB_KEY: {"no_such_field": 5.0}}),
     "extra_args\\['corelib'\\]\\['no_such_field'\\] is not a corelib sampling parameter"),
    (dict(extra_args={CORELIB_KEY: {"temperature": 0.5}}),
     "extra_args\\['corelib'\\]\\['temperature'\\]: temperature is a field of vLLM's SamplingParams"),
    (dict(extra_args={CORELIB_KEY: {"thinking_budget": 4}}),
     "extra_args\\['corelib'\\]\\['thinking_budget'\\]: the reasoning budget is vLLM's"),
    (dict(extra_args={CORELIB_KEY: [("dry_multiplier", 0.5)]}),
     "extra_args\\['corelib'\\] must be a dict of corelib sampling parameters .*, got list"),
    (dict(extra_args={CORELIB_KEY: "{'tfs': 0.5}"}),
     "extra_args\\['corelib'\\]: a string must hold a JSON object .* got \"{'tfs'"),
    (dict(extra_args={CORELIB_KEY: "[1, 2]"}),
     "extra_args\\['corelib'\\]: a string must hold a JSON object .* got JSON list"),
    (dict(extra_args={CORELIB_KEY: '{"tfs": 0}'}), "tfs: tfs must be in \\(0, 1\\]"),
    (dict(extra_args={CORELIB_KEY: {"top_a": 1.5}}), "top_a: top_a must be in \\[0, 1\\]"),
    (dict(extra_args={CORELIB_KEY: {"epsilon_cutoff": 1.0}}), "epsilon_cutoff: .*\\[0, 1\\)"),
    (dict(extra_args={CORELIB_KEY: {"eta_cutoff": -0.1}}), "eta_cutoff: .*\\[0, 1\\)"),
    (dict(extra_args={CORELIB_KEY: {"dynatemp_exponent": 0.0}}), "dynatemp_exponent: .*> 0"),
    (dict(extra_args={CORELIB_KEY: {"smoothing_curve": 4.0}}), "smoothing_curve: .*\\[1, 3\\]"),
    (dict(extra_args={CORELIB_KEY: {"p_less": "loose"}}), "p_less"),
    (dict(extra_args={CORELIB_KEY: {"mirostat_eta": 2.0}}), "mirostat_eta: .*\\[0, 1\\]"),
    (dict(extra_args={CORELIB_KEY: {"adaptive_p_decay": 1.0}}), "adaptive_p_decay: .*0.99"),
    (dict(extra_args={CORELIB_KEY: {"sampler_order": ["top_k", "nope"]}}),
     "sampler_order: unknown filter 'nope'"),
    (dict(extra_args={CORELIB_KEY: {"sampler_order": ["top_k", "top_k"]}}),
     "sampler_order: 'top_k' is listed twice"),
    (dict(top_k=5, extra_args={CORELIB_KEY: {"sampler_order": ["temperature"]}}),
     "sampler_order must list every filter the request turns on"),
    (dict(extra_args={CORELIB_KEY: {"sampler_order": ["top_k"], "temperature_last": True}}),
     "temperature_last cannot be combined with sampler_order"),
    (dict(extra_args={CORELIB_KEY: {"mirostat_tau": 5.0, "adaptive_p_target": 0.5}}),
     "mirostat.*adaptive"),
    (dict(extra_args={CORELIB_KEY: {"dry_multiplier": 0.5}, "dry_multiplier": 0.7}),
     "extra_args\\['dry_multiplier'\\]: dry_multiplier is also set in extra_args\\['corelib'\\]"),
    (dict(extra_args={CORELIB_KEY: {"dry_multiplier": -1.0}}), "dry_multiplier: .*0"),
    (dict(extra_args={"typical_p": 1.5}), "typical_p: .*1"),
    (dict(logprob_token_ids=[1, 2]), "logprob_token_ids is not supported"),
    (dict(logprobs=600), "logprobs=600 exceeds the model's vocabulary of 512"),
    (dict(seed=-5), "seed must be in \\[0, 2\\*\\*63\\)"),
    (dict(thinking_token_budget=10), "thinking_token_budget=10 needs the engine's reasoning markers"),
    (dict(allowed_token_ids=[3, 600]), "token id 600 .* vocabulary of 512"),
    (dict(allowed_token_ids=[7, 9], min_tokens=2, stop_token_ids=[9, 7]),
     "allowed_token_ids \\[7, 9\\] are all excluded .* no first token"),
])
def test_what_corelib_cannot_honour_is_an_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        corelib_params(VllmParams(**kwargs), vocab_size=512)


def test_extra_args_of_other_code_pass_through_untouched():
    """Keys corelib does not own belong to logits processors, plugins or the user, as in
    vLLM: corelib neither reads nor refuses them, whether or not the engine runs processors,
    also where a key happens to be the name of a vLLM field."""
    extra = {"target_token": 3, "temperature": 9, "my_plugin": {"x": [1]},
             CORELIB_KEY: {"top_n_sigma": 1.5}, "dry_multiplier": 0.5}
    params = VllmParams(extra_args=extra)
    before = repr(params.extra_args)
    assert corelib_params(params) == corelib.SamplingParams(top_n_sigma=1.5, dry_multiplier=0.5)
    assert repr(params.extra_args) == before
    assert corelib_params(VllmParams(extra_args={"target_token": 3})) == corelib.SamplingParams()


def test_unsupported_is_a_value_error():
    assert issubclass(UnsupportedParameterError, ValueError)


# ---------------------------------------------------------------------- in the engine
def test_a_bad_request_fails_alone_at_admission(corelib_llm):
    """The error comes from vLLM's request validation (HTTP 400 in the server), names the
    parameter, and the engine goes on serving."""
    prompt = [TokensPrompt(prompt_token_ids=[1, 2, 3])]
    with pytest.raises(VLLMValidationError,
                       match="corelib sampler \\(CORELIB_VLLM\\): extra_args\\['corelib'\\]\\['foo'\\]"):
        corelib_llm.generate(prompt, VllmParams(extra_args={CORELIB_KEY: {"foo": 1}}),
                             use_tqdm=False)
    with pytest.raises(VLLMValidationError, match="logprob_token_ids"):
        corelib_llm.generate(prompt, VllmParams(logprob_token_ids=[4]), use_tqdm=False)
    with pytest.raises(VLLMValidationError, match="mirostat_eta: mirostat_eta must be in \\[0, 1\\]"):
        corelib_llm.generate(prompt, VllmParams(extra_args={CORELIB_KEY: {
            "mirostat_tau": 5.0, "mirostat_eta": 1.5}}), use_tqdm=False)
    # eos joins the stop ids only in vLLM's final parameters: the check sees those.
    with pytest.raises(VLLMValidationError, match="allowed_token_ids \\[2\\] are all excluded"):
        corelib_llm.generate(prompt, VllmParams(allowed_token_ids=[EOS], min_tokens=2),
                             use_tqdm=False)
    out = corelib_llm.generate(prompt, VllmParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_extra_args_meant_for_other_code_are_served_as_vllm_serves_them(corelib_llm, vllm_llm):
    """vLLM ignores extra_args keys no processor reads; so does corelib: the request is served,
    and samples what it samples without them (greedy: what vLLM's sampler samples too)."""
    prompts = PROMPTS[:3]
    other = {"target_token": 3, "temperature": 2.0, "my_plugin": {"on": True}}
    greedy = run(corelib_llm, prompts, vllm_params(temperature=0.0))
    assert run(corelib_llm, prompts, vllm_params(temperature=0.0, extra_args=other)) == greedy
    assert run(vllm_llm, prompts, vllm_params(temperature=0.0, extra_args=other)) == greedy
    seeded = dict(temperature=1.0, top_p=0.9, seed=5)
    assert (run(corelib_llm, prompts, vllm_params(**seeded, extra_args=other))
            == run(corelib_llm, prompts, vllm_params(**seeded)))


def test_a_row_left_without_tokens_finishes_that_request_with_an_error(corelib_llm, model_dir):
    """allowed_token_ids=[t] and the bad word "t t": the first token is t, the second has no
    token left, which the admission check cannot foresee. corelib flags the row; vLLM's
    scheduler finishes that request with finish reason "error" and corelib's reason, without
    a token nobody drew, while the other request and the engine go on."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    token = next(t for t in range(3, 512)
                 if tokenizer.decode([t]).isalpha()
                 and tokenizer.encode(tokenizer.decode([t]) * 2, add_special_tokens=False) == [t, t])
    stuck = VllmParams(allowed_token_ids=[token], max_tokens=4,
                       bad_words=[tokenizer.decode([token]) * 2])
    other = VllmParams(temperature=0.0, max_tokens=4)
    prompts = [TokensPrompt(prompt_token_ids=[1, 2, 3]), TokensPrompt(prompt_token_ids=[1, 5])]
    outs = corelib_llm.generate(prompts, [stuck, other], use_tqdm=False)
    failed = outs[0].outputs[0]
    assert failed.finish_reason == "error" and list(failed.token_ids) == [token]
    assert "has no token to sample after 1 generated tokens" in failed.stop_reason
    alone = corelib_llm.generate(prompts[1:], other, use_tqdm=False)
    assert outs[1].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert outs[1].outputs[0].finish_reason == "length"


def test_min_p_and_logit_bias_are_accepted_under_speculation_with_corelib():
    """vLLM's own sampler refuses them under speculative decoding; corelib's verification
    applies every stage at every slot."""
    from conftest import corelib_vllm
    register()
    params = VllmParams(min_p=0.1, logit_bias={3: 1.0})
    spec = object()
    params._validate_spec_decode(spec)
    with corelib_vllm(None), pytest.raises(VLLMValidationError, match="min_p and logit_bias"):
        params._validate_spec_decode(spec)


def test_synthetic_rejection_sampling_is_refused_at_start(model_dir):
    """corelib verifies drafts by the token rule or as a block; vLLM's synthetic acceptance
    (fixed rates, for load tests) would accept drafts by no rule that keeps the target
    distribution."""
    with pytest.raises(Exception, match="rejection_sample_method='synthetic' is not supported"):
        make_llm(model_dir, "cpu", speculative_config={
            "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2,
            "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 1.5})


def test_model_runner_v2_is_refused():
    """vLLM's V2 runner (its default on CUDA) is not supported: the plugin selects V1 unless
    the user chose V2, and a V2 runner refuses to start. (V2 needs Triton, so on this CPU
    build vLLM itself never builds one: the hook is called directly.)"""
    register()                     # as vLLM does at start (once per process)
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    runner = GPUModelRunner.__new__(GPUModelRunner)
    with pytest.raises(ValueError, match="CORELIB_VLLM works with vLLM's V1 model runner"):
        GPUModelRunner.__init__(runner, None, None)


# ---------------------------------------------------------------------- the backend choice
def test_backend_choice_auto_named_and_wrong_device():
    import torch

    from corelib.integrations.vllm.sampler import make_sampler
    auto = make_sampler("auto", torch.device("cpu"), seed=3)
    assert auto.name == corelib.get_sampler(torch.device("cpu")).name
    assert auto.generator.initial_seed() == 3      # unseeded rows: the engine's seed
    assert make_sampler("reference", torch.device("cpu"), seed=None).name == "reference"
    with pytest.raises(ValueError, match="logits are on cuda:0"):
        make_sampler("cpu", torch.device("cuda", 0), seed=0)
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        make_sampler("nope", torch.device("cpu"), seed=0)
