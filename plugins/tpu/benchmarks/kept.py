"""What kept sets and ``score`` cost on the tpu backend (docs/benchmarks-tpu.md, "Fourth
release: kept sets and score"): step time (``sample`` + ``append``) paired in rounds on one
warm process, as ratios against the same step on a sampler whose graphs do not trace the kept
sets at all (the graphs of the release before); then ``score`` over T positions of every row
in one call against T single-position calls with ``append`` between.

    PJRT_DEVICE=CPU .venv-xla/bin/python plugins/tpu/benchmarks/kept.py --vocab 32000 --rows 8 32

Cases per row count (every row random, seeded, top-k 40, top-p 0.9, temperature 0.8):
``no kept traced``: a sampler whose step state turns the kept sets off, so its graphs are the
previous release's; ``kept traced, none asks``: this backend's graph, no row asks (the
conditional's predicate and a zero ``[B, W]`` output); ``every row asks``: the kept sets
computed in the graph and read back with the step's results (one transfer of both).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch
from corelib import SamplingParams

from corelib_tpu.sampler import TpuSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from paired import paired_steps, report  # noqa: E402

BASE = dict(top_k=40, top_p=0.9, temperature=0.8)


class _WithoutKept(TpuSampler):
    """The baseline: graphs that do not trace the kept sets."""

    def step_state(self, logits, batch):
        return dataclasses.replace(super().step_state(logits, batch), any_kept=False)


def _batch(sampler: TpuSampler, rows: int, vocab: int, kept: bool):
    batch = sampler.new_batch(vocab)
    for i in range(rows):
        batch.add(f"r{i}", SamplingParams(seed=i, return_kept=kept, **BASE))
    return batch


def _steps(args, device, rows: int, V: int) -> None:
    plain = _WithoutKept(device, buckets=(rows,), max_rows=rows)
    r_plain = plain.warmup(V, selectors=False)
    traced = TpuSampler(device, buckets=(rows,), max_rows=rows)
    r_traced = traced.warmup(V, selectors=False)
    print(f"== V {V}, bucket {rows}: warm-up graphs / seconds")
    for name, r in (("no kept traced", r_plain), ("kept traced", r_traced)):
        print(f"  {name:26s} {r.graphs:4d} graphs {r.seconds:7.1f} s")
    cases = {
        "no kept traced": (plain, _batch(plain, rows, V, False)),
        "kept traced, none asks": (traced, _batch(traced, rows, V, False)),
        "every row asks": (traced, _batch(traced, rows, V, True)),
    }
    gen = torch.Generator().manual_seed(0)
    logits = [(torch.randn((rows, V), generator=gen) * 3).to(device) for _ in range(4)]
    times, compiled = paired_steps(cases, logits, args.rounds, (plain, traced))
    report(times, "no kept traced", args.rounds, compiled)

def _score(args, device, V: int) -> None:
    """One sequence (bucket 8), T positions: one call against T calls of one position."""
    import torch_xla
    T = args.positions
    sampler = TpuSampler(device, buckets=(8,), max_rows=8)
    report = sampler.warmup(V, selectors=False, score_positions=(1, T))
    print(f"== score, V {V}, 1 row (bucket 8), T {T}: warm-up {report.graphs} graphs "
          f"{report.seconds:.1f} s, score graphs {report.step_graphs.get(('score', 8, T))}")
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn((1, T, V), generator=gen) * 3).to(device)
    tokens = torch.randint(0, V, (1, T), generator=gen)
    steps = [logits[:, t].clone() for t in range(T)]
    torch_xla.sync()
    times: dict = {"one call": [], "T calls": []}
    for _ in range(args.score_rounds + 1):
        batch = sampler.new_batch(V)
        batch.add("r", SamplingParams(seed=3, **BASE))
        t0 = time.perf_counter()
        sampler.score(logits, batch, tokens)
        times["one call"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for t in range(T):
            sampler.score(steps[t], batch, tokens[:, t])
            batch.append(tokens[:, t])
        torch_xla.sync()
        times["T calls"].append(time.perf_counter() - t0)
    one, many = (statistics.median(times[k][1:]) for k in ("one call", "T calls"))
    print(f"  median of {args.score_rounds} rounds (the first left out): one call "
          f"{one * 1e3:.1f} ms, {T} calls {many * 1e3:.1f} ms ({many / one:.1f}x the one call); "
          f"graphs compiled after warm-up: {sampler.guard.compiled_after_warmup}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rows", type=int, nargs="*", default=[8, 32])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--positions", type=int, default=64, help="score's T (0: skip score)")
    parser.add_argument("--score-rounds", type=int, default=3)
    args = parser.parse_args()
    import torch_xla
    device = torch_xla.device()
    for rows in args.rows:
        _steps(args, device, rows, args.vocab)
    if args.positions:
        _score(args, device, args.vocab)


if __name__ == "__main__":
    main()
