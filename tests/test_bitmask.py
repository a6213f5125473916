"""Token bitmasks: the packed format grammar engines fill, and the reference's step 3 with it."""

import pytest
import torch

from corelib import Sampler, SamplingParams
from corelib.bitmask import bitmask_width, pack_bitmask, unpack_bitmask

REF = Sampler("cpu")


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100, 1000])
def test_pack_and_unpack_are_inverse(vocab):
    allowed = torch.rand((4, vocab), generator=torch.Generator().manual_seed(vocab)) < 0.4
    words = pack_bitmask(allowed)
    assert words.dtype == torch.int32 and words.shape == (4, bitmask_width(vocab))
    assert torch.equal(unpack_bitmask(words, vocab), allowed)


def test_bit_j_of_word_j_over_32_least_significant_first():
    words = torch.tensor([[0b101, -1, 0, -2**31]], dtype=torch.int32)
    allowed = unpack_bitmask(words, 128)[0]
    assert allowed[:32].nonzero().flatten().tolist() == [0, 2]
    assert allowed[32:64].all() and not allowed[64:96].any()
    assert allowed.nonzero().flatten().tolist()[-1:] == [127]   # the sign bit of word 3


def test_bits_past_the_vocabulary_are_ignored():
    V = 40
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(1))
    batch = REF.new_batch(V)
    batch.add("a", SamplingParams(temperature=0.0))
    batch.add("b", SamplingParams(temperature=0.0))
    words = torch.tensor([[0b11, 0], [0b11, -1]], dtype=torch.int32)   # word 1 covers ids 32..63
    out = REF.processed_logits(logits, batch, token_bitmask=words)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [0, 1]
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [0, 1] + list(range(32, 40))


def test_a_bitmask_equals_allowed_token_ids_of_the_same_tokens():
    V = 300
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, V, generator=gen) * 3
    allowed = torch.rand((3, V), generator=gen) < 0.2
    with_mask = REF.new_batch(V)
    with_ids = REF.new_batch(V)
    for row in range(3):
        params = dict(seed=row, top_k=15, repetition_penalty=1.2)
        with_mask.add(f"r{row}", SamplingParams(**params), prompt_token_ids=[1, 2])
        ids = allowed[row].nonzero().flatten().tolist()
        with_ids.add(f"r{row}", SamplingParams(**params, allowed_token_ids=ids), prompt_token_ids=[1, 2])
    for _ in range(4):
        a = REF.sample(logits, with_mask, token_bitmask=pack_bitmask(allowed))
        b = REF.sample(logits, with_ids)
        assert torch.equal(a.token_ids, b.token_ids)
        with_mask.append(a.token_ids)
        with_ids.append(b.token_ids)


def test_the_bitmask_intersects_allowed_token_ids():
    V = 64
    batch = REF.new_batch(V)
    batch.add("r", SamplingParams(allowed_token_ids=[1, 2, 3, 40]))
    allowed = torch.zeros((1, V), dtype=torch.bool)
    allowed[0, [2, 3, 50]] = True
    out = REF.processed_logits(torch.zeros(1, V), batch, token_bitmask=pack_bitmask(allowed))
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [2, 3]


def test_masks_agree_with_the_grammar_engines_own_kernel():
    """xgrammar applies the same words in place: exactly the same tokens end at -inf."""
    xgrammar = pytest.importorskip("xgrammar")
    V = 1000
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, V, generator=gen)
    words = torch.randint(-2**31, 2**31, (5, bitmask_width(V)), generator=gen, dtype=torch.int64).to(torch.int32)
    words[2] = -1
    theirs = logits.clone()
    xgrammar.apply_token_bitmask_inplace(theirs, words)
    batch = REF.new_batch(V)
    for row in range(5):
        batch.add(f"r{row}", SamplingParams(temperature=0.0))
    ours = REF.processed_logits(logits, batch, token_bitmask=words)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    assert torch.equal(ours[torch.isfinite(ours)], logits[torch.isfinite(ours)])


def test_the_callers_mask_is_not_modified_and_may_be_reused():
    V = 64
    batch = REF.new_batch(V)
    batch.add("r", SamplingParams(seed=1))
    words = pack_bitmask(torch.rand((1, V)) < 0.5)
    before = words.clone()
    REF.sample(torch.randn(1, V), batch, token_bitmask=words)
    assert torch.equal(words, before)


def test_per_request_logits_take_a_mask_per_row():
    V = 64
    batch = REF.new_batch(V)
    batch.add("kids", SamplingParams(n=2, seed=3))
    allowed = torch.zeros((2, V), dtype=torch.bool)
    allowed[0, 5] = allowed[1, 9] = True
    out = REF.sample(torch.zeros(1, V), batch, token_bitmask=pack_bitmask(allowed))
    assert out.token_ids.tolist() == [5, 9]
