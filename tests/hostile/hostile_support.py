"""Shared pieces of the hostile-input suite: backends to run, an independent oracle of the
contract's masking and penalty stages, batch builders and comparisons, memory probes.

The oracle is written from the contract (``docs/contract.md``) alone (plain Python loops over one
row), so it does not share a line of code with any backend it checks.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Optional, Sequence

import pytest
import torch

import corelib
from corelib import SamplingParams

#: Every backend the suite runs against; those not installed or not usable here are skipped.
#: HOSTILE_BACKENDS="reference,tpu" (comma-separated names) runs another selection.
BACKEND_NAMES = tuple(name.strip() for name in
                      os.environ.get("HOSTILE_BACKENDS", "reference,cpu,cuda").split(",") if name.strip())

NEG_INF = float("-inf")


def load_sampler(name: str) -> corelib.Sampler:
    """``corelib.get_sampler(name)``, or a clean skip saying why the backend cannot run here."""
    try:
        return corelib.get_sampler(name)
    except (ValueError, corelib.BackendUnavailableError) as exc:
        pytest.skip(f"backend {name!r} not usable here: {exc}")


def on(sampler: corelib.Sampler, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(sampler.device)


# --------------------------------------------------------------------------- requests
@dataclass
class Request:
    """One request as the caller knows it: parameters, prompt and each child's history."""

    request_id: str
    params: SamplingParams
    prompt: list[int] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)

    def __post_init__(self):
        if not self.outputs:
            self.outputs = [[] for _ in range(self.params.n)]

    def output_arg(self):
        """``output_token_ids`` for ``batch.add`` (None when nothing was generated yet)."""
        if not any(self.outputs):
            return None
        return self.outputs[0] if self.params.n == 1 else self.outputs


def build_batch(sampler: corelib.Sampler, requests: Sequence[Request], vocab_size: int,
                eos_token_id: Optional[int] = None, logprobs_mode: str = "raw"):
    """A fresh batch holding ``requests`` (in that order) with their histories."""
    batch = sampler.new_batch(vocab_size, eos_token_id=eos_token_id, logprobs_mode=logprobs_mode)
    for r in requests:
        batch.add(r.request_id, r.params, prompt_token_ids=r.prompt, output_token_ids=r.output_arg())
    return batch


def logits_by_key(batch, table: dict) -> torch.Tensor:
    """float32 [rows, V]: the logits row ``table[(request_id, child)]`` for each batch row."""
    return torch.stack([table[key] for key in batch.rows])


# --------------------------------------------------------------------------- the oracle
def oracle_masked(params: SamplingParams, output: Sequence[int], eos: Optional[int],
                  vocab_size: int) -> set[int]:
    """Token ids masked by steps 3-5 for a row with generated tokens ``output``."""
    masked: set[int] = set()
    if params.allowed_token_ids is not None:
        allowed = set(params.allowed_token_ids)
        masked |= {t for t in range(vocab_size) if t not in allowed}
    for word in params.bad_words:
        prefix = list(word[:-1])
        if not prefix or (len(output) >= len(prefix) and list(output[-len(prefix):]) == prefix):
            masked.add(word[-1])
    if len(output) < params.min_tokens:
        masked |= set(params.stop_token_ids)
        if eos is not None:
            masked.add(eos)
    return masked


def oracle_prepared(row: torch.Tensor, params: SamplingParams, prompt: Sequence[int],
                    output: Sequence[int], eos: Optional[int]) -> tuple[list[float], bool]:
    """Steps 2-8 for one row, one token at a time: (logits as floats, row valid)."""
    V = row.shape[0]
    x = [float(v) for v in row.to(torch.float32)]
    finite = not any(math.isnan(v) or v == math.inf for v in x)
    for t in oracle_masked(params, output, eos, V):
        x[t] = NEG_INF
    valid = finite and any(v > NEG_INF for v in x)
    if not valid:
        return x, False
    for t, b in params.logit_bias.items():
        x[t] += b
    seen = set(prompt) | set(output)
    counts = {t: output.count(t) for t in set(output)}
    r = params.repetition_penalty
    for t in range(V):
        if t in seen:
            x[t] = x[t] / r if x[t] > 0 else x[t] * r
        c = counts.get(t, 0)
        x[t] -= params.frequency_penalty * c + params.presence_penalty * (c > 0)
    return x, True


def argmax_set(values: Sequence[float], tolerance: float) -> set[int]:
    """Ids whose value is within ``tolerance`` (relative and absolute) of the row's maximum."""
    top = max(values)
    slack = tolerance * (1.0 + abs(top))
    return {i for i, v in enumerate(values) if v >= top - slack}


# --------------------------------------------------------------------------- state views
ROW_SCALARS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
               "presence_penalty", "top_k", "seed_lo", "seed_hi", "child", "position",
               "min_tokens", "seeded", "greedy", "dry_multiplier", "dry_base",
               "dry_allowed_length", "dry_range", "top_n_sigma", "typical_p", "xtc_threshold",
               "xtc_probability", "dry_length", "dry_since_breaker")
FLAGS = ("any_greedy", "all_greedy", "any_random", "any_seeded", "any_unseeded", "any_top_k",
         "any_top_p", "any_min_p", "any_temperature", "any_penalties", "any_allowed", "any_bias",
         "any_bad_words", "any_min_tokens", "num_logprobs", "any_dry", "any_top_n_sigma",
         "any_typical_p", "any_xtc")


def snapshot(batch, rows: Optional[int] = None) -> dict[str, torch.Tensor]:
    """A copy of every tensor of ``batch.step_state(rows)``, to check nothing wrote to it."""
    s = batch.step_state(rows)
    return {name: value.clone() for name, value in vars(s).items() if isinstance(value, torch.Tensor)}


def assert_same_snapshot(before: dict, after: dict, what: str) -> None:
    assert before.keys() == after.keys(), what
    for name in before:
        assert torch.equal(before[name], after[name]), f"{what}: step_state.{name} changed"


# Neutral values of the padding rows (rows past len(batch)), from the StepState docs.
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
           "frequency_penalty": 0.0, "presence_penalty": 0.0, "top_k": 0, "seed_lo": 0,
           "seed_hi": 0, "child": 0, "position": 0, "min_tokens": 0, "seeded": False,
           "greedy": False, "dry_multiplier": 0.0, "top_n_sigma": 0.0, "typical_p": 1.0,
           "xtc_probability": 0.0, "dry_length": 0}


def per_key(batch, values) -> dict:
    return {key: values[row] for row, key in enumerate(batch.rows)}


def assert_same_state(batch, rebuilt, sampler, reference, where: str, table: dict,
                      max_freed_rows: int = 64) -> None:
    """``batch`` (sampled by ``sampler``) equals ``rebuilt`` (a fresh batch of the same live
    requests and histories, sampled by ``reference``): rows, positions, per-row parameters,
    flags, running counts, neutral padding rows, processed logits and seeded/greedy draws
    on the logits ``table[(request_id, child)]``. Rows may be in a different order."""
    assert sorted(batch.rows) == sorted(rebuilt.rows), where
    assert dict(zip(batch.rows, batch.generated_counts())) == \
        dict(zip(rebuilt.rows, rebuilt.generated_counts())), where
    s, r = batch.step_state(), rebuilt.step_state()
    for name in FLAGS:
        assert getattr(s, name) == getattr(r, name), f"{where}: flag {name}"
    for name in ROW_SCALARS:
        if getattr(s, name) is None:        # a backend that keeps this scalar elsewhere
            continue
        mine = per_key(batch, getattr(s, name).cpu().tolist())
        theirs = per_key(rebuilt, getattr(r, name).tolist())
        assert mine == theirs, f"{where}: step_state.{name}"
    for name in ("output_counts", "prompt_mask"):
        if getattr(s, name) is not None and getattr(r, name) is not None:
            mine, theirs = per_key(batch, getattr(s, name).cpu()), per_key(rebuilt, getattr(r, name))
            for key in theirs:
                if batch.params_of(key[0]).uses_penalties:
                    assert torch.equal(mine[key], theirs[key]), f"{where}: {name} of {key}"
    padded = batch.step_state(len(batch) + max_freed_rows)   # covers every freed row
    for name, neutral in NEUTRAL.items():
        if getattr(padded, name) is None:
            continue
        tail = getattr(padded, name)[len(batch):].cpu()
        assert (tail == neutral).all(), f"{where}: padding rows of {name} are not neutral"
    if not len(batch):
        return
    mine_logits = torch.stack([table[k] for k in batch.rows])
    theirs_logits = torch.stack([table[k] for k in rebuilt.rows])
    mine_p = per_key(batch, sampler.processed_logits(on(sampler, mine_logits), batch).cpu())
    theirs_p = per_key(rebuilt, reference.processed_logits(theirs_logits, rebuilt))
    for key in theirs_p:
        params = batch.params_of(key[0])
        if params.uses_xtc and params.seed is None and params.temperature > 0:
            continue        # XTC's coin of an unseeded row is random: its kept set is too
        assert torch.equal(torch.isfinite(mine_p[key]), torch.isfinite(theirs_p[key])), f"{where}: kept set of {key}"
        assert torch.allclose(mine_p[key], theirs_p[key], atol=1e-4, rtol=1e-5, equal_nan=True), \
            f"{where}: processed logits of {key}"
    mine_out = sampler.sample(on(sampler, mine_logits), batch)
    theirs_out = reference.sample(theirs_logits, rebuilt)
    mine_ids, theirs_ids = per_key(batch, mine_out.token_ids.cpu().tolist()), per_key(rebuilt, theirs_out.token_ids.tolist())
    for key in theirs_ids:
        params = batch.params_of(key[0])
        if params.seed is not None or params.temperature == 0.0:
            assert mine_ids[key] == theirs_ids[key], f"{where}: seeded draw of {key} params={params!r}"


# --------------------------------------------------------------------------- statistics
def chi_square_p_value(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness-of-fit p-value; bins expecting < 5 draws are pooled."""
    observed, probs = observed.double(), probs.double()
    expected = probs * observed.sum()
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
        obs[torch.argmax(exp)] += observed[small].sum()
        exp[torch.argmax(exp)] += expected[small].sum()
    df = exp.numel() - 1
    if df < 1:
        return 1.0
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


# --------------------------------------------------------------------------- memory
def rss_bytes() -> int:
    """Resident set size of this process, from /proc/self/statm (psutil is not installed)."""
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")
