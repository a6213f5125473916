"""Step 8b, the reasoning budget: the incremental state against the contract's definition."""

import random

import pytest
import torch

from corelib import Sampler, SamplingParams
from corelib import thinking

V = 8


def last_end(history: list[int], marker: list[int]) -> int:
    """Where the last occurrence of ``marker`` (a contiguous run) ends in ``history``; -1."""
    for end in range(len(history), len(marker) - 1, -1):
        if history[end - len(marker):end] == marker:
            return end
    return -1


def contract_forced(history, start, end, forced, budget):
    """The contract's words, read literally: the forced token of a row, or None."""
    s, e = last_end(history, start), last_end(history, end)
    if s < 0 or s <= e:
        return None                                  # not thinking
    after = history[s:]
    if len(after) < budget:
        return None
    j = max(l for l in range(len(forced)) if l <= len(after) and history[len(history) - l:] == forced[:l])
    return forced[j]


def markers(rng):
    start = [rng.randrange(4) for _ in range(rng.randint(1, 3))]
    end = [rng.randrange(4) for _ in range(rng.randint(1, 3))]
    forced = [rng.randrange(4) for _ in range(rng.randint(0, 2))] + end
    return start, end, forced


@pytest.mark.parametrize("seed", range(40))
def test_incremental_state_gives_the_contracts_forced_token_after_every_prefix(seed):
    rng = random.Random(seed)
    start, end, forced = markers(rng)
    budget = rng.randint(0, 3)
    history = [rng.randrange(4) for _ in range(60)]
    width = max(map(len, (start, end, forced)))
    table = thinking.marker_table(start, end, forced, width)[None]
    match = torch.zeros((1, 3, width), dtype=torch.bool)
    count = torch.full((1,), -1, dtype=torch.int32)
    for i, token in enumerate(history):
        match, count = thinking.advance(table, match, count, torch.tensor([token]), torch.tensor([True]))
        prefix = history[: i + 1]
        bits, host_count = thinking.replay(prefix, start, end, forced)
        assert torch.equal(match[0], thinking.bits_tensor(bits, width)), (prefix, start, end, forced)
        assert int(count[0]) == host_count
        got = int(thinking.forced_tokens(table, match, count, torch.tensor([budget], dtype=torch.int32))[0])
        want = contract_forced(prefix, start, end, forced, budget)
        assert got == (-1 if want is None else want), (prefix, start, end, forced, budget)


def test_rows_without_a_budget_are_never_forced_and_live_false_changes_nothing():
    table = thinking.marker_table([1], [2], [2], 2)[None].repeat(2, 1, 1)
    table[1] = -1                                            # a row without a budget
    match = torch.zeros((2, 3, 2), dtype=torch.bool)
    count = torch.full((2,), -1, dtype=torch.int32)
    match, count = thinking.advance(table, match, count, torch.tensor([1, 1]), torch.tensor([True, True]))
    assert count.tolist() == [0, -1]
    frozen = thinking.advance(table, match, count, torch.tensor([5, 5]), torch.tensor([False, False]))
    assert torch.equal(frozen[0], match) and torch.equal(frozen[1], count)
    budget = torch.tensor([0, -1], dtype=torch.int32)
    assert thinking.forced_tokens(table, match, count, budget).tolist() == [2, -1]


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(thinking_budget=3), "needs thinking_start_token_ids"),
    (dict(thinking_budget=3, thinking_start_token_ids=[1]), "needs thinking_end_token_ids"),
    (dict(thinking_budget=-1, thinking_start_token_ids=[1], thinking_end_token_ids=[2]),
     "thinking_budget must be >= 0"),
    (dict(thinking_budget=3, thinking_start_token_ids=[1], thinking_end_token_ids=[2, 3],
          thinking_forced_token_ids=[4, 2]), "must end with thinking_end_token_ids"),
    (dict(thinking_budget=True, thinking_start_token_ids=[1], thinking_end_token_ids=[2]), "thinking_budget"),
])
def test_bad_budgets_and_markers_name_the_field(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        SamplingParams(**kwargs)


def test_markers_outside_the_vocabulary_raise_at_add():
    batch = Sampler("cpu").new_batch(V)
    params = SamplingParams(thinking_budget=1, thinking_start_token_ids=[1], thinking_end_token_ids=[V])
    with pytest.raises(ValueError, match=f"request 'r': token id {V} in its parameters is out of range"):
        batch.add("r", params)
    assert batch.rows == []


def test_forced_rows_emit_the_forced_token_for_greedy_and_random_rows_seeded_or_not():
    sampler = Sampler("cpu")
    batch = sampler.new_batch(V)
    think = dict(thinking_budget=0, thinking_start_token_ids=[1], thinking_end_token_ids=[2])
    for rid, extra in (("g", dict(temperature=0.0)), ("s", dict(seed=3, top_k=2)),
                       ("u", dict(temperature=2.0)), ("m", dict(allowed_token_ids=[5]))):
        batch.add(rid, SamplingParams(**think, **extra), prompt_token_ids=[4, 1])
    logits = torch.zeros(4, V)
    logits[:, 2] = -50.0                                    # the model would never choose it
    for _ in range(20):
        out = sampler.sample(logits, batch)
        assert out.token_ids.tolist() == [2, 2, 2, 2] and bool(out.valid.all())
    processed = sampler.processed_logits(logits, batch)
    assert torch.equal(torch.isfinite(processed), torch.nn.functional.one_hot(torch.tensor([2] * 4), V).bool())


def test_a_thinking_budget_changes_nothing_for_rows_that_are_not_forced():
    sampler = Sampler("cpu")
    plain, budgeted = sampler.new_batch(V), sampler.new_batch(V)
    params = dict(seed=9, temperature=1.0, presence_penalty=0.5)
    plain.add("r", SamplingParams(**params), prompt_token_ids=[3, 4])
    budgeted.add("r", SamplingParams(**params, thinking_budget=5, thinking_start_token_ids=[1],
                                     thinking_end_token_ids=[2]), prompt_token_ids=[3, 4])
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(1))
    logits[:, 1] = -1e9                                     # never opens a thinking section
    for _ in range(10):
        a, b = sampler.step(logits, plain), sampler.step(logits, budgeted)
        assert a.token_ids.tolist() == b.token_ids.tolist()
