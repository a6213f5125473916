"""The cpu backend against the reference backend and one clone() of the logits, over the grid
of issue 3: B in {1, 8, 32, 128, 256}, V in {32000, 128256, 151936}, flat and peaked logits,
every config of ``corelib.bench`` plus ``random_seeded``, ``top_p_seeded`` and
``top_k_top_p_seeded`` (every row seeded: whole-row draws must compute the contract's noise for
every token that can win).

Prints a table and the issue's targets, writes ``cpu_grid.csv`` and ``cpu_grid.png`` under
``--out``. ``--quick`` runs a small grid in under two minutes. Ratios are measured in the same
run; nothing here asserts a time.

    python benchmarks/cpu_grid.py --quick
    python benchmarks/cpu_grid.py --out bench-results/
    python benchmarks/cpu_grid.py --profile top_p:128:128256:flat
"""

from __future__ import annotations

import os

os.environ.setdefault("KINETO_LOG_LEVEL", "5")   # keep the memory profiler quiet

import argparse
import csv
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
from corelib import Sampler, SamplingParams
from corelib.bench import CONFIGS, GENERATED, PROMPT_LEN, SEEDED_CONFIGS, machine_description, make_logits

from corelib_cpu.sampler import CpuSampler
from harness import Summary, load_average, samples

# Every row seeded: the draws whose noise the contract fixes (whole rows for random and
# top_p, the top-k candidates for top_k_top_p).
GRID_CONFIGS = {**CONFIGS, "random_seeded": dict(), "top_p_seeded": CONFIGS["top_p"],
                "top_k_top_p_seeded": CONFIGS["top_k_top_p"]}
SEEDED = set(SEEDED_CONFIGS) | {"random_seeded", "top_p_seeded", "top_k_top_p_seeded"}
FULL_GRID = dict(batch_sizes=[1, 8, 32, 128, 256], vocab_sizes=[32000, 128256, 151936],
                 profiles=["flat", "peaked"])
QUICK_GRID = dict(batch_sizes=[1, 32], vocab_sizes=[128256], profiles=["flat", "peaked"])
TARGET_V = 128256


@dataclass
class Cell:
    config: str
    batch_size: int
    vocab_size: int
    profile: str
    cpu_ms: float
    cpu_min_ms: float
    reference_ms: Optional[float]
    clone_ms: float
    copy_ms: float                       # logits copied into an existing buffer: one pure
                                         # read + write, without clone()'s page faults
    peak_extra_logits: float             # (allocation high-water mark of one cpu call + the
                                         # sampler's workspace) / logits bytes

    @property
    def speedup(self) -> Optional[float]:
        return None if self.reference_ms is None else self.reference_ms / self.cpu_ms

    @property
    def passes(self) -> float:
        return self.cpu_ms / self.clone_ms

    @property
    def copy_passes(self) -> float:
        return self.cpu_ms / self.copy_ms

    def row(self) -> dict:
        return {**asdict(self), "speedup": self.speedup, "passes": self.passes,
                "copy_passes": self.copy_passes}


def make_batch(sampler: Sampler, config: str, batch_size: int, vocab_size: int):
    """One-row requests with the config's parameters; ``full`` adds a 1000-token prompt and
    256 generated tokens per row (as ``corelib.bench.make_batch``), seeded configs a seed."""
    gen = torch.Generator().manual_seed(0)
    batch = sampler.new_batch(vocab_size, eos_token_id=1)
    history = config in SEEDED_CONFIGS
    for i in range(batch_size):
        params = dict(GRID_CONFIGS[config])
        if config in SEEDED:
            params["seed"] = 100_003 + i
        if "logit_bias" in params:
            params["logit_bias"] = {t % vocab_size: b for t, b in params["logit_bias"].items()}
        prompt = torch.randint(0, vocab_size, (PROMPT_LEN,), generator=gen).tolist() if history else []
        output = torch.randint(0, vocab_size, (GENERATED,), generator=gen).tolist() if history else None
        batch.add(f"req-{i}", SamplingParams(**params), prompt_token_ids=prompt, output_token_ids=output)
    return batch


def peak_extra_memory(fn: Callable[[], object]) -> float:
    """Bytes: the high-water mark of torch's CPU allocations during fn(), from
    torch.profiler's memory events (allocations inside ops, frees as they happen), replayed
    in time order. Tensors alive before the call (logits, batch state) do not count."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    changes = []
    for event in prof.events():
        if event.name == "[memory]":
            changes.append((event.time_range.start, event.cpu_memory_usage))
        elif event.self_cpu_memory_usage:
            changes.append((event.time_range.start, event.self_cpu_memory_usage))
    changes.sort(key=lambda c: c[0])
    level = peak = 0
    for _, delta in changes:
        level += delta
        peak = max(peak, level)
    return float(peak)


def bench_cell(reference: Optional[Sampler], config: str, B: int, V: int, profile: str,
               repeats: int) -> Cell:
    cpu = CpuSampler()          # a fresh workspace: the cell's memory is its own
    logits = make_logits(B, V, profile)
    batch = make_batch(cpu, config, B, V)
    cpu_times = Summary.of(samples(lambda: cpu.sample(logits, batch), repeats))
    peak = peak_extra_memory(lambda: cpu.sample(logits, batch)) + cpu.workspace.nbytes()
    clone_ms = statistics.median(samples(lambda: logits.clone(), max(repeats, 9)))
    target = torch.empty_like(logits)
    copy_ms = statistics.median(samples(lambda: target.copy_(logits), max(repeats, 9)))
    reference_ms = None
    if reference is not None:
        ref_batch = make_batch(reference, config, B, V)
        reference_ms = statistics.median(samples(lambda: reference.sample(logits, ref_batch),
                                                 max(1, repeats // 3), warmup=1 if B * V < 2**22 else 0))
    logits_bytes = logits.numel() * logits.element_size()
    return Cell(config, B, V, profile, cpu_times.median, cpu_times.min,
                reference_ms, clone_ms, copy_ms, peak / logits_bytes)


def format_table(cells: list[Cell]) -> str:
    head = ["config", "B", "V", "logits", "cpu ms", "ref ms", "speedup", "passes", "copies", "peak mem"]
    body = [[c.config, str(c.batch_size), str(c.vocab_size), c.profile, f"{c.cpu_ms:.3f}",
             "-" if c.reference_ms is None else f"{c.reference_ms:.2f}",
             "-" if c.speedup is None else f"{c.speedup:.1f}x", f"{c.passes:.1f}", f"{c.copy_passes:.1f}",
             f"{c.peak_extra_logits:.2f}x"] for c in cells]
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) if i < 4 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths)))
              for r in body]
    return "\n".join(lines)


def targets(cells: list[Cell]) -> list[str]:
    """Where each target of issue 3 stands, from the cells at V = 128256 (if measured)."""
    at = [c for c in cells if c.vocab_size == TARGET_V]
    out = []

    def check(name, sel, value, ok, unit, higher_is_better=False):
        if not sel:
            return
        worst = min(sel, key=value) if higher_is_better else max(sel, key=value)
        v = value(worst)
        out.append(f"{'MET ' if ok(v) else 'MISS'} {name}: worst {v:.1f}{unit} "
                   f"({worst.config} B={worst.batch_size} {worst.profile})")

    speed = lambda c: c.speedup                                          # noqa: E731
    ref = [c for c in at if c.speedup is not None]
    check("top-k 50 + top-p 0.9 + temperature, B >= 8: >= 25x", [c for c in ref if c.config == "top_k_top_p" and c.batch_size >= 8],
          speed, lambda v: v >= 25, "x", True)
    check("top-k 50 + top-p 0.9 + temperature, B = 1: >= 10x", [c for c in ref if c.config == "top_k_top_p" and c.batch_size == 1],
          speed, lambda v: v >= 10, "x", True)
    check("top-p 0.9 alone, flat logits: >= 8x", [c for c in ref if c.config == "top_p" and c.profile == "flat"],
          speed, lambda v: v >= 8, "x", True)
    passes = lambda c: c.passes                                          # noqa: E731
    for B in sorted({c.batch_size for c in at}):
        check(f"plain random, B={B}: <= 4 passes", [c for c in at if c.config == "random" and c.batch_size == B],
              passes, lambda v: v <= 4, " passes")
        check(f"full pipeline, B={B}: <= 10 passes", [c for c in at if c.config == "full" and c.batch_size == B],
              passes, lambda v: v <= 10, " passes")
    for B in sorted({c.batch_size for c in at}):
        check(f"peak extra memory, B={B}: <= 3x the logits", [c for c in at if c.batch_size == B],
              lambda c: c.peak_extra_logits, lambda v: v <= 3, "x")
    return out


def write_csv(cells: list[Cell], path: str, description: str) -> None:
    with open(path, "w", newline="") as f:
        f.write(f"# {description}\n")
        writer = csv.DictWriter(f, fieldnames=list(cells[0].row()))
        writer.writeheader()
        for c in cells:
            writer.writerow(c.row())


def write_plot(cells: list[Cell], path: str, description: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install matplotlib)", file=sys.stderr)
        return False
    vocabs = sorted({c.vocab_size for c in cells})
    configs = list(dict.fromkeys(c.config for c in cells))
    colour = {config: plt.get_cmap("tab10")(i % 10) for i, config in enumerate(configs)}
    fig, axes = plt.subplots(2, len(vocabs), figsize=(5.5 * len(vocabs), 8), squeeze=False)
    for col, V in enumerate(vocabs):
        for (config, profile) in sorted({(c.config, c.profile) for c in cells if c.vocab_size == V},
                                        key=lambda cp: (configs.index(cp[0]), cp[1])):
            sel = sorted((c for c in cells if (c.config, c.profile, c.vocab_size) == (config, profile, V)),
                         key=lambda c: c.batch_size)
            style = dict(color=colour[config], ls="-" if profile == "flat" else "--", marker="o", ms=3)
            if all(c.speedup is not None for c in sel):
                axes[0][col].plot([c.batch_size for c in sel], [c.speedup for c in sel],
                                  label=f"{config} {profile}", **style)
            axes[1][col].plot([c.batch_size for c in sel], [c.copy_passes for c in sel],
                              label=f"{config} {profile}", **style)
        for row, label in ((0, "speedup over reference (x)"),
                           (1, "time / one copy_() of the logits")):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("batch size")
            ax.set_ylabel(label)
            ax.set_title(f"V = {V}")
            ax.grid(True, which="both", lw=0.3)
        axes[0][col].axhline(25, color="grey", lw=0.8, ls=":")
        axes[1][col].axhline(4, color="grey", lw=0.8, ls=":")
        axes[1][col].axhline(10, color="grey", lw=0.8, ls=":")
    if axes[0][0].lines:
        axes[0][0].legend(fontsize=6, ncol=2)
    else:
        axes[1][0].legend(fontsize=6, ncol=2)
    fig.suptitle(f"corelib cpu backend vs reference\n{description}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def profile_cell(spec: str) -> None:
    """Print torch.profiler's op table for one cell, ``config:B:V:profile``, with the time and
    the number of torch operator calls per step."""
    config, B, V, profile = spec.split(":")
    B, V = int(B), int(V)
    cpu = CpuSampler()
    logits = make_logits(B, V, profile)
    batch = make_batch(cpu, config, B, V)
    for _ in range(2):
        cpu.sample(logits, batch)
    ms = statistics.median(samples(lambda: cpu.sample(logits, batch), 15))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            cpu.sample(logits, batch)
    clone_ms = statistics.median(samples(lambda: logits.clone(), 9))
    table = prof.key_averages()
    calls = sum(event.count for event in table) / 5
    print(f"{spec}: {ms:.3f} ms per step (median of 15), one clone() = {clone_ms:.3f} ms; "
          f"{calls:.0f} torch operator calls per step (nested ones included); 5 steps profiled")
    print(table.table(sort_by="self_cpu_time_total", row_limit=12))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench-results/", help="folder for the CSV and PNG")
    parser.add_argument("--quick", action="store_true", help="a small grid (under two minutes)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per cell")
    parser.add_argument("--configs", default=",".join(GRID_CONFIGS))
    parser.add_argument("--batch-sizes", default=None)
    parser.add_argument("--vocab-sizes", default=None)
    parser.add_argument("--profiles", default=None)
    parser.add_argument("--no-reference", action="store_true", help="skip the reference backend")
    parser.add_argument("--profile", metavar="CONFIG:B:V:PROFILE", help="profile one cell and exit")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.profile:
        profile_cell(args.profile)
        return 0
    grid = dict(QUICK_GRID if args.quick else FULL_GRID)
    for key, arg, kind in (("batch_sizes", args.batch_sizes, int), ("vocab_sizes", args.vocab_sizes, int),
                           ("profiles", args.profiles, str)):
        if arg:
            grid[key] = [kind(v) for v in arg.split(",")]
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in GRID_CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}; choose from {', '.join(GRID_CONFIGS)}")
    repeats = args.repeats or (3 if args.quick else 7)

    description = f"{machine_description()}, load average {load_average():.2f} at start"
    print(description)
    reference = None if args.no_reference else Sampler("cpu")
    cells = []
    order = [(V, p, c, B) for V in grid["vocab_sizes"] for p in grid["profiles"]
             for c in configs for B in grid["batch_sizes"]]
    started = time.perf_counter()
    for i, (V, profile, config, B) in enumerate(order):
        cells.append(bench_cell(reference, config, B, V, profile, repeats))
        sys.stderr.write(f"\r{i + 1}/{len(order)} {config} B={B} V={V} {profile}        ")
        sys.stderr.flush()
    sys.stderr.write("\n")
    description += f", {load_average():.2f} at end, {time.perf_counter() - started:.0f} s"
    print(format_table(cells))
    print("\nTargets (V = 128256):")
    for line in targets(cells):
        print("  " + line)
    os.makedirs(args.out, exist_ok=True)
    csv_path = os.path.join(args.out, "cpu_grid.csv")
    write_csv(cells, csv_path, description)
    png_path = os.path.join(args.out, "cpu_grid.png")
    wrote = write_plot(cells, png_path, description)
    print(f"\nwrote {csv_path}" + (f" and {png_path}" if wrote else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
