"""Each contract stage on hand-checked small cases, through the reference backend."""

import math

import pytest
import torch

from corelib import Sampler, SamplingParams

INF = math.inf


@pytest.fixture
def ref():
    return Sampler("cpu")


def processed(ref, logits, params, prompt=(), output=None, eos=None, vocab=None):
    logits = torch.tensor(logits, dtype=torch.float32)[None]
    batch = ref.new_batch(vocab_size=logits.shape[1], eos_token_id=eos)
    batch.add("r", params, prompt_token_ids=list(prompt), output_token_ids=output)
    return ref.processed_logits(logits, batch)[0].tolist()


def kept(values):
    return [i for i, v in enumerate(values) if v != -INF]


def test_allowed_ids_mask_every_other_token(ref):
    out = processed(ref, [1.0, 2.0, 3.0, 4.0], SamplingParams(allowed_token_ids=[0, 2]))
    assert out == [1.0, -INF, 3.0, -INF]


def test_one_token_bad_word_is_always_banned(ref):
    out = processed(ref, [1.0, 2.0, 3.0], SamplingParams(bad_words=[[1]]))
    assert out == [1.0, -INF, 3.0]


def test_bad_word_bans_its_last_token_only_after_its_prefix(ref):
    params = SamplingParams(bad_words=[[0, 1, 2]])
    assert kept(processed(ref, [0.0] * 4, params, output=[0, 1])) == [0, 1, 3]
    assert kept(processed(ref, [0.0] * 4, params, output=[1, 0])) == [0, 1, 2, 3]
    assert kept(processed(ref, [0.0] * 4, params, output=[0])) == [0, 1, 2, 3]
    # The prompt is not generated text: a prefix there does not count.
    assert kept(processed(ref, [0.0] * 4, params, prompt=[0, 1])) == [0, 1, 2, 3]


def test_bad_words_of_different_lengths_share_a_row(ref):
    params = SamplingParams(bad_words=[[3], [1, 2], [0, 0, 1]])
    assert kept(processed(ref, [0.0] * 5, params, output=[0, 0])) == [0, 2, 4]
    assert kept(processed(ref, [0.0] * 5, params, output=[2, 1])) == [0, 1, 4]


def test_min_tokens_masks_stop_ids_and_eos_until_reached(ref):
    params = SamplingParams(min_tokens=2, stop_token_ids=[1])
    assert kept(processed(ref, [0.0] * 4, params, eos=3)) == [0, 2]
    assert kept(processed(ref, [0.0] * 4, params, output=[0], eos=3)) == [0, 2]
    assert kept(processed(ref, [0.0] * 4, params, output=[0, 0], eos=3)) == [0, 1, 2, 3]


def test_min_tokens_zero_leaves_stop_ids(ref):
    assert kept(processed(ref, [0.0] * 3, SamplingParams(stop_token_ids=[1]), eos=2)) == [0, 1, 2]


def test_logit_bias_adds_to_the_logit(ref):
    out = processed(ref, [1.0, 2.0, 3.0], SamplingParams(logit_bias={0: 2.5, 2: -1.0}))
    assert out == [3.5, 2.0, 2.0]


def test_repetition_penalty_divides_positive_and_multiplies_negative(ref):
    params = SamplingParams(repetition_penalty=2.0)
    out = processed(ref, [4.0, -4.0, 4.0, -4.0], params, prompt=[0], output=[1])
    assert out == [2.0, -8.0, 4.0, -4.0]


def test_frequency_and_presence_use_output_counts_only(ref):
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    out = processed(ref, [0.0, 0.0, 0.0, 0.0], params, prompt=[3], output=[1, 1, 1, 2])
    assert out == [0.0, -2.5, -1.5, 0.0]


def test_penalty_order_repetition_then_frequency(ref):
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0)
    # token 0: 6 / 2 - 1 * 1 = 2
    assert processed(ref, [6.0, 1.0], params, output=[0])[0] == 2.0


def test_temperature_divides_logits(ref):
    assert processed(ref, [1.0, 2.0], SamplingParams(temperature=0.5)) == [2.0, 4.0]


def test_min_p_drops_tokens_below_fraction_of_max_prob(ref):
    # probs proportional to exp(l): ratios to max are 1, e^-1=.37, e^-2=.135, e^-3=.05
    params = SamplingParams(min_p=0.1)
    assert kept(processed(ref, [3.0, 2.0, 1.0, 0.0], params)) == [0, 1, 2]
    assert kept(processed(ref, [3.0, 2.0, 1.0, 0.0], SamplingParams(min_p=0.5))) == [0]


def test_top_k_keeps_k_largest_and_ties_at_the_boundary(ref):
    assert kept(processed(ref, [1.0, 5.0, 3.0, 4.0], SamplingParams(top_k=2))) == [1, 3]
    assert kept(processed(ref, [1.0, 5.0, 4.0, 4.0], SamplingParams(top_k=2))) == [1, 2, 3]
    assert kept(processed(ref, [1.0, 5.0], SamplingParams(top_k=10))) == [0, 1]
    assert kept(processed(ref, [1.0, 5.0], SamplingParams(top_k=-1))) == [0, 1]


def test_top_p_keeps_smallest_set_reaching_the_mass(ref):
    logits = [math.log(p) for p in (0.5, 0.3, 0.15, 0.05)]
    assert kept(processed(ref, logits, SamplingParams(top_p=0.5))) == [0]
    assert kept(processed(ref, logits, SamplingParams(top_p=0.6))) == [0, 1]
    assert kept(processed(ref, logits, SamplingParams(top_p=0.81))) == [0, 1, 2]
    assert kept(processed(ref, logits, SamplingParams(top_p=1e-6))) == [0]


def test_top_p_keeps_ties_at_the_boundary(ref):
    logits = [math.log(p) for p in (0.4, 0.2, 0.2, 0.2)]
    assert kept(processed(ref, logits, SamplingParams(top_p=0.5))) == [0, 1, 2, 3]


def test_top_p_works_on_what_min_p_and_top_k_left(ref):
    logits = [math.log(p) for p in (0.4, 0.3, 0.2, 0.1)]
    # top_k=2 leaves 0.4/0.7=.571 and .429; top_p .5 keeps only token 0.
    assert kept(processed(ref, logits, SamplingParams(top_k=2, top_p=0.5))) == [0]
    assert kept(processed(ref, logits, SamplingParams(top_k=2, top_p=0.6))) == [0, 1]


def test_greedy_row_skips_temperature_and_filters(ref):
    out = processed(ref, [1.0, 2.0, 3.0], SamplingParams(temperature=0.0, top_k=1, logit_bias={0: 1.0}))
    assert out == [2.0, 2.0, 3.0]


def sample_row(ref, logits, params, **kw):
    logits = torch.tensor(logits, dtype=torch.float32)[None]
    batch = ref.new_batch(vocab_size=logits.shape[1], **kw)
    batch.add("r", params)
    return ref.sample(logits, batch)


def test_greedy_takes_lowest_id_on_ties(ref):
    assert sample_row(ref, [1.0, 3.0, 3.0], SamplingParams(temperature=0.0)).token_ids.tolist() == [1]


def test_draw_never_leaves_the_kept_set(ref):
    logits = torch.zeros(64, 10)
    batch = ref.new_batch(vocab_size=10)
    for i in range(64):
        batch.add(f"r{i}", SamplingParams(top_k=3, seed=i if i % 2 else None))
    logits[:, 7] = logits[:, 2] = logits[:, 5] = 1.0
    for _ in range(5):
        assert set(ref.sample(logits, batch).token_ids.tolist()) <= {2, 5, 7}


def test_raw_logprobs_come_from_unprocessed_logits(ref):
    logits = [math.log(p) for p in (0.1, 0.6, 0.3)]
    out = sample_row(ref, logits, SamplingParams(temperature=0.0, logit_bias={0: 50.0}, logprobs=2))
    assert out.token_ids.tolist() == [0]
    lp = out.logprobs
    assert lp.token_ids.tolist() == [[0, 1, 2]]
    torch.testing.assert_close(lp.logprobs, torch.tensor([[math.log(0.1), math.log(0.6), math.log(0.3)]]))
    assert lp.ranks.tolist() == [3]


def test_processed_logprobs_come_from_the_final_distribution(ref):
    logits = [math.log(p) for p in (0.1, 0.6, 0.3)]
    out = sample_row(ref, logits, SamplingParams(top_k=2, seed=1, logprobs=1), logprobs_mode="processed")
    lp = out.logprobs
    assert lp.token_ids[0, 1] == 1
    torch.testing.assert_close(lp.logprobs[0, 1], torch.tensor(math.log(0.6 / 0.9)))
    assert lp.token_ids[0, 0] in (1, 2)
    assert lp.ranks.tolist() == [1 if lp.token_ids[0, 0] == 1 else 2]


def test_logprobs_zero_returns_only_the_sampled_token(ref):
    out = sample_row(ref, [0.0, 1.0], SamplingParams(temperature=0.0, logprobs=0))
    assert out.logprobs.token_ids.tolist() == [[1]]


def test_logprobs_up_to_the_vocabulary_and_every_token(ref):
    out = sample_row(ref, [0.0, 1.0], SamplingParams(temperature=0.0, logprobs=2))
    assert out.logprobs.token_ids.tolist() == [[1, 1, 0]]
    out = sample_row(ref, [0.0, 1.0, 0.5], SamplingParams(temperature=0.0, logprobs=-1))
    assert out.logprobs.token_ids.tolist() == [[1, 1, 2, 0]]
    with pytest.raises(ValueError, match="request 'r': logprobs=3 asks for more entries than the vocabulary"):
        ref.new_batch(vocab_size=2).add("r", SamplingParams(logprobs=3))


def test_gather_pads_a_width_beyond_the_vocabulary(ref):
    """Backends with fixed shapes (XLA) gather a padded N; columns past V are id -1, -inf."""
    lp = ref.gather_logprobs(torch.log_softmax(torch.tensor([[0.0, 1.0]]), -1), torch.tensor([1]), 4)
    assert lp.token_ids.tolist() == [[1, 1, 0, -1, -1]]
    assert lp.logprobs[0, 3] == -INF


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nonfinite_row_is_flagged_with_minus_one(ref, bad):
    batch = ref.new_batch(vocab_size=3)
    batch.add("good", SamplingParams(temperature=0.0))
    batch.add("broken", SamplingParams())
    out = ref.sample(torch.tensor([[0.0, 1.0, 0.5], [0.0, bad, 1.0]]), batch)
    assert out.token_ids.tolist() == [1, -1] and out.valid.tolist() == [True, False]
    with pytest.raises(ValueError, match="request 'broken'"):
        out.raise_on_invalid(batch)


def test_minus_inf_logits_are_masks_not_errors(ref):
    out = sample_row(ref, [-INF, -INF, 2.0], SamplingParams())
    assert out.token_ids.tolist() == [2] and out.valid.tolist() == [True]


def test_fully_masked_row_is_flagged(ref):
    out = sample_row(ref, [0.0, 1.0, 2.0], SamplingParams(allowed_token_ids=[1], bad_words=[[1]]))
    assert out.token_ids.tolist() == [-1] and out.valid.tolist() == [False]
