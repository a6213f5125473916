"""The third-party example stage plugin (``tests/plugins/corelib-stage-example``: ``ban-repeats``
after step 8a with per-row state, ``floor-prob`` after step 13b) traced into the tpu backend's
graphs, against the reference backend running the same plugin."""

from __future__ import annotations

import zlib

import pytest
import torch
from corelib import SamplingParams, available_stages
from corelib.sampler import Sampler

from corelib_tpu.sampler import TpuSampler

from tpu_support import needs_xla, xla_device

V = 128
STAGES = ("ban-repeats", "floor-prob")
REQUESTS = [
    ("ban", SamplingParams(seed=1, stage_args={"ban-repeats": {"times": 1}}), [3, 4, 5], [7, 8]),
    ("floor", SamplingParams(seed=2, top_k=40, temperature=0.7,
                             stage_args={"floor-prob": {"prob": 0.04}}), [], None),
    ("both", SamplingParams(seed=3, n=2, dry_multiplier=0.5,
                            stage_args={"ban-repeats": {"times": 2}, "floor-prob": {"prob": 0.01}}),
     [9, 9], None),
    ("none", SamplingParams(seed=4, top_p=0.9), [1], None),
    ("greedy", SamplingParams(temperature=0.0, stage_args={"ban-repeats": {"times": 1}}), [2], None),
]


def test_the_example_plugin_is_installed_and_discovered():
    """The test command installs it next to the tpu plugin; without it this module proves nothing."""
    import corelib_stage_example  # noqa: F401
    names = {s.name for s in available_stages() if s.available}
    assert set(STAGES) <= names, names


def _build(sampler: Sampler, requests=REQUESTS):
    batch = sampler.new_batch(V, eos_token_id=0)
    for rid, params, prompt, outputs in requests:
        batch.add(rid, params, prompt_token_ids=prompt, output_token_ids=outputs)
    return batch


def _logits(batch, step: int) -> torch.Tensor:
    """Logits that depend on (request, child, position) only, peaked enough that a banned
    token would often win."""
    rows = []
    for (rid, child), position in zip(batch.rows, batch.generated_counts()):
        gen = torch.Generator().manual_seed(zlib.crc32(f"{rid}/{child}/{position + step}".encode()))
        row = torch.randn(V, generator=gen) * 2.0
        row[7] += 4.0                                         # token 7 is always likely
        rows.append(row)
    return torch.stack(rows)


def _run(sampler: Sampler, batch, steps: int, churn: bool = False) -> dict:
    tokens = {key: [] for key in batch.rows}
    for step in range(steps):
        if churn and step == 2:
            batch.swap_rows(0, len(batch) - 1)
        if churn and step == 3:                      # remove and resume mid-generation
            rid, params, prompt, outputs = REQUESTS[0]
            batch.remove(rid)
            batch.add(rid, params, prompt_token_ids=prompt,
                      output_token_ids=list(outputs) + tokens[(rid, 0)])
        out = sampler.sample(_logits(batch, 0).to(sampler.device), batch)
        for key, token in zip(batch.rows, out.token_ids.cpu().tolist()):
            tokens[key].append(token)
        batch.append(out.token_ids)
    return tokens


@pytest.mark.parametrize("device", ["cpu", pytest.param("xla", marks=needs_xla)])
@pytest.mark.parametrize("stages", [None, STAGES], ids=["stages-in-use", "fixed-stages"])
def test_example_stages_on_tpu_equal_the_reference(device, stages):
    """Seeded and greedy rows draw the reference's tokens over 8 steps with the stages at their
    slots, through a swap, a removal and a resumption (the stage state follows its row and
    resumes from ``output_token_ids``); ``ban-repeats`` really bans."""
    sampler = TpuSampler(xla_device() if device == "xla" else "cpu", buckets=(8,), dry_window=32,
                         stages=stages)
    got = _run(sampler, _build(sampler), steps=8, churn=True)
    want = _run(Sampler("cpu"), _build(Sampler("cpu")), steps=8, churn=True)
    assert got == want
    banned = [7, 8] + got[("ban", 0)]
    assert len(set(banned)) == len(banned), f"'ban' repeated a token: {banned}"
    assert all(got[("both", c)].count(t) <= 2 for c in (0, 1) for t in got[("both", c)])


@needs_xla
def test_verify_advances_the_example_stage_state_at_every_slot():
    """Drafts equal to the plain run's tokens are all accepted, so verification emits exactly
    the plain run: the ban state at slot j counts the j drafts before it."""
    sampler = TpuSampler(xla_device(), buckets=(8,), speculative_k=(3,), dry_window=32, stages=STAGES)
    requests = REQUESTS[:1] + REQUESTS[4:]
    plain = _run(sampler, _build(sampler, requests), steps=6)
    batch = _build(sampler, requests)
    emitted = {key: [] for key in batch.rows}
    while min(len(v) for v in emitted.values()) < 6:
        done = [len(emitted[key]) for key in batch.rows]
        drafts = torch.tensor([plain[key][d:d + 3] + [-1] * (3 - len(plain[key][d:d + 3]))
                               for key, d in zip(batch.rows, done)])
        logits = torch.stack([_logits(batch, j) for j in range(4)], dim=1)
        out = sampler.verify(logits.to(xla_device()), batch, drafts)
        for key, row in zip(batch.rows, out.token_ids.tolist()):
            emitted[key] += [t for t in row if t >= 0]
        batch.append(out.token_ids)
    assert {key: v[:6] for key, v in emitted.items()} == plain


def test_fixed_stages_reject_other_stages_naming_the_request():
    batch = TpuSampler("cpu", buckets=(4,), stages=("floor-prob",)).new_batch(V)
    with pytest.raises(ValueError, match=r"'r'.*'ban-repeats'.*stages=\('floor-prob',\)"):
        batch.add("r", SamplingParams(stage_args={"ban-repeats": {"times": 1}}))
    with pytest.raises(ValueError, match="unknown stage 'nope'"):
        TpuSampler("cpu", buckets=(4,), stages=("nope",)).new_batch(V)
