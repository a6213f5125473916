"""The tpu backend on XLA against sort-based traced samplers, and what its features cost.

Run with the XLA venv (torch 2.9 + torch-xla 2.9, corelib, corelib-tpu, optionally corelib-cpu)::

    PJRT_DEVICE=CPU python benchmarks/tpu_bench.py [--suites sample verify costs]
        [--vocab 128256] [--rows 1 8 32] [--reps 7] [--verify-rows 32] [--k 4]

Three suites, each measured in one process and interleaved round by round (so machine load
hits every variant alike); times are medians over the rounds, ratios the medians of the
per-round ratios:

``sample`` (each configuration and batch size):

- ``tpu``: ``TpuSampler.sample`` on logits already on the XLA device (all stages, padding to
  the bucket, one transfer of the results);
- ``sort``: a straightforward traced sampler: temperature, a full sort, top-k by rank,
  softmax + cumsum for top-p, scatter back to vocabulary order (``harness.sort_based_filter``),
  the contract's Gumbel draw (``torch.argmax``), one transfer of the ids;
- ``light``: the lighter fixed reference the backend's lead was first measured against: the
  same sort-based filter, then ``argmax`` over the logits plus noise computed once before the
  timing (no hash, no logarithms in the timed graph), one transfer of the ids;
- ``cpu``: the ``cpu`` backend on the same logits as CPU tensors, timed by ``--cpu-python``
  (the cpu plugin targets the project's main torch, not torch 2.9).

``verify`` (B rows, K drafts each, with and without draft probabilities):

- ``tpu``: ``TpuSampler.verify`` (one graph for B (K+1) slots, one transfer);
- ``sort``: the same verification traced the straightforward way: the sort-based filter at
  every slot, the Gumbel draw, the ratio test and a residual draw, the emitted tokens, one
  transfer.

``costs`` (B rows, one step): the production step against the same step built without one
feature, to price what every graph carries (the token bitmask input, DRY) and what a variant
adds (the filters 10a-13b, a real DRY history).

"first" is the first call, compilation included, and "graphs" counts the XLA graphs that call
compiled; every variant then runs once more untimed before the rounds. Prints Markdown
tables.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from corelib import SamplingParams

import harness
from harness import sort_based_filter


CONFIGS = {
    # name: (parameters, logits scale: 3 = peaked like an LLM's, 0.01 = nearly flat)
    "top-k 50 + top-p 0.9 + T 0.7": (dict(top_k=50, top_p=0.9, temperature=0.7), 3.0),
    "top-p 0.9, flat logits": (dict(top_p=0.9), 0.01),
    "temperature 0.8 + min-p 0.05": (dict(temperature=0.8, min_p=0.05), 3.0),
    "greedy": (dict(temperature=0.0), 3.0),
}


def gumbel_draw(x, keys, greedy):
    """Step 14: ``argmax(x + gumbel)`` with the contract's noise keyed per row."""
    from corelib import noise
    vocab = torch.arange(x.shape[-1], dtype=torch.int32, device=x.device)[None, :]
    gumbel = torch.where(greedy[:, None], 0.0, noise.seeded_gumbel(keys[:, None], vocab))
    return torch.argmax(x + gumbel, dim=-1)


def sort_based_sample(logits, temperature, top_k, top_p, keys):
    """The straightforward traced sampler (see the module docstring). int64 ``[B]``."""
    return gumbel_draw(sort_based_filter(logits, temperature, top_k, top_p), keys, temperature == 0)


def light_sample(logits, temperature, top_k, top_p, gumbel):
    """The light baseline (see the module docstring): the sort-based filter, then ``argmax``
    over the filtered logits plus ``gumbel``, float32 ``[B, V]`` noise made before the timing
    (zero in greedy rows). int64 ``[B]``."""
    return torch.argmax(sort_based_filter(logits, temperature, top_k, top_p) + gumbel, dim=-1)


def sort_based_verify(logits, temperature, top_k, top_p, keys, uniforms, drafts, probs):
    """Verification the straightforward traced way: the sort-based filter and the draw at every
    slot of ``logits`` ``[B, K+1, V]``; with draft ``probs`` ``[B, K, V]``, the ratio test
    (``uniforms`` ``[B (K+1)]``) and a draw from the residual at each draft slot; the emitted
    tokens and their count, packed as int32 ``[B, K + 2]``."""
    B, S, V = logits.shape
    K = S - 1
    per_slot = lambda t: t.repeat_interleave(S)                            # noqa: E731
    final = sort_based_filter(logits.reshape(B * S, V), per_slot(temperature), per_slot(top_k),
                              per_slot(top_p))
    greedy = per_slot(temperature == 0)
    tokens = gumbel_draw(final, keys, greedy).view(B, S)
    accepted = drafts == tokens[:, :K]
    if probs is not None:
        p = torch.softmax(final, dim=-1).view(B, S, V)[:, :K]
        d = drafts.clamp(min=0)[..., None]
        u = uniforms.view(B, S)[:, :K]
        accepted = u * probs.gather(2, d)[..., 0] < p.gather(2, d)[..., 0]
        residual = (p - probs).clamp(min=0.0)
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)
        recovered = gumbel_draw(residual.log().reshape(B * K, V), keys.view(B, S)[:, :K].reshape(-1),
                                greedy.view(B, S)[:, :K].reshape(-1)).view(B, K)
        tokens = torch.cat([recovered, tokens[:, K:]], dim=1)
    taken = (torch.cumsum((~accepted).to(torch.int32), dim=1) == 0).sum(dim=1)
    last = tokens.gather(1, taken[:, None])
    column = torch.arange(S, device=logits.device)[None, :]
    padded = torch.cat([drafts, last], dim=1)
    emitted = torch.where(column < taken[:, None], padded, torch.where(column == taken[:, None], last, -1))
    return torch.cat([emitted, (taken + 1)[:, None]], dim=1).to(torch.int32)


def compile_count() -> int:
    from corelib_tpu.xla import compile_count as count
    return count()


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


def baseline_inputs(sp: SamplingParams, rows: int, vocab: int, gen: torch.Generator, device):
    """The sort-based baselines' inputs for ``rows`` rows of ``sp``, on ``device``:
    temperature, top_k and top_p ``[rows]``, the rows' noise keys (int32 ``[rows]``, drawn
    from ``gen``) and the light baseline's Gumbel noise (float32 ``[rows, vocab]``, the
    contract's, made once before the timing)."""
    from corelib import noise
    temperature = torch.full((rows,), sp.temperature).to(device)
    top_k = torch.full((rows,), sp.effective_top_k).to(device)
    top_p = torch.full((rows,), sp.top_p).to(device)
    keys = torch.randint(-(2**31), 2**31, (rows,), dtype=torch.int32, generator=gen).to(device)
    vocab_ids = torch.arange(vocab, dtype=torch.int32)[None, :].to(device)
    gumbel = torch.where((temperature == 0)[:, None], 0.0, noise.seeded_gumbel(keys[:, None], vocab_ids))
    return temperature, top_k, top_p, keys, gumbel


def bench_one(name, params, scale, rows, vocab, reps, tpu, cpu_python, device):
    gen = torch.Generator().manual_seed(rows)
    host = torch.randn((rows, vocab), generator=gen) * scale
    logits = host.to(device)
    sp = SamplingParams(**params)
    batch = tpu.new_batch(vocab)
    for i in range(rows):
        batch.add(f"r{i}", sp)
    temperature, top_k, top_p, keys, gumbel = baseline_inputs(sp, rows, vocab, gen, device)
    import torch_xla
    torch_xla.sync()

    def run_tpu():
        tpu.sample(logits, batch).token_ids.tolist()

    def run_sort():
        sort_based_sample(logits, temperature, top_k, top_p, keys).cpu().tolist()

    def run_light():
        light_sample(logits, temperature, top_k, top_p, gumbel).cpu().tolist()

    result = {"config": name, "rows": rows, "path": batch.path()}
    times = interleaved({"tpu": run_tpu, "sort": run_sort, "light": run_light}, reps)
    for label in ("tpu", "sort", "light"):
        result[f"{label}_first"], result[f"{label}_graphs"], result[label] = times[label][:3]
    # Each round times all back to back: the median of the per-round ratios resists load drift.
    result["ratio"] = ratio(times, "sort", "tpu")
    result["cpu_ratio"] = ratio(times, "sort", "tpu", 4)
    result["light_ratio"] = ratio(times, "light", "tpu")
    result["light_cpu_ratio"] = ratio(times, "light", "tpu", 4)
    result["cpu"], result["cpu_error"] = (cpu_backend_time(cpu_python, vocab, rows, scale, reps, params)
                                          if cpu_python else (None, "not measured"))
    return result


VERIFY_CONFIGS = {
    # name: (parameters, with draft probabilities, verify method)
    "top-k 50 + top-p 0.9, draft probs": (dict(top_k=50, top_p=0.9), True, "token"),
    "top-k 50 + top-p 0.9, draft probs, block": (dict(top_k=50, top_p=0.9), True, "block"),
    "top-k 50 + top-p 0.9, no draft probs": (dict(top_k=50, top_p=0.9), False, "token"),
    "greedy": (dict(temperature=0.0), False, "token"),
}


def interleaved(fns: dict, reps: int) -> dict:
    """{label: [first call s, graphs it compiled, median wall s, [per-round wall s],
    [per-round CPU s]]}: the first call of each (compilation included) timed alone, then one
    untimed warm round and ``reps`` interleaved rounds (``harness.interleaved``), each round
    starting with the next call in turn, each call's
    process CPU time (every XLA:CPU thread, none of the other jobs) recorded beside its wall
    time."""
    out = {}
    for label, fn in fns.items():
        before = compile_count()
        out[label] = [harness.timed(fn) / 1e3, compile_count() - before, None, [], []]
    cpu: dict = {label: [] for label in fns}

    def with_cpu(label, fn):
        def call():
            start = time.process_time()
            fn()
            cpu[label].append(time.process_time() - start)
        return call
    # rotated: a call that always followed the slowest one (the sort-based reference, a second
    # of work) ran up to a fifth slower in that slot
    wall = harness.interleaved({label: with_cpu(label, fn) for label, fn in fns.items()}, reps,
                               warmup=1, rotate=True)
    for label in fns:
        out[label][3] = [ms / 1e3 for ms in wall[label]]
        out[label][4] = cpu[label][1:]                     # the warm round's left out
        out[label][2] = statistics.median(out[label][3])
    return out


def ratio(times: dict, slow: str, fast: str, column: int = 3) -> float:
    """Median of the per-round ratios, of wall times (column 3) or CPU times (4)."""
    return statistics.median(s / f for s, f in zip(times[slow][column], times[fast][column]))


def bench_verify(name, params, with_probs, method, rows, K, vocab, reps, device):
    from corelib_tpu.sampler import TpuSampler
    import torch_xla
    S = K + 1
    gen = torch.Generator().manual_seed(K)
    logits = (torch.randn((rows, S, vocab), generator=gen) * 3).to(device)
    q_host = torch.softmax(torch.randn((rows, K, vocab), generator=gen) * 3, dim=-1)
    drafts = torch.multinomial(q_host.reshape(-1, vocab), 1, generator=gen).view(rows, K).to(device)
    q = q_host.to(device) if with_probs else None
    sp = SamplingParams(**params)
    tpu = TpuSampler(device, buckets=(rows,), speculative_k=(K,))
    batch = tpu.new_batch(vocab)
    for i in range(rows):
        batch.add(f"r{i}", SamplingParams(**params, seed=i))
    temperature = torch.full((rows,), sp.temperature).to(device)
    top_k = torch.full((rows,), sp.effective_top_k).to(device)
    top_p = torch.full((rows,), sp.top_p).to(device)
    keys = torch.randint(-(2**31), 2**31, (rows * S,), dtype=torch.int32, generator=gen).to(device)
    uniforms = torch.rand((rows * S,), generator=gen).to(device)
    torch_xla.sync()
    times = interleaved({
        "tpu": lambda: tpu.verify(logits, batch, drafts, q, method=method).token_ids.tolist(),
        "sort": lambda: sort_based_verify(logits, temperature, top_k, top_p, keys, uniforms, drafts,
                                          q).cpu().tolist(),
    }, reps)
    return {"config": name, "rows": rows, "K": K, "path": batch.path(), "times": times,
            "ratio": ratio(times, "sort", "tpu"), "cpu_ratio": ratio(times, "sort", "tpu", 4)}


COST_CONFIGS = {
    "top-k 50 + top-p 0.9": dict(top_k=50, top_p=0.9),
    "temperature 0.8 + min-p 0.05": dict(temperature=0.8, min_p=0.05),
}


def _sampler_without(flag: str):
    """A TpuSampler whose step graphs leave out one stage the production graphs always carry
    (``any_bitmask`` or ``any_dry``): for pricing it only."""
    import dataclasses
    from corelib_tpu.sampler import TpuSampler

    class Without(TpuSampler):
        def with_bitmask(self, s, batch, token_bitmask, slots=None):
            s = super().with_bitmask(s, batch, token_bitmask, slots)
            return dataclasses.replace(s, **{flag: False})
    return Without


def bench_costs(name, params, rows, vocab, reps, device, dry_history=1024):
    from corelib.bitmask import pack_bitmask
    from corelib_tpu.sampler import TpuSampler
    import torch_xla
    gen = torch.Generator().manual_seed(rows)
    logits = (torch.randn((rows, vocab), generator=gen) * 3).to(device)
    allowed = torch.rand((rows, vocab), generator=gen) < 0.5
    allowed[:, :100] = True
    mask = pack_bitmask(allowed)
    history = torch.randint(0, 200, (dry_history,), generator=gen).tolist()

    def batch_of(sampler, extra=None, first=None):
        batch = sampler.new_batch(vocab)
        for i in range(rows):
            row = dict(params, seed=i, **(extra or {}))
            if i == 0 and first:
                row.update(first)
            batch.add(f"r{i}", SamplingParams(**row), prompt_token_ids=history if extra else [])
        return batch

    make = lambda cls=TpuSampler: cls(device, buckets=(rows,), dry_window=dry_history)  # noqa: E731
    production = make()
    plain = batch_of(production)
    no_mask, no_dry = make(_sampler_without("any_bitmask")), make(_sampler_without("any_dry"))
    steps = {
        "production": (production, plain, None),
        "with a host bitmask": (production, plain, mask),
        "no bitmask stage": (no_mask, batch_of(no_mask), None),
        "no DRY stage": (no_dry, batch_of(no_dry), None),
        f"every row DRY, {dry_history}-token history":
            (production, batch_of(production, extra=dict(dry_multiplier=0.8, dry_allowed_length=2)), None),
        "filters variant (one row top-n-sigma)":
            (production, batch_of(production, first=dict(top_n_sigma=2.0)), None),
    }
    torch_xla.sync()
    fns = {label: (lambda s=s, b=b, m=m: s.sample(logits, b, m).token_ids.tolist())
           for label, (s, b, m) in steps.items()}
    times = interleaved(fns, reps)
    return {"config": name, "rows": rows, "times": times,
            "ratios": {label: ratio(times, label, "production") for label in times},
            "cpu_ratios": {label: ratio(times, label, "production", 4) for label in times}}


PROFILE_CONFIGS = {
    "top-k 50 + top-p 0.9 + T 0.7": (dict(top_k=50, top_p=0.9, temperature=0.7), 3.0),
    "top-p 0.9, flat logits": (dict(top_p=0.9), 0.01),
}


def _ablations():
    """{label: TpuSampler subclass}: the production step, and steps that each leave one part
    out (not valid samplers: for pricing the parts of a step only). Flags are switched off
    through ``with_bitmask``, the template's last hook before the stages."""
    import dataclasses
    from corelib_tpu import thresholds
    from corelib_tpu.filter_stages import filters_in_use
    from corelib_tpu.sampler import TpuSampler

    def without(**flags):
        class Without(TpuSampler):
            def with_bitmask(self, s, batch, token_bitmask, slots=None):
                s = super().with_bitmask(s, batch, token_bitmask, slots)
                return dataclasses.replace(s, **flags)
        return Without

    class NoNoise(TpuSampler):
        def draw(self, x, s, route=None):
            return thresholds.first_argmax(x)

    class NoDry(TpuSampler):
        def apply_dry(self, x, s):
            return x

    class NoFilterConds(TpuSampler):
        # the filter group's conditional on the filters few batches use
        # (``FilterStages.run_group``): its branch without them, alone
        def run_group(self, group, x, s):
            if group != "filter":
                return super().run_group(group, x, s)
            lean = [stage for stage in filters_in_use(s) if stage.name in ("temperature", "top_k_top_p")]
            return self._filters_in_turn(x, dataclasses.replace(s, any_dynatemp=False), lean)

    return {
        "production": TpuSampler,
        "no draw noise (argmax only)": NoNoise,
        "no DRY conditional": NoDry,
        "no conditionals of the filters few batches use": NoFilterConds,
        "no kept-set conditional": without(any_kept=False),
        "no step 8b": without(any_thinking=False),
        "no bitmask": without(any_bitmask=False),
        "no penalties (7-8)": without(any_penalties=False),
        "no allowed ids, bad words, min tokens (3-5)": without(any_allowed=False, any_bad_words=False,
                                                                any_min_tokens=False),
        "no step 15 conditional": without(num_logprobs=None),
    }


def bench_profile(name, params, scale, rows, vocab, reps, device):
    """Where a step's time goes: the production step against steps built without one part
    (``_ablations``), interleaved; plus the host's share (tracing the step in Python)."""
    import torch_xla
    from corelib_tpu.sampler import TpuSampler
    gen = torch.Generator().manual_seed(rows)
    logits = (torch.randn((rows, vocab), generator=gen) * scale).to(device)
    fns = {}
    for label, cls in _ablations().items():
        sampler = cls(device, buckets=(rows,))
        batch = sampler.new_batch(vocab)
        for i in range(rows):
            batch.add(f"r{i}", SamplingParams(**params))
        fns[label] = lambda s=sampler, b=batch: s.sample(logits, b).token_ids.tolist()
    tracer = TpuSampler(device, buckets=(rows,))
    traced = tracer.new_batch(vocab)
    for i in range(rows):
        traced.add(f"r{i}", SamplingParams(**params))
    tracer.sample(logits, traced)

    def trace_only():      # the step's Python tracing, its graph never launched
        from corelib.sampler import Sampler
        Sampler.sample(tracer, logits, traced)
    fns["host: tracing the step (not launched)"] = trace_only
    torch_xla.sync()
    times = interleaved(fns, reps)
    return {"config": name, "rows": rows, "times": times,
            "ratios": {label: ratio(times, label, "production") for label in times},
            "cpu_ratios": {label: ratio(times, label, "production", 4) for label in times}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suites", nargs="+", default=["sample", "verify", "costs"],
                        choices=["sample", "verify", "costs", "profile"])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--verify-rows", type=int, default=32)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--cost-rows", type=int, default=32)
    parser.add_argument("--cpu-python", default=None,
                        help="a Python with corelib and corelib-cpu installed, to time the cpu backend")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from corelib_tpu.sampler import TpuSampler
    from corelib_tpu.xla import default_device
    device = default_device()
    print(f"V = {args.vocab}, XLA:CPU ({os.cpu_count()} cores), torch {torch.__version__}, "
          f"median of {args.reps} interleaved rounds\n")

    if "sample" in args.suites:
        tpu = TpuSampler(device, max_rows=max(args.rows))
        results = []
        for name in args.configs:
            params, scale = CONFIGS[name]
            for rows in args.rows:
                results.append(bench_one(name, params, scale, rows, args.vocab, args.reps, tpu,
                                         args.cpu_python, device))
                r = results[-1]
                print(f"# {name}, B={rows}: tpu {r['tpu']*1e3:.1f} ms, sort {r['sort']*1e3:.1f} ms, "
                      f"light {r['light']*1e3:.1f} ms, ratio {r['ratio']:.1f}, light ratio "
                      f"{r['light_ratio']:.1f}, cpu {r['cpu']} {r['cpu_error']}", flush=True)
        print(f"\n## sample (load average {load():.1f})\n")
        print("| config | B | path | tpu ms | sort ms | sort / tpu | sort / tpu, CPU time | light ms "
              "| light / tpu | light / tpu, CPU time | cpu ms | tpu first s (graphs) | sort first s (graphs) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in results:
            cpu_ms = f"{r['cpu'] * 1e3:.1f}" if r["cpu"] is not None else "-"
            print(f"| {r['config']} | {r['rows']} | {r['path']} | {r['tpu'] * 1e3:.1f} | {r['sort'] * 1e3:.1f} "
                  f"| {r['ratio']:.1f}x | {r['cpu_ratio']:.1f}x | {r['light'] * 1e3:.1f} "
                  f"| {r['light_ratio']:.1f}x | {r['light_cpu_ratio']:.1f}x | {cpu_ms} | {r['tpu_first']:.1f} "
                  f"({r['tpu_graphs']}) | {r['sort_first']:.1f} ({r['sort_graphs']}) |", flush=True)

    if "verify" in args.suites:
        results = []
        for name, (params, with_probs, method) in VERIFY_CONFIGS.items():
            results.append(bench_verify(name, params, with_probs, method, args.verify_rows, args.k,
                                        args.vocab, args.reps, device))
            print(f"# verify {name}: ratio {results[-1]['ratio']:.1f} (CPU time "
                  f"{results[-1]['cpu_ratio']:.1f})", flush=True)
        print(f"\n## verify (load average {load():.1f})\n")
        print("| config | B | K | path | tpu ms | sort ms | sort / tpu | sort / tpu, CPU time | tpu first s (graphs) | sort first s (graphs) |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in results:
            t, o = r["times"]["tpu"], r["times"]["sort"]
            print(f"| {r['config']} | {r['rows']} | {r['K']} | {r['path']} | {t[2] * 1e3:.1f} | "
                  f"{o[2] * 1e3:.1f} | {r['ratio']:.1f}x | {r['cpu_ratio']:.1f}x | {t[0]:.1f} ({t[1]}) | "
                  f"{o[0]:.1f} ({o[1]}) |", flush=True)

    if "costs" in args.suites:
        results = []
        for name, params in COST_CONFIGS.items():
            results.append(bench_costs(name, params, args.cost_rows, args.vocab, args.reps, device))
            print(f"# costs {name}: {results[-1]['ratios']}", flush=True)
        print_parts("costs", results)


    if "profile" in args.suites:
        results = []
        for name, (params, scale) in PROFILE_CONFIGS.items():
            results.append(bench_profile(name, params, scale, args.cost_rows, args.vocab, args.reps, device))
            print(f"# profile {name}: {results[-1]['ratios']}", flush=True)
        print_parts("profile", results)

def load() -> float:
    """The machine's one-minute load average (NaN where the OS has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def print_parts(title: str, results: list) -> None:
    """The table of a suite that times a step's parts against the production step."""
    print(f"\n## {title} (load average {load():.1f})\n")
    print("| config | B | step | ms | / production | / production, CPU time | first s (graphs) |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        for label, t in r["times"].items():
            print(f"| {r['config']} | {r['rows']} | {label} | {t[2] * 1e3:.1f} | "
                  f"{r['ratios'][label]:.2f} | {r['cpu_ratios'][label]:.2f} | {t[0]:.1f} ({t[1]}) |",
                  flush=True)


if __name__ == "__main__":
    main()
