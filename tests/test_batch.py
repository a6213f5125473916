"""Batch state: continuous batching, parallel sampling, running counts, resumption."""

import random

import numpy as np
import pytest
import torch

from corelib import Sampler, SamplingParams

V = 32


@pytest.fixture
def batch():
    return Sampler("cpu").new_batch(vocab_size=V, eos_token_id=31)


def test_add_returns_one_row_per_child_and_rows_name_them(batch):
    assert batch.add("a", SamplingParams(n=3, seed=1)) == [0, 1, 2]
    assert batch.add("b", SamplingParams()) == [3]
    assert batch.rows == [("a", 0), ("a", 1), ("a", 2), ("b", 0)]
    assert batch.num_requests == 2 and len(batch) == 4


def test_remove_moves_last_rows_into_the_hole_and_keeps_their_state(batch):
    batch.add("a", SamplingParams(seed=1, temperature=0.5))
    batch.add("b", SamplingParams(n=2, seed=2, top_k=4))
    batch.add("c", SamplingParams(seed=3, top_p=0.3, min_p=0.2))
    batch.append([1, 2, 3, 4])
    batch.remove("a")
    assert sorted(batch.rows) == [("b", 0), ("b", 1), ("c", 0)]
    s = batch.step_state()
    for row, (rid, child) in enumerate(batch.rows):
        p = batch.params_of(rid)
        assert s.temperature[row] == pytest.approx(p.temperature)
        assert s.top_k[row] == p.effective_top_k and s.child[row] == child
        assert s.position[row] == 1
    assert batch.step_state(8).temperature[3:].tolist() == [1.0] * 5  # freed rows are neutral


def _random_params(rng):
    """A request's parameters drawing on every kind of per-row state the batch keeps."""
    choices = [
        dict(seed=rng.randrange(100), temperature=0.5),
        dict(n=rng.randint(2, 3), top_k=4, seed=rng.randrange(100)),
        dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.1),
        dict(bad_words=[[3, 4], [5]], min_tokens=2, stop_token_ids=[7]),
        dict(logit_bias={2: 1.5, 9: -1.0}, allowed_token_ids=[1, 2, 9, 11]),
        dict(dry_multiplier=0.8, dry_allowed_length=1, top_p=0.9),
        dict(temperature=0.0, thinking_budget=3,
             thinking_start_token_ids=[12], thinking_end_token_ids=[13]),
    ]
    return SamplingParams(**rng.choice(choices))


def _batch_state(batch, num_rows):
    s = batch.step_state(num_rows)      # the freed rows too: they must be neutral
    tensors = {k: v.clone() for k, v in vars(s).items() if isinstance(v, torch.Tensor)}
    return batch.rows, {rid: batch.rows_of(rid) for rid, _ in batch.rows}, \
        batch.generated_counts(), tensors


@pytest.mark.parametrize("seed", range(12))
def test_removing_several_requests_at_once_equals_one_at_a_time(seed):
    rng = random.Random(seed)
    requests = [(f"r{i}", _random_params(rng), [rng.randrange(1, V) for _ in range(rng.randint(0, 5))])
                for i in range(rng.randint(3, 9))]
    leaving = rng.sample([rid for rid, _, _ in requests], rng.randint(1, len(requests)))
    one_by_one, at_once = (Sampler("cpu").new_batch(vocab_size=V, eos_token_id=31) for _ in range(2))
    for batch in (one_by_one, at_once):
        for rid, params, prompt in requests:
            batch.add(rid, params, prompt_token_ids=prompt)
        for step in range(3):
            batch.append([(7 * row + step) % V for row in range(len(batch))])
    rows_before = len(one_by_one)
    for rid in leaving:
        one_by_one.remove(rid)
    at_once.remove(*leaving)
    want, got = _batch_state(one_by_one, rows_before), _batch_state(at_once, rows_before)
    assert got[:3] == want[:3], leaving
    for name, tensor in want[3].items():
        assert torch.equal(got[3][name], tensor), (name, leaving)
    for batch in (one_by_one, at_once):     # and they go on alike
        if len(batch):
            batch.append([row % V for row in range(len(batch))])
    assert _batch_state(at_once, rows_before)[2:3] == _batch_state(one_by_one, rows_before)[2:3]


def test_removing_several_checks_every_id_before_anything_leaves(batch):
    batch.add("a", SamplingParams(seed=1))
    batch.add("b", SamplingParams(n=2, frequency_penalty=0.5))
    before = _batch_state(batch, 3)
    with pytest.raises(KeyError, match="request 'zzz' is not in the batch"):
        batch.remove("a", "zzz")
    with pytest.raises(ValueError, match="request 'b' is given more than once"):
        batch.remove("b", "a", "b")
    after = _batch_state(batch, 3)
    assert after[:3] == before[:3]
    assert all(torch.equal(after[3][k], v) for k, v in before[3].items())
    batch.remove()                          # nothing leaves: an engine's quiet step
    assert batch.rows == [("a", 0), ("b", 0), ("b", 1)]
    batch.remove("b", "a")
    assert batch.rows == [] and batch.num_requests == 0


def test_swap_rows_moves_every_piece_of_state(batch):
    batch.add("a", SamplingParams(seed=1, temperature=0.5, frequency_penalty=0.5), [7, 8])
    batch.add("b", SamplingParams(n=2, seed=2, top_k=4, bad_words=[[3, 4]]), [9])
    batch.append([1, 3, 5])
    before = {k: v.clone() for k, v in vars(batch.step_state()).items() if isinstance(v, torch.Tensor)}
    keys = batch.rows
    batch.swap_rows(0, 2)
    assert batch.rows == [keys[2], keys[1], keys[0]]
    assert batch.rows_of("a") == [2] and batch.rows_of("b") == [1, 0]
    after = batch.step_state()
    order = torch.tensor([2, 1, 0])
    for name in ("temperature", "top_k", "seed_lo", "child", "position", "prompt_mask",
                 "output_counts", "recent", "bad_prefix"):
        assert torch.equal(getattr(after, name), before[name][order]), name
    with pytest.raises(ValueError, match="row b=3"):
        batch.swap_rows(0, 3)


def test_duplicate_and_unknown_request_ids_are_errors(batch):
    batch.add("a", SamplingParams())
    with pytest.raises(ValueError, match="request 'a' is already in the batch"):
        batch.add("a", SamplingParams())
    with pytest.raises(KeyError, match="request 'zzz' is not in the batch"):
        batch.remove("zzz")


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(prompt_token_ids=[1, 32]), "prompt_token_ids holds token id 32"),
    (dict(prompt_token_ids=[-1]), "prompt_token_ids holds token id -1"),
    (dict(output_token_ids=[40]), "output_token_ids holds token id 40"),
])
def test_out_of_range_history_ids_name_the_request(batch, kwargs, fragment):
    with pytest.raises(ValueError, match="request 'bad'") as err:
        batch.add("bad", SamplingParams(), **kwargs)
    assert fragment in str(err.value)
    assert batch.num_requests == 0


@pytest.mark.parametrize("params", [
    SamplingParams(logit_bias={32: 1.0}), SamplingParams(stop_token_ids=[99]),
    SamplingParams(allowed_token_ids=[1, 32]), SamplingParams(bad_words=[[1, 500]]),
])
def test_out_of_range_parameter_ids_are_rejected_at_add(batch, params):
    with pytest.raises(ValueError, match="out of range for vocab_size=32"):
        batch.add("bad", params)
    assert batch.rows == []


@pytest.mark.parametrize("ids, error, fragment", [
    ([1] * 500 + [True], TypeError, "prompt_token_ids must hold ints, got True"),
    ([1] * 500 + [2.0], TypeError, "must hold ints, got 2.0"),
    ([3, np.int64(4)], TypeError, "must hold ints, got np.int64(4)"),
    ([1] * 500 + [32], ValueError, "token id 32, out of range for vocab_size=32"),
    ([5, -1, 40], ValueError, "token id -1, out of range"),
    (torch.tensor([1, 2, 33]), ValueError, "token id 33, out of range"),
    (torch.tensor([1.0]), TypeError, "must hold ints, got 1.0"),
])
def test_prompt_and_output_ids_are_checked_whole(batch, ids, error, fragment):
    for where in ("prompt_token_ids", "output_token_ids"):
        with pytest.raises(error) as err:
            batch.add("bad", SamplingParams(), **{where: ids})
        assert fragment.replace("prompt_token_ids", where) in str(err.value)
        assert batch.rows == []
    assert batch.add("good", SamplingParams(), prompt_token_ids=list(range(32)) * 50,
                     output_token_ids=torch.tensor([31, 0])) == [0]


def test_append_needs_one_token_per_row(batch):
    batch.add("a", SamplingParams(n=2))
    with pytest.raises(ValueError, match=r"expected shape \[2\] .*got \[3\]"):
        batch.append([1, 2, 3])
    with pytest.raises(ValueError, match="token id 32 for row 1"):
        batch.append([1, 32])
    with pytest.raises(TypeError, match="integer token ids"):
        batch.append(torch.tensor([1.0, 2.0]))
    assert batch.generated_counts() == [0, 0]


@pytest.mark.parametrize("rows", [1, 16, 17, 40])
def test_append_range_check_names_the_row_at_any_batch_size(batch, rows):
    """Few rows are checked on the host as a list, more with one tensor pass: both name
    the first bad row, accept -1 (no token), and leave every row's state unchanged."""
    for i in range(rows):
        batch.add(f"r{i}", SamplingParams())
    good = torch.arange(rows) % V
    for bad_id in (V, -2):
        ids = good.clone()
        ids[rows - 1] = bad_id
        with pytest.raises(ValueError, match=f"token id {bad_id} for row {rows - 1} "
                                             f"\\(request 'r{rows - 1}'\\)"):
            batch.append(ids)
    assert batch.generated_counts() == [0] * rows
    ids = good.clone()
    ids[0] = -1
    batch.append(ids)
    assert batch.generated_counts() == [0] + [1] * (rows - 1)
    batch.append([i % V for i in range(rows)])
    assert batch.generated_counts() == [1] + [2] * (rows - 1)


def test_marked_sampled_ids_skip_the_range_check_only_while_unchanged(batch):
    """``mark_sampled_ids``: append of the marked tensor advances every row without reading
    it back; written in place since, or another tensor, it is checked as always (the bad id
    named, nothing advanced)."""
    batch.add("a", SamplingParams(n=2))
    ids = torch.tensor([3, 4])
    batch.mark_sampled_ids(ids)
    batch.append(ids)
    assert batch.generated_counts() == [1, 1]
    ids[1] = V                                     # the version counter moves
    with pytest.raises(ValueError, match=f"token id {V} for row 1"):
        batch.append(ids)
    batch.mark_sampled_ids(torch.tensor([3, 4]))
    with pytest.raises(ValueError, match="token id -2 for row 0"):
        batch.append(torch.tensor([-2, 4]))        # not the marked tensor
    assert batch.generated_counts() == [1, 1]
    with torch.inference_mode():                   # no version counter: always checked
        inferred = torch.tensor([5, 6])
        batch.mark_sampled_ids(inferred)
        inferred[0] = V
        with pytest.raises(ValueError, match=f"token id {V} for row 0"):
            batch.append(inferred)
    marked = torch.tensor([5, 6])
    batch.mark_sampled_ids(marked)
    batch.add("b", SamplingParams())               # rows changed: the shape is checked
    with pytest.raises(ValueError, match=r"expected shape \[3\]"):
        batch.append(marked)


def test_running_counts_equal_the_histories(batch):
    batch.add("a", SamplingParams(frequency_penalty=1.0, n=2), prompt_token_ids=[5, 5, 6])
    gen = torch.Generator().manual_seed(0)
    history = [[], []]
    for _ in range(50):
        ids = torch.randint(0, V, (2,), generator=gen)
        batch.append(ids)
        for row in range(2):
            history[row].append(int(ids[row]))
    s = batch.step_state()
    for row in range(2):
        assert torch.equal(s.output_counts[row], torch.bincount(torch.tensor(history[row]), minlength=V).int())
        assert s.prompt_mask[row].nonzero().flatten().tolist() == [5, 6]
    assert s.position.tolist() == [50, 50] and batch.generated_counts() == [50, 50]


def test_resumed_request_has_the_state_of_an_uninterrupted_one():
    sampler = Sampler("cpu")
    params = SamplingParams(n=2, seed=3, repetition_penalty=1.2, bad_words=[[1, 2, 3]], min_tokens=4)
    live = sampler.new_batch(V, eos_token_id=0)
    live.add("r", params, prompt_token_ids=[4, 5])
    outputs = [[1, 2, 9], [7, 1, 2]]
    for step in range(3):
        live.append([outputs[0][step], outputs[1][step]])
    resumed = sampler.new_batch(V, eos_token_id=0)
    resumed.add("r", params, prompt_token_ids=[4, 5], output_token_ids=outputs)
    a, b = live.step_state(), resumed.step_state()
    for name in ("position", "output_counts", "prompt_mask", "recent", "seed_lo", "child"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.any_min_tokens and b.any_min_tokens


def test_output_token_ids_for_n_children_need_one_list_each(batch):
    with pytest.raises(ValueError, match="one list per child"):
        batch.add("r", SamplingParams(n=2), output_token_ids=[1, 2])


def test_capacity_grows_without_losing_rows(batch):
    for i in range(40):
        batch.add(f"r{i}", SamplingParams(seed=i, logit_bias={i % V: float(i % 7)}))
        if i % 6 == 5:      # state read and advanced between growths (8 -> 16 -> 32 -> 64)
            assert batch.step_state().seed_lo.tolist() == list(range(i + 1))
            batch.append([1] * (i + 1))
    s = batch.step_state()
    assert s.num_rows == 40
    assert s.seed_lo.tolist() == list(range(40))
    assert [int(s.bias_values[i, 0]) for i in range(40)] == [i % 7 for i in range(40)]
    assert s.position.tolist() == [6 - i // 6 for i in range(36)] + [0] * 4


def test_every_per_row_field_starts_neutral_and_is_its_own(batch):
    """The scalar columns share one allocation per dtype: each still starts at its own
    neutral value, through growth, and a write to one leaves the others alone."""
    from corelib.step_state import SCALARS
    for i in range(20):                                     # past the first capacity
        batch.add(f"r{i}", SamplingParams())
    s = batch.step_state()
    for name, (dtype, neutral) in SCALARS.items():
        column = getattr(s, name, None)
        if column is None:
            continue
        assert column.dtype == dtype and column.shape == (20,), name
        assert (column == neutral).all(), name
    batch.add("hot", SamplingParams(temperature=0.5, top_k=3, seed=9))
    s = batch.step_state()
    assert s.top_k[:20].tolist() == [SCALARS["top_k"][1]] * 20 and s.top_k[20] == 3
    assert (s.temperature[:20] == SCALARS["temperature"][1]).all() and s.temperature[20] == 0.5
    assert s.seed_lo[20] == 9 and not s.seeded[:20].any() and s.seeded[20]


def test_wider_bias_and_longer_bad_words_keep_earlier_rows(batch):
    batch.add("a", SamplingParams(logit_bias={1: 1.0}, bad_words=[[2, 3]]))
    batch.append([2])
    batch.add("b", SamplingParams(logit_bias={i: 0.5 for i in range(10)}, bad_words=[[4, 5, 6, 7]]))
    sampler = Sampler("cpu")
    out = sampler.processed_logits(torch.zeros(2, V), batch)
    assert out[0, 1] == 1.0 and out[0, 3] == float("-inf")     # a's word still fires after widening
    assert out[1, :10].tolist() == [0.5] * 10 and torch.isfinite(out[1]).all()


def test_request_ids_follow_first_rows(batch):
    batch.add("a", SamplingParams())
    batch.add("b", SamplingParams(n=2))
    batch.add("c", SamplingParams())
    batch.remove("a")     # c moves into row 0
    assert batch.rows[0] == ("c", 0)
    assert batch.request_ids == ["c", "b"]
    assert batch.request_index().tolist() == [0, 1, 1]


def test_flags_follow_the_live_requests(batch):
    batch.add("g", SamplingParams(temperature=0.0))
    s = batch.step_state()
    assert s.all_greedy and not s.any_random and not s.any_penalties
    batch.add("p", SamplingParams(presence_penalty=0.5, top_k=3, logprobs=4))
    s = batch.step_state()
    assert s.any_greedy and s.any_random and s.any_penalties and s.any_top_k and s.num_logprobs == 4
    batch.remove("p")
    s = batch.step_state()
    assert not s.any_penalties and s.num_logprobs is None


def test_host_flags_match_the_live_rows_through_joins_and_leaves(batch):
    """Each step's host flags are those of the rows in the batch at that moment, however
    requests of every kind joined and left (n > 1 included)."""
    kinds = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(seed=3, top_k=5, n=2),
        SamplingParams(top_p=0.8),
        SamplingParams(top_k=-1, top_p=0.9, logprobs=-1),
        SamplingParams(mirostat_tau=5.0, seed=1),
        SamplingParams(top_k=4, sampler_order=["top_p", "top_k"], top_p=0.9, return_kept=True),
        SamplingParams(temperature=0.0, sampler_order=["top_p", "top_k", "temperature"], top_p=0.5,
                       top_k=2),
    ]
    rng = random.Random(5)
    live: dict[str, SamplingParams] = {}
    for step in range(60):
        if live and rng.random() < 0.4:
            batch.remove(rng.choice(sorted(live)))
            live.pop(next(r for r in live if r not in batch.request_ids))
        else:
            live[f"r{step}"] = params = rng.choice(kinds)
            batch.add(f"r{step}", params)
        s = batch.step_state()
        rows = [p for p in live.values() for _ in range(p.n)]
        random_rows = [p for p in rows if p.temperature > 0]
        asked = [V if p.logprobs == -1 else p.logprobs for p in rows if p.logprobs is not None]
        expected = dict(
            any_greedy=len(random_rows) < len(rows), all_greedy=bool(rows) and not random_rows,
            any_random=bool(random_rows),
            any_seeded=any(p.seed is not None for p in random_rows),
            any_unseeded=any(p.seed is None for p in random_rows),
            any_selector=any(p.mirostat_tau > 0 for p in random_rows),
            any_kept=any(p.return_kept for p in rows),
            max_top_k=max((max(p.top_k, 0) for p in random_rows), default=0),
            any_top_p_without_top_k=any(p.top_p < 1 and p.top_k <= 0 for p in random_rows),
            all_random_top_k=bool(random_rows) and all(p.top_k > 0 for p in random_rows),
            num_logprobs=max(asked) if asked else None,
            orders=len({p.filter_order for p in random_rows} - {None}),
        )
        got = {name: getattr(s, name) for name in expected if name != "orders"}
        got["orders"] = len(s.filter_orders)
        assert got == expected, (step, sorted(live))


def test_min_tokens_flag_turns_off_once_reached(batch):
    batch.add("m", SamplingParams(min_tokens=2))
    assert batch.step_state().any_min_tokens
    batch.append([1])
    batch.append([1])
    assert not batch.step_state().any_min_tokens


def test_batch_constructor_validates(batch):
    sampler = Sampler("cpu")
    with pytest.raises(ValueError, match="vocab_size"):
        sampler.new_batch(0)
    with pytest.raises(ValueError, match="logprobs_mode"):
        sampler.new_batch(10, logprobs_mode="cooked")
    with pytest.raises(ValueError, match="eos_token_id"):
        sampler.new_batch(10, eos_token_id=10)


@pytest.mark.parametrize("logits,error,fragment", [
    (torch.zeros(2, 31), ValueError, "vocab size 31"),
    (torch.zeros(3, 32), ValueError, "logits have 3 rows"),
    (torch.zeros(2, 32, dtype=torch.long), TypeError, "floating-point"),
    (torch.zeros(32), ValueError, "2-D"),
    ([[0.0] * 32] * 2, TypeError, "torch.Tensor"),
])
def test_bad_logits_are_rejected_with_a_clear_error(batch, logits, error, fragment):
    batch.add("a", SamplingParams(n=2))
    with pytest.raises(error, match=fragment):
        Sampler("cpu").sample(logits, batch)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_float_dtypes_are_sampled_in_float32(batch, dtype):
    batch.add("a", SamplingParams(temperature=0.0))
    logits = torch.zeros(1, V)
    logits[0, 9] = 3.0
    assert Sampler("cpu").sample(logits.to(dtype), batch).token_ids.tolist() == [9]


def test_non_contiguous_logits_are_fine(batch):
    batch.add("a", SamplingParams(temperature=0.0))
    batch.add("b", SamplingParams(temperature=0.0))
    wide = torch.zeros(V, 2)
    wide[5, 0] = wide[7, 1] = 1.0
    assert Sampler("cpu").sample(wide.t(), batch).token_ids.tolist() == [5, 7]


def test_empty_batch_samples_nothing(batch):
    out = Sampler("cpu").sample(torch.zeros(0, V), batch)
    assert out.token_ids.shape == (0,)
    batch.append(out.token_ids)


def test_child_offset_keys_the_seeded_draw_and_is_checked(batch):
    batch.add("split-2", SamplingParams(seed=5), child_offset=2)
    batch.add("kids", SamplingParams(n=2, seed=5), child_offset=3)
    assert batch.rows == [("split-2", 0), ("kids", 0), ("kids", 1)]
    assert batch.step_state().child.tolist() == [2, 3, 4]
    for bad in (-1, True, 1.5, 2**31 - 1):
        with pytest.raises(ValueError, match=r"request 'x': child_offset must be an int in \[0, 2\*\*31 - n\]"):
            batch.add("x", SamplingParams(n=2), child_offset=bad)
    assert "x" not in batch


def test_staged_rows_that_do_not_follow_the_pending_ones_write_those_first(batch):
    # No public operation makes such rows (every row change reads the state first); the
    # batch still keeps both sets of values rather than dropping one.
    batch.add("a", SamplingParams(temperature=0.5))
    batch._stage_row_values(3, {"temperature": [0.25]})
    assert batch.step_state(4).temperature.tolist() == [0.5, 1.0, 1.0, 0.25]


def test_append_and_score_advance_only_the_selectors_some_request_turns_on(monkeypatch):
    """A stateful selector no request of the batch uses is not advanced: its advance would
    keep every row's state, at the price of whole-row passes. Once a request turns it on,
    both advance, and the states are those of a batch that ran every advance."""
    from corelib import selectors
    calls = []
    for name in ("advance_mirostat", "advance_adaptive_p"):
        real = getattr(selectors, name)
        monkeypatch.setattr(selectors, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    sampler = Sampler("cpu")
    x = torch.randn(2, V, generator=torch.Generator().manual_seed(0))
    batch = sampler.new_batch(V)
    batch.add("a", SamplingParams(adaptive_p_target=0.3, seed=1))
    batch.append(sampler.sample(x[:1], batch).token_ids)
    assert calls == ["advance_adaptive_p"]
    fresh = sampler.new_batch(V)
    fresh.add("a", SamplingParams(adaptive_p_target=0.3, seed=1))
    sampler.score(torch.stack([x[:1], x[:1]], dim=1), fresh, torch.tensor([[3, 4]]))
    assert calls == ["advance_adaptive_p"] * 2
    batch.add("m", SamplingParams(mirostat_tau=3.0, seed=2))
    calls.clear()
    batch.append(sampler.sample(x, batch).token_ids)
    assert sorted(calls) == ["advance_adaptive_p", "advance_mirostat"]
    assert batch.sampler_state("m") != [[6.0]] and batch.sampler_state("a") != [[0.0, 0.0]]
