"""Benchmark helpers shared by ``corelib bench`` and ``benchmarks/``.

Every number is a ratio measured in the same run: the backend against the ``reference``
backend, and against one ``clone()`` of the same logits ("passes": how many trips over the
logits the step costs). Wall-clock seconds are reported but never asserted.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Optional

import torch

from .params import SamplingParams
from .sampler import Sampler

PROMPT_LEN = 1000
GENERATED = 256

CONFIGS: dict[str, dict] = {
    "greedy": dict(temperature=0.0),
    "random": dict(),
    "top_k": dict(temperature=0.7, top_k=50),
    "top_p": dict(top_p=0.9),
    "top_k_top_p": dict(temperature=0.7, top_k=50, top_p=0.9),
    "min_p": dict(min_p=0.05),
    "full": dict(temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.1,
                 frequency_penalty=0.2, presence_penalty=0.1, min_tokens=300,
                 stop_token_ids=[2], logprobs=5,
                 logit_bias={7: 1.5, 99: -2.0, 1234: 0.5, 2000: 3.0, 5000: -1.0, 8000: 0.25,
                             9000: -0.75, 12000: 2.0}),
}
SEEDED_CONFIGS = {"full"}


@dataclass
class BenchRow:
    backend: str
    config: str
    batch_size: int
    vocab_size: int
    profile: str
    backend_ms: float
    reference_ms: Optional[float]
    clone_ms: float

    @property
    def speedup(self) -> Optional[float]:
        return None if self.reference_ms is None else self.reference_ms / self.backend_ms

    @property
    def passes(self) -> float:
        return self.backend_ms / self.clone_ms

    def as_dict(self) -> dict:
        return {**asdict(self), "speedup": self.speedup, "passes": self.passes}


def make_logits(batch_size: int, vocab_size: int, profile: str = "flat", seed: int = 0,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 ``[B, V]`` logits: ``flat`` = randn; ``peaked`` = Zipf-like, log-probability
    falling linearly with log-rank (as language models' outputs do), shuffled per row."""
    gen = torch.Generator().manual_seed(seed)
    if profile == "flat":
        logits = torch.randn((batch_size, vocab_size), generator=gen)
    elif profile == "peaked":
        ranks = torch.arange(1, vocab_size + 1, dtype=torch.float32)
        profile_row = -1.1 * torch.log(ranks) + 0.3 * torch.randn(vocab_size, generator=gen)
        order = torch.argsort(torch.rand((batch_size, vocab_size), generator=gen), dim=-1)
        logits = profile_row[order]
    else:
        raise ValueError(f"profile must be 'flat' or 'peaked', got {profile!r}")
    return logits.to(device)


def make_batch(sampler: Sampler, batch_size: int, vocab_size: int, config: str, seed: int = 0):
    """A batch of ``batch_size`` one-row requests with the config's parameters; for the full
    pipeline each has a 1000-token prompt, 256 generated tokens and a seed."""
    if config not in CONFIGS:
        raise ValueError(f"unknown config {config!r}; choose from {', '.join(CONFIGS)}")
    gen = torch.Generator().manual_seed(seed)
    batch = sampler.new_batch(vocab_size, eos_token_id=1)
    full = config in SEEDED_CONFIGS
    for i in range(batch_size):
        params = dict(CONFIGS[config])
        if full:
            params["seed"] = seed * 100_003 + i
            params["logit_bias"] = {t % vocab_size: b for t, b in params["logit_bias"].items()}
        prompt = torch.randint(0, vocab_size, (PROMPT_LEN,), generator=gen).tolist() if full else []
        output = torch.randint(0, vocab_size, (GENERATED,), generator=gen).tolist() if full else None
        batch.add(f"req-{i}", SamplingParams(**params), prompt_token_ids=prompt, output_token_ids=output)
    return batch


def time_call(fn: Callable[[], object], repeats: int, warmup: int = 1,
              sync: Callable[[], None] = lambda: None) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(samples)


def device_sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def bench_one(sampler: Sampler, reference: Optional[Sampler], config: str, batch_size: int,
              vocab_size: int, profile: str, repeats: int) -> BenchRow:
    logits = make_logits(batch_size, vocab_size, profile, device=sampler.device)
    sync = device_sync(sampler.device)
    batch = make_batch(sampler, batch_size, vocab_size, config)
    backend_ms = time_call(lambda: sampler.sample(logits, batch).token_ids, repeats, sync=sync)
    clone_ms = time_call(lambda: logits.clone(), max(repeats, 5), sync=sync)
    reference_ms = None
    if reference is not None:
        cpu_logits = logits.cpu()
        ref_batch = make_batch(reference, batch_size, vocab_size, config)
        reference_ms = time_call(lambda: reference.sample(cpu_logits, ref_batch), max(1, repeats // 2))
    return BenchRow(sampler.name, config, batch_size, vocab_size, profile, backend_ms,
                    reference_ms, clone_ms)


class ProgressBar:
    """A one-line progress bar on stderr (no dependency)."""

    def __init__(self, total: int, width: int = 30, stream=None):
        self.total, self.width, self.done = max(total, 1), width, 0
        self.stream = stream if stream is not None else sys.stderr

    def step(self, label: str) -> None:
        self.done += 1
        filled = int(self.width * self.done / self.total)
        bar = "#" * filled + "-" * (self.width - filled)
        self.stream.write(f"\r[{bar}] {self.done}/{self.total} {label:<40}")
        if self.done == self.total:
            self.stream.write("\n")
        self.stream.flush()


def run_grid(sampler: Sampler, configs: Iterable[str], batch_sizes: Iterable[int],
             vocab_sizes: Iterable[int], profiles: Iterable[str], repeats: int,
             with_reference: bool = True, progress: bool = True) -> list[BenchRow]:
    reference = Sampler("cpu") if with_reference else None
    grid = [(c, b, v, p) for v in vocab_sizes for p in profiles for c in configs for b in batch_sizes]
    bar = ProgressBar(len(grid)) if progress else None
    rows = []
    for config, batch_size, vocab_size, profile in grid:
        rows.append(bench_one(sampler, reference, config, batch_size, vocab_size, profile, repeats))
        if bar:
            bar.step(f"{config} B={batch_size} V={vocab_size} {profile}")
    return rows


def format_table(rows: list[BenchRow]) -> str:
    head = ["backend", "config", "B", "V", "logits", "ms", "reference ms", "speedup", "passes"]
    body = []
    for r in rows:
        body.append([r.backend, r.config, str(r.batch_size), str(r.vocab_size), r.profile,
                     f"{r.backend_ms:.2f}", "-" if r.reference_ms is None else f"{r.reference_ms:.2f}",
                     "-" if r.speedup is None else f"{r.speedup:.1f}x", f"{r.passes:.1f}"])
    widths = [max(len(h), *(len(row[i]) for row in body)) if body else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(cell.rjust(w) if i >= 2 else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
              for row in body]
    return "\n".join(lines)


def write_csv(rows: list[BenchRow], path: str) -> None:
    import csv
    with open(path, "w", newline="") as f:
        fields = list(rows[0].as_dict()) if rows else ["backend"]
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow(row.as_dict())


def write_plot(rows: list[BenchRow], path: str) -> None:
    """Speedup over the reference per config and batch size (needs matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install 'corelib[plot]'") from exc
    fig, ax = plt.subplots(figsize=(7, 4))
    for (config, vocab, profile) in sorted({(r.config, r.vocab_size, r.profile) for r in rows}):
        sel = sorted((r for r in rows if (r.config, r.vocab_size, r.profile) == (config, vocab, profile)),
                     key=lambda r: r.batch_size)
        if any(r.speedup is None for r in sel):
            continue
        ax.plot([r.batch_size for r in sel], [r.speedup for r in sel], marker="o",
                label=f"{config} V={vocab} {profile}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("batch size")
    ax.set_ylabel("speedup over reference (x)")
    ax.set_title(f"corelib bench: {rows[0].backend if rows else ''}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def machine_description() -> str:
    import os
    import platform
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, Python {platform.python_version()}")


def geometric_mean(values: Iterable[float]) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")
