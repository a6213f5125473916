"""The new samplers (stages 8a DRY, 10a top-n-sigma, 13a typical-p, 13b XTC) in the reference
backend, each against an independent naive implementation of the contract's definition
(typical-p also against transformers' TypicalLogitsWarper), plus their placement and tie rules."""

import math
import random
import statistics

import pytest
import torch

from corelib import Sampler, SamplingParams
from corelib.history import match_lengths
from corelib.noise import STREAM_XTC, row_keys, split_seed, stream_uniform

REF = Sampler("cpu")
NEG_INF = float("-inf")


def final_logits(logits, prompt=(), output=None, vocab=None, **params):
    """The reference's processed logits of one request (steps 2-13b)."""
    logits = torch.as_tensor(logits, dtype=torch.float32)
    batch = REF.new_batch(vocab or logits.shape[-1])
    batch.add("r", SamplingParams(**params), prompt_token_ids=list(prompt), output_token_ids=output)
    return REF.processed_logits(logits[None], batch)[0]


# ---------------------------------------------------------------------- DRY
def naive_dry_penalties(history, vocab, multiplier, base, allowed, dry_range, breakers):
    """The contract's stage 8a word for word: per token, the longest repeat it would extend."""
    h = history[-dry_range:] if dry_range > 0 else list(history)
    m = len(h)
    penalties = [0.0] * vocab
    for t in range(vocab):
        if t in breakers:
            continue
        best = 0
        for i in range(m):
            if h[i] != t:
                continue
            for length in range(1, i + 1):
                before = h[i - length:i]
                if before == h[m - length:] and not set(h[m - length:]) & set(breakers):
                    best = max(best, length)
        if best >= allowed:
            penalties[t] = multiplier * base ** min(best - allowed, 30)
    return penalties


@pytest.mark.parametrize("trial", range(40))
def test_dry_matches_the_naive_definition(trial):
    rng = random.Random(trial)
    vocab = 6
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 15))]
    output = [rng.randrange(vocab) for _ in range(rng.randrange(0, 15))]
    params = dict(dry_multiplier=rng.choice([0.5, 1.0, 3.0]), dry_base=rng.choice([1.1, 1.75, 3.0]),
                  dry_allowed_length=rng.choice([1, 2, 3]), dry_range=rng.choice([0, 0, 4, 9]),
                  dry_sequence_breakers=rng.sample(range(vocab), rng.choice([0, 0, 1, 2])))
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(trial))
    got = final_logits(logits, prompt, output, **params)
    penalties = naive_dry_penalties(prompt + output, vocab, params["dry_multiplier"], params["dry_base"],
                                    params["dry_allowed_length"], params["dry_range"],
                                    params["dry_sequence_breakers"])
    want = logits - torch.tensor(penalties)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6), (prompt, output, params, got, want)


def test_dry_follows_appended_tokens_incrementally():
    """The batch's repeat lengths after many appends equal a fresh computation."""
    rng = random.Random(5)
    vocab = 4
    batch = REF.new_batch(vocab)
    params = SamplingParams(dry_multiplier=1.0, dry_allowed_length=1, dry_sequence_breakers=[3])
    prompt = [rng.randrange(vocab) for _ in range(10)]
    batch.add("r", params, prompt_token_ids=prompt)
    batch.add("plain", SamplingParams(), prompt_token_ids=prompt)
    history = list(prompt)
    logits = torch.zeros((2, vocab))
    for step in range(150):                 # the history outgrows its first allocation
        token = rng.randrange(vocab)
        batch.append([token, token])
        history.append(token)
        s = batch.step_state()
        m = len(history)
        assert int(s.dry_length[0]) == m
        assert s.dry_match[0, :m].tolist() == match_lengths(history), step
    got = REF.processed_logits(logits, batch)[0]
    want = -torch.tensor(naive_dry_penalties(history, vocab, 1.0, 1.75, 1, 0, [3]))
    assert torch.allclose(got, want)


def test_dry_exponent_is_capped_at_30():
    history = [1, 2] * 40                  # a repeat of length ~78 before token 1
    got = final_logits([0.0, 0.0, 0.0], output=history, dry_multiplier=1.0, dry_base=2.0,
                       dry_allowed_length=2)
    assert got[1].item() == pytest.approx(-(2.0 ** 30))
    assert got[2].item() == 0.0 and got[0].item() == 0.0


def test_dry_applies_to_greedy_rows():
    got = final_logits([1.0, 0.9, 0.0], output=[0, 1, 2, 0, 1, 2, 0, 1], temperature=0.0,
                       dry_multiplier=2.0, dry_allowed_length=2)
    assert got[2] < 0.0                     # 2 would continue [0, 1, 2, 0, 1] -> penalised
    batch = REF.new_batch(3)
    batch.add("g", SamplingParams(temperature=0.0, dry_multiplier=5.0, dry_allowed_length=1),
              output_token_ids=[0, 1, 0])
    # 1 once followed the current suffix [0]: 1.9 - 5 < 2.0 would not matter, but with the
    # logits of 0 lowered it shows: without DRY the greedy token is 1, with it 2
    out = REF.sample(torch.tensor([[-1.0, 1.9, 0.0]]), batch)
    assert out.token_ids.tolist() == [2]


# ---------------------------------------------------------------------- top-n-sigma
@pytest.mark.parametrize("n", [0.5, 1.0, 2.0])
def test_top_n_sigma_matches_the_naive_definition(n):
    gen = torch.Generator().manual_seed(int(n * 10))
    logits = torch.randn(50, generator=gen) * 2
    logits[[3, 17]] = NEG_INF              # masked tokens do not count towards sigma
    temperature = 0.7
    got = final_logits(logits, top_n_sigma=n, temperature=temperature)
    scaled = [v / temperature for v in logits.tolist()]
    finite = [v for v in scaled if math.isfinite(v)]
    threshold = max(finite) - n * statistics.pstdev(finite)
    kept = [math.isfinite(v) and v >= threshold for v in scaled]
    assert torch.isfinite(got).tolist() == kept


def test_top_n_sigma_keeps_everything_on_flat_logits_and_zero_is_off():
    assert torch.isfinite(final_logits([1.0] * 8, top_n_sigma=1.0)).all()
    x = torch.randn(30, generator=torch.Generator().manual_seed(3))
    assert torch.equal(final_logits(x, top_n_sigma=0.0), x)


# ---------------------------------------------------------------------- typical-p
def naive_typical(logits, typical_p):
    p = torch.softmax(torch.tensor(logits, dtype=torch.float64), -1).tolist()
    entropy = -sum(q * math.log(q) for q in p if q > 0)
    score = [abs(-math.log(q) - entropy) if q > 0 else math.inf for q in p]
    order = sorted(range(len(p)), key=lambda i: score[i])
    mass, kept = 0.0, []
    for i in order:
        if mass >= typical_p and kept:
            break
        kept.append(i)
        mass += p[i]
    threshold = score[kept[-1]]
    return [score[i] <= threshold for i in range(len(p))]


@pytest.mark.parametrize("typical_p", [0.2, 0.5, 0.9, 0.99])
def test_typical_p_matches_the_naive_definition_and_transformers(typical_p):
    from transformers.generation.logits_process import TypicalLogitsWarper

    gen = torch.Generator().manual_seed(int(typical_p * 100))
    logits = torch.randn(64, generator=gen) * 2.0        # tie-free
    got = torch.isfinite(final_logits(logits, typical_p=typical_p))
    assert got.tolist() == naive_typical(logits.tolist(), typical_p)
    hf = TypicalLogitsWarper(mass=typical_p)(None, logits[None].clone())[0]
    assert got.tolist() == torch.isfinite(hf).tolist()


def test_typical_p_keeps_ties_at_the_boundary_and_never_empties_a_row():
    # two tokens with equal probability share a score: both stay
    got = final_logits([2.0, 1.0, 1.0, -3.0], typical_p=0.3)
    assert torch.isfinite(got[1]) == torch.isfinite(got[2])
    assert torch.isfinite(final_logits([5.0, 0.0, 0.0], typical_p=1e-6)).sum() >= 1


# ---------------------------------------------------------------------- XTC
def naive_xtc(logits, threshold):
    p = torch.softmax(torch.tensor(logits), -1).tolist()
    above = [i for i, q in enumerate(p) if math.isfinite(logits[i]) and q >= threshold]
    if len(above) < 2:
        return [math.isfinite(v) for v in logits]
    smallest = min(p[i] for i in above)
    return [math.isfinite(logits[i]) and not (i in above and p[i] > smallest) for i in range(len(p))]


@pytest.mark.parametrize("threshold", [0.0, 0.05, 0.1, 0.3, 0.6])
def test_xtc_matches_the_naive_definition(threshold):
    logits = [2.0, 1.8, 1.0, 0.5, 0.0, -1.0, NEG_INF, -2.0]
    got = torch.isfinite(final_logits(logits, xtc_probability=1.0, xtc_threshold=threshold))
    assert got.tolist() == naive_xtc(logits, threshold)


def test_xtc_coin_is_the_seeded_stream_and_reproducible():
    """A seeded row's coin is u = stream_uniform(key, STREAM_XTC) at its position: XTC acts
    exactly at the positions where u < xtc_probability."""
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    seed = 1234
    lo, hi = split_seed(seed)
    acted = []
    for position in range(40):
        batch = REF.new_batch(4)
        batch.add("x", SamplingParams(seed=seed, xtc_probability=0.5, xtc_threshold=0.1),
                  output_token_ids=[2] * position)
        kept = torch.isfinite(REF.processed_logits(logits, batch)[0])
        acted.append(not bool(kept[0]))
        key = row_keys(*(torch.tensor([v], dtype=torch.int32) for v in (lo, hi, 0, position)))
        assert acted[-1] == bool(stream_uniform(key, STREAM_XTC)[0] < 0.5), position
    assert 5 < sum(acted) < 35                # a fair coin, not always on or off


def test_xtc_unseeded_coin_has_the_asked_probability():
    """Unseeded rows flip the coin with the sampler's generator: acting frequency ~ p
    (binomial, 4000 rows, tolerance 5 sigma)."""
    rows, p = 4000, 0.3
    sampler = Sampler("cpu", generator=torch.Generator().manual_seed(7))
    batch = sampler.new_batch(4)
    for i in range(rows):
        batch.add(f"x{i}", SamplingParams(xtc_probability=p, xtc_threshold=0.1))
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]]).expand(rows, -1)
    kept = torch.isfinite(sampler.processed_logits(logits, batch))
    acted = (~kept[:, 0]).double().mean().item()
    assert abs(acted - p) < 5 * math.sqrt(p * (1 - p) / rows)


# ---------------------------------------------------------------------- placement
def test_greedy_rows_skip_the_filters_but_not_dry():
    logits = [2.0, 1.9, 0.0, -1.0]
    got = final_logits(logits, temperature=0.0, top_n_sigma=0.1, typical_p=0.1,
                       xtc_probability=1.0, xtc_threshold=0.01)
    assert torch.isfinite(got).all()


def test_stages_run_in_contract_order_top_n_sigma_before_min_p_and_xtc_last():
    # top-n-sigma (10a) sees the temperature-scaled logits; XTC (13b) sees what top-k (12) left
    logits = [4.0, 3.9, 3.8, 0.0, -5.0]
    got = torch.isfinite(final_logits(logits, top_k=2, xtc_probability=1.0, xtc_threshold=0.1))
    assert got.tolist() == [False, True, False, False, False]   # of {0, 1}, only the less likely stays
