"""The step states the cpu backend runs on declare every field it reads or writes, and the
plugin's modules import one way: the block value, its cuts and verification's judges never
import the sampler or its stages."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from corelib import SamplingBatch, SamplingParams, StepState

from corelib_cpu.sampler import CpuSampler
from corelib_cpu.state import BlockState, CpuStepState, cpu_state

V = 64


def requests(batch, n: int, **params):
    for i in range(n):
        batch.add(f"r{i}", SamplingParams(seed=i, **params))
    return batch


@pytest.mark.parametrize("penalties", [False, True], ids=["plain", "penalty-slots"])
def test_a_cpu_batchs_step_states_are_cpu_step_states(penalties):
    extra = dict(repetition_penalty=1.3) if penalties else {}
    batch = requests(CpuSampler().new_batch(V), 3, top_p=0.9, **extra)
    for s in (batch.step_state(), batch.speculative_state(torch.zeros((3, 2), dtype=torch.long))):
        assert type(s) is CpuStepState
        assert (s.slot_ids is not None) is penalties
        assert s.plan is None and s.keys is None and s.undrawn == frozenset()


def test_a_core_step_state_becomes_one_sharing_its_tensors():
    s = requests(SamplingBatch(V), 2, top_k=5).step_state()
    assert type(s) is StepState
    c = cpu_state(s)
    assert type(c) is CpuStepState and cpu_state(c) is c
    assert c.top_k is s.top_k and c.num_rows == 2 and c.any_top_k
    assert c.slot_ids is None and c.plan is None and c.undrawn == frozenset()


def test_one_block_writes_the_blocks_fields_into_the_step_state():
    sampler = CpuSampler()
    batch = requests(sampler.new_batch(V), 2)
    s = batch.step_state()
    (state,) = sampler.block_states(torch.randn(2, V), batch, s)
    assert state is s and s.plan.r0 == 0 and s.plan.r1 == 2
    assert s.keys.shape == (2,) and s.keys.dtype == torch.int32


def test_block_states_slice_declared_fields_and_refuse_others():
    sampler = CpuSampler(block_elements=2 * V)                # two rows per block
    batch = requests(sampler.new_batch(V), 5, temperature=0.7, min_p=0.1)
    s = batch.step_state()
    states = sampler.block_states(torch.randn(5, V), batch, s)
    assert [(b.plan.r0, b.plan.r1) for b in states] == [(0, 2), (2, 4), (4, 5)]
    for b in states:
        assert isinstance(b, BlockState)
        assert torch.equal(b.temperature, s.temperature[b.plan.r0:b.plan.r1])
        assert b.num_rows == b.plan.n and b.any_min_p
        with pytest.raises(AttributeError, match="no field 'bounds'"):
            b.bounds


def test_the_block_value_and_the_judges_do_not_import_the_sampler():
    code = ("import sys, corelib_cpu.block, corelib_cpu.judge; "
            "print(sorted(m for m in sys.modules if m.startswith('corelib_cpu.') and "
            "(m.endswith('sampler') or m.endswith('_stage') or m.endswith('_stages') "
            "or m.endswith('verification'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
