"""The reference backend's ``score`` as a trainer uses it: gradients (the contract's
"differentiable", checked with ``torch.autograd.gradcheck`` in float64), the constants the
contract names (masks, the dynamic temperature, smoothing's maximum, the selectors' state),
the dtypes, and the one-position form. Kept sets and ``score``'s agreement with ``sample``
are checked on every backend by the conformance suite (``corelib.testing.kept``)."""

from __future__ import annotations

import pytest
import torch

import corelib
from corelib import SamplingParams
from corelib.bitmask import pack_kept, unpack_bitmask

V = 12
T = 3


@pytest.fixture(scope="module")
def sampler():
    return corelib.get_sampler("reference")


def batch_of(sampler, *params, prompt=(1, 2, 3)):
    batch = sampler.new_batch(V)
    for i, p in enumerate(params):
        batch.add(f"r{i}", p, prompt_token_ids=list(prompt))
    return batch


def logits_of(rows: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn((rows, T, V), generator=gen, dtype=torch.float64) * 2).requires_grad_()


# Every stage whose only effect on the kept tokens' logits is a mask or a shift by a
# constant: there the processed logprob is a smooth function of the logits, masks fixed.
MASKING = [
    SamplingParams(top_k=6, top_p=0.9, temperature=0.7),
    SamplingParams(repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1,
                   dry_multiplier=0.8, dry_allowed_length=1, logit_bias={3: 1.0}, bad_words=[[2, 4]]),
    SamplingParams(temperature=0.0, presence_penalty=0.4),
    SamplingParams(min_p=0.05, typical_p=0.9, tfs=0.95, eta_cutoff=0.01, top_a=0.05,
                   epsilon_cutoff=0.01, top_n_sigma=2.0, seed=2),
    SamplingParams(mirostat_tau=3.0, mirostat_eta=0.3, p_less="norm", seed=3),
    SamplingParams(min_p=0.1, temperature=1.4, temperature_last=True, seed=4),
]


def test_score_passes_gradcheck_in_float64_over_every_masking_stage(sampler):
    logits = logits_of(len(MASKING))
    ids = logits.detach().argmax(-1)      # the most likely token is never dropped: finite
    score = lambda x: sampler.score(x, batch_of(sampler, *MASKING), ids).logprobs  # noqa: E731
    assert score(logits).dtype == torch.float64
    assert torch.autograd.gradcheck(score, (logits,), eps=1e-6, atol=1e-6)


def test_score_passes_gradcheck_with_the_rollouts_kept_sets(sampler):
    logits = logits_of(2, seed=3)
    params = [SamplingParams(top_k=4, temperature=0.8, seed=1), SamplingParams(xtc_probability=1.0,
                                                                              xtc_threshold=0.05, seed=2)]
    ids = logits.detach().argsort(-1, descending=True)[..., 3]
    keep = torch.zeros((2, T, V), dtype=torch.bool)
    keep.scatter_(2, logits.detach().argsort(-1, descending=True)[..., :5], True)
    kept = pack_kept(keep)
    score = lambda x: sampler.score(x, batch_of(sampler, *params), ids, kept).logprobs  # noqa: E731
    assert torch.autograd.gradcheck(score, (logits,), eps=1e-6, atol=1e-6)


def test_adaptive_p_is_differentiable_at_one_position(sampler):
    logits = logits_of(1, seed=5)[:, 0].detach().requires_grad_()
    params = SamplingParams(adaptive_p_target=0.3, min_p=0.02, seed=1)
    ids = logits.detach().argmax(-1)
    score = lambda x: sampler.score(x, batch_of(sampler, params), ids).logprobs  # noqa: E731
    assert torch.autograd.gradcheck(score, (logits,), eps=1e-6, atol=1e-6)


def test_the_selectors_state_is_a_constant_across_positions(sampler):
    # adaptive-p's state at position 1 comes from position 0's distribution: the history, not
    # a path of the gradient
    logits = logits_of(1, seed=6)
    params = SamplingParams(adaptive_p_target=0.3, seed=1)
    ids = logits.detach().argmax(-1)
    out = sampler.score(logits, batch_of(sampler, params), ids)
    grad, = torch.autograd.grad(out.logprobs[0, 1], logits)
    assert torch.equal(grad[0, 0], torch.zeros(V, dtype=torch.float64))
    assert grad[0, 1].abs().sum() > 0


@pytest.mark.parametrize("params,constant", [
    (SamplingParams(temperature=0.9, dynatemp_range=0.5, dynatemp_exponent=1.5, seed=1), "dynatemp"),
    (SamplingParams(smoothing_factor=0.3, smoothing_curve=2.0, seed=1), "smoothing"),
])
def test_dynamic_temperature_and_smoothings_maximum_are_constants(sampler, params, constant):
    x = logits_of(1, seed=7)[:, 0].detach().requires_grad_()
    token = int(x.detach().argsort(descending=True)[0, 2])
    out = sampler.score(x, batch_of(sampler, params, prompt=()), torch.tensor([token]))
    got, = torch.autograd.grad(out.logprobs[0], x)
    # the contract's formula with the constant frozen, written out by hand
    y = x[0]
    if constant == "dynatemp":
        p = torch.softmax(y.detach(), -1)
        h = -(p * p.log()).sum()
        lo, hi = max(0.0, 0.9 - 0.5), 0.9 + 0.5
        t = lo + (hi - lo) * (h / torch.log(torch.tensor(float(V), dtype=torch.float64))) ** 1.5
        z = y / t
    else:
        m = y.detach().max()
        d = y - m
        z = m - (3 - 2.0) / 2 * 0.3 * d * d + (2.0 - 1) / 2 * 0.3 * d ** 3
    want, = torch.autograd.grad(torch.log_softmax(z, -1)[token], x)
    torch.testing.assert_close(got, want)


def test_float32_logits_are_scored_in_float32_with_or_without_grad(sampler):
    x = logits_of(1).detach().float()
    ids = x.argmax(-1)
    plain = sampler.score(x, batch_of(sampler, SamplingParams(top_k=5)), ids)
    tracked = sampler.score(x.clone().requires_grad_(), batch_of(sampler, SamplingParams(top_k=5)), ids)
    assert plain.logprobs.dtype == tracked.logprobs.dtype == torch.float32
    assert torch.equal(plain.logprobs, tracked.logprobs.detach())
    # float64 without grad: float32, as sample works
    assert sampler.score(x.double(), batch_of(sampler, SamplingParams(top_k=5)), ids).logprobs.dtype == torch.float32


def test_a_token_outside_the_kept_set_reads_minus_infinity(sampler):
    x = logits_of(1).detach().float()
    order = x.argsort(-1, descending=True)
    ids = order[..., 7]                       # ranked 8th of 12: top_k 5 drops it
    out = sampler.score(x, batch_of(sampler, SamplingParams(top_k=5)), ids)
    assert torch.equal(out.logprobs, torch.full((1, T), float("-inf")))
    assert not out.kept_token.any() and out.valid.all()
    assert torch.equal(out.ranks, torch.full((1, T), V))       # every token >= -inf
    torch.testing.assert_close(out.raw_logprobs, torch.log_softmax(x, -1).gather(2, ids[..., None])[..., 0])


def test_one_position_form_gives_one_value_per_row(sampler):
    x = logits_of(2).detach().float()[:, 0]
    params = [SamplingParams(top_k=5, seed=1), SamplingParams(temperature=0.0)]
    out = sampler.score(x, batch_of(sampler, *params), x.argmax(-1))
    assert out.logprobs.shape == out.kept_token.shape == out.ranks.shape == (2,)
    assert out.kept_token.all()
    kept = pack_kept(torch.ones((2, V), dtype=torch.bool))
    replayed = sampler.score(x, batch_of(sampler, *params), x.argmax(-1), kept)
    torch.testing.assert_close(replayed.logprobs[0], torch.log_softmax(x[0], -1).max())


def test_pack_kept_is_the_bitmask_layout_with_no_bits_past_the_vocabulary():
    keep = torch.rand((3, 2, 70), generator=torch.Generator().manual_seed(1)) < 0.5
    words = pack_kept(keep)
    assert words.dtype == torch.int32 and words.shape == (3, 2, 3)
    assert torch.equal(unpack_bitmask(words, 70), keep)
    assert not unpack_bitmask(words, 96)[..., 70:].any()
    assert torch.equal(pack_kept(torch.ones((1, 32), dtype=torch.bool)), torch.tensor([[-1]], dtype=torch.int32))


def test_earlier_equal_drafts_counts_as_comparing_every_slots_drafts():
    from corelib.logit_stages import earlier_equal_drafts
    gen = torch.Generator().manual_seed(0)
    for _ in range(100):
        n, K = int(torch.randint(1, 4, (), generator=gen)), int(torch.randint(1, 9, (), generator=gen))
        S = K + 1
        drafts = torch.randint(-1, 4, (n, K), generator=gen).repeat_interleave(S, 0)
        slot = torch.arange(S).repeat(n)
        ids = torch.where((slot[:, None] > torch.arange(K)[None, :]) & (drafts >= 0), drafts, -1)
        safe, live = ids.clamp(min=0), ids >= 0
        brute = ((safe[:, :, None] == safe[:, None, :]) & live[:, None, :]).sum(-1)
        assert torch.equal(earlier_equal_drafts(ids, S), brute)
