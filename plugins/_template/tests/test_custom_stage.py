"""The plugin's custom stage: discovered through the entry point, checked at add, equal to a
naive computation, run the same on this backend and on the reference."""

from __future__ import annotations

import pytest
import torch

import corelib
from corelib.registry import Registry, reset_default_registry

V = 50
STAGE = "template-epsilon"


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    monkeypatch.delenv("CORELIB_PLUGINS", raising=False)
    reset_default_registry(None)         # rediscover the installed plugins
    yield
    reset_default_registry(None)


def test_the_stage_is_discovered_through_the_entry_point():
    status = next(s for s in Registry().stage_statuses() if s.name == STAGE)
    assert status.available and status.slot == "after_filters"
    assert status.distribution == "corelib-template"


def test_bad_arguments_are_rejected_when_the_request_joins():
    batch = corelib.get_sampler("template").new_batch(V)
    with pytest.raises(ValueError, match="epsilon must be in"):
        batch.add("r", corelib.SamplingParams(stage_args={STAGE: {"epsilon": 1.5}}))
    with pytest.raises(ValueError, match="unknown arguments"):
        batch.add("r", corelib.SamplingParams(stage_args={STAGE: {"eps": 0.1}}))


@pytest.mark.parametrize("backend", ["template", "reference"])
def test_the_stage_drops_tokens_below_epsilon_on_its_rows_only(backend):
    sampler = corelib.get_sampler(backend)
    batch = sampler.new_batch(V)
    batch.add("eps", corelib.SamplingParams(temperature=0.7, stage_args={STAGE: {"epsilon": 0.02}}))
    batch.add("plain", corelib.SamplingParams(temperature=0.7))
    logits = torch.randn((2, V), generator=torch.Generator().manual_seed(0)) * 2
    got = sampler.processed_logits(logits, batch)
    probs = torch.softmax(logits / 0.7, dim=-1)
    assert torch.isfinite(got[0]).tolist() == (probs[0] >= 0.02).tolist()
    assert torch.isfinite(got[1]).all()
