"""Tests of the benchmarks' shared harness: its summaries, its timing loops, and that the
sort-based baseline keeps and draws what top-k and top-p define.

    .venv/bin/python -m pytest -p no:cacheprovider -q benchmarks/test_harness.py
    .venv-vllm/bin/python -m pytest -p no:cacheprovider -q benchmarks/test_harness.py   # + vLLM's metadata
"""

from __future__ import annotations

import argparse
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402


def test_summary_of_known_values():
    s = harness.Summary.of([4.0, 1.0, 3.0, 2.0, 10.0])
    assert (s.median, s.min, s.max, s.count) == (3.0, 1.0, 10.0, 5)
    # inclusive quartiles of 1, 2, 3, 4, 10: 2 and 4
    assert s.spread == pytest.approx((4.0 - 2.0) / 3.0)
    assert harness.Summary.of([5.0]).spread == 0.0


def test_summary_of_nothing_is_a_value_error():
    with pytest.raises(ValueError, match="values"):
        harness.Summary.of([])


def test_interleaved_takes_turns_after_the_warm_up():
    log = []
    calls = {"a": lambda: log.append("a"), "b": lambda: log.append("b")}
    times = harness.interleaved(calls, repeats=3, warmup=2)
    assert log == ["a", "b"] * 5
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3}
    assert all(t >= 0 for v in times.values() for t in v)


def test_interleaved_rotation_starts_each_round_with_the_next_call():
    log = []
    calls = {n: (lambda n=n: log.append(n)) for n in "abc"}
    harness.interleaved(calls, repeats=4, warmup=1, rotate=True,
                        round_start=lambda r: log.append(r))
    assert log == ["a", "b", "c", 0, "a", "b", "c", 1, "b", "c", "a", 2, "c", "a", "b",
                   3, "a", "b", "c"]


def test_samples_and_timed_call_pass_results_and_arguments():
    seen = []
    assert len(harness.samples(lambda: seen.append(1), repeats=4, warmup=1)) == 4
    assert len(seen) == 5
    ms, out = harness.timed_call(lambda a, b: a + b, 2, 3)
    assert out == 5 and ms >= 0


def test_thread_clock_is_refused_with_several_threads():
    parser = argparse.ArgumentParser()
    harness.add_clock_argument(parser)
    args = parser.parse_args(["--clock", "thread"])
    assert harness.clock_from(args, parser, 1) is harness.CLOCKS["thread"]
    with pytest.raises(SystemExit):
        harness.clock_from(args, parser, 2)


def kept_by_definition(row: torch.Tensor, temperature: float, top_k: int, top_p: float) -> set:
    """The tokens top-k then top-p keep, one by one: rank below k, and the probability mass of
    the tokens ranked before it (after top-k) below p."""
    x = row / temperature if temperature > 0 else row
    order = torch.argsort(x, descending=True, stable=True).tolist()
    if top_k > 0:
        order = order[:top_k]
    probs = torch.softmax(x[order].double(), dim=-1).tolist()
    kept, mass = set(), 0.0
    for token, p in zip(order, probs):
        if mass < top_p:
            kept.add(token)
        mass += p
    return kept


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 50, 0.9), (1.0, 0, 0.5),
                                                      (1.3, 5, 1.0), (0.0, 10, 0.9)])
def test_sort_based_filter_keeps_the_defined_set(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 400, generator=g) * 3
    t, k, p = harness.per_row(6, "cpu", temperature, top_k, top_p)
    out = harness.sort_based_filter(logits, t, k, p)
    ordered, order = harness.sort_based_filter(logits, t, k, p, vocabulary_order=False)
    assert torch.equal(out.gather(1, order), ordered)
    for b in range(6):
        kept = set(torch.nonzero(out[b] > float("-inf")).flatten().tolist())
        assert kept == kept_by_definition(logits[b], temperature, top_k, top_p)


def test_sort_based_sample_greedy_rows_take_the_argmax():
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(3))
    t, k, p = harness.per_row(8, "cpu", 0.0, 0, 1.0)
    assert torch.equal(harness.sort_based_sample(logits, t, k, p), logits.argmax(dim=-1))


def test_sort_based_sample_draws_the_filtered_distribution():
    """200,000 draws from one row of 20 tokens with top-k 8 and top-p 0.9: dropped tokens
    never come, and the kept ones come as often as their renormalised probability says
    (Pearson's chi-square, fixed seeds)."""
    V, draws = 20, 200_000
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(11)) * 1.5
    t, k, p = harness.per_row(draws, "cpu", 0.8, 8, 0.9)
    tokens = harness.sort_based_sample(logits.expand(draws, V).contiguous(), t, k, p,
                                       generator=torch.Generator().manual_seed(12))
    kept = sorted(kept_by_definition(logits[0], 0.8, 8, 0.9))
    counts = torch.bincount(tokens, minlength=V).double()
    assert counts.sum() == draws
    assert counts[[i for i in range(V) if i not in kept]].sum() == 0
    expected = torch.softmax((logits[0] / 0.8)[kept].double(), dim=-1) * draws
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    # the 0.999 quantile of chi-square with len(kept) - 1 <= 7 degrees of freedom is <= 24.4
    assert chi2 < 24.4, (chi2, kept)


def test_vllm_metadata_matches_the_parameters():
    vllm = harness.load_vllm()
    if vllm is None:
        pytest.skip("vLLM is not importable here (the vLLM venv has it)")
    B = 4
    prompts = [[1, 2, 3]] * B
    m = harness.vllm_metadata(vllm, B, dict(top_k=50, top_p=0.9, repetition_penalty=1.1),
                              seeds=[5, 6, 7, 8], prompts=prompts)
    assert m.top_k.tolist() == [50] * B and m.no_penalties is False
    assert m.prompt_token_ids.tolist() == prompts
    assert sorted(m.generators) == list(range(B))
    assert m.generators[2].initial_seed() == 7
    plain = harness.vllm_metadata(vllm, B, dict(temperature=0.7))
    assert plain.top_k is None and plain.no_penalties and plain.generators == {}
    with pytest.raises(ValueError, match="prompts"):
        harness.vllm_metadata(vllm, B, dict(presence_penalty=0.2))


def test_thread_share_counts_only_calls_large_enough_to_split():
    from thread_share import GRAIN, bound, large_call_share

    big = torch.randn(64 * GRAIN)
    small = torch.randn(64)
    _, big_share = large_call_share(lambda: [big.exp() for _ in range(4)], calls=3)
    _, small_share = large_call_share(lambda: [small.exp() for _ in range(200)], calls=3)
    assert big_share > 0.8
    assert small_share < 0.05
    assert bound(0.0, 8) == 1.0 and bound(1.0, 8) == 8.0 and abs(bound(0.5, 2) - 4 / 3) < 1e-12
