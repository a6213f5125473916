"""The bad-input catalogue: each hostile input, its documented outcome (docs/reliability.md),
and proof that the other rows' results and the batch state are unaffected.

Outcomes: bad rows (NaN/+inf logits, every token masked, float32 overflow) are flagged
(``valid`` False, token id -1); bad arguments raise ValueError/TypeError naming the parameter
or request and the value, and leave the batch exactly as it was.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import re

from corelib import Sampler, SamplingParams
from hostile_support import Request, assert_same_snapshot, build_batch, on, snapshot

V = 32
INF, NAN = float("inf"), float("nan")


def mixed_requests():
    """Seeded requests exercising most stages, so 'unaffected' covers every kind of row."""
    return [
        Request("plain", SamplingParams(seed=11)),
        Request("victim", SamplingParams(seed=12, top_p=0.8, logprobs=3)),
        Request("pen", SamplingParams(seed=13, n=2, frequency_penalty=0.5, repetition_penalty=1.3,
                                      logit_bias={4: 3.0}), prompt=[4, 5, 5]),
        Request("masks", SamplingParams(seed=14, bad_words=[[1, 2]], min_tokens=2,
                                        stop_token_ids=[7], top_k=6, logprobs=2),
                outputs=[[1]]),
        Request("greedy", SamplingParams(temperature=0.0, min_p=0.1, logprobs=1)),
    ]


def clean_logits(batch, seed=0):
    return torch.randn(len(batch), batch.vocab_size, generator=torch.Generator().manual_seed(seed)) * 2


class State:
    """Everything observable about a batch, to compare before and after a hostile call."""

    def __init__(self, batch):
        self.rows = batch.rows
        self.counts = batch.generated_counts()
        self.tensors = snapshot(batch, batch.step_state().num_rows)

    def assert_unchanged(self, batch, what):
        assert batch.rows == self.rows, what
        assert batch.generated_counts() == self.counts, what
        assert_same_snapshot(self.tensors, snapshot(batch, len(self.rows)), what)


def assert_rows_match(out, expected, rows, what):
    for row in rows:
        assert int(out.token_ids[row]) == int(expected.token_ids[row]), f"{what}: row {row}"
        if expected.logprobs is not None:
            assert torch.equal(out.logprobs.token_ids[row].cpu(), expected.logprobs.token_ids[row].cpu()), what
            assert torch.allclose(out.logprobs.logprobs[row].cpu(), expected.logprobs.logprobs[row].cpu(),
                                  equal_nan=True), what


# --------------------------------------------------------------------------- bad rows
@pytest.mark.parametrize("mode", ["raw", "processed"])
@pytest.mark.parametrize("poison", ["nan_row", "nan_one", "posinf_one", "neginf_row"])
def test_nonfinite_row_is_flagged_and_other_rows_unchanged(sampler, poison, mode):
    batch = build_batch(sampler, mixed_requests(), V, eos_token_id=0, logprobs_mode=mode)
    logits = clean_logits(batch)
    expected = sampler.sample(on(sampler, logits), batch)
    assert expected.valid.all()
    victim = batch.rows_of("victim")[0]
    bad = logits.clone()
    if poison == "nan_row":
        bad[victim] = NAN
    elif poison == "nan_one":
        bad[victim, 5] = NAN
    elif poison == "posinf_one":
        bad[victim, 5] = INF
    else:
        bad[victim] = -INF
    before = State(batch)
    out = sampler.sample(on(sampler, bad), batch)
    before.assert_unchanged(batch, "sample changed the batch")
    assert out.valid.cpu().tolist() == [row != victim for row in range(len(batch))]
    assert int(out.token_ids[victim]) == -1
    assert_rows_match(out, expected, [r for r in range(len(batch)) if r != victim], poison)
    with pytest.raises(ValueError, match=rf"row {victim} \(request 'victim', child 0\) has no token"):
        out.raise_on_invalid(batch)


def test_minus_inf_entries_are_masks(sampler):
    batch = build_batch(sampler, [Request(f"r{i}", SamplingParams(seed=i)) for i in range(64)], V)
    logits = torch.zeros(64, V)
    logits[:, : V - 2] = -INF                       # only the last two tokens may be drawn
    out = sampler.sample(on(sampler, logits), batch)
    assert out.valid.all()
    assert set(out.token_ids.cpu().tolist()) <= {V - 2, V - 1}


@pytest.mark.parametrize("params,outputs", [
    (SamplingParams(seed=1, allowed_token_ids=[3], bad_words=[[3]]), None),
    (SamplingParams(seed=1, allowed_token_ids=[2, 5], bad_words=[[2, 5], [2, 2]]), [2]),
    (SamplingParams(seed=1, allowed_token_ids=[3, 4], stop_token_ids=[3, 4], min_tokens=2), [9]),
    (SamplingParams(temperature=0.0, allowed_token_ids=[0], min_tokens=1), None),   # eos = 0
], ids=["allowed_vs_bad_word", "allowed_vs_bad_word_prefix", "min_tokens_over_allowed", "greedy_eos"])
def test_row_with_every_token_masked_is_flagged(sampler, params, outputs):
    requests = mixed_requests() + [Request("masked", params, outputs=[outputs] if outputs else [])]
    batch = build_batch(sampler, requests, V, eos_token_id=0)
    clean = build_batch(sampler, mixed_requests(), V, eos_token_id=0)
    logits = clean_logits(batch)
    out = sampler.sample(on(sampler, logits), batch)
    expected = sampler.sample(on(sampler, logits[: len(clean)]), clean)
    row = batch.rows_of("masked")[0]
    assert not bool(out.valid[row]) and int(out.token_ids[row]) == -1
    assert out.valid.sum() == len(batch) - 1
    assert_rows_match(out, expected, range(len(clean)), "other rows")


def test_min_tokens_over_the_allowed_set_clears_once_reached(sampler):
    params = SamplingParams(seed=3, allowed_token_ids=[3, 4], stop_token_ids=[3], min_tokens=2)
    batch = build_batch(sampler, [Request("m", params, outputs=[[9, 9]])], V, eos_token_id=4)
    out = sampler.sample(on(sampler, clean_logits(batch)), batch)
    assert bool(out.valid[0]) and int(out.token_ids[0]) in (3, 4)


@pytest.mark.parametrize("case", ["huge_logits_low_temperature", "huge_logits_top_p",
                                  "subnormal_temperature", "repetition_overflow"])
def test_float32_overflow_is_flagged_never_a_masked_token(sampler, case):
    logits = torch.zeros(1, V)
    logits[0, 1] = logits[0, 2] = 3e38           # finite, but x / 0.5 overflows
    logits[0, 0] = 1.0
    params = {
        "huge_logits_low_temperature": SamplingParams(seed=5, temperature=0.5, allowed_token_ids=[0, 1, 2]),
        "huge_logits_top_p": SamplingParams(seed=5, temperature=0.5, top_p=0.9, allowed_token_ids=[1, 2]),
        "subnormal_temperature": SamplingParams(seed=5, temperature=1e-39, allowed_token_ids=[1, 2, 3]),
        "repetition_overflow": SamplingParams(temperature=0.0, repetition_penalty=0.5),
    }[case]
    if case == "subnormal_temperature":
        logits = torch.zeros(1, V)
        logits[0, 1], logits[0, 2] = 1.0, 2.0          # 1 / 1e-39 and 2 / 1e-39 are both +inf
    batch = build_batch(sampler, [Request("o", params, prompt=[1])], V)
    out = sampler.sample(on(sampler, logits), batch)
    token, valid = int(out.token_ids[0]), bool(out.valid[0])
    # A backend that computes these rows exactly may return a token; it must be a right one.
    right = {"huge_logits_low_temperature": {1, 2}, "huge_logits_top_p": {1, 2},
             "subnormal_temperature": {2}, "repetition_overflow": {1}}[case]
    assert (not valid and token == -1) or token in right, (token, valid)
    if sampler.name == "reference":               # the reference flags them (docs/reliability.md)
        assert not valid


def test_small_but_normal_temperature_is_argmax_not_flagged(sampler):
    logits = torch.zeros(1, V)
    logits[0, 1], logits[0, 2] = 1.0, 2.0
    batch = build_batch(sampler, [Request("t", SamplingParams(temperature=1e-3, seed=1))], V)
    out = sampler.sample(on(sampler, logits), batch)
    assert bool(out.valid[0]) and int(out.token_ids[0]) == 2


def test_step_with_a_flagged_row_records_no_token_for_it(sampler):
    """step = sample + append. A flagged row's -1 is "no token this step" on every device: the
    step goes through, the row's state stays as it was, and every other row moves on. A request
    the engine then removes leaves the survivors with the state of an uninterrupted run."""
    batch = build_batch(sampler, mixed_requests(), V, eos_token_id=0)
    logits = clean_logits(batch)
    victim = batch.rows_of("victim")[0]
    logits[victim] = NAN
    before, rows = batch.generated_counts(), batch.rows
    out = sampler.step(on(sampler, logits), batch)
    assert int(out.token_ids[victim]) == -1
    after = batch.generated_counts()
    assert after[victim] == before[victim]
    assert all(a == b + 1 for row, (a, b) in enumerate(zip(after, before)) if row != victim)
    batch.remove("victim")
    survivors = [r for r in mixed_requests() if r.request_id != "victim"]
    tokens = dict(zip(rows, out.token_ids.cpu().tolist()))
    for r in survivors:
        r.outputs = [o + [tokens[(r.request_id, c)]] for c, o in enumerate(r.outputs)]
    rebuilt = build_batch(sampler, survivors, V, eos_token_id=0)
    table = {key: row for key, row in zip(rebuilt.rows, clean_logits(rebuilt, seed=3))}
    mine = sampler.sample(on(sampler, torch.stack([table[k] for k in batch.rows])), batch)
    theirs = sampler.sample(on(sampler, torch.stack([table[k] for k in rebuilt.rows])), rebuilt)
    assert dict(zip(batch.rows, mine.token_ids.cpu().tolist())) == \
        dict(zip(rebuilt.rows, theirs.token_ids.cpu().tolist()))


# --------------------------------------------------------------------------- bad logits
@pytest.mark.parametrize("make,error,fragment", [
    (lambda b: torch.zeros(V), ValueError, r"must be 2-D \[rows, vocab\], got shape \[32\]"),
    (lambda b: torch.zeros(1, len(b), V), ValueError, "must be 2-D"),
    (lambda b: torch.zeros(len(b) + 1, V), ValueError, "logits have 7 rows; the batch has 6 rows"),
    (lambda b: torch.zeros(len(b), V + 1), ValueError, "vocab size 33 but the batch was created with vocab_size=32"),
    (lambda b: torch.zeros(len(b), V - 1), ValueError, "vocab size 31"),
    (lambda b: torch.zeros(len(b), V, dtype=torch.int64), TypeError, "floating-point tensor .* got torch.int64"),
    (lambda b: torch.zeros(len(b), V, dtype=torch.int32), TypeError, "got torch.int32"),
    (lambda b: torch.zeros(len(b), V, dtype=torch.bool), TypeError, "got torch.bool"),
    (lambda b: torch.zeros(len(b), V, dtype=torch.complex64), TypeError, "got torch.complex64"),
    (lambda b: np.zeros((len(b), V), dtype=np.float32), TypeError, "must be a torch.Tensor, got ndarray"),
    (lambda b: [[0.0] * V] * len(b), TypeError, "must be a torch.Tensor, got list"),
    (lambda b: torch.zeros(len(b), V, device="meta"), ValueError, "logits are on meta but this batch lives on"),
], ids=["1d", "3d", "rows", "vocab_plus", "vocab_minus", "int64", "int32", "bool", "complex",
        "numpy", "list", "meta_device"])
def test_bad_logits_raise_naming_the_problem(sampler, make, error, fragment):
    batch = build_batch(sampler, mixed_requests(), V)
    before = State(batch)
    logits = make(batch)
    if isinstance(logits, torch.Tensor) and logits.device.type != "meta":
        logits = on(sampler, logits)
    with pytest.raises(error, match=fragment):
        sampler.sample(logits, batch)
    with pytest.raises(error, match=fragment):
        sampler.step(logits, batch)
    before.assert_unchanged(batch, "a rejected call changed the batch")


def test_batch_from_another_device_is_rejected(sampler):
    foreign = Sampler("meta").new_batch(V)
    foreign.add("a", SamplingParams())
    with pytest.raises(ValueError, match="meta"):
        sampler.sample(on(sampler, torch.zeros(1, V)), foreign)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_other_float_dtypes_give_the_float32_result(sampler, dtype):
    batch = build_batch(sampler, mixed_requests(), V, eos_token_id=0)
    # Multiples of 1/4 in [-8, 8] are exact in every one of these dtypes.
    logits = (clean_logits(batch) * 2).round().clamp(-32, 32) / 4
    expected = sampler.sample(on(sampler, logits), batch)
    out = sampler.sample(on(sampler, logits.to(dtype)), batch)
    assert_rows_match(out, expected, range(len(batch)), str(dtype))


@pytest.mark.parametrize("dtype,value", [(torch.float64, 1e300), (torch.float64, -1e300),
                                         (torch.float16, INF), (torch.bfloat16, NAN)])
def test_values_outside_float32_follow_the_float32_rules(sampler, dtype, value):
    """Logits are sampled in float32: float64 beyond its range becomes +/-inf there (+inf: the
    row is flagged; -inf: the token is masked)."""
    batch = build_batch(sampler, [Request("a", SamplingParams(seed=1)), Request("b", SamplingParams(seed=2))], V)
    logits = torch.zeros(2, V, dtype=dtype)
    logits[0, 3] = value
    out = sampler.sample(on(sampler, logits), batch)
    if value == -1e300:
        assert out.valid.all() and int(out.token_ids[0]) != 3
    else:
        assert out.valid.cpu().tolist() == [False, True] and int(out.token_ids[0]) == -1


@pytest.mark.parametrize("layout", ["transposed", "strided", "expanded", "offset_view"])
def test_non_contiguous_logits_sample_like_a_contiguous_copy(sampler, layout):
    batch = build_batch(sampler, mixed_requests(), V, eos_token_id=0)
    B = len(batch)
    base = on(sampler, clean_logits(batch))         # views are made on the sampler's device
    if layout == "transposed":
        logits = base.t().contiguous().t()
    elif layout == "strided":
        wide = torch.zeros(B, 2 * V, device=base.device)
        wide[:, ::2] = base
        logits = wide[:, ::2]
    elif layout == "expanded":
        base = base[:1].expand(B, V).contiguous()
        logits = base[:1].expand(B, V)
    else:
        big = torch.randn(B + 3, V + 5, device=base.device)
        big[2: 2 + B, 3: 3 + V] = base
        logits = big[2: 2 + B, 3: 3 + V]
    assert not logits.is_contiguous() and torch.equal(logits, base)
    before = logits.clone()
    out = sampler.sample(logits, batch)
    expected = sampler.sample(base.contiguous(), batch)
    assert_rows_match(out, expected, range(B), layout)
    assert torch.equal(logits, before), "the caller's view was modified"


# --------------------------------------------------------------------------- sizes
def test_empty_batch_samples_nothing(sampler):
    batch = sampler.new_batch(V)
    for step in range(2):
        out = sampler.step(on(sampler, torch.zeros(0, V)), batch)
        assert out.token_ids.shape == (0,) and out.valid.shape == (0,) and out.logprobs is None
        out.raise_on_invalid(batch)
        # Emptied again after requests that allocated every optional tensor.
        batch.add("x", SamplingParams(n=2, logprobs=3, frequency_penalty=1.0, bad_words=[[1, 2]],
                                      logit_bias={1: 1.0}, allowed_token_ids=[1, 2], min_tokens=1))
        batch.remove("x")
    with pytest.raises(ValueError, match="logits have 1 rows; the batch has 0 rows"):
        sampler.sample(on(sampler, torch.zeros(1, V)), batch)


def test_huge_n_is_rejected_before_anything_is_built(sampler):
    batch = build_batch(sampler, mixed_requests(), V)
    before = State(batch)
    with pytest.raises(ValueError, match=r"request 'huge': n=2147483648 does not fit"):
        batch.add("huge", SamplingParams(n=2**31, seed=1))
    with pytest.raises(ValueError, match=r"n=1099511627776 does not fit"):
        batch.add("huge", SamplingParams(n=2**40))
    before.assert_unchanged(batch, "a rejected add changed the batch")


def test_large_n_works_and_children_draw_distinct_streams(sampler):
    batch = build_batch(sampler, [Request("many", SamplingParams(n=3000, seed=9))], 8)
    logits = on(sampler, torch.zeros(1, 8))        # one row per request serves every child
    out = sampler.sample(logits, batch)
    counts = torch.bincount(out.token_ids.cpu(), minlength=8)
    assert out.valid.all() and counts.min() > 300, counts   # uniform: 375 expected per token


@pytest.mark.parametrize("case", ["new_vocab_wide_tensor", "growing_existing_tensors"])
def test_allocation_failure_leaves_the_batch_usable(sampler, case):
    """A request whose tensors cannot be allocated raises the allocator's error (RuntimeError /
    torch.OutOfMemoryError / MemoryError); the batch keeps its old tensors and grows normally
    afterwards. Both sizes asked for are over a terabyte, so they fail at once everywhere."""
    if case == "new_vocab_wide_tensor":
        # 32 rows x 2**33 bools for the penalties' prompt mask.
        vocab, first = 2**33, SamplingParams(seed=1)
        big = SamplingParams(n=20, seed=2, frequency_penalty=0.5)
    else:
        # A first request's penalties allocate [capacity, 2**20] tensors; growing them to
        # 2**20 rows needs a terabyte, after the per-row scalars have already grown.
        vocab = 2**20
        first = SamplingParams(seed=1, frequency_penalty=0.5)
        big = SamplingParams(n=2**20 - 8, seed=2)
    batch = sampler.new_batch(vocab)
    batch.add("a", first)
    before = State(batch)
    try:
        batch.add("big", big)
    except (RuntimeError, MemoryError):
        before.assert_unchanged(batch, "a failed allocation changed the batch")
    else:  # a backend whose batch keeps this state sparsely may manage it: then it is there
        assert len(batch.rows_of("big")) == big.n
        batch.remove("big")
    for i in range(12):                             # capacity grows 8 -> 16 past the failure
        batch.add(f"r{i}", SamplingParams(seed=100 + i))
    s = batch.step_state()
    assert s.seed_lo.cpu().tolist() == [1] + [100 + i for i in range(12)]
    assert s.position.cpu().tolist() == [0] * 13


def test_huge_logit_bias_dict_equals_a_dense_bias(sampler):
    vocab = 4096
    gen = torch.Generator().manual_seed(4)
    dense = (torch.rand(vocab, generator=gen) * 200 - 100).clamp(-100, 100)
    huge = SamplingParams(temperature=0.0, logit_bias={t: float(dense[t]) for t in range(vocab)})
    batch = sampler.new_batch(vocab)
    batch.add("small", SamplingParams(temperature=0.0, logit_bias={5: 2.0}))
    batch.add("huge", huge)
    logits = torch.randn(2, vocab, generator=gen)
    processed = sampler.processed_logits(on(sampler, logits), batch).cpu()
    assert torch.allclose(processed[1], logits[1] + dense.float(), atol=1e-4)
    assert processed[0, 5] == logits[0, 5] + 2.0 and torch.equal(processed[0, 6:], logits[0, 6:])
    batch.remove("huge")
    batch.add("after", SamplingParams(temperature=0.0, logit_bias={7: -3.0}))
    processed = sampler.processed_logits(on(sampler, logits), batch).cpu()
    assert processed[1, 7] == logits[1, 7] - 3.0 and torch.equal(processed[1, 8:], logits[1, 8:])


@pytest.mark.parametrize("field,value", [("top_k", 2**40), ("min_tokens", 2**70)])
def test_int_parameters_beyond_int32_keep_their_meaning(sampler, field, value):
    logits = clean_logits(build_batch(sampler, [Request("x", SamplingParams())], V))
    extra = {"stop_token_ids": [3]} if field == "min_tokens" else {}
    huge = build_batch(sampler, [Request("x", SamplingParams(seed=1, **{field: value}, **extra))], V)
    equivalent = {"top_k": 0, "min_tokens": 2**31 - 1}[field]
    same = build_batch(sampler, [Request("x", SamplingParams(seed=1, **{field: equivalent}, **extra))], V)
    a = sampler.processed_logits(on(sampler, logits), huge)
    b = sampler.processed_logits(on(sampler, logits), same)
    assert torch.equal(torch.isfinite(a), torch.isfinite(b))
    assert int(sampler.sample(on(sampler, logits), huge).token_ids[0]) == \
        int(sampler.sample(on(sampler, logits), same).token_ids[0])


# --------------------------------------------------------------------------- bad arguments
def test_duplicate_request_id_is_rejected_and_changes_nothing(sampler):
    batch = build_batch(sampler, mixed_requests(), V)
    before = State(batch)
    with pytest.raises(ValueError, match="request 'pen' is already in the batch"):
        batch.add("pen", SamplingParams(n=3))
    before.assert_unchanged(batch, "duplicate add")


@pytest.mark.parametrize("call", ["remove", "params_of", "rows_of"])
def test_unknown_request_id_is_a_value_error_and_a_key_error(sampler, call):
    batch = build_batch(sampler, mixed_requests(), V)
    before = State(batch)
    with pytest.raises(ValueError, match="request 'ghost' is not in the batch") as err:
        getattr(batch, call)("ghost")
    assert isinstance(err.value, KeyError)
    before.assert_unchanged(batch, call)


@pytest.mark.parametrize("request_id,params,error,fragment", [
    (5, SamplingParams(), TypeError, "request_id must be a non-empty str, got 5"),
    ("", SamplingParams(), TypeError, "request_id must be a non-empty str"),
    ("x", {"n": 1}, TypeError, "params of request 'x' must be corelib.SamplingParams, got dict"),
])
def test_bad_request_arguments(sampler, request_id, params, error, fragment):
    batch = build_batch(sampler, mixed_requests(), V)
    before = State(batch)
    with pytest.raises(error, match=fragment):
        batch.add(request_id, params)
    before.assert_unchanged(batch, "bad add")


@pytest.mark.parametrize("ids,error,fragment", [
    ([1, 2], ValueError, r"expected shape \[6\] .*got \[2\]"),
    ([[[1]]] * 6, ValueError, r"expected shape \[6\] .*got \[6, 1, 1\]"),
    ([[1, 2]] * 5, ValueError, r"expected shape \[6\] .*got \[5, 2\]"),
    ([[1, -1, 2]] * 6, ValueError, r"row 0 \(request 'plain'\) has a token after -1 padding"),
    ([[1, -2]] * 6, ValueError, r"token id -2 at row 0, slot 1 \(request 'plain'\) is out of range"),
    ([1.0] * 6, TypeError, "integer token ids, got dtype torch.float32"),
    ([True] * 6, TypeError, "integer token ids, got dtype torch.bool"),
    (None, TypeError, "append needs one integer token id per row, got NoneType"),
    (["a"] * 6, ValueError, "append needs one integer token id per row, got list"),
    ([2**70] * 6, ValueError, "append needs one integer token id per row"),
    ([1, 2, 3, 4, 5, 32], ValueError, r"token id 32 for row 5 \(request 'greedy'\) is out of range"),
    ([1, -2, 3, 4, 5, 6], ValueError, r"token id -2 for row 1 \(request 'victim'\)"),
], ids=["too_few", "3d", "2d_too_few", "2d_gap", "2d_minus_two", "floats", "bools", "none", "strings", "past_int64", "id_too_big", "minus_two"])
def test_append_of_the_wrong_tokens_raises_and_records_nothing(sampler, ids, error, fragment):
    batch = build_batch(sampler, mixed_requests(), V)
    before = State(batch)
    with pytest.raises(error, match=fragment):
        batch.append(ids)
    before.assert_unchanged(batch, "a rejected append changed the batch")


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(prompt_token_ids=[1, 32]), "prompt_token_ids holds token id 32"),
    (dict(prompt_token_ids=[-3]), "prompt_token_ids holds token id -3"),
    (dict(prompt_token_ids=[2**70]), "prompt_token_ids holds token id 1180591620717411303424"),
    (dict(output_token_ids=[5, 40]), "output_token_ids holds token id 40"),
    (dict(params=SamplingParams(n=2), output_token_ids=[[1], [99]]), r"output_token_ids\[1\] holds token id 99"),
    (dict(params=SamplingParams(logit_bias={32: 1.0})), "token id 32 in its parameters is out of range"),
    (dict(params=SamplingParams(stop_token_ids=[1000])), "token id 1000 in its parameters"),
    (dict(params=SamplingParams(allowed_token_ids=[0, 33])), "token id 33 in its parameters"),
    (dict(params=SamplingParams(bad_words=[[1, 2], [3, 64]])), "token id 64 in its parameters"),
], ids=["prompt", "prompt_negative", "prompt_past_int64", "output", "output_child", "bias",
        "stop", "allowed", "bad_words"])
def test_out_of_range_token_ids_name_the_request_and_change_nothing(sampler, kwargs, fragment):
    batch = build_batch(sampler, mixed_requests(), V)
    before = State(batch)
    kwargs = dict(kwargs)                           # the parametrized dict is shared
    params = kwargs.pop("params", SamplingParams())
    with pytest.raises(ValueError, match="request 'bad'") as err:
        batch.add("bad", params, **kwargs)
    assert re.search(fragment, str(err.value)), str(err.value)
    assert "vocab_size=32" in str(err.value)
    before.assert_unchanged(batch, "a rejected add changed the batch")
    expected = build_batch(sampler, mixed_requests(), V)
    logits = clean_logits(batch)
    assert_rows_match(sampler.sample(on(sampler, logits), batch),
                      sampler.sample(on(sampler, logits), expected), range(len(batch)), "after")


@pytest.mark.parametrize("field,value", [
    ("logit_bias", {-1: 1.0}), ("stop_token_ids", [-2]), ("allowed_token_ids", [-1]),
    ("bad_words", [[1, -5]]), ("logit_bias", {3: float("nan")}), ("logit_bias", {3: 101.0}),
    ("temperature", float("inf")), ("top_p", float("nan")), ("n", 0), ("seed", -1),
])
def test_negative_ids_and_non_finite_values_fail_at_the_parameters(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


# --------------------------------------------------------------------------- engine features
WORDS = (V + 31) // 32


@pytest.mark.parametrize("mask,error,fragment", [
    (lambda: torch.full((6, WORDS), -1.0), ValueError, "token_bitmask must be int32"),
    (lambda: torch.full((6, WORDS), -1, dtype=torch.uint8), ValueError, "token_bitmask must be int32"),
    (lambda: torch.full((5, WORDS), -1, dtype=torch.int32), ValueError, r"token_bitmask must be \[6, 1\]"),
    (lambda: torch.full((6, WORDS + 2), -1, dtype=torch.int32), ValueError, r"got \[6, 3\]"),
    (lambda: [[-1]] * 6, TypeError, "token_bitmask must be an int32 torch.Tensor"),
    (lambda: np.full((6, WORDS), -1, dtype=np.int32), TypeError, "got ndarray"),
], ids=["float", "uint8", "rows", "width", "list", "numpy"])
def test_bad_bitmasks_raise_and_change_nothing(sampler, mask, error, fragment):
    batch = build_batch(sampler, mixed_requests(), V)
    before = State(batch)
    bad = mask()
    with pytest.raises(error, match=fragment):
        sampler.sample(on(sampler, clean_logits(batch)), batch,
                       token_bitmask=on(sampler, bad) if isinstance(bad, torch.Tensor) else bad)
    before.assert_unchanged(batch, "a rejected token_bitmask changed the batch")


def test_an_all_zero_bitmask_row_is_flagged_and_other_rows_unchanged(sampler):
    batch = build_batch(sampler, mixed_requests(), V)
    logits = clean_logits(batch, seed=3)
    mask = torch.full((6, WORDS), -1, dtype=torch.int32)
    mask[1] = 0                                        # 'victim' has no token left
    got = sampler.sample(on(sampler, logits), batch, token_bitmask=on(sampler, mask))
    want = sampler.sample(on(sampler, logits), build_batch(sampler, mixed_requests(), V))
    assert got.valid.cpu().tolist() == [True, False, True, True, True, True]
    assert int(got.token_ids[1]) == -1
    assert_rows_match(got, want, [0, 2, 3, 4, 5], "an all-zero mask row changed other rows")


def verify_args(batch, K=2):
    B = len(batch)
    logits = torch.randn((B, K + 1, V), generator=torch.Generator().manual_seed(1))
    drafts = torch.randint(0, V, (B, K), generator=torch.Generator().manual_seed(2))
    probs = torch.softmax(torch.randn((B, K, V), generator=torch.Generator().manual_seed(3)), -1)
    return logits, drafts, probs


@pytest.mark.parametrize("change,error,fragment", [
    (lambda l, d, p: (l[:, 0], d, p), ValueError, "logits must be \\[rows, K \\+ 1, vocab\\]"),
    (lambda l, d, p: (l[:5], d[:5], p[:5]), ValueError, "logits have 5 rows; the batch has 6"),
    (lambda l, d, p: (l, d[:, :1], p), ValueError, "draft_token_ids must be \\[rows, K\\] = \\[6, 2\\]"),
    (lambda l, d, p: (l, d.float(), p), ValueError, "draft_token_ids must hold integer ids"),
    (lambda l, d, p: (l, d, p[:, :1]), ValueError, "draft_probs must be \\[rows, K, vocab\\]"),
    (lambda l, d, p: (l, d, p.to(torch.int32)), ValueError, "draft_probs must be a float tensor"),
    (lambda l, d, p: (l, torch.full_like(d, V), p), ValueError, "out of range for vocab_size=32"),
    (lambda l, d, p: (l, torch.tensor([[-1, 3]] * 6), p), ValueError, "draft after -1 padding"),
    (lambda l, d, p: (l.int(), d, p), TypeError, "floating-point"),
    (lambda l, d, p: (l, "drafts", p), TypeError, "draft_token_ids must be a tensor"),
], ids=["logits_2d", "rows", "k", "float_ids", "probs_shape", "int_probs", "id_range", "gap",
        "int_logits", "string"])
def test_bad_verify_arguments_raise_and_change_nothing(sampler, change, error, fragment):
    batch = build_batch(sampler, mixed_requests(), V)
    before = State(batch)
    logits, drafts, probs = change(*verify_args(batch))
    logits, drafts, probs = [on(sampler, t) if isinstance(t, torch.Tensor) else t
                             for t in (logits, drafts, probs)]
    with pytest.raises(error, match=fragment):
        sampler.verify(logits, batch, drafts, probs)
    before.assert_unchanged(batch, "a rejected verify call changed the batch")


def test_bad_draft_numbers_flag_their_row_only(sampler):
    batch = build_batch(sampler, mixed_requests(), V)
    logits, drafts, probs = verify_args(batch)
    clean = sampler.verify(on(sampler, logits), build_batch(sampler, mixed_requests(), V),
                           on(sampler, drafts), on(sampler, probs))
    bad = probs.clone()
    bad[1, 0, 5] = NAN
    bad[3, 1, 2] = -1.0
    got = sampler.verify(on(sampler, logits), batch, on(sampler, drafts), on(sampler, bad))
    assert got.valid.cpu().tolist() == [True, False, True, False, True, True]
    assert got.num_emitted.cpu().tolist()[1] == 0 and got.num_emitted.cpu().tolist()[3] == 0
    for row in (0, 2, 4, 5):
        params = batch.params_of(batch.rows[row][0])
        if params.seed is not None or params.temperature == 0.0:
            assert got.token_ids[row].tolist() == clean.token_ids[row].tolist(), f"row {row}"
