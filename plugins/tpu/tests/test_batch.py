"""XlaSamplingBatch: fixed-shape state that follows rows through churn (removes, swaps, one or
K + 1 ids appended), limits, variant choice."""

from __future__ import annotations

import random

import pytest
import torch
from corelib import SamplingParams
from corelib.sampler import Sampler

from corelib_tpu.layout import _POSITION, ROUTES, choose_path
from corelib_tpu.sampler import TpuSampler

from tpu_support import needs_xla, xla_device

V = 64
OPTIONS = [
    dict(), dict(temperature=0.0), dict(top_k=3, seed=1), dict(top_p=0.6),
    dict(logit_bias={1: 4.0, 9: -3.0}), dict(allowed_token_ids=[2, 3, 5, 7, 11]),
    dict(bad_words=[[4], [1, 2], [3, 3, 3]]), dict(min_tokens=3, stop_token_ids=[8]),
    dict(repetition_penalty=1.4, frequency_penalty=0.5, presence_penalty=-0.3),
    dict(n=3, seed=7, min_p=0.1), dict(logprobs=2, top_k=10, top_p=0.9),
    dict(dry_multiplier=1.2, dry_allowed_length=1, dry_sequence_breakers=[5]),
    dict(top_n_sigma=1.5, typical_p=0.8), dict(xtc_probability=1.0, xtc_threshold=0.05),
    dict(stage_args={"ban-repeats": {"times": 1}}), dict(stage_args={"floor-prob": {"prob": 0.02}}),
    # step 8b: a budget of 1 or 2 after the start marker [10, 11] forces [12, 13]
    dict(thinking_budget=1, thinking_start_token_ids=[10, 11], thinking_end_token_ids=[13],
         thinking_forced_token_ids=[12, 13]),
    dict(seed=3, thinking_budget=2, thinking_start_token_ids=[10], thinking_end_token_ids=[13]),
]


def _churn(sampler: Sampler, reference: Sampler, steps: int, seed: int):
    """Random adds, removes (rows move) and appends on both samplers; after each step the
    processed logits must agree."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    mine, ref = sampler.new_batch(V, eos_token_id=0), reference.new_batch(V, eos_token_id=0)
    for step in range(steps):
        if len(mine) < 12 and rng.random() < 0.7:
            params = SamplingParams(**rng.choice(OPTIONS))
            prompt = [rng.randrange(V) for _ in range(rng.randrange(4))]
            if params.uses_thinking_budget and rng.random() < 0.7:
                prompt += params.thinking_start_token_ids        # the prompt opens a section
            outputs = [[rng.randrange(1, V) for _ in range(rng.randrange(3))] for _ in range(params.n)]
            outputs = outputs[0] if params.n == 1 else outputs
            for batch in (mine, ref):
                batch.add(f"r{step}", params, prompt_token_ids=prompt, output_token_ids=outputs)
        if len(mine) > 3 and rng.random() < 0.4:
            victim = rng.choice(mine.request_ids)
            mine.remove(victim)
            ref.remove(victim)
        if len(mine) > 1 and rng.random() < 0.4:
            a, b = rng.sample(range(len(mine)), 2)
            mine.swap_rows(a, b)
            ref.swap_rows(a, b)
        assert mine.rows == ref.rows
        if not len(mine):
            continue
        logits = torch.randn((len(mine), V), generator=gen) * 2
        got = sampler.processed_logits(logits.to(sampler.device), mine)
        want = reference.processed_logits(logits, ref)
        assert torch.equal(torch.isfinite(got), torch.isfinite(want)), f"kept sets differ at step {step}"
        torch.testing.assert_close(got[torch.isfinite(want)], want[torch.isfinite(want)])
        tokens = torch.argmax(want, dim=-1)                      # any valid token per row
        if rng.random() < 0.3:                                   # verify's [rows, K + 1] form
            more = torch.randint(0, V, (len(mine), 2), generator=gen)
            more[::2, 1] = -1
            tokens = torch.cat([tokens[:, None], more], dim=1)
        mine.append(tokens)
        ref.append(tokens)
    return mine


def test_state_follows_rows_through_churn_on_cpu():
    batch = _churn(TpuSampler("cpu", buckets=(4, 8, 16)), Sampler("cpu"), steps=60, seed=1)
    assert batch.generated_counts() == [int(p) for p in batch._ints[:len(batch), _POSITION]]


def _row_state(batch, row: int) -> dict:
    """Every per-row tensor of ``row``: the host scalars and each dense device row."""
    state = {"floats": batch._floats[row].clone(), "ints": batch._ints[row].clone()}
    state.update({name: tensor[row].cpu().clone() for name, tensor in batch._state.items()})
    return state


@pytest.mark.parametrize("device", ["cpu", pytest.param("xla", marks=needs_xla)])
def test_swap_rows_exchanges_all_state_at_once(device):
    """``swap_rows(a, b)`` moves a's state to b and b's to a (a simultaneous permutation: a
    move one row at a time would copy one row over the other and lose it), and leaves other
    rows alone."""
    sampler = TpuSampler(xla_device() if device == "xla" else "cpu", buckets=(4,), dry_window=16,
                         stages=("ban-repeats",))
    batch = sampler.new_batch(V)
    batch.add("a", SamplingParams(seed=1, frequency_penalty=0.5, dry_multiplier=1.0,
                                  stage_args={"ban-repeats": {"times": 2}}, bad_words=[[1, 2]]),
              prompt_token_ids=[1, 2, 3], output_token_ids=[4, 4, 5])
    batch.add("b", SamplingParams(temperature=0.5, top_k=3, logit_bias={7: 2.0}), prompt_token_ids=[9])
    batch.add("c", SamplingParams(seed=3, min_tokens=4, stop_token_ids=[6]), output_token_ids=[8])
    before = [_row_state(batch, row) for row in range(3)]
    batch.swap_rows(0, 2)
    assert batch.rows == [("c", 0), ("b", 0), ("a", 0)]
    assert batch.rows_of("a") == [2] and batch.rows_of("c") == [0]
    assert batch.generated_counts() == [1, 0, 3]
    after = [_row_state(batch, row) for row in range(3)]
    for row, source in ((0, 2), (1, 1), (2, 0)):
        for name, value in before[source].items():
            assert torch.equal(after[row][name], value), f"row {row} {name} is not row {source}'s"


def test_two_dimensional_append_equals_appending_one_token_at_a_time():
    sampler = TpuSampler("cpu", buckets=(4,), dry_window=16, stages=("ban-repeats",))
    params = [SamplingParams(seed=1, frequency_penalty=0.5, dry_multiplier=1.0, bad_words=[[3, 4]],
                             stage_args={"ban-repeats": {"times": 1}}),
              SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[2])]
    at_once, one_by_one = sampler.new_batch(V), sampler.new_batch(V)
    for batch in (at_once, one_by_one):
        for i, p in enumerate(params):
            batch.add(f"r{i}", p, prompt_token_ids=[3, 4, 3])
    at_once.append(torch.tensor([[3, 4, 5], [6, -1, -1]]))      # row 1 emitted one token
    for column in ([3, 6], [4, 0], [5, 0]):                      # row 0's, one at a time
        one_by_one.append(torch.tensor(column))
    assert at_once.generated_counts() == [3, 1]
    for name, tensor in at_once._state.items():
        assert torch.equal(tensor[0], one_by_one._state[name][0]), name
    counts = at_once.step_state().output_counts[1]
    assert int(counts[6]) == 1 and int(counts.sum()) == 1
    assert int(at_once._state["recent"][1, -1]) == 6


@needs_xla
def test_state_follows_rows_through_churn_on_xla():
    _churn(TpuSampler(xla_device(), buckets=(16,)), Sampler("cpu"), steps=25, seed=2)


def test_limits_raise_naming_the_request():
    sampler = TpuSampler("cpu", buckets=(4,), max_bad_words=2, max_bad_word_length=3)
    batch = sampler.new_batch(V)
    with pytest.raises(ValueError, match=r"'big': n=5 does not fit.*at most 4 rows"):
        batch.add("big", SamplingParams(n=5, seed=1))
    with pytest.raises(ValueError, match=r"'words'.*max_bad_words=2"):
        batch.add("words", SamplingParams(bad_words=[[1, 2], [2, 3], [3, 4]]))
    with pytest.raises(ValueError, match=r"'long'.*max_bad_word_length=3"):
        batch.add("long", SamplingParams(bad_words=[[1, 2, 3, 4]]))
    batch.add("ok", SamplingParams(bad_words=[[1], [2], [3], [1, 2], [2, 3, 4]]))   # 1-token words are free
    assert len(batch) == 1


def test_marker_and_logprobs_limits_raise_at_add_naming_them():
    sampler = TpuSampler("cpu", buckets=(4,), max_thinking_marker_length=3, max_logprobs=30)
    batch = sampler.new_batch(V)
    think = dict(thinking_budget=4, thinking_start_token_ids=[1], thinking_end_token_ids=[2])
    with pytest.raises(ValueError, match=r"'phrase'.*thinking_forced_token_ids holds 4 tokens.*"
                                         r"max_thinking_marker_length=3"):
        batch.add("phrase", SamplingParams(**think, thinking_forced_token_ids=[5, 6, 7, 2]))
    with pytest.raises(ValueError, match=r"'start'.*thinking_start_token_ids holds 4 tokens"):
        batch.add("start", SamplingParams(**dict(think, thinking_start_token_ids=[1, 1, 1, 1])))
    with pytest.raises(ValueError, match=r"'many'.*logprobs=31.*max_logprobs=30"):
        batch.add("many", SamplingParams(logprobs=31))
    with pytest.raises(ValueError, match=r"'all'.*logprobs=-1 asks for 64 .*every token.*max_logprobs=30"):
        batch.add("all", SamplingParams(logprobs=-1))
    assert len(batch) == 0
    batch.add("ok", SamplingParams(**think, thinking_forced_token_ids=[5, 6, 2], logprobs=30))
    every = TpuSampler("cpu", buckets=(4,), max_logprobs=V).new_batch(V)
    every.add("all", SamplingParams(logprobs=-1))
    assert every.step_state(4).num_logprobs == V


def test_append_checks_host_ids_and_counts_device_ids():
    sampler = TpuSampler("cpu", buckets=(4,))
    batch = sampler.new_batch(V)
    batch.add("a", SamplingParams(frequency_penalty=1.0))
    with pytest.raises(ValueError, match="out of range"):
        batch.append([V])
    with pytest.raises(ValueError, match="one token id per row"):
        batch.append([1, 2])
    batch.append([5])
    assert batch.generated_counts() == [1]
    assert int(batch.step_state().output_counts[0, 5]) == 1


@pytest.mark.parametrize("rows, path", [
    ([dict(temperature=0.0)], "greedy"),
    ([dict(), dict(temperature=0.0, top_k=500, min_p=0.2)], "plain"),
    ([dict(), dict(min_p=0.1), dict(temperature=0.0, top_k=500)], "min_p"),
    ([dict(top_k=50, top_p=0.9), dict(top_k=64), dict(temperature=0.0)], "candidates"),
    ([dict(top_k=50, top_p=0.9), dict()], "candidates"),
    ([dict(top_p=0.9)], "nucleus"),
    ([dict(top_k=-1, top_p=0.5), dict(top_k=3)], "nucleus"),
    ([dict(top_k=65)], "exhaustive"),
    ([dict(top_p=0.9), dict(top_k=65, top_p=0.5)], "exhaustive"),
])
def test_path_choice(rows, path):
    assert choose_path([SamplingParams(**p) for p in rows], candidates=64) == path


@pytest.mark.parametrize("rows, route", [
    ([dict(top_p=0.9)], "top_p"),
    ([dict(top_p=0.9), dict(temperature=0.0, top_k=500, min_p=0.2)], "top_p"),  # greedy: skipped
    ([dict(top_p=0.9), dict(min_p=0.1)], "nucleus"),
    ([dict(top_k=-1, top_p=0.5), dict(top_k=3)], "nucleus"),
    ([dict(top_p=0.9, top_k=V)], "top_p"),                 # a top-k of the vocabulary is off
    ([dict(top_k=50, top_p=0.9)], "candidates"),
    ([dict(temperature=0.0)], "plain"),
])
def test_route_choice(rows, route):
    """The nucleus path without min-p and top-k in its random rows takes top-p alone."""
    batch = TpuSampler("cpu", buckets=(8,)).new_batch(V)
    for i, p in enumerate(rows):
        batch.add(f"r{i}", SamplingParams(**p))
    assert batch._route_name() == route
    assert int(batch.step_state().route[0]) == ROUTES.index(route)


def test_row_sources_map_rows_to_their_logits_rows():
    batch = TpuSampler("cpu", buckets=(8,)).new_batch(V)
    batch.add("a", SamplingParams(n=2, seed=1))
    batch.add("b", SamplingParams())
    batch.add("c", SamplingParams(n=2, seed=2))
    batch.remove("a")                                  # c's rows move into a's places
    assert batch.rows == [("c", 0), ("c", 1), ("b", 0)]
    assert batch.row_sources(8, per_request=False).tolist() == [0, 1, 2, 0, 0, 0, 0, 0]
    assert batch.request_ids == ["c", "b"]
    assert batch.row_sources(8, per_request=True).tolist() == [0, 0, 1, 0, 0, 0, 0, 0]


def test_padded_rows_are_neutral():
    batch = TpuSampler("cpu", buckets=(8,)).new_batch(V)
    batch.add("a", SamplingParams(temperature=0.5, top_k=3, top_p=0.5, min_p=0.2, seed=3,
                                  repetition_penalty=2.0, min_tokens=4))
    batch.remove("a")
    batch.add("b", SamplingParams())
    s = batch.step_state(batch.bucket())
    assert s.num_rows == 8 and s.live_rows == 1
    for name, neutral in [("temperature", 1.0), ("top_p", 1.0), ("min_p", 0.0),
                          ("repetition_penalty", 1.0), ("top_k", 0), ("min_tokens", 0)]:
        assert torch.all(getattr(s, name)[1:] == neutral), name
    # padding rows enter the graph as greedy rows: no noise, and the draw over the candidate
    # set stays open to the live rows (TpuSampler.draw)
    assert not s.seeded[1:].any() and not s.greedy[0] and s.greedy[1:].all()


def test_the_draw_runs_over_the_candidates_when_every_random_row_keeps_few(monkeypatch):
    """``TpuSampler.draw`` races over the candidate set when every random row keeps at most
    ``top_k_candidates`` tokens (greedy and padding rows do not count against it), in
    ``sample`` and in ``verify``; a row keeping more sends the step to the vocabulary-wide
    draw. Where steps 11-13 took the candidate route, the race reuses its candidates
    (("draw", 8, "route") taken) instead of searching them again. Off XLA the conditional
    reads its predicate, which is recorded here."""
    from corelib_tpu import xla
    taken = []
    real_cond = xla.cond

    def recording_cond(pred, true_fn, false_fn, operands, key):
        taken.append((key, bool(pred)))
        return real_cond(pred, true_fn, false_fn, operands, key)

    monkeypatch.setattr(xla, "cond", recording_cond)
    sampler = TpuSampler("cpu", buckets=(4,), speculative_k=(2,), top_k_candidates=8)
    batch = sampler.new_batch(V)
    batch.add("a", SamplingParams(seed=1, top_k=5))
    batch.add("b", SamplingParams(temperature=0.0))
    route = ("draw", 8, "route")
    sampler.sample(torch.randn(2, V), batch)
    assert (route, True) in taken and ("draw", 8) not in [key for key, _ in taken]
    taken.clear()
    sampler.verify(torch.randn(2, 3, V), batch, torch.tensor([[1, 2], [3, 4]]))
    assert (route, True) in taken
    taken.clear()
    batch.add("c", SamplingParams(seed=2))                  # keeps the whole vocabulary
    sampler.sample(torch.randn(3, V), batch)
    assert (route, False) in taken and (("draw", 8), False) in taken
    assert (("draw", 8), True) not in taken
    taken.clear()
    batch.remove("c")
    batch.add("d", SamplingParams(seed=3, top_p=0.5))       # the nucleus: no candidate route
    sampler.sample(torch.randn(3, V), batch)
    assert (route, False) in taken and ("draw", 8) in [key for key, _ in taken]
