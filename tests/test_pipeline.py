"""The stage table (corelib.pipeline) is the one place that knows each built-in stage: the
batch's scalars, the step state's fields and flags and the template's order all follow it,
and a stage added to the table alone runs, in order, with its per-row values kept by the
batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import corelib
from corelib import pipeline
from corelib.batch import StepState
from corelib.sampler import Sampler
from corelib.testing.added_stage import expected_kept, run_added_stage

V = 256   # the table's examples are for a vocabulary of 256


# Between them, every field of the table away from its neutral value (the two selectors
# exclude each other).
EVERY_FIELD_ON = (
    dict(temperature=0.5, top_k=3, top_p=0.8, min_p=0.1, typical_p=0.9, top_n_sigma=1.0,
         xtc_probability=0.5, xtc_threshold=0.2, repetition_penalty=1.1, presence_penalty=0.5,
         frequency_penalty=0.25, dry_multiplier=0.5, dry_base=2.0, dry_allowed_length=3,
         dry_range=16, min_tokens=2, dynatemp_range=0.3, dynatemp_exponent=2.0,
         smoothing_factor=0.2, smoothing_curve=2.0, top_a=0.1, epsilon_cutoff=0.01,
         eta_cutoff=0.01, tfs=0.9, p_less="norm", mirostat_tau=4.0, mirostat_eta=0.2, seed=1),
    dict(adaptive_p_target=0.4, adaptive_p_decay=0.5),
)


def test_every_stage_field_is_a_step_state_tensor_with_its_dtype_and_neutral_padding():
    names = {f.name for f in dataclasses.fields(StepState)}
    turned_on = set()
    for fields in EVERY_FIELD_ON:
        batch = Sampler().new_batch(V)
        batch.add("a", corelib.SamplingParams(**fields))
        s = batch.step_state(num_rows=3)          # two padding rows past the request's one
        params = batch.params_of("a")
        for f in pipeline.stage_fields() + pipeline.state_fields():
            assert f.name in names
            tensor = getattr(s, f.name)
            assert tensor.dtype == f.dtype and tuple(tensor.shape) == (3,)
            assert tensor[0].item() == pytest.approx(f.value(params)), f.name
            if tensor[0].item() != pytest.approx(f.neutral):
                turned_on.add(f.name)
            assert tensor[1:].tolist() == pytest.approx([f.neutral] * 2), f"{f.name}: padding rows are neutral"
    every = {f.name for f in pipeline.stage_fields() + pipeline.state_fields()}
    assert turned_on == every, f"not turned on by EVERY_FIELD_ON: {every - turned_on}"


def test_int32_fields_are_clamped_and_top_k_disabled_both_ways():
    batch = Sampler().new_batch(V)
    batch.add("big", corelib.SamplingParams(top_k=2**40, min_tokens=2**40, stop_token_ids=[1]))
    batch.add("off", corelib.SamplingParams(top_k=-1))
    s = batch.step_state()
    assert s.top_k.tolist() == [pipeline.INT32_MAX, 0]
    assert s.min_tokens.tolist() == [pipeline.INT32_MAX, 0]


@pytest.mark.parametrize("stage, switch", pipeline.switches(),
                         ids=[sw.flag for _, sw in pipeline.switches()])
def test_each_switch_is_on_exactly_when_a_row_it_applies_to_uses_the_stage(stage, switch):
    if switch.uses is None:
        pytest.skip(f"{switch.flag} is set per call or per step, not from the requests")
    batch = Sampler().new_batch(V)
    batch.add("plain", corelib.SamplingParams(seed=1))
    assert getattr(batch.step_state(), switch.flag) is False
    greedy = dict(stage.example)
    greedy["temperature"] = 0.0
    batch.add("greedy", corelib.SamplingParams(**greedy))
    # greedy rows skip the filter group, so they turn on only the stages of every row
    assert getattr(batch.step_state(), switch.flag) is (stage.rows == pipeline.ALL_ROWS)
    batch.add("random", corelib.SamplingParams(**stage.example))
    assert getattr(batch.step_state(), switch.flag) is True
    batch.remove("random", "greedy")
    assert getattr(batch.step_state(), switch.flag) is False


ROW_FIELD_CASES = [dict(), *EVERY_FIELD_ON, *(stage.example for stage in pipeline.STAGES if stage.example),
                   dict(top_k=-1, top_p=1.0), dict(xtc_probability=0.0, xtc_threshold=0.3),
                   dict(adaptive_p_target=0.0), dict(dynatemp_range=0.5, temperature=0.0)]


def test_row_fields_name_a_field_of_their_stage_in_the_filter_and_select_groups():
    named = [(stage, switch) for stage, switch in pipeline.switches() if switch.row_field is not None]
    listed = pipeline.row_switches("filter", "select")
    assert [(stage, switch) for stage, switch, _ in listed] == named
    assert all(field.name == switch.row_field and field in stage.fields for stage, switch, field in listed)


@pytest.mark.parametrize("stage, switch, field", pipeline.row_switches("filter", "select"),
                         ids=[sw.flag for _, sw, _ in pipeline.row_switches("filter", "select")])
def test_a_switchs_row_field_away_from_neutral_is_its_uses_for_random_rows(stage, switch, field):
    """What a backend reads per row from the step state's tensors (``Switch.row_field``)
    says what ``uses`` says of the row's request."""
    for case in ROW_FIELD_CASES:
        params = corelib.SamplingParams(**case)
        if params.is_greedy:
            continue
        batch = Sampler().new_batch(V)
        batch.add("r", params)
        value = getattr(batch.step_state(), field.name)[0].item()
        assert (value != field.neutral) == switch.uses(params), (switch.flag, case)


class RecordingSampler(Sampler):
    """The reference, recording which table stage runs when."""

    def __init__(self):
        super().__init__()
        self.calls = []
        for stage in pipeline.STAGES:
            setattr(self, stage.method, self._recording(stage.name, getattr(self, stage.method)))

    def _recording(self, name, method):
        def run(x, s):
            self.calls.append(name)
            return method(x, s)
        return run


def test_the_template_runs_every_stage_in_the_tables_order():
    sampler = RecordingSampler()
    batch = sampler.new_batch(V, eos_token_id=0)
    batch.add("all", corelib.SamplingParams(
        temperature=0.9, top_k=20, top_p=0.95, min_p=0.01, typical_p=0.99, top_n_sigma=3.0,
        xtc_probability=0.5, xtc_threshold=0.3, presence_penalty=0.1, dry_multiplier=0.1,
        logit_bias={5: 1.0}, bad_words=[[7]], allowed_token_ids=list(range(1, 60)),
        min_tokens=3, dynatemp_range=0.2, smoothing_factor=0.1, top_a=0.01, epsilon_cutoff=1e-4,
        eta_cutoff=1e-4, tfs=0.99, p_less="plain", mirostat_tau=5.0, seed=2),
        prompt_token_ids=[1, 2, 3])
    batch.add("adaptive", corelib.SamplingParams(adaptive_p_target=0.5, seed=3))
    mask = torch.full((2, (V + 31) // 32), -1, dtype=torch.int32)
    sampler.sample(torch.randn(2, V), batch, token_bitmask=mask)
    assert sampler.calls == [stage.name for stage in pipeline.STAGES]


@pytest.mark.parametrize("backend", ["reference", "cpu", "cuda-torch-path"])
def test_a_stage_added_through_the_table_alone_runs_in_order_with_its_row_values(backend):
    """A fresh interpreter adds a throwaway stage (top-a's rule as "cut-a") to the table
    before the batch is loaded (``corelib.testing.added_stage``): the batch keeps its per-row value (also after rows
    move), the step state carries it and its switch, and the filter group runs it in its
    place; its kept sets are the hand computation's. The cpu backend, which has no method of
    its own for it, runs the reference's on whole rows; the cuda backend's torch path runs the
    reference's as it is; the TPU plugin's suite traces it on XLA."""
    if backend == "cuda-torch-path":
        pytest.importorskip("corelib_cuda")
    assert run_added_stage(backend) == expected_kept()
