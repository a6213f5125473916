"""The cpu backend's engine features against their targets, every figure a ratio measured in
the same run (calls alternating, one torch thread, medians):

- token bitmask (issue 10): at B >= 32 a step with a mask costs at most one ``clone()`` of the
  logits more than the same step without, and the mask costs no more than xgrammar's own CPU
  kernel (``xgrammar.apply_token_bitmask_inplace``, when xgrammar is importable) on the same
  logits and mask;
- verification (issue 10): ``verify`` with B = 32, K = 4 costs at most 1.5x one ``sample``
  over the same 160 rows, with and without draft probabilities;
- the new samplers (issue 12): at B >= 32 each of DRY, top-n-sigma, typical-p and XTC adds at
  most one clone of the logits to the step without it; DRY with 4,096 tokens of history at
  most two.

    python benchmarks/cpu_engine.py                         # everything, B = 32: ~5 min
    python benchmarks/cpu_engine.py --parts bitmask --batch-sizes 32,128
    python benchmarks/cpu_engine.py --clock thread          # CPU time of the calling thread
    python benchmarks/cpu_engine.py --profile samplers:typical_p:32   # operator table of a cell

Nothing here asserts a time; the test suites check the results.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Optional

import torch
from corelib import SamplingParams
from corelib.bench import machine_description, make_logits
from corelib.bitmask import pack_bitmask

from corelib_cpu.sampler import CpuSampler
from harness import CLOCKS, add_clock_argument, interleaved, load_average, timed
from harness import medians as medians_of

V = 128256
clock = CLOCKS["wall"]

#: The step the new samplers are added to: whole rows (no top-k), so each stage meets the
#: vocabulary, and the same step with the stage on.
BASE_STEP = dict(temperature=0.8)
SAMPLERS = {
    "top_n_sigma": dict(top_n_sigma=1.0),
    "typical_p": dict(typical_p=0.9),
    "xtc": dict(xtc_threshold=0.1, xtc_probability=0.5),
    "dry_4096": dict(dry_multiplier=0.8, dry_allowed_length=2),
}
DRY_HISTORY = 4096
#: The configs of the bitmask and verification parts.
STEPS = {
    "random": dict(),
    "top_k_top_p": dict(temperature=0.7, top_k=50, top_p=0.9),
    "top_p": dict(top_p=0.9),
}
TARGETS = {"bitmask": 1.0, "verify": 1.5, "samplers": 1.0, "dry_4096": 2.0}


def medians(calls: dict, repeats: int) -> dict:
    """Median ms of each named call, the calls alternating so they share the machine's load,
    after one warm-up round (workspace buffers, plans, lazy imports)."""
    return medians_of(interleaved(calls, repeats, warmup=1, clock=clock))


def batch_of(sampler: CpuSampler, rows: int, params: dict, seeded: bool = False,
             prompt: Optional[list] = None):
    batch = sampler.new_batch(V)
    for i in range(rows):
        p = dict(params, seed=1000 + i) if seeded else params
        batch.add(f"r{i}", SamplingParams(**p), prompt_token_ids=prompt or [])
    return batch


def repeating_history(length: int, seed: int = 0) -> list[int]:
    """A prompt whose phrases recur (DRY has repeats to penalise): 64-token phrases drawn
    from a pool of 16."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, V, (16, 64), generator=g)
    picks = torch.randint(0, 16, (length // 64 + 1,), generator=g)
    return pool[picks].flatten()[:length].tolist()


def verdict(ratio: float, target: float, higher_is_better: bool = False) -> str:
    ok = ratio >= target if higher_is_better else ratio <= target
    return "met" if ok else "MISSED"


# ---------------------------------------------------------------------- parts
def bitmask_part(batch_sizes, repeats):
    try:
        import xgrammar
        xgr = xgrammar.apply_token_bitmask_inplace
    except ImportError:
        xgr = None
    print("\n## token bitmask: (step with mask - step without) / one clone (target <= 1); "
          "xgrammar kernel / that cost (target >= 1)")
    print(f"{'config':12s} {'B':>4s} {'density':>7s} {'plain ms':>9s} {'mask ms':>8s} {'clone ms':>8s} "
          f"{'copy ms':>7s} {'xgr ms':>7s} {'clones':>7s} {'copies':>7s} {'xgr/mask':>8s}")
    for B in batch_sizes:
        logits = make_logits(B, V, "flat")
        for density in (0.5, 0.05):
            allowed = torch.rand((B, V), generator=torch.Generator().manual_seed(1)) < density
            mask = pack_bitmask(allowed)
            scratch, buffer = logits.clone(), torch.empty_like(logits)
            for config in ("random", "top_k_top_p"):
                sampler = CpuSampler()
                batch = batch_of(sampler, B, STEPS[config])
                calls = {"plain": lambda: sampler.sample(logits, batch),
                         "mask": lambda: sampler.sample(logits, batch, token_bitmask=mask),
                         "clone": lambda: logits.clone(),
                         "copy": lambda: buffer.copy_(logits)}
                if xgr is not None:
                    # in place, as an engine runs it; on a copy that keeps its -inf from call to
                    # call (the kernel's work does not depend on the values)
                    calls["xgrammar"] = lambda: xgr(scratch, mask)
                m = medians(calls, repeats)
                cost = m["mask"] - m["plain"]
                clones = cost / m["clone"]
                xg = m.get("xgrammar")
                versus = f"{xg / cost:7.1f}x" if xg is not None and cost > 0 else "      -"
                print(f"{config:12s} {B:4d} {density:7.2f} {m['plain']:9.2f} {m['mask']:8.2f} "
                      f"{m['clone']:8.2f} {m['copy']:7.2f} {xg if xg is not None else float('nan'):7.2f} "
                      f"{clones:7.2f} {cost / m['copy']:7.2f} {versus}  "
                      f"{verdict(clones, TARGETS['bitmask'])}", flush=True)


def verify_part(batch_sizes, repeats, K: int = 4):
    print(f"\n## verify, K = {K}: verify / one sample over the same B (K+1) rows (target <= 1.5)")
    print(f"{'config':12s} {'B':>4s} {'rows':7s} {'draft probs':11s} {'sample ms':>9s} {'verify ms':>9s} {'ratio':>6s}")
    S = K + 1
    for B in batch_sizes:
        logits = make_logits(B * S, V, "flat")
        g = torch.Generator().manual_seed(2)
        drafts = torch.randint(0, V, (B, K), generator=g)
        probs = torch.softmax(make_logits(B * K, V, "flat", seed=3), dim=-1).view(B, K, V)
        for config in STEPS:
            for seeded in (False, True):
                sampler = CpuSampler()
                flat = batch_of(sampler, B * S, STEPS[config], seeded)
                target = batch_of(sampler, B, STEPS[config], seeded)
                spec = logits.view(B, S, V)
                calls = {"sample": lambda: sampler.sample(logits, flat),
                         "verify": lambda: sampler.verify(spec, target, drafts),
                         "verify_probs": lambda: sampler.verify(spec, target, drafts, probs)}
                m = medians(calls, repeats)
                kind = "seeded" if seeded else "unseeded"
                for name, label in (("verify", "no"), ("verify_probs", "yes")):
                    ratio = m[name] / m["sample"]
                    print(f"{config:12s} {B:4d} {kind:7s} {label:11s} {m['sample']:9.2f} {m[name]:9.2f} "
                          f"{ratio:6.2f}  {verdict(ratio, TARGETS['verify'])}", flush=True)


def samplers_part(batch_sizes, repeats):
    print(f"\n## new samplers on whole rows ({BASE_STEP}): (step with it - step without) / one "
          f"clone (target <= 1; DRY with {DRY_HISTORY} tokens of history <= 2)")
    print(f"{'sampler':12s} {'B':>4s} {'base ms':>8s} {'with ms':>8s} {'clone ms':>8s} {'copy ms':>7s} "
          f"{'clones':>7s} {'copies':>7s}")
    for B in batch_sizes:
        logits = make_logits(B, V, "flat")
        buffer = torch.empty_like(logits)
        history = repeating_history(DRY_HISTORY)
        for name, extra in SAMPLERS.items():
            prompt = history if name.startswith("dry") else None
            sampler = CpuSampler()
            base = batch_of(sampler, B, BASE_STEP, prompt=prompt)
            withit = batch_of(sampler, B, {**BASE_STEP, **extra}, prompt=prompt)
            m = medians({"base": lambda: sampler.sample(logits, base),
                         "with": lambda: sampler.sample(logits, withit),
                         "clone": lambda: logits.clone(),
                         "copy": lambda: buffer.copy_(logits)}, repeats)
            clones = (m["with"] - m["base"]) / m["clone"]
            target = TARGETS.get(name, TARGETS["samplers"])
            print(f"{name:12s} {B:4d} {m['base']:8.2f} {m['with']:8.2f} {m['clone']:8.2f} {m['copy']:7.2f} "
                  f"{clones:7.2f} {(m['with'] - m['base']) / m['copy']:7.2f}  "
                  f"{verdict(clones, target)} (target <= {target:g})", flush=True)


def profile_cell(spec: str, repeats: int = 5):
    """``part:config:B``: the torch operator table of one cell's step with the feature on."""
    from torch.profiler import ProfilerActivity, profile
    part, config, B = spec.split(":")
    B = int(B)
    sampler = CpuSampler()
    if part == "samplers":
        prompt = repeating_history(DRY_HISTORY) if config.startswith("dry") else None
        batch = batch_of(sampler, B, {**BASE_STEP, **SAMPLERS[config]}, prompt=prompt)
        logits = make_logits(B, V, "flat")
        step = lambda: sampler.sample(logits, batch)                         # noqa: E731
    elif part == "bitmask":
        batch = batch_of(sampler, B, STEPS[config])
        logits = make_logits(B, V, "flat")
        mask = pack_bitmask(torch.rand((B, V), generator=torch.Generator().manual_seed(1)) < 0.5)
        step = lambda: sampler.sample(logits, batch, token_bitmask=mask)    # noqa: E731
    elif part in ("verify", "verify_probs"):
        K = 4
        batch = batch_of(sampler, B, STEPS[config])
        logits = make_logits(B * (K + 1), V, "flat").view(B, K + 1, V)
        drafts = torch.randint(0, V, (B, K), generator=torch.Generator().manual_seed(2))
        probs = None
        if part == "verify_probs":
            probs = torch.softmax(make_logits(B * K, V, "flat", seed=3), dim=-1).view(B, K, V)
        step = lambda: sampler.verify(logits, batch, drafts, probs)          # noqa: E731
    else:
        raise SystemExit(f"unknown part {part!r}: bitmask, verify, verify_probs or samplers")
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            step()
    print(f"{spec}: {repeats} calls profiled, {statistics.median([timed(step, clock=clock) for _ in range(repeats)]):.2f} ms a call")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="bitmask,verify,samplers")
    parser.add_argument("--batch-sizes", default="32")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per cell and variant")
    add_clock_argument(parser)
    parser.add_argument("--profile", help="part:config:B, e.g. samplers:typical_p:32")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    global clock
    clock = CLOCKS[args.clock]
    if args.profile:
        profile_cell(args.profile)
        return 0
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    print(f"{machine_description()}, 1 torch thread, {args.clock} clock, V = {V}, median of "
          f"{args.repeats}, load average {load_average():.2f} at start")
    parts = {"bitmask": bitmask_part, "verify": verify_part, "samplers": samplers_part}
    for part in args.parts.split(","):
        parts[part](batch_sizes, args.repeats)
    print(f"\nload average {load_average():.2f} at end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
