"""The tpu backend's step at two revisions of the plugin, in one process, against the sort
and light baselines of ``benchmarks/tpu_bench.py``: the before/after of a change, paired.

    PJRT_DEVICE=CPU python plugins/tpu/benchmarks/revisions.py --before 2a45dfd \\
        [--rows 32 8] [--reps 5] [--vocab 128256] [--verify]

The plugin of ``--before`` (a git revision of this repository) is extracted with ``git
archive`` into a temporary folder under another package name, so that both revisions run in
the same process on the same core (``corelib``), their calls interleaved round by round with
the baselines (``tpu_bench.interleaved``: the first call timed alone, one warm round, then the
rounds; wall and process CPU time). "after" is the working tree's plugin. Each configuration
also checks that both revisions draw the same tokens (seeded rows). ``--verify`` adds
``verify`` at B = 32, K = 4 with and without draft probabilities against tpu_bench's sort-based
verification.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from corelib import SamplingParams  # noqa: E402

PACKAGE = "plugins/tpu/corelib_tpu"


def plugin_at(revision: str, folder: Path):
    """``TpuSampler`` of the plugin at ``revision``, imported as ``corelib_tpu_before``."""
    from harness import extract_revision
    extract_revision(revision, str(folder), PACKAGE)
    (folder / PACKAGE).rename(folder / "corelib_tpu_before")
    sys.path.insert(0, str(folder))
    return importlib.import_module("corelib_tpu_before.sampler").TpuSampler


def report(title: str, times: dict, labels, tb) -> None:
    print(f"\n{title}, load average {os.getloadavg()[0]:.1f}\n")
    print("| | wall ms | CPU ms | light / x | light / x, CPU | sort / x | sort / x, CPU | before / x | before / x, CPU |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label in labels:
        w, c = times[label][3], times[label][4]
        cells = [f"{statistics.median(w) * 1e3:.1f}", f"{statistics.median(c) * 1e3:.1f}"]
        for base in ("light", "sort", "before"):
            if base in times:
                cells += [f"{tb.ratio(times, base, label):.2f}", f"{tb.ratio(times, base, label, 4):.2f}"]
            else:
                cells += ["-", "-"]
        print(f"| {label} | " + " | ".join(cells) + " |")


def sample_suite(before_cls, after_cls, rows, vocab, reps, device, tb) -> None:
    import torch_xla
    for B in rows:
        for name in ("top-k 50 + top-p 0.9 + T 0.7", "top-p 0.9, flat logits"):
            params, scale = tb.CONFIGS[name]
            gen = torch.Generator().manual_seed(B)
            logits = (torch.randn((B, vocab), generator=gen) * scale).to(device)
            temperature, top_k, top_p, keys, gumbel = tb.baseline_inputs(
                SamplingParams(**params), B, vocab, gen, device)
            fns, tokens = {}, {}
            for label, cls in (("before", before_cls), ("after", after_cls)):
                sampler = cls(device, buckets=(B,))
                batch = sampler.new_batch(vocab)
                for i in range(B):
                    batch.add(f"r{i}", SamplingParams(**params, seed=i))
                fns[label] = (lambda s=sampler, b=batch, label=label:
                              tokens.setdefault(label, s.sample(logits, b).token_ids.tolist()))
            fns["sort"] = lambda: tb.sort_based_sample(logits, temperature, top_k, top_p, keys).cpu().tolist()
            fns["light"] = lambda: tb.light_sample(logits, temperature, top_k, top_p, gumbel).cpu().tolist()
            torch_xla.sync()
            times = tb.interleaved(fns, reps)
            report(f"sample, {name}, B = {B}, V = {vocab}; same tokens: "
                   f"{tokens['before'] == tokens['after']}", times, fns, tb)


def verify_suite(before_cls, after_cls, vocab, reps, device, tb, B: int = 32, K: int = 4) -> None:
    import torch_xla
    S = K + 1
    gen = torch.Generator().manual_seed(K)
    logits = (torch.randn((B, S, vocab), generator=gen) * 3).to(device)
    q_host = torch.softmax(torch.randn((B, K, vocab), generator=gen) * 3, dim=-1)
    drafts = torch.multinomial(q_host.reshape(-1, vocab), 1, generator=gen).view(B, K).to(device)
    temperature = torch.full((B,), 1.0).to(device)
    top_k = torch.full((B,), 50).to(device)
    top_p = torch.full((B,), 0.9).to(device)
    keys = torch.randint(-(2**31), 2**31, (B * S,), dtype=torch.int32, generator=gen).to(device)
    uniforms = torch.rand((B * S,), generator=gen).to(device)
    for given in (True, False):
        q = q_host.to(device) if given else None
        fns, tokens = {}, {}
        for label, cls in (("before", before_cls), ("after", after_cls)):
            sampler = cls(device, buckets=(B,), speculative_k=(K,))
            batch = sampler.new_batch(vocab)
            for i in range(B):
                batch.add(f"r{i}", SamplingParams(top_k=50, top_p=0.9, seed=i))
            fns[label] = (lambda s=sampler, b=batch, label=label:
                          tokens.setdefault(label, s.verify(logits, b, drafts, q).token_ids.tolist()))
        fns["sort"] = lambda: tb.sort_based_verify(logits, temperature, top_k, top_p, keys, uniforms,
                                                   drafts, q).cpu().tolist()
        torch_xla.sync()
        times = tb.interleaved(fns, reps)
        report(f"verify, top-k 50 + top-p 0.9, {'with' if given else 'no'} draft probabilities, "
               f"B = {B}, K = {K}, V = {vocab}; same tokens: {tokens['before'] == tokens['after']}",
               times, ("before", "after", "sort"), tb)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the git revision to compare with")
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 8])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--verify", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import tpu_bench as tb
    from corelib_tpu.sampler import TpuSampler
    from corelib_tpu.xla import default_device
    device = default_device()
    with tempfile.TemporaryDirectory() as folder:
        before = plugin_at(args.before, Path(folder))
        print(f"before: {args.before}, after: the working tree; XLA:CPU ({os.cpu_count()} cores), "
              f"median of {args.reps} interleaved rounds")
        sample_suite(before, TpuSampler, args.rows, args.vocab, args.reps, device, tb)
        if args.verify:
            verify_suite(before, TpuSampler, args.vocab, args.reps, device, tb)


if __name__ == "__main__":
    main()
