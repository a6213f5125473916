"""What each filter of the fourth release, a filter order of a request's own and the stateful
selectors cost on the cpu backend: "how much slower is my step when I turn this on?"

Per filter and batch size, the same step (``CpuSampler.sample``, every row random, seeded or
not) without the filter and with it, and the cost of one pass over the logits (``torch.softmax``
and ``amax`` over ``[B, V]``), all timed in one interleaved run so that the machine's load moves
them together. ``extra/pass`` is (with - without) / softmax: the filter's cost in passes over
the logits (the target is at most 1). The order part times the default order against
``temperature_last`` (every row, or one row of the batch) for a step with temperature, min-p,
top-k and top-p.

    python benchmarks/cpu_new_filters.py                              # B in 1, 32, 256
    python benchmarks/cpu_new_filters.py --batch-sizes 1,32 --filters top_a,eta --repeats 9
    python benchmarks/cpu_new_filters.py --parts orders --clock thread
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

#: The step every filter is added to: random rows at temperature 0.8.
BASE = dict(temperature=0.8)
#: Each filter at a value that drops tokens (the stage table's examples where they have one).
FILTERS = {
    "dynatemp": dict(dynatemp_range=0.5, dynatemp_exponent=1.5),
    "smoothing": dict(smoothing_factor=0.3, smoothing_curve=2.0),
    "top_a": dict(top_a=0.2),
    "epsilon": dict(epsilon_cutoff=3e-6),
    "eta": dict(eta_cutoff=4e-6),
    "tfs": dict(tfs=0.95),
    "p_less": dict(p_less="plain"),
    "p_less_norm": dict(p_less="norm"),
    "mirostat": dict(mirostat_tau=5.0, mirostat_eta=0.1),
    "adaptive_p": dict(adaptive_p_target=0.3, adaptive_p_decay=0.9),
}
#: The order part's step: the common filters, default order vs temperature last.
ORDERED = dict(temperature=0.8, min_p=0.02, top_k=50, top_p=0.9)


def batch_of(sampler: CpuSampler, V: int, rows: list) -> object:
    batch = sampler.new_batch(V, eos_token_id=2)
    for i, params in enumerate(rows):
        batch.add(f"r{i}", params, prompt_token_ids=[1, 2, 3], output_token_ids=[4, 5])
    return batch


def rows_of(B: int, params: dict, seeded: bool) -> list:
    return [SamplingParams(**params, **({"seed": 100 + i} if seeded else {})) for i in range(B)]


def filters_part(args, clock, V: int) -> None:
    print(f"{'filter':12s} {'B':>4s} {'seeded':6s} {'without ms':>10s} {'with ms':>9s} {'softmax ms':>10s} "
          f"{'amax ms':>8s} {'extra/pass':>10s}")
    for name in args.filters.split(","):
        for B in map(int, args.batch_sizes.split(",")):
            for seeded in (False, True):
                logits = make_logits(B, V, args.profile)
                without, with_ = CpuSampler(), CpuSampler()
                plain = batch_of(without, V, rows_of(B, BASE, seeded))
                on = batch_of(with_, V, rows_of(B, {**BASE, **FILTERS[name]}, seeded))
                m = medians(interleaved({
                    "without": lambda: without.sample(logits, plain),
                    "with": lambda: with_.sample(logits, on),
                    "softmax": lambda: torch.softmax(logits, dim=-1),
                    "amax": lambda: logits.amax(dim=-1),
                }, args.repeats, warmup=1, clock=clock))
                extra = (m["with"] - m["without"]) / m["softmax"]
                print(f"{name:12s} {B:4d} {str(seeded):6s} {m['without']:10.3f} {m['with']:9.3f} "
                      f"{m['softmax']:10.3f} {m['amax']:8.3f} {extra:10.2f}", flush=True)


def orders_part(args, clock, V: int) -> None:
    print(f"{'rows ordered':12s} {'B':>4s} {'seeded':6s} {'default ms':>10s} {'ordered ms':>10s} "
          f"{'softmax ms':>10s} {'ordered/default':>15s}")
    for B in map(int, args.batch_sizes.split(",")):
        for seeded in (False, True):
            for share in ("all", "one"):
                logits = make_logits(B, V, args.profile)
                default_rows = rows_of(B, ORDERED, seeded)
                ordered_rows = rows_of(B, {**ORDERED, "temperature_last": True}, seeded)
                if share == "one":
                    ordered_rows = default_rows[:-1] + ordered_rows[-1:]
                a, b = CpuSampler(), CpuSampler()
                default, ordered = batch_of(a, V, default_rows), batch_of(b, V, ordered_rows)
                m = medians(interleaved({
                    "default": lambda: a.sample(logits, default),
                    "ordered": lambda: b.sample(logits, ordered),
                    "softmax": lambda: torch.softmax(logits, dim=-1),
                }, args.repeats, warmup=1, clock=clock))
                print(f"{share:12s} {B:4d} {str(seeded):6s} {m['default']:10.3f} {m['ordered']:10.3f} "
                      f"{m['softmax']:10.3f} {m['ordered'] / m['default']:14.2f}x", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="filters,orders")
    parser.add_argument("--filters", default=",".join(FILTERS))
    parser.add_argument("--batch-sizes", default="1,32,256")
    parser.add_argument("--vocab-size", type=int, default=128256)
    parser.add_argument("--profile", default="peaked", choices=["flat", "peaked"])
    add_run_arguments(parser, 5)
    args = parser.parse_args(argv)
    clock = run_settings(args, parser)
    V = args.vocab_size
    print(f"cpu backend, V = {V}, {args.profile} logits, {args.threads} thread(s), {args.clock} clock, "
          f"median of {args.repeats}, load average {load_average():.2f} at start")
    parts = args.parts.split(",")
    if "filters" in parts:
        filters_part(args, clock, V)
    if "orders" in parts:
        orders_part(args, clock, V)
    print(f"load average {load_average():.2f} at end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
