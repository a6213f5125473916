"""The tpu backend's step on XLA against a sort-based traced sampler and the cpu backend.

Run with the XLA venv (torch 2.9 + torch-xla 2.9, corelib, corelib-tpu, optionally corelib-cpu)::

    PJRT_DEVICE=CPU python benchmarks/tpu_bench.py [--vocab 128256] [--rows 1 8 32] [--reps 7]

For each configuration and batch size it measures, in the same process and interleaved
round by round (so machine load hits all three alike):

- ``tpu``: ``TpuSampler.sample`` on logits already on the XLA device (all stages, padding to
  the bucket, one transfer of the results);
- ``sort``: a straightforward traced sampler: temperature, a full sort, top-k by rank,
  softmax + cumsum for top-p, scatter back to vocabulary order, the contract's Gumbel draw
  (``torch.argmax``), one transfer of the ids;
- ``cpu``: the ``cpu`` backend on the same logits as CPU tensors, timed by ``--cpu-python``
  (the cpu plugin targets the project's main torch, not torch 2.9).

Times are medians over the rounds, "sort / tpu" the median of the per-round ratios; "first" is the first call, compilation included, and
"graphs" counts the XLA graphs that call compiled. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from corelib import SamplingParams

NEG_INF = float("-inf")

CONFIGS = {
    # name: (parameters, logits scale: 3 = peaked like an LLM's, 0.01 = nearly flat)
    "top-k 50 + top-p 0.9": (dict(top_k=50, top_p=0.9), 3.0),
    "top-p 0.9, flat logits": (dict(top_p=0.9), 0.01),
    "temperature 0.8 + min-p 0.05": (dict(temperature=0.8, min_p=0.05), 3.0),
    "greedy": (dict(temperature=0.0), 3.0),
}


def sort_based_sample(logits, temperature, top_k, top_p, keys):
    """The straightforward traced sampler (see the module docstring). int64 ``[B]``."""
    from corelib_tpu import noise
    V = logits.shape[-1]
    greedy = temperature == 0
    x = logits / torch.where(greedy, 1.0, temperature)[:, None]
    ordered, order = torch.sort(x, dim=-1, descending=True)
    ranks = torch.arange(V, device=x.device)[None, :]
    ordered = ordered.masked_fill((top_k[:, None] > 0) & (ranks >= top_k[:, None]), NEG_INF)
    probs = torch.softmax(ordered, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    ordered = ordered.masked_fill(mass_before >= top_p[:, None], NEG_INF)
    x = torch.full_like(x, NEG_INF).scatter(1, order, ordered)
    vocab = torch.arange(V, dtype=torch.int32, device=x.device)[None, :]
    gumbel = torch.where(greedy[:, None], 0.0, noise.seeded_gumbel(keys[:, None], vocab))
    return torch.argmax(x + gumbel, dim=-1)


def compile_count() -> int:
    from corelib_tpu.xla import compile_count as count
    return count()


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


CPU_SCRIPT = """
import json, statistics, sys, time, torch, corelib
vocab, rows, scale, reps, params = json.loads(sys.argv[1])
gen = torch.Generator().manual_seed(rows)
logits = torch.randn((rows, vocab), generator=gen) * scale
sampler = corelib.get_sampler("cpu")
batch = sampler.new_batch(vocab)
for i in range(rows):
    batch.add(f"r{i}", corelib.SamplingParams(**params))
sampler.sample(logits, batch)
times = []
for _ in range(reps):
    start = time.perf_counter(); sampler.sample(logits, batch).token_ids.tolist()
    times.append(time.perf_counter() - start)
print(json.dumps(statistics.median(times)))
"""


def cpu_backend_time(python, vocab, rows, scale, reps, params):
    """Median seconds of the cpu backend's sample, measured by ``python`` (another venv: the
    cpu plugin targets the project's main torch) on the same logits."""
    import json
    import subprocess
    out = subprocess.run([python, "-c", CPU_SCRIPT, json.dumps([vocab, rows, scale, reps, params])],
                         capture_output=True, text=True)
    if out.returncode != 0:
        return None, out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "failed"
    return json.loads(out.stdout.strip().splitlines()[-1]), ""


def bench_one(name, params, scale, rows, vocab, reps, tpu, cpu_python, device):
    gen = torch.Generator().manual_seed(rows)
    host = torch.randn((rows, vocab), generator=gen) * scale
    logits = host.to(device)
    sp = SamplingParams(**params)
    batch = tpu.new_batch(vocab)
    for i in range(rows):
        batch.add(f"r{i}", sp)
    temperature = torch.full((rows,), sp.temperature).to(device)
    top_k = torch.full((rows,), sp.effective_top_k).to(device)
    top_p = torch.full((rows,), sp.top_p).to(device)
    keys = torch.randint(-(2**31), 2**31, (rows,), dtype=torch.int32, generator=gen).to(device)
    import torch_xla
    torch_xla.sync()

    def run_tpu():
        tpu.sample(logits, batch).token_ids.tolist()

    def run_sort():
        sort_based_sample(logits, temperature, top_k, top_p, keys).cpu().tolist()

    result = {"config": name, "rows": rows, "path": batch.path()}
    for label, fn in (("tpu", run_tpu), ("sort", run_sort)):
        before = compile_count()
        result[f"{label}_first"] = timed(fn)
        result[f"{label}_graphs"] = compile_count() - before
    times = {"tpu": [], "sort": []}
    for _ in range(reps):
        times["sort"].append(timed(run_sort))
        times["tpu"].append(timed(run_tpu))
    result["tpu"] = statistics.median(times["tpu"])
    result["sort"] = statistics.median(times["sort"])
    # Each round times both back to back: the median of the per-round ratios resists load drift.
    result["ratio"] = statistics.median(s / t for s, t in zip(times["sort"], times["tpu"]))
    result["cpu"], result["cpu_error"] = (cpu_backend_time(cpu_python, vocab, rows, scale, reps, params)
                                          if cpu_python else (None, "not measured"))
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--cpu-python", default=None,
                        help="a Python with corelib and corelib-cpu installed, to time the cpu backend")
    args = parser.parse_args()

    from corelib_tpu.sampler import TpuSampler
    from corelib_tpu.xla import default_device
    device = default_device()
    tpu = TpuSampler(device, max_rows=max(args.rows))

    results = []
    for name in args.configs:
        params, scale = CONFIGS[name]
        for rows in args.rows:
            results.append(bench_one(name, params, scale, rows, args.vocab, args.reps, tpu,
                                     args.cpu_python, device))
            r = results[-1]
            print(f"# {name}, B={rows}: tpu {r['tpu']*1e3:.1f} ms, sort {r['sort']*1e3:.1f} ms, "
                  f"ratio {r['ratio']:.1f}, cpu {r['cpu']} {r['cpu_error']}", flush=True)

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\nV = {args.vocab}, XLA:CPU ({os.cpu_count()} cores, load average {load:.1f}), "
          f"torch {torch.__version__}, median of {args.reps} interleaved rounds\n")
    print("| config | B | path | tpu ms | sort ms | sort / tpu | cpu ms | tpu first s (graphs) | sort first s (graphs) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        cpu_ms = f"{r['cpu'] * 1e3:.1f}" if r["cpu"] is not None else "-"
        print(f"| {r['config']} | {r['rows']} | {r['path']} | {r['tpu'] * 1e3:.1f} | {r['sort'] * 1e3:.1f} "
              f"| {r['ratio']:.1f}x | {cpu_ms} | {r['tpu_first']:.1f} ({r['tpu_graphs']}) "
              f"| {r['sort_first']:.1f} ({r['sort_graphs']}) |")


if __name__ == "__main__":
    main()
