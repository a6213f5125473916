"""SamplingParams: the contract's table, field by field."""

import math

import pydantic
import pytest

from corelib import SamplingParams


def test_defaults_disable_every_stage():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_k, p.top_p, p.min_p) == (1, 1.0, 0, 1.0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.logit_bias == {} and p.min_tokens == 0 and p.stop_token_ids == []
    assert p.allowed_token_ids is None and p.bad_words == [] and p.seed is None and p.logprobs is None
    assert not p.uses_penalties and p.effective_top_k == 0
    assert (p.dry_multiplier, p.dry_base, p.dry_allowed_length, p.dry_range) == (0.0, 1.75, 2, 0)
    assert p.dry_sequence_breakers == [] and not p.uses_dry
    assert (p.top_n_sigma, p.typical_p, p.xtc_threshold, p.xtc_probability) == (0.0, 1.0, 0.1, 0.0)
    assert not p.uses_xtc and p.stage_args == {}


@pytest.mark.parametrize("field,value", [
    ("n", 1), ("n", 64), ("temperature", 0.0), ("temperature", 2), ("top_k", -1), ("top_k", 0),
    ("top_k", 50), ("top_p", 1e-9), ("top_p", 1.0), ("min_p", 0.0), ("min_p", 1.0),
    ("presence_penalty", -2.0), ("frequency_penalty", 2.0), ("repetition_penalty", 1e-3),
    ("logit_bias", {0: -100.0, 5: 100}), ("min_tokens", 0), ("stop_token_ids", [0, 7]),
    ("allowed_token_ids", [3]), ("bad_words", [[1], [2, 3]]), ("seed", 0), ("seed", 2**63 - 1),
    ("logprobs", 0), ("logprobs", 20),
    ("dry_multiplier", 0.0), ("dry_multiplier", 100), ("dry_base", 1.0001), ("dry_base", 10.0),
    ("dry_allowed_length", 1), ("dry_range", 0), ("dry_range", 4096),
    ("dry_sequence_breakers", [0, 13]), ("top_n_sigma", 0.0), ("top_n_sigma", 3.5),
    ("typical_p", 1e-6), ("typical_p", 1.0), ("xtc_threshold", 0.0), ("xtc_threshold", 1.0),
    ("xtc_probability", 0.0), ("xtc_probability", 1),
    ("stage_args", {"my-stage": {"level": 2}}),
])
def test_valid_values_are_accepted(field, value):
    p = SamplingParams(**{field: value})
    assert getattr(p, field) == value


@pytest.mark.parametrize("field,value,fragment", [
    ("n", 0, "n must be >= 1"),
    ("temperature", -0.1, "temperature must be >= 0"),
    ("temperature", math.nan, "finite"),
    ("temperature", math.inf, "finite"),
    ("top_k", -2, "top_k must be >= -1"),
    ("top_p", 0.0, "top_p must be in (0, 1], got 0.0"),
    ("top_p", 1.5, "top_p must be in (0, 1], got 1.5"),
    ("min_p", 1.01, "min_p must be in [0, 1]"),
    ("min_p", -0.01, "min_p must be in [0, 1]"),
    ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2], got 2.5"),
    ("frequency_penalty", -3.0, "frequency_penalty must be in [-2, 2]"),
    ("repetition_penalty", 0.0, "repetition_penalty must be > 0"),
    ("logit_bias", {3: 100.5}, "logit_bias[3] must be in [-100, 100], got 100.5"),
    ("logit_bias", {3: math.nan}, "finite"),
    ("logit_bias", {-1: 1.0}, "greater than or equal to 0"),
    ("min_tokens", -1, "min_tokens must be >= 0"),
    ("stop_token_ids", [-3], "greater than or equal to 0"),
    ("allowed_token_ids", [], "allowed_token_ids must not be empty"),
    ("bad_words", [[1], []], "bad_words[1] must be a non-empty token sequence"),
    ("seed", -1, "seed must be in [0, 2**63)"),
    ("seed", 2**63, "seed must be in [0, 2**63)"),
    ("logprobs", -2, "logprobs must be >= -1 (-1 = every token), got -2"),
    ("thinking_budget", -3, "thinking_budget must be >= 0, got -3"),
    ("dry_multiplier", -0.5, "dry_multiplier must be in [0, 100], got -0.5"),
    ("dry_multiplier", 100.5, "dry_multiplier must be in [0, 100]"),
    ("dry_multiplier", math.inf, "finite"),
    ("dry_base", 1.0, "dry_base must be in (1, 10], got 1.0"),
    ("dry_base", 10.5, "dry_base must be in (1, 10]"),
    ("dry_base", math.nan, "finite"),
    ("dry_allowed_length", 0, "dry_allowed_length must be >= 1, got 0"),
    ("dry_range", -1, "dry_range must be >= 0"),
    ("dry_sequence_breakers", [-1], "greater than or equal to 0"),
    ("top_n_sigma", -0.1, "top_n_sigma must be >= 0"),
    ("top_n_sigma", math.inf, "finite"),
    ("typical_p", 0.0, "typical_p must be in (0, 1], got 0.0"),
    ("typical_p", 1.1, "typical_p must be in (0, 1]"),
    ("xtc_threshold", -0.1, "xtc_threshold must be in [0, 1]"),
    ("xtc_threshold", 1.5, "xtc_threshold must be in [0, 1]"),
    ("xtc_probability", 2.0, "xtc_probability must be in [0, 1], got 2.0"),
    ("xtc_probability", math.nan, "finite"),
    ("stage_args", {"": {}}, "stage_args keys must be stage names"),
    ("stage_args", {"s": 3}, "stage_args['s'] must be a dict"),
])
def test_invalid_values_name_the_field_and_value(field, value, fragment):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    assert field.split("[")[0] in str(err.value)
    assert fragment in str(err.value)


@pytest.mark.parametrize("field,value", [
    ("n", True), ("n", 2.0), ("top_k", 1.5), ("min_tokens", "3"), ("seed", 1.0),
    ("logprobs", False), ("stop_token_ids", [1.0]), ("allowed_token_ids", [True]),
    ("dry_allowed_length", True), ("dry_range", 2.0), ("dry_sequence_breakers", ["a"]),
])
def test_ints_reject_bools_floats_and_strings(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field,value", [
    ("temperature", True), ("top_p", "0.5"), ("min_p", False), ("logit_bias", {1: True}),
    ("dry_multiplier", True), ("dry_base", "2"), ("top_n_sigma", False), ("typical_p", "0.9"),
    ("xtc_threshold", True), ("xtc_probability", "1"),
])
def test_floats_reject_bools_and_strings(field, value):
    with pytest.raises(pydantic.ValidationError, match=field.split("[")[0]):
        SamplingParams(**{field: value})


def test_unknown_fields_are_an_error():
    with pytest.raises(pydantic.ValidationError, match="top_a"):
        SamplingParams(top_a=3)


def test_greedy_with_several_completions_is_rejected():
    with pytest.raises(ValueError, match="n > 1 needs temperature > 0"):
        SamplingParams(n=2, temperature=0.0)


def test_params_are_immutable():
    p = SamplingParams()
    with pytest.raises(pydantic.ValidationError):
        p.temperature = 0.5


def test_max_token_id_spans_every_id_field():
    p = SamplingParams(logit_bias={4: 1.0}, stop_token_ids=[9], allowed_token_ids=[2],
                       bad_words=[[1, 30]])
    assert p.max_token_id() == 30
    assert SamplingParams(dry_multiplier=1.0, dry_sequence_breakers=[3, 77]).max_token_id() == 77
    assert SamplingParams().max_token_id() is None
