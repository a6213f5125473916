"""The step timing the tpu benchmarks share: ``sample`` + ``append`` of every case once per
round, in turn, on one warm process, reported as medians and ratios against a base case (the
machine's load moves the cases together, so the ratios are what to read)."""

from __future__ import annotations

import statistics
import time


def paired_steps(cases: dict, logits: list, rounds: int, samplers) -> tuple[dict, int]:
    """Time ``cases`` (name -> (sampler, batch)) over ``rounds`` rounds, logits ``logits[r %
    len(logits)]`` in round r, after two untimed steps each (anything left to compile).
    Returns (name -> seconds per round, graphs the ``samplers`` compiled after warm-up)."""
    import torch_xla
    times: dict = {name: [] for name in cases}
    for _ in range(2):
        for sampler, batch in cases.values():
            batch.append(sampler.sample(logits[0], batch).token_ids)
    compiled = sum(s.guard.compiled_after_warmup for s in samplers)
    for r in range(rounds):
        for name, (sampler, batch) in cases.items():
            t0 = time.perf_counter()
            out = sampler.sample(logits[r % len(logits)], batch)
            batch.append(out.token_ids)
            torch_xla.sync()
            times[name].append(time.perf_counter() - t0)
    return times, compiled


def report(times: dict, base: str, rounds: int, compiled: int) -> None:
    """Print each case's median, its ratio to ``base``'s, and the spread."""
    reference = statistics.median(times[base])
    print(f"  step (sample + append), median of {rounds} paired rounds; "
          f"graphs compiled after warm-up: {compiled}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:26s} {med * 1e3:8.2f} ms  {med / reference:5.2f}x  "
              f"(min {min(ts) * 1e3:.2f}, max {max(ts) * 1e3:.2f})")
