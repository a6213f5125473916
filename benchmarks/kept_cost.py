"""What ``return_kept`` costs on the cpu backend: "how much slower is my step when every row
asks for its kept set?"

Per configuration, the same step (``CpuSampler.sample`` on ``[B, V]`` logits, every row
random) on a batch whose requests do not ask for their kept sets and on one whose requests
do, with two yardsticks of one pass over the logits (``x.clone()``: read and write 4 B V
bytes; ``torch.isfinite(x)``: read 4 B V, write B V), all timed in one interleaved run so the
machine's load moves them together. ``extra/clone`` is (with - without) / clone: the kept
set's cost in passes over the logits (issue 34's target: at most 1). ``logprobs`` is the same
step asking instead for the drawn token's processed logprob (``logprobs=0``, mode
``processed``), which reads the same final distribution.

    python benchmarks/kept_cost.py                                  # B = 32, V = 128256
    python benchmarks/kept_cost.py --batch-sizes 1,32,256 --repeats 15 --clock thread
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from corelib import SamplingParams
from corelib.bench import make_logits

from corelib_cpu.sampler import CpuSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import add_run_arguments, interleaved, load_average, medians, run_settings  # noqa: E402

#: The steps measured: the common filter stacks, plain sampling and greedy.
CONFIGS = {
    "top_k_top_p_T": dict(top_k=50, top_p=0.9, temperature=0.8),
    "min_p_T": dict(min_p=0.05, temperature=0.8),
    "top_p": dict(top_p=0.9),
    "random": dict(),
    "greedy": dict(temperature=0.0),
}


def batch_of(sampler: CpuSampler, V: int, B: int, params: dict, seeded: bool, kept: bool,
             logprobs: bool = False):
    batch = sampler.new_batch(V, eos_token_id=2, logprobs_mode="processed" if logprobs else "raw")
    for i in range(B):
        seed = {"seed": 100 + i} if seeded and params.get("temperature", 1.0) != 0.0 else {}
        asked = {"logprobs": 0} if logprobs else {}
        batch.add(f"r{i}", SamplingParams(**params, **seed, **asked, return_kept=kept),
                  prompt_token_ids=[1, 2, 3], output_token_ids=[4, 5])
    return batch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="32")
    parser.add_argument("--vocab-size", type=int, default=128256)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--profile", default="peaked", choices=["flat", "peaked"])
    parser.add_argument("--seeded", default="no,yes", help="unseeded and/or seeded rows")
    add_run_arguments(parser, 11)
    args = parser.parse_args(argv)
    clock = run_settings(args, parser)
    V = args.vocab_size
    print(f"return_kept on the cpu backend, V = {V}, {args.profile} logits, {args.threads} "
          f"thread(s), {args.clock} clock, medians of {args.repeats} rounds, load average "
          f"{load_average():.2f} at start")
    print(f"{'config':14s} {'seeded':6s} {'B':>4s} {'without':>9s} {'with':>9s} {'clone':>8s} "
          f"{'isfinite':>8s} {'extra ms':>8s} {'extra/clone':>11s} {'logprobs':>9s}")
    for B in map(int, args.batch_sizes.split(",")):
        logits = make_logits(B, V, args.profile)
        for config in args.configs.split(","):
            for seeded in (s == "yes" for s in args.seeded.split(",")):
                if seeded and config == "greedy":
                    continue
                sampler = CpuSampler()
                plain = batch_of(sampler, V, B, CONFIGS[config], seeded, kept=False)
                asking = batch_of(sampler, V, B, CONFIGS[config], seeded, kept=True)
                logprobs = batch_of(sampler, V, B, CONFIGS[config], seeded, kept=False, logprobs=True)
                a, b = sampler.sample(logits, plain), sampler.sample(logits, asking)
                if seeded and not torch.equal(a.token_ids, b.token_ids):
                    raise SystemExit(f"{config}: return_kept changed a seeded token")
                m = medians(interleaved({
                    "without": lambda: sampler.sample(logits, plain),
                    "with": lambda: sampler.sample(logits, asking),
                    "logprobs": lambda: sampler.sample(logits, logprobs),
                    "clone": lambda: logits.clone(),
                    "isfinite": lambda: torch.isfinite(logits),
                }, args.repeats, warmup=1, clock=clock))
                extra = m["with"] - m["without"]
                print(f"{config:14s} {'yes' if seeded else 'no':6s} {B:4d} {m['without']:9.3f} "
                      f"{m['with']:9.3f} {m['clone']:8.3f} {m['isfinite']:8.3f} {extra:8.3f} "
                      f"{extra / m['clone']:11.2f} {m['logprobs']:9.3f}", flush=True)
        mb = B * V * 4 / 1e6
        print(f"(B = {B}: the logits are {mb:.1f} MB; a clone moves {2 * mb:.1f} MB)")
    print(f"load average {load_average():.2f} at end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
