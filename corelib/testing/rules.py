"""The contract's rules as the conformance suite names them, and the helpers its failure
messages and statistical checks use (shared by ``conformance`` and ``engine``)."""

from __future__ import annotations

import pytest
import torch

from .. import pipeline
from ..params import SamplingParams

# The contract's rules, as failure messages name them (docs/contract.md explains each).
RULES: dict[str, str] = {
    # each stage of the table by its name (corelib.pipeline), then the rules below
    **{stage.name: f"step {stage.step} ({stage.rule})" for stage in pipeline.STAGES},
    "copy": "step 2 (work on a float32 copy: the caller's logits are never modified)",
    "allowed": "step 3 (allowed_token_ids)",
    "bias": "step 6 (logit_bias)",
    "repetition": "step 7 (repetition_penalty)",
    "freq_presence": "step 8 (frequency and presence penalties)",
    "penalties": "steps 7-8 (repetition, frequency and presence penalties)",
    "masks": "steps 3-4 (allowed_token_ids, bad_words: masked tokens are never drawn)",
    "greedy": "step 9 (temperature 0 = argmax, lowest id on ties)",
    "greedy_prep": "steps 2-9 (greedy rows: penalties and masks, then argmax)",
    "top_k": "step 12 (top_k, ties at the boundary kept)",
    "top_p": "step 13 (top_p, smallest set with mass >= top_p, ties kept)",
    "filters": "steps 10-13 (temperature, min_p, top_k, top_p)",
    "draw": "step 14 (draw from the renormalised kept probabilities)",
    "logprobs": "step 15 (logprobs: sampled token, top-N, rank)",
    "seed_reference": "seeded draws (equal to the reference's: docs/seeded-draw.md)",
    "seed_batch": "seeded draws (independent of batch size, row place and other rows)",
    "children": "parallel sampling (children of a request draw from distinct streams)",
    "child_zero": "parallel sampling (child 0 of n completions equals the request with n = 1)",
    "resume": "resumption (output_token_ids continue as if never interrupted)",
    "remove": "continuous batching (removing a request leaves other rows' state intact)",
    "per_request": "per-request logits ([num_requests, V] serves every child of a request)",
    "bad_rows": "bad rows (NaN/+inf or fully masked rows are flagged with id -1, others untouched)",
    "flagged_append": "a flagged row in append (-1 is no token this step: the row's position, counts, windows, DRY history and stage state stay as they were)",
    "outputs": "outputs (the tensors sample, verify and score return belong to the caller: a later step leaves them as they were)",
    "dtype": "step 2 (logits of any float dtype are upcast to float32 first)",
    "new_samplers": "steps 8a-13b (DRY, top-n-sigma, typical-p, XTC together)",
    "bitmask": "step 3 (token_bitmask: only tokens whose bit is set may be kept or drawn)",
    "bitmask_args": "token_bitmask checks (another dtype, shape or row count raises ValueError naming it)",
    "bitmask_flag": "steps 3-5 (a row left with no token after the bitmask and min_tokens is flagged, never given token 0)",
    "verify_k0": "verification (with K = 0, verify equals sample)",
    "verify_seeded": "verification (a seeded request's tokens are the same with or without speculation; greedy rows accept drafts equal to each slot's argmax)",
    "verify_slots": "verification (every stage applies at every slot, with the row's state advanced by the earlier drafts)",
    "verify_reference": "verification (emitted tokens and logprobs equal the reference's for seeded and greedy rows)",
    "verify_distribution": "verification (rejection sampling: the emitted tokens follow the target distribution)",
    "verify_acceptance": "verification (a draft is accepted with probability min(1, p/q): acceptance rate sum(min(p, q)))",
    "verify_flags": "verification (a slot with no token stops the row; at slot 0, or with unusable drafts, the row is flagged)",
    "verify_block": "block verification (method='block': the emitted sequence has the target distribution; on average at least as many drafts accepted as by the token rule; rows without draft probabilities keep the token rule)",
    "thinking": "step 8b (reasoning budget: a thinking row whose count reached its budget emits the forced sequence; state kept across join, leave, swap, resume and verify)",
    "verify_args": "verification argument checks (ValueError naming the argument; the batch unchanged)",
    "order": "the order of the filter group (sampler_order, temperature_last: each row runs its own order, exactly as alone; stages that drop nothing do not change seeded draws)",
    "selector_state": "stateful selectors' state (mirostat, adaptive-p: kept across join, leave, swap and append; sampler_state moves a request exactly, on any backend; a malformed one raises ValueError naming it)",
    "kept": "kept sets (return_kept: int32 [rows, ceil(V / 32)] bits of the distribution each row drew from, after every stage, the grammar mask and the selector; greedy rows the argmax, forced rows the forced token, flagged rows and rows that did not ask none; per slot in verify)",
    "score": "score (teacher forcing: position t sees the row's state with the tokens before it appended; the processed logprob equals, bitwise, what sample reported for the token it drew; kept= replays given kept sets; differentiable)",
    "score_args": "score argument checks (ValueError naming the argument; the batch unchanged)",
    "custom_stage": "custom stages (run at their slot on the rows that use them; state moves and resumes with the row; failures raise StageError)",
}

PROMPT = [1, 2, 3, 2, 9, 100, 101]
OUTPUT = [9, 1, 2, 9, 9, 9]


def violation(rule: str, message: str) -> None:
    """Fail the running test with ``contract <rule>: <message>``."""
    pytest.fail(f"contract {RULES[rule]}: {message}")


def params_text(params: SamplingParams | dict) -> str:
    """A short form of parameters: only the fields that differ from the defaults."""
    if isinstance(params, dict):
        params = SamplingParams(**params)
    fields = params.model_dump(exclude_defaults=True)
    return "SamplingParams(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ")"


def chi_square_p_value(observed: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """p-value of Pearson's chi-square goodness of fit; bins expecting < 5 are pooled."""
    observed = observed.double()
    expected = probs.double() * observed.sum()
    small = expected < min_expected
    obs = torch.cat([observed[~small], observed[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    if exp[-1] < min_expected:  # the pooled bin may itself be tiny: fold it into the largest
        obs, exp = obs[:-1].clone(), exp[:-1].clone()
        biggest = torch.argmax(exp)
        obs[biggest] += observed[small].sum()
        exp[biggest] += expected[small].sum()
    df = exp.numel() - 1
    if df < 1:
        return 1.0
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))
