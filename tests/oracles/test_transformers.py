"""corelib's min-p and typical-p against transformers' logits warpers on the same logits.

Where the contract chose differently from transformers, the test says so and checks the
difference: transformers' ``min_tokens_to_keep`` (the contract has no such knob: a filter
never drops the most likely token, and otherwise keeps what its rule keeps), and its
``TypicalLogitsWarper`` refusing ``mass = 1`` (the contract's off value of typical_p).
Skipped without transformers.
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.generation.logits_process import (  # noqa: E402
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
)

from oracle_rows import (  # noqa: E402
    ROW_IDS, assert_kept_equal, corelib_kept, cumulative_edge, kept_of, logit_row, near)


def hf(warper, logits: torch.Tensor) -> torch.Tensor:
    """A warper's output for one ``[V]`` row (it works on ``[1, V]`` and ignores input_ids)."""
    return warper(None, logits[None].clone())[0]


def probs64(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits.double(), -1)


# ---------------------------------------------------------------------- min-p
@pytest.mark.parametrize("min_p", [0.01, 0.05, 0.2, 0.6])
@pytest.mark.parametrize("row_id", ROW_IDS)
def test_min_p_matches_transformers(row_id, min_p):
    logits = logit_row(row_id)
    p = probs64(logits)
    edge = near(p, min_p * float(p.max()))
    ours = corelib_kept(logits, min_p=min_p)
    theirs = kept_of(hf(MinPLogitsWarper(min_p), logits))
    assert_kept_equal(ours, theirs, edge)
    assert int(logits.argmax()) in ours


def test_min_p_min_tokens_to_keep_is_transformers_only():
    """transformers tops the kept set up to min_tokens_to_keep by probability; the contract
    keeps only what the rule keeps (min_p = 0.6 on a spiked row keeps few tokens)."""
    logits = logit_row("spiked-V1000-s0")
    ours = corelib_kept(logits, min_p=0.6)
    theirs = kept_of(hf(MinPLogitsWarper(0.6, min_tokens_to_keep=10), logits))
    assert len(ours) < 10 and len(theirs) == 10
    assert ours < theirs
    top10 = set(torch.topk(logits, 10).indices.tolist())
    assert theirs == top10


# ---------------------------------------------------------------------- typical-p
def typical_edge(logits: torch.Tensor, typical_p: float) -> set[int]:
    """Tokens where the running mass, along increasing score |-log p - H|, passes within
    EDGE of typical_p (float64)."""
    logp = torch.log_softmax(logits.double(), -1)
    p = logp.exp()
    entropy = -(p * logp).sum()
    return cumulative_edge(p, torch.argsort((-logp - entropy).abs()), typical_p)


@pytest.mark.parametrize("typical_p", [0.2, 0.5, 0.9, 0.95])
@pytest.mark.parametrize("row_id", ROW_IDS)
def test_typical_p_matches_transformers(row_id, typical_p):
    """Both keep the smallest set of lowest-score tokens whose mass reaches typical_p,
    together with every token tied with the last one's score."""
    logits = logit_row(row_id)
    ours = corelib_kept(logits, typical_p=typical_p)
    theirs = kept_of(hf(TypicalLogitsWarper(mass=typical_p), logits))
    assert_kept_equal(ours, theirs, typical_edge(logits, typical_p))


def test_typical_p_off_value_is_the_contracts_only():
    """typical_p = 1 is the contract's off value (every token kept); transformers refuses
    mass = 1 and leaves the choice of not adding the warper to the caller."""
    logits = logit_row("flat-V50-s0")
    assert corelib_kept(logits, typical_p=1.0) == set(range(50))
    with pytest.raises(ValueError):
        TypicalLogitsWarper(mass=1.0)


# ---------------------------------------------------------------------- epsilon
@pytest.mark.parametrize("epsilon", [1e-4, 1e-3, 0.01, 0.05])
@pytest.mark.parametrize("row_id", ROW_IDS)
def test_epsilon_cutoff_matches_transformers(row_id, epsilon):
    """Both drop p < epsilon and keep every token tied at the largest logit (transformers'
    min_tokens_to_keep = 1 keeps the logits >= the largest, the contract never drops the most
    likely token): a flat V = 1000 row at epsilon 0.05 keeps only its maximum on both sides."""
    logits = logit_row(row_id)
    ours = corelib_kept(logits, epsilon_cutoff=epsilon)
    theirs = kept_of(hf(EpsilonLogitsWarper(epsilon), logits))
    assert_kept_equal(ours, theirs, near(probs64(logits), epsilon))
    assert int(logits.argmax()) in ours


def test_epsilon_min_tokens_to_keep_is_transformers_only():
    logits = logit_row("flat-V1000-s0")
    assert corelib_kept(logits, epsilon_cutoff=0.05) == {int(logits.argmax())}
    theirs = kept_of(hf(EpsilonLogitsWarper(0.05, min_tokens_to_keep=5), logits))
    assert theirs == set(torch.topk(logits, 5).indices.tolist())


# ---------------------------------------------------------------------- eta
def eta_threshold(logits: torch.Tensor, eta: float) -> float:
    p = probs64(logits)
    entropy = float(-(p * p.log()).sum())
    return min(eta, math.sqrt(eta) * math.exp(-entropy))


@pytest.mark.parametrize("eta", [1e-4, 3e-4, 2e-3, 0.02])
@pytest.mark.parametrize("row_id", ROW_IDS)
def test_eta_cutoff_matches_transformers(row_id, eta):
    """The contract's eta_cutoff is the probability itself, as transformers' (some front ends
    count it in units of 1e-4; the contract does not): drop p < min(eta, sqrt(eta) e^-H)."""
    logits = logit_row(row_id)
    ours = corelib_kept(logits, eta_cutoff=eta)
    theirs = kept_of(hf(EtaLogitsWarper(eta), logits))
    assert_kept_equal(ours, theirs, near(probs64(logits), eta_threshold(logits, eta)))


def test_eta_entropy_is_over_the_tokens_still_kept():
    """After min-p, the contract's H is the entropy of the renormalised kept tokens, and so
    is transformers' when its warpers are chained (the dropped logits are -inf)."""
    logits = logit_row("peaked-V1000-s0")
    after_min_p = hf(MinPLogitsWarper(0.01), logits)
    theirs = kept_of(hf(EtaLogitsWarper(0.02), after_min_p))
    ours = corelib_kept(logits, min_p=0.01, eta_cutoff=0.02)
    masked = torch.where(torch.isfinite(after_min_p), logits, torch.tensor(float("-inf")))
    assert_kept_equal(ours, theirs, near(probs64(masked), eta_threshold(masked, 0.02)))
    assert ours < kept_of(after_min_p)
