"""The filter group in one conditional (``FilterStages.run_group``) against the two
conditionals around the route of steps 11-13 that buckets below ``GROUP_CONDITIONAL_MIN_ROWS``
keep, in one process on the same plugin: each structure built twice, so the two pairs of
the same code show the measurement's own spread (an A/A pair).

    PJRT_DEVICE=CPU .venv-xla/bin/python plugins/tpu/benchmarks/group_conditional.py --rows 1 8 16 32 64 \
        [--group-from 1]

``--group-from N`` sets ``GROUP_CONDITIONAL_MIN_ROWS`` to N for the run (1: the one
conditional in every bucket, how buckets of 1 and 8 rows were measured).

Every row seeded, V = 128256 by default; top-k 50 + top-p 0.9 + T 0.7 on peaked logits and
top-p 0.9 on flat ones. Calls take turns round by round, each round starting with the next
(``tpu_bench.interleaved``); ratios are medians of per-round ratios of process CPU time (every
XLA:CPU thread of this process).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
from corelib import SamplingParams

from corelib_tpu import filter_stages
from corelib_tpu.sampler import TpuSampler
from corelib_tpu.xla import default_device

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "benchmarks"))
import tpu_bench  # noqa: E402

CONFIGS = {"top-k 50 + top-p 0.9 + T 0.7": (dict(top_k=50, top_p=0.9, temperature=0.7), 3.0),
           "top-p 0.9, flat logits": (dict(top_p=0.9), 0.01)}


class TwoConditionals(TpuSampler):
    """The filter group as buckets below ``GROUP_CONDITIONAL_MIN_ROWS`` run it, in every bucket."""

    def run_group(self, group, x, s):
        if group != "filter":
            return super().run_group(group, x, s)
        return self._filters_in_turn(x, s, filter_stages.filters_in_use(s))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--group-from", type=int, default=None)
    args = parser.parse_args()
    if args.group_from is not None:
        filter_stages.GROUP_CONDITIONAL_MIN_ROWS = args.group_from
    torch.set_num_threads(1)
    device = default_device()
    print("| config | B | one conditional, CPU ms | two, CPU ms | two / one (both pairs) "
          "| A/A: one / one, two / two |")
    print("|---|---|---|---|---|---|")
    for rows in args.rows:
        for name, (params, scale) in CONFIGS.items():
            gen = torch.Generator().manual_seed(rows)
            logits = (torch.randn((rows, args.vocab), generator=gen) * scale).to(device)
            fns = {}
            for label, cls in [("one", TpuSampler), ("two", TwoConditionals),
                               ("one again", TpuSampler), ("two again", TwoConditionals)]:
                sampler = cls(device, buckets=(rows,))
                batch = sampler.new_batch(args.vocab)
                for i in range(rows):
                    batch.add(f"r{i}", SamplingParams(**params, seed=i))
                fns[label] = lambda s=sampler, b=batch: s.sample(logits, b).token_ids.tolist()
            t = tpu_bench.interleaved(fns, args.reps)
            cpu = {label: statistics.median(v[4]) * 1e3 for label, v in t.items()}
            r = lambda slow, fast: tpu_bench.ratio(t, slow, fast, 4)  # noqa: E731
            print(f"| {name} | {rows} | {cpu['one']:.1f} | {cpu['two']:.1f} | {r('two', 'one'):.2f}, "
                  f"{r('two again', 'one again'):.2f} | {r('one again', 'one'):.2f}, "
                  f"{r('two again', 'two'):.2f} |", flush=True)


if __name__ == "__main__":
    main()
