"""SamplingParams of the fourth release: the new filters, the order of the filter group and
the stateful selectors (the contract's "Fourth release" tables), field by field."""

import math

import pydantic
import pytest

from corelib import SamplingParams, pipeline

NEW_DEFAULTS = dict(dynatemp_range=0.0, dynatemp_exponent=1.0, smoothing_factor=0.0,
                    smoothing_curve=1.0, top_a=0.0, epsilon_cutoff=0.0, eta_cutoff=0.0, tfs=1.0,
                    p_less=None, sampler_order=None, temperature_last=False, mirostat_tau=0.0,
                    mirostat_eta=0.1, adaptive_p_target=None, adaptive_p_decay=0.9)


def test_defaults_turn_every_new_sampler_off():
    p = SamplingParams()
    assert {name: getattr(p, name) for name in NEW_DEFAULTS} == NEW_DEFAULTS
    assert pipeline.filters_on(p) == ()
    assert p.filter_order is None and not p.uses_mirostat and not p.uses_adaptive_p


@pytest.mark.parametrize("field,value", [
    ("dynatemp_range", 0.0), ("dynatemp_range", 5), ("dynatemp_exponent", 1e-3),
    ("dynatemp_exponent", 4.0), ("smoothing_factor", 0.0), ("smoothing_factor", 10.0),
    ("smoothing_curve", 1.0), ("smoothing_curve", 3), ("top_a", 0.0), ("top_a", 1.0),
    ("epsilon_cutoff", 0.0), ("epsilon_cutoff", 0.999), ("eta_cutoff", 0.0),
    ("eta_cutoff", 0.5), ("tfs", 1e-6), ("tfs", 1.0), ("p_less", "plain"), ("p_less", "norm"),
    ("mirostat_tau", 0.0), ("mirostat_tau", 8), ("mirostat_eta", 0.0), ("mirostat_eta", 1.0),
    ("adaptive_p_target", 0.0), ("adaptive_p_target", 1.0), ("adaptive_p_decay", 0.0),
    ("adaptive_p_decay", 0.99), ("temperature_last", True),
    ("sampler_order", ["xtc", "temperature"]), ("sampler_order", list(pipeline.order_names())),
])
def test_valid_values_are_accepted(field, value):
    assert getattr(SamplingParams(**{field: value}), field) == value


@pytest.mark.parametrize("field,value,fragment", [
    ("dynatemp_range", -0.1, "dynatemp_range must be >= 0"),
    ("dynatemp_range", math.inf, "finite"),
    ("dynatemp_exponent", 0.0, "dynatemp_exponent must be > 0"),
    ("dynatemp_exponent", math.nan, "finite"),
    ("smoothing_factor", -1.0, "smoothing_factor must be >= 0"),
    ("smoothing_curve", 0.99, "smoothing_curve must be in [1, 3]"),
    ("smoothing_curve", 3.01, "smoothing_curve must be in [1, 3]"),
    ("top_a", 1.01, "top_a must be in [0, 1]"),
    ("top_a", -0.01, "top_a must be in [0, 1]"),
    ("epsilon_cutoff", 1.0, "epsilon_cutoff must be in [0, 1)"),
    ("eta_cutoff", 1.0, "eta_cutoff must be in [0, 1)"),
    ("eta_cutoff", -1e-9, "eta_cutoff must be in [0, 1)"),
    ("tfs", 0.0, "tfs must be in (0, 1]"),
    ("tfs", 1.5, "tfs must be in (0, 1]"),
    ("p_less", "fancy", "p_less"),
    ("p_less", True, "p_less"),
    ("mirostat_tau", -1.0, "mirostat_tau must be >= 0"),
    ("mirostat_tau", math.inf, "finite"),
    ("mirostat_eta", 1.5, "mirostat_eta must be in [0, 1]"),
    ("adaptive_p_target", 1.2, "adaptive_p_target must be in [0, 1]"),
    ("adaptive_p_target", math.nan, "finite"),
    ("adaptive_p_decay", 0.995, "adaptive_p_decay must be in [0, 0.99]"),
    ("temperature_last", 1, "temperature_last"),
    ("top_a", True, "top_a must be a number"),
    ("tfs", "0.5", "tfs must be a number"),
])
def test_out_of_range_values_raise_naming_the_field(field, value, fragment):
    with pytest.raises(pydantic.ValidationError) as err:
        SamplingParams(**{field: value})
    assert fragment in str(err.value) and field in str(err.value)


@pytest.mark.parametrize("params,fragment", [
    (dict(sampler_order=["min_p", "top_q"], min_p=0.1), "unknown filter 'top_q'"),
    (dict(sampler_order=["min_p", "min_p"], min_p=0.1), "'min_p' is listed twice"),
    (dict(sampler_order=["top_k"], top_k=5, min_p=0.1), "'min_p' is on but not listed"),
    (dict(sampler_order=["min_p"], temperature=0.5, min_p=0.1), "'temperature' is on but not listed"),
    (dict(sampler_order=["top_k"], dynatemp_range=0.5, top_k=3), "'temperature' is on but not listed"),
    (dict(sampler_order=["xtc"], temperature_last=True), "temperature_last cannot be combined with sampler_order"),
    (dict(sampler_order="min_p"), "sampler_order"),
    (dict(mirostat_tau=5.0, adaptive_p_target=0.5), "both replace the draw"),
])
def test_bad_combinations_raise_naming_the_field(params, fragment):
    with pytest.raises(pydantic.ValidationError) as err:
        SamplingParams(**params)
    assert fragment in str(err.value)


def test_a_filter_is_on_when_one_of_its_fields_is_not_at_its_off_value():
    assert pipeline.filters_on(SamplingParams(temperature=1.0, dynatemp_range=0.3)) == ("temperature",)
    assert pipeline.filters_on(SamplingParams(temperature=0.7)) == ("temperature",)
    # smoothing_curve alone does not turn smoothing on: its factor does
    assert pipeline.filters_on(SamplingParams(smoothing_curve=2.0)) == ()
    assert pipeline.filters_on(SamplingParams(xtc_threshold=0.3)) == ()
    assert pipeline.filters_on(SamplingParams(top_k=-1, top_p=0.9, p_less="norm")) == ("top_p", "p_less")


def test_filter_order_is_none_for_the_default_order_and_lists_only_filters_that_are_on():
    # a listed filter that is off does nothing; an order equal to the default one is None
    assert SamplingParams(sampler_order=list(pipeline.order_names()), top_k=3).filter_order is None
    assert SamplingParams(sampler_order=["min_p", "top_k", "xtc"], top_k=3, min_p=0.1).filter_order is None
    assert SamplingParams(sampler_order=["top_k", "min_p", "xtc"], top_k=3, min_p=0.1).filter_order == ("top_k", "min_p")
    order = SamplingParams(sampler_order=["top_k", "temperature", "min_p"], top_k=3, min_p=0.1,
                           temperature=0.5).filter_order
    assert order == ("top_k", "temperature", "min_p")


def test_temperature_last_moves_temperature_then_smoothing_after_xtc():
    p = SamplingParams(temperature_last=True, temperature=0.7, smoothing_factor=0.2, min_p=0.05,
                       xtc_probability=0.5)
    assert p.filter_order == ("min_p", "xtc", "temperature", "smoothing")
    # with nothing after them, temperature last is the default order
    assert SamplingParams(temperature_last=True, temperature=0.7).filter_order is None
