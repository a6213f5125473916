"""The conformance suite fails on backends that break the contract (it can fail)."""

import dataclasses

import pytest
import torch

import corelib

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


# ---------------------------------------------------------------------- engine features
class IgnoresBitmask(Sampler):
    def apply_token_bitmask(self, x, s):
        return x


class SlotsSeeTheRowsCurrentState(Sampler):
    """Runs every slot with the row's state before any draft (penalties, min_tokens, DRY and
    positions never advance across the slots)."""
    def speculative_step_state(self, batch, drafts):
        frozen = torch.full_like(drafts.token_ids, -1)
        return batch.speculative_state(frozen)


class AcceptsWithoutTheRatioTest(Sampler):
    """Takes every draft a drafter proposes when it has probabilities for it."""
    def rejection_sample(self, final, s, drafts):
        passed, recovered = super().rejection_sample(final, s, drafts)
        return torch.ones_like(passed), recovered


class ResidualIsTheTarget(Sampler):
    """Replaces a rejected draft with a fresh draw from p instead of max(p - q, 0)."""
    def rejection_sample(self, final, s, drafts):
        passed, _ = super().rejection_sample(final, s, drafts)
        B, K = drafts.token_ids.shape
        return passed, self.draw(final, s).view(B, K + 1)[:, :K]


class SkipsTypicalP(Sampler):
    def apply_typical_p(self, x, s):
        return x


class DryWithoutBreakers(Sampler):
    def apply_dry(self, x, s):
        return super().apply_dry(x, dataclasses.replace(s, dry_breakers=torch.full_like(s.dry_breakers, -1)))


class CustomStagesBeforeTheFilters(Sampler):
    """Runs every custom stage right after step 8a, whatever slot it asked for."""
    def apply_custom_stages(self, x, s, slot):
        if slot == "after_filters":
            return x
        for spec, inputs, plugin in s.stages:
            x = torch.where(inputs.active[:, None], spec.apply(x, inputs), x)
        return x


class IgnoresCustomStages(Sampler):
    def apply_custom_stages(self, x, s, slot):
        return x


def test_bitmask_checks_catch_a_backend_that_ignores_the_mask():
    with pytest.raises(FAILURE, match="token_bitmask"):
        suite.test_bitmask_kept_set_matches_reference(IgnoresBitmask("cpu"), REF)
    with pytest.raises(FAILURE, match="never given token 0|flagged"):
        suite.test_finished_grammar_with_min_tokens_is_flagged_not_token_zero(IgnoresBitmask("cpu"))


def test_slot_checks_catch_a_stage_skipped_at_later_slots():
    with pytest.raises(FAILURE, match="every stage applies at every slot"):
        suite.test_verify_applies_every_stage_at_every_slot(SlotsSeeTheRowsCurrentState("cpu"), "mirostat")
    with pytest.raises(FAILURE, match="same with or without speculation"):
        suite.test_verify_keeps_seeded_and_greedy_tokens_of_plain_sampling(SlotsSeeTheRowsCurrentState("cpu"), 3)


@pytest.mark.parametrize("seeded", [False, True])
def test_distribution_check_catches_drafts_accepted_without_the_ratio_test(seeded):
    with pytest.raises(FAILURE, match="target|acceptance|accepted in"):
        suite.test_verify_rejection_sampling_keeps_the_target_distribution(AcceptsWithoutTheRatioTest("cpu"), seeded)


def test_distribution_check_catches_a_wrong_residual():
    with pytest.raises(FAILURE, match="does not follow the target"):
        suite.test_verify_rejection_sampling_keeps_the_target_distribution(ResidualIsTheTarget("cpu"), True)


@pytest.mark.parametrize("case,backend", [("typical_p", SkipsTypicalP), ("dry_range_breakers", DryWithoutBreakers)])
def test_kept_set_check_catches_the_new_samplers_broken(case, backend):
    with pytest.raises(FAILURE, match="kept"):
        suite.test_kept_set_matches_reference(backend("cpu"), REF, case)


@pytest.mark.parametrize("backend", [CustomStagesBeforeTheFilters, IgnoresCustomStages])
def test_custom_stage_check_catches_stages_at_the_wrong_slot_or_skipped(backend):
    from corelib.registry import default_registry
    from corelib.testing.engine import _ConformanceStagePlugin
    registry = default_registry()
    registry.register(_ConformanceStagePlugin(), name="corelib-conformance-stages", distribution="corelib")
    try:
        with pytest.raises(FAILURE, match="custom stages"):
            suite.test_custom_stages_match_reference(backend("cpu"), REF, None)
    finally:
        registry.unregister("corelib-conformance-stages")


class FlaggedRowAdvances(Sampler):
    """A batch that counts a flagged row's -1 as a token: its position moves on."""
    class batch_class(corelib.SamplingBatch):
        def append(self, token_ids):
            ids = torch.as_tensor(token_ids)
            super().append(ids)
            if ids.dim() == 1:
                self._tensors["position"][: ids.shape[0]] += (ids < 0).to(torch.int32)
                self._generated = [g + int(i < 0) for g, i in zip(self._generated, ids.tolist())]


class FlaggedRowRaises(Sampler):
    """A batch that refuses every id outside [0, V), the flagged row's -1 included."""
    class batch_class(corelib.SamplingBatch):
        def append(self, token_ids):
            if (torch.as_tensor(token_ids) < 0).any():
                raise ValueError("append: token id -1 is out of range")
            super().append(token_ids)


@pytest.mark.parametrize("backend", [FlaggedRowAdvances, FlaggedRowRaises])
def test_flagged_append_check_catches_a_row_that_advances_or_raises(backend):
    with pytest.raises((*FAILURE, ValueError), match="flagged|out of range"):
        suite.test_a_flagged_row_appended_as_minus_one_changes_nothing(backend("cpu"), "nan")
