"""How much of a step more torch threads could speed up: the cpu backend against vLLM's sampler.

A harness that leaves torch's default thread count on a machine with many cores times both
samplers with every core. Whatever part of a step runs inside operator calls large enough to
split across intra-op threads (torch splits an elementwise or reduction call over at least its
grain, 32768 elements) can use them; the rest (Python, compiled row kernels, small calls) runs
on one. This script profiles each step on one thread and reports that split and the speedup
it allows at 2, 4 and 8 threads (Amdahl's bound: the large calls assumed to scale perfectly,
so the bound is an upper limit), for corelib's ``cpu`` backend and, when vLLM is installed,
vLLM's sampler on the same logits. The ratio a many-thread harness reads is about the
one-thread ratio times corelib's bound over vLLM's.

    .venv-vllm/bin/python benchmarks/thread_share.py
    .venv-vllm/bin/python benchmarks/thread_share.py --batch-sizes 8,32 --configs 3,4
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import argparse
import math
import time
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from corelib.bench import make_logits

from cpu_vs_vllm import CONFIGS, V, CpuSampler, corelib_batch
from harness import load_vllm, vllm_metadata

#: elements from which torch's CPU kernels split a call across intra-op threads
GRAIN = 32768
THREADS = (2, 4, 8)
WARMUP = 3


def large_call_share(step: Callable[[], object], calls: int) -> tuple[float, float]:
    """(ms per step, the share of that time in top-level operator calls whose largest input
    holds at least ``GRAIN`` elements). Both are wall time (the profiler's clock): on a loaded
    machine both stretch alike."""
    for _ in range(WARMUP):
        step()
    clock = 0.0
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(calls):
            start = time.perf_counter()
            step()
            clock += time.perf_counter() - start
    large = 0.0
    for event in prof.events():
        if event.cpu_parent is not None:
            continue
        sizes = [math.prod(shape) for shape in (event.input_shapes or []) if shape]
        if sizes and max(sizes) >= GRAIN:
            large += event.cpu_time_total / 1e6
    return clock / calls * 1e3, min(large / clock, 1.0)


def bound(share: float, threads: int) -> float:
    return 1.0 / ((1.0 - share) + share / threads)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", default="8,32")
    parser.add_argument("--configs", default="3,4",
                        help="indices of cpu_vs_vllm.py's configurations (default: the seeded ones)")
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    vllm = load_vllm()
    names = list(CONFIGS)
    head = " / ".join(f"{t}" for t in THREADS)
    print(f"V = {V}, one torch thread, {args.calls} profiled steps per cell")
    print(f"| configuration | B | corelib ms | share in large calls | bound at {head} threads "
          f"| vLLM ms | vLLM share | vLLM bound | one-thread ratio | ratio at {head} threads (bound) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for index in (int(i) for i in args.configs.split(",")):
        name = names[index]
        params, seeded = CONFIGS[name]
        for B in (int(b) for b in args.batch_sizes.split(",")):
            logits = make_logits(B, V, "flat")
            sampler = CpuSampler()
            batch = corelib_batch(sampler, params, seeded, B)
            ms, share = large_call_share(lambda: sampler.step(logits, batch), args.calls)
            ours = [bound(share, t) for t in THREADS]
            row = [name, str(B), f"{ms:.2f}", f"{share:.0%}", " / ".join(f"{b:.2f}" for b in ours)]
            if vllm is None:
                print("| " + " | ".join(row + ["-"] * 5) + " |")
                continue
            seeds = [100_003 + i for i in range(B)] if seeded else None
            metadata = vllm_metadata(vllm, B, params, seeds=seeds)
            theirs_sampler = vllm.Sampler()
            spare = [logits.clone() for _ in range(args.calls + WARMUP)]   # vLLM works in place
            v_ms, v_share = large_call_share(lambda: theirs_sampler(spare.pop(), metadata), args.calls)
            theirs = [bound(v_share, t) for t in THREADS]
            ratio = v_ms / ms
            row += [f"{v_ms:.2f}", f"{v_share:.0%}", " / ".join(f"{b:.2f}" for b in theirs),
                    f"{ratio:.1f}x",
                    " / ".join(f"{ratio * o / t:.1f}x" for o, t in zip(ours, theirs))]
            print("| " + " | ".join(row) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
