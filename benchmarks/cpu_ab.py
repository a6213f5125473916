"""The cpu backend of this checkout against the same backend at another git revision, in one
process, calls alternating: "did this change make anything slower?" on a machine whose load
moves (both sides see the same load), and whether seeded tokens stayed the same.

The other revision's ``plugins/cpu/corelib_cpu`` is extracted with ``git archive`` into a
temporary folder and imported as ``corelib_cpu_base`` (it runs on this checkout's core).
Prints, per cell, both medians and base / current (above 1: the current code is faster).

    python benchmarks/cpu_ab.py --base 4de1acf                          # B in 32, 128, 256
    python benchmarks/cpu_ab.py --base main --batch-sizes 1,8 --repeats 15
    python benchmarks/cpu_ab.py --base main --clock thread              # CPU time of the thread
    python benchmarks/cpu_ab.py --base main --one-sequence --repeats 400  # B = 1 sample + append

``--one-sequence`` times ``step`` (sample + append) of a batch of one request for the chains
of ``llama_cpp_compare.py`` (``--only`` picks them by name), unseeded and seeded, each call on
the next of 16 logit rows with the cache flushed before it (``--warm``: not flushed;
``--flush-mib``: how much the flush writes), and
checks that both sides drew the same seeded tokens over the whole run.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile

import torch
from corelib.bench import make_logits

from corelib_cpu.sampler import CpuSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_grid import GRID_CONFIGS, SEEDED, make_batch  # noqa: E402
from harness import (add_run_arguments, extract_revision, interleaved, load_average, medians,  # noqa: E402
                     run_settings)


def load_base(revision: str, folder: str):
    """The CpuSampler class of ``revision``'s cpu plugin, imported as corelib_cpu_base."""
    extract_revision(revision, folder, "plugins/cpu/corelib_cpu")
    os.rename(os.path.join(folder, "plugins", "cpu", "corelib_cpu"), os.path.join(folder, "corelib_cpu_base"))
    sys.path.insert(0, folder)
    return importlib.import_module("corelib_cpu_base.sampler").CpuSampler


def one_sequence(Base, args, clock) -> None:
    """The ``--one-sequence`` table (see the module docstring)."""
    from corelib import SamplingParams
    from harness import CacheFlush
    from llama_cpp_compare import CHAINS
    V = args.vocab_size
    flush = CacheFlush(args.flush_mib)
    rows = make_logits(16, V, args.profiles.split(",")[0], seed=V)
    print(f"{'chain':58s} {'seed':>5s} {'base ms':>9s} {'now ms':>9s} {'base/now':>8s}")
    for chain in CHAINS:
        if args.only and not any(o in chain.name for o in args.only):
            continue
        for seed in ((None, 100_003) if chain.seeded else (None,)):
            params = SamplingParams(**chain.params, **({} if seed is None else dict(seed=seed)))
            sides, tokens = {}, {"base": [], "now": []}
            for name, cls in (("base", Base), ("now", CpuSampler)):
                sampler = cls()
                batch = sampler.new_batch(V)
                batch.add("r", params)
                sides[name] = (sampler, batch)
            at = [0]

            def call(name):
                sampler, batch = sides[name]
                return lambda: tokens[name].append(int(sampler.step(rows[at[0]:at[0] + 1], batch).token_ids[0]))
            calls = {"base": call("base"), "now": call("now")}
            # the sides take turns going first: the second call of a round reads what the
            # first left in the shared cache levels (an A/A run read 1.04x with base first)
            turns = (calls, {"now": calls["now"], "base": calls["base"]})
            times = {"base": [], "now": []}
            interleaved(calls, repeats=0, warmup=3)
            for i in range(args.repeats):
                at[0] = i % rows.shape[0]
                timed = interleaved(turns[i % 2], repeats=1, warmup=0, clock=clock,
                                    before=None if args.warm else flush)
                for name, ms in timed.items():
                    times[name] += ms
            b, n = medians(times)["base"], medians(times)["now"]
            same = f"  seeded tokens equal: {tokens['base'] == tokens['now']}" if seed is not None else ""
            print(f"{chain.name[:58]:58s} {'yes' if seed else 'no':>5s} {b:9.3f} {n:9.3f} {b / n:7.2f}x{same}",
                  flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="git revision to compare with")
    parser.add_argument("--batch-sizes", default="32,128,256")
    parser.add_argument("--vocab-size", type=int, default=128256)
    parser.add_argument("--configs", default=",".join(GRID_CONFIGS))
    parser.add_argument("--profiles", default="flat,peaked")
    parser.add_argument("--one-sequence", action="store_true",
                        help="B = 1 step (sample + append) of llama_cpp_compare.py's chains")
    parser.add_argument("--only", action="append", default=[],
                        help="with --one-sequence: the chains whose name contains this (repeatable)")
    parser.add_argument("--warm", action="store_true",
                        help="with --one-sequence: no cache flush before each step (the step's code and data warm)")
    parser.add_argument("--flush-mib", type=int, default=16,
                        help="with --one-sequence: MiB the cache flush writes and reads (default 16; "
                             "twice the L3 evicts all of it)")
    add_run_arguments(parser, 5, "timed calls per cell and side")
    args = parser.parse_args(argv)
    clock = run_settings(args, parser)
    V = args.vocab_size
    with tempfile.TemporaryDirectory() as folder:
        Base = load_base(args.base, folder)
        print(f"base {args.base} vs this checkout, V = {V}, {args.threads} thread(s), {args.clock} "
              f"clock, median of {args.repeats}, load average {load_average():.2f} at start")
        if args.one_sequence:
            one_sequence(Base, args, clock)
            print(f"load average {load_average():.2f} at end")
            return 0
        print(f"{'config':20s} {'B':>4s} {'logits':7s} {'base ms':>9s} {'now ms':>9s} {'base/now':>8s}")
        for profile in args.profiles.split(","):
            for config in args.configs.split(","):
                for B in map(int, args.batch_sizes.split(",")):
                    logits = make_logits(B, V, profile)
                    base, now = Base(), CpuSampler()
                    base_batch, now_batch = make_batch(base, config, B, V), make_batch(now, config, B, V)
                    same = torch.equal(base.sample(logits, base_batch).token_ids,
                                       now.sample(logits, now_batch).token_ids)
                    # the sample calls above were the warm-up
                    m = medians(interleaved({"base": lambda: base.sample(logits, base_batch),
                                             "now": lambda: now.sample(logits, now_batch)},
                                            args.repeats, warmup=0, clock=clock))
                    b, n = m["base"], m["now"]
                    seeded = f"  seeded tokens equal: {same}" if config in SEEDED else ""
                    print(f"{config:20s} {B:4d} {profile:7s} {b:9.3f} {n:9.3f} {b / n:7.2f}x{seeded}", flush=True)
        print(f"load average {load_average():.2f} at end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
