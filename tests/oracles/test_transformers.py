"""corelib's min-p and typical-p against transformers' logits warpers on the same logits.

Where the contract chose differently from transformers, the test says so and checks the
difference: transformers' ``min_tokens_to_keep`` (the contract has no such knob: a filter
never drops the most likely token, and otherwise keeps what its rule keeps), and its
``TypicalLogitsWarper`` refusing ``mass = 1`` (the contract's off value of typical_p).
Skipped without transformers.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.generation.logits_process import (  # noqa: E402
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
