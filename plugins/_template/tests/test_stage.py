"""The replaced stage against the reference stage on adversarial inputs: ties at the top-k
boundary, top-p boundaries that fall inside a tie, masked tokens, and mixed per-row values."""

from __future__ import annotations

import pytest
import torch

import corelib
from corelib.testing.conformance import params_text

from corelib_template.sampler import TemplateSampler

V = 64
REFERENCE = corelib.Sampler("cpu")
MINE = TemplateSampler("cpu")


def step_state(params: list[corelib.SamplingParams]) -> corelib.StepState:
    batch = REFERENCE.new_batch(V)
    for i, p in enumerate(params):
        batch.add(f"r{i}", p)
    return batch.step_state()


def tied_logits(rows: int, seed: int) -> torch.Tensor:
    """Logits on a coarse grid (many exact ties), with a few tokens already masked."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-4, 5, (rows, V), generator=gen).to(torch.float32) / 2
    x[:, :3] = float("-inf")
    return x


CASES = [
    dict(top_k=5), dict(top_k=1), dict(top_k=V + 10), dict(top_p=0.5), dict(top_p=0.05),
    dict(top_p=0.999), dict(top_k=12, top_p=0.7), dict(top_k=3, top_p=0.2),
]


@pytest.mark.parametrize("seed", range(5))
def test_one_sort_equals_the_reference(seed):
    params = [corelib.SamplingParams(**case) for case in CASES] + [corelib.SamplingParams()]
    s = step_state(params)
    x = tied_logits(len(params), seed)
    got = MINE.apply_top_k_top_p(x, s)
    want = REFERENCE.apply_top_k_top_p(x, s)
    for row, p in enumerate(params):
        assert torch.equal(torch.isfinite(got[row]), torch.isfinite(want[row])), (
            f"kept set differs at row {row} ({params_text(p)}): "
            f"{torch.isfinite(got[row]).nonzero().flatten().tolist()} vs "
            f"{torch.isfinite(want[row]).nonzero().flatten().tolist()}")
    assert torch.equal(got, want)


def test_input_is_not_modified():
    s = step_state([corelib.SamplingParams(top_k=4, top_p=0.6)])
    x = tied_logits(1, 0)
    before = x.clone()
    MINE.apply_top_k_top_p(x, s)
    assert torch.equal(x, before)
