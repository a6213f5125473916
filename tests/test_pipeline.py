"""The stage table (corelib.pipeline) is the one place that knows each built-in stage: the
batch's scalars, the step state's fields and flags and the template's order all follow it,
and a stage added to the table alone runs, in order, with its per-row values kept by the
batch."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap

import pytest
import torch

import corelib
from corelib import pipeline
from corelib.batch import StepState
from corelib.sampler import Sampler

V = 256   # the table's examples are for a vocabulary of 256


def test_every_stage_field_is_a_step_state_tensor_with_its_dtype_and_neutral_padding():
    sampler = Sampler()
    batch = sampler.new_batch(V)
    batch.add("a", corelib.SamplingParams(temperature=0.5, top_k=3, top_p=0.8, min_p=0.1,
                                          typical_p=0.9, top_n_sigma=1.0, xtc_probability=0.5,
                                          xtc_threshold=0.2, repetition_penalty=1.1,
                                          presence_penalty=0.5, frequency_penalty=0.25,
                                          dry_multiplier=0.5, dry_base=2.0, dry_allowed_length=3,
                                          dry_range=16, min_tokens=2, seed=1))
    s = batch.step_state(num_rows=3)          # two padding rows past the request's one
    names = {f.name for f in dataclasses.fields(StepState)}
    params = batch.params_of("a")
    for f in pipeline.stage_fields():
        assert f.name in names
        tensor = getattr(s, f.name)
        assert tensor.dtype == f.dtype and tuple(tensor.shape) == (3,)
        assert tensor[0].item() == pytest.approx(f.value(params)), f.name
        assert tensor[0].item() != pytest.approx(f.neutral), f"{f.name}: the request turns it on"
        assert tensor[1:].tolist() == pytest.approx([f.neutral] * 2), f"{f.name}: padding rows are neutral"


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
        min_tokens=3, seed=2), prompt_token_ids=[1, 2, 3])
    mask = torch.full((1, (V + 31) // 32), -1, dtype=torch.int32)
    sampler.sample(torch.randn(1, V), batch, token_bitmask=mask)
    assert sampler.calls == [stage.name for stage in pipeline.STAGES]


SCRIPT = textwrap.dedent("""
    import importlib.util, json, sys, torch, pydantic
    # the table module alone, before the package that derives the batch and step state from
    # it: as if pipeline.py itself had been edited
    path = sys.argv[1]
    spec = importlib.util.spec_from_file_location("corelib.pipeline", path)
    pipeline = sys.modules["corelib.pipeline"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pipeline)

    # a throwaway stage, top-a (drop tokens with p < a * p_max**2), after min-p: its table
    # entry, its field on a request type of its own, its reference method; nothing else
    top_a = pipeline.Stage("11a", "top_a", "apply_top_a", "filter", pipeline.RANDOM_ROWS,
                           (pipeline.Switch("any_top_a", lambda p: getattr(p, "top_a", 0.0) > 0),),
                           (pipeline.Field("top_a", torch.float32, 0.0,
                                           lambda p: getattr(p, "top_a", 0.0)),))
    at = [s.name for s in pipeline.STAGES].index("min_p") + 1
    pipeline.STAGES = pipeline.STAGES[:at] + (top_a,) + pipeline.STAGES[at:]
    pipeline._BY_GROUP = {g: tuple(s for s in pipeline.STAGES if s.group == g)
                          for g in pipeline.GROUPS}
    pipeline._FLAGGED = {g: tuple((s, s.flags) for s in stages)
                         for g, stages in pipeline._BY_GROUP.items()}

    import corelib
    from corelib.params import SamplingParams
    from corelib.sampler import Sampler

    class Params(SamplingParams):
        top_a: float = pydantic.Field(default=0.0, ge=0.0, le=1.0)

    def apply_top_a(self, x, s):
        p = torch.softmax(x, dim=-1)
        cut = s.top_a[:, None] * p.amax(dim=-1, keepdim=True) ** 2
        return x.masked_fill(p < cut, float("-inf"))
    Sampler.apply_top_a = apply_top_a

    if sys.argv[2] == "cuda-torch-path":       # the cuda backend's torch path, on CPU tensors
        from corelib_cuda import CudaSampler
        sampler = CudaSampler("cpu", use_flashinfer=False)
    else:
        sampler = corelib.get_sampler(sys.argv[2])
    batch = sampler.new_batch(8)
    batch.add("off", Params(temperature=1.0))
    batch.add("on", Params(temperature=1.0, top_a=0.9, n=2, seed=3))
    # with a top-k, a backend may divide only the top-k candidates by the temperature: top-a
    # runs before top-k and must see the divided row
    batch.add("cold", Params(temperature=0.5, top_k=4, top_a=0.2, seed=4))
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0]]).repeat(4, 1)
    kept = torch.isfinite(sampler.processed_logits(logits, batch))
    batch.remove("off")       # the rows move: the scalars move with them
    moved = torch.isfinite(sampler.processed_logits(logits[:3], batch))
    solo = sampler.new_batch(8)      # every random row has a top-k here
    solo.add("cold", Params(temperature=0.5, top_k=4, top_a=0.2, seed=4))
    alone = torch.isfinite(sampler.processed_logits(logits[:1], solo))
    print("RESULT " + json.dumps({"kept": kept.tolist(), "moved": moved.tolist(),
                                  "alone": alone.tolist(),
                                  "flag": batch.step_state().any_top_a}))
""")


@pytest.mark.parametrize("backend", ["reference", "cpu", "cuda-torch-path"])
def test_a_stage_added_through_the_table_alone_runs_in_order_with_its_row_values(backend):
    """A fresh interpreter adds top-a to the table before the batch is loaded: the batch keeps
    its per-row value (also after rows move), the step state carries it and its switch, and
    the filter group runs it in its place; its kept set is the hand computation's. The cpu
    backend, which has no method of its own for it, runs the reference's on whole rows; the
    cuda backend's torch path runs the reference's as it is."""
    if backend == "cuda-torch-path":
        pytest.importorskip("corelib_cuda")
    done = subprocess.run([sys.executable, "-c", SCRIPT, pipeline.__file__, backend],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.split("RESULT ")[-1])
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0])
    probs = torch.softmax(logits, dim=0)
    hand = (probs >= 0.9 * probs.max() ** 2).tolist()
    assert hand.count(True) == 2                       # the cut drops something here
    cold = torch.softmax(logits / 0.5, dim=0)
    cold = ((cold >= 0.2 * cold.max() ** 2) & (torch.arange(8) < 4)).tolist()
    assert cold.count(True) == 3                       # top-a, not top-k, makes the cut
    assert result["kept"] == [[True] * 8, hand, hand, cold]
    assert result["moved"] == [cold, hand, hand]     # the last row filled the one that left
    assert result["alone"] == [cold]
    assert result["flag"] is True
