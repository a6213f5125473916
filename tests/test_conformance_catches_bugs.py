"""The conformance suite fails on backends that break the contract (it can fail)."""

import pytest
import torch

from corelib import Sampler
from corelib.noise import row_keys, seeded_gumbel
from corelib.testing import ConformanceSuite

suite = ConformanceSuite()


class TopKOffByOne(Sampler):
    def apply_top_k(self, x, s):
        k = (s.top_k + 1) * (s.top_k > 0)
        return super().apply_top_k(x, type(s)(**{**s.__dict__, "top_k": k}))


class NoiseIgnoresPosition(Sampler):
    def draw(self, x, s):
        keys = row_keys(s.seed_lo, s.seed_hi, s.child, torch.zeros_like(s.position))[:, None]
        vocab = torch.arange(x.shape[1], dtype=torch.int32)[None, :]
        return torch.argmax(x + seeded_gumbel(keys, vocab), dim=-1)


class ChildrenShareAStream(Sampler):
    def draw(self, x, s):
        return super().draw(x, type(s)(**{**s.__dict__, "child": torch.zeros_like(s.child)}))


class SkewedDraw(Sampler):
    """Draws at a slightly lower temperature than asked: plausible-looking but wrong."""
    def draw(self, x, s):
        return super().draw(x * 1.1, s)


class WritesIntoCallerLogits(Sampler):
    """Skips the float32 copy when the logits already are float32, then masks in place."""
    def working_copy(self, logits, batch, s):
        return logits if logits.dtype == torch.float32 else logits.float()

    def apply_allowed_ids(self, x, s):
        return x.masked_fill_(~s.allowed_mask, float("-inf"))


FAILURE = (AssertionError, pytest.fail.Exception)
REF = Sampler("cpu")


def test_kept_set_check_catches_top_k_off_by_one():
    with pytest.raises(FAILURE, match="kept set differs"):
        suite.test_kept_set_matches_reference(TopKOffByOne("cpu"), REF, "top_k")


def test_seeded_check_catches_noise_that_ignores_position():
    with pytest.raises(FAILURE, match="seeded tokens differ from the reference"):
        suite.test_seeded_tokens_equal_the_reference(NoiseIgnoresPosition("cpu"), REF)


def test_children_check_catches_a_shared_stream():
    with pytest.raises(FAILURE, match="share a stream"):
        suite.test_children_draw_distinct_streams(ChildrenShareAStream("cpu"))


@pytest.mark.parametrize("seeded", [False, True])
def test_chi_square_catches_a_skewed_distribution(seeded):
    with pytest.raises(FAILURE, match="chi-square"):
        suite.test_draws_follow_the_reference_distribution(SkewedDraw("cpu"), REF, seeded)


def test_caller_logits_check_catches_in_place_writes():
    with pytest.raises(FAILURE, match="modified the caller's logits"):
        suite.test_caller_logits_are_not_modified(WritesIntoCallerLogits("cpu"))
