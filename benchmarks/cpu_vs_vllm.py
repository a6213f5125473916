"""The cpu backend against vLLM's CPU sampler, on the same logits in one process (issue 13).

Runs vLLM's ``vllm.v1.sample.sampler.Sampler`` (the V1 sampler a vLLM CPU build uses: its
top-k/top-p by sorting, its fused Gumbel-argmax draw with a seed per row) and corelib's
``cpu`` backend on the same random logits, for the six configurations of issue 13 and two
with 5 logprobs asked for (issue 35), B in {1, 8, 32, 128}, and prints the ratio table
(vLLM time / corelib time: above 1 means corelib is faster) with the issues' targets, the
milliseconds of both, and corelib's time in clone-passes at B = 1. Calls of the two samplers alternate, so load changes hit both.

vLLM is not a dependency of corelib. Run this script with the vLLM venv the test command
builds (``scripts/lib.sh``'s ``ensure_vllm_venv``: vLLM's CPU build on the pinned torch, with
corelib and the cpu plugin). Without vLLM, the script times corelib alone.

    .venv-vllm/bin/python benchmarks/cpu_vs_vllm.py                 # one torch thread
    .venv-vllm/bin/python benchmarks/cpu_vs_vllm.py --threads 2
    .venv-vllm/bin/python benchmarks/cpu_vs_vllm.py --batch-sizes 1,8 --repeats 9
    .venv-vllm/bin/python benchmarks/cpu_vs_vllm.py --base engine   # the cpu plugin of a revision too

How else a harness might call the two, each behind a flag (issue 35: an independent harness
read some seeded cells lower than this one):

- ``--through-vllm``: corelib through its vLLM integration (``CorelibSampler.forward``) fed the
  metadata of a real vLLM ``InputBatch`` holding the requests, as the engine's model runner
  does (the batch mirror's sync, the sample, the append, vLLM's output types); vLLM's sampler
  gets that same metadata (each seeded request's generator as the runner makes it);
- ``--dtype bfloat16``: the logits in bfloat16, as a model emits them (both samplers convert);
- ``--fresh-batch``: a new corelib batch every call (the requests added, one sample, removed):
  no plan or workspace kept from an earlier step;
- ``--logprobs N``: every request asks for N logprobs, on both sides.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import statistics
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from corelib import SamplingParams
from corelib.bench import machine_description, make_logits

from corelib_cpu.sampler import CpuSampler
from harness import add_clock_argument, clock_from, load_average, load_vllm, timed, vllm_metadata

V = 128256
BATCH_SIZES = (1, 8, 32, 128)
# name -> (corelib SamplingParams fields, seeded); the rows of issue 13's table, in order
CONFIGS: dict[str, tuple[dict, bool]] = {
    "top-k 50 + top-p 0.9 + T 0.7": (dict(top_k=50, top_p=0.9, temperature=0.7), False),
    "top-p 0.9 alone": (dict(top_p=0.9), False),
    "plain random": (dict(), False),
    "every row seeded: top-k + top-p + T": (dict(top_k=50, top_p=0.9, temperature=0.7), True),
    "every row seeded: top-p alone": (dict(top_p=0.9), True),
    "every row seeded: plain random": (dict(), True),
    # issue 35: with logprobs asked for, the cells read lowest (a harness serving requests
    # that ask for them measures these)
    "top-k + top-p + T, 5 logprobs": (dict(top_k=50, top_p=0.9, temperature=0.7, logprobs=5), False),
    "every row seeded: top-p alone, 5 logprobs": (dict(top_p=0.9, logprobs=5), True),
}
# Issue 13's targets: the smallest acceptable ratio, per config, as a function of B.
TARGETS: dict[str, tuple[Callable[[int], float], str]] = {
    "top-k 50 + top-p 0.9 + T 0.7": (lambda B: 15.0 if B == 1 else 25.0, ">= 15x at B=1, >= 25x at B >= 8"),
    "top-p 0.9 alone": (lambda B: 8.0, ">= 8x everywhere"),
    "plain random": (lambda B: 1.0, ">= 1x"),
    "every row seeded: top-k + top-p + T": (lambda B: 15.0 if B == 1 else 25.0, "as unseeded"),
    "every row seeded: top-p alone": (lambda B: 8.0, ">= 8x"),
    "every row seeded: plain random": (lambda B: 1.0, ">= 1x"),
    "top-k + top-p + T, 5 logprobs": (lambda B: 15.0 if B == 1 else 25.0, "as without logprobs"),
    "every row seeded: top-p alone, 5 logprobs": (lambda B: 8.0, ">= 8x"),
}


@dataclass
class Cell:
    config: str
    batch_size: int
    corelib_ms: float
    vllm_ms: Optional[float]
    clone_ms: float
    base_ms: Optional[float] = None      # the cpu plugin of --base, when asked

    @property
    def ratio(self) -> Optional[float]:
        return None if self.vllm_ms is None else self.vllm_ms / self.corelib_ms

    @property
    def base_ratio(self) -> Optional[float]:
        return None if self.vllm_ms is None or self.base_ms is None else self.vllm_ms / self.base_ms


def corelib_batch(sampler: CpuSampler, params: dict, seeded: bool, B: int):
    batch = sampler.new_batch(V)
    for i in range(B):
        extra = dict(seed=100_003 + i) if seeded else {}
        batch.add(f"req-{i}", SamplingParams(**params, **extra))
    return batch


class ThroughVllm:
    """corelib's ``cpu`` backend behind its vLLM integration: ``CorelibSampler`` on a real vLLM
    ``InputBatch`` of B requests (vLLM's SamplingParams from ``params``, seeds 100_003 + i
    when ``seeded``, their generators made as the model runner makes them), called with that
    batch's own ``sampling_metadata`` as the runner calls it; ``step(logits)`` samples, then
    extends each request's output tokens by its token, as the runner does. ``metadata``: the
    same metadata for vLLM's sampler."""

    def __init__(self, params: dict, seeded: bool, B: int):
        from types import SimpleNamespace

        from vllm import SamplingParams as VllmParams
        from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

        from corelib.integrations.vllm.sampler import CorelibSampler
        self.input_batch = InputBatch(max_num_reqs=max(B, 1), max_model_len=1 << 16,
                                      max_num_batched_tokens=1 << 16, device=torch.device("cpu"),
                                      vocab_size=V, block_sizes=[16], max_num_blocks_per_req=[4096])
        self.requests = {}
        for i in range(B):
            extra = {"logprobs": params["logprobs"]} if "logprobs" in params else {}
            vp = VllmParams(temperature=float(params.get("temperature", 1.0)), top_p=float(params.get("top_p", 1.0)),
                            top_k=int(params.get("top_k", 0)), seed=100_003 + i if seeded else None, **extra)
            generator = torch.Generator().manual_seed(vp.seed) if vp.seed is not None else None
            state = CachedRequestState(req_id=f"req-{i}", prompt_token_ids=[1, 2, 3], mm_features=[],
                                       sampling_params=vp, generator=generator, block_ids=([0],),
                                       num_computed_tokens=0, output_token_ids=[])
            self.requests[state.req_id] = state
            self.input_batch.add_request(state)
        self.input_batch.condense()
        self.input_batch.refresh_metadata()
        runner = SimpleNamespace(
            model_config=SimpleNamespace(logprobs_mode="raw_logprobs", seed=0),
            vllm_config=SimpleNamespace(reasoning_config=None), speculative_config=None,
            input_batch=self.input_batch, requests=self.requests, device="cpu")
        self.sampler = CorelibSampler(runner, "cpu")
        self.metadata = self.input_batch.sampling_metadata

    def step(self, logits: torch.Tensor):
        out = self.sampler(logits, self.metadata)
        for rid, token in zip(self.input_batch.req_ids, out.sampled_token_ids[:, 0].tolist()):
            self.requests[rid].output_token_ids.append(token)
        return out


def bench_cell(vllm, name: str, B: int, repeats: int, clock, Base=None, profile: str = "flat",
               how: Optional[dict] = None) -> Cell:
    """One cell; ``how``: the ways of calling of the module docstring (``through_vllm``,
    ``dtype``, ``fresh_batch``, ``logprobs``), all off when None."""
    how = how or {}
    params, seeded = CONFIGS[name]
    if how.get("logprobs") is not None:
        params = dict(params, logprobs=how["logprobs"])
    logits = make_logits(B, V, profile).to(how.get("dtype", torch.float32))
    sampler = CpuSampler()
    batch = corelib_batch(sampler, params, seeded, B)
    through = ThroughVllm(params, seeded, B) if how.get("through_vllm") else None
    if through is not None:
        corelib_step = lambda: through.step(logits)                          # noqa: E731
    elif how.get("fresh_batch"):
        def corelib_step():
            fresh = corelib_batch(sampler, params, seeded, B)
            return sampler.sample(logits, fresh)
    else:
        # A decode loop: each call samples and appends, so seeded rows move to a new position.
        corelib_step = lambda: sampler.step(logits, batch)                  # noqa: E731
    base_step = None
    if Base is not None:
        base_sampler = Base()
        base_batch = corelib_batch(base_sampler, params, seeded, B)
        base_step = lambda: base_sampler.step(logits, base_batch)            # noqa: E731
        base_step()
    vllm_step = None
    if vllm is not None:
        # the metadata as vLLM's input batch builds it (a generator per row when seeded)
        seeds = [100_003 + i for i in range(B)] if seeded else None
        vllm_sampler = vllm.Sampler()
        metadata = (through.metadata if through is not None
                    else vllm_metadata(vllm, B, params, seeds=seeds))
        spare = [logits.clone() for _ in range(2 * repeats + 1)]   # vLLM works in place on its input
        vllm_step = lambda: vllm_sampler(spare.pop(), metadata)              # noqa: E731
    corelib_step()                                                          # warm-up
    if vllm_step is not None:
        vllm_step()
    corelib_times, vllm_times, base_times = [], [], []
    for i in range(repeats):
        if base_step is None:
            corelib_times.append(timed(corelib_step, clock=clock))
            if vllm_step is not None:
                vllm_times.append(timed(vllm_step, clock=clock))
            continue
        # Each corelib side runs right after a vLLM call, as in the loop without --base: the
        # call after vLLM's pays for the caches and memory vLLM's sort left behind (2-3x at
        # B = 32), so taking turns in one rotation would compare positions, not code.
        if vllm_step is not None:
            vllm_times.append(timed(vllm_step, clock=clock))
        corelib_times.append(timed(corelib_step, clock=clock))
        if vllm_step is not None:
            vllm_times.append(timed(vllm_step, clock=clock))
        base_times.append(timed(base_step, clock=clock))
    clone_ms = statistics.median(timed(logits.clone, clock=clock) for _ in range(max(repeats, 9)))
    return Cell(name, B, statistics.median(corelib_times),
                statistics.median(vllm_times) if vllm_times else None, clone_ms,
                statistics.median(base_times) if base_times else None)


def table(cells: list[Cell], batch_sizes, value: Callable[[Cell], str], last: Optional[Callable[[str], str]] = None) -> str:
    head = ["config"] + [f"B={B}" for B in batch_sizes] + (["target"] if last else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in dict.fromkeys(c.config for c in cells):
        row = [name]
        for B in batch_sizes:
            cell = next((c for c in cells if c.config == name and c.batch_size == B), None)
            row.append("-" if cell is None else value(cell))
        if last:
            row.append(last(name))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def verdicts(cells: list[Cell]) -> list[str]:
    out = []
    for c in cells:
        if c.ratio is None:
            continue
        need = TARGETS[c.config][0](c.batch_size)
        out.append(f"{'MET ' if c.ratio >= need else 'MISS'} {c.config}, B={c.batch_size}: "
                   f"{c.ratio:.1f}x (target {need:g}x)")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)))
    parser.add_argument("--configs", default=None,
                        help="comma-separated indices (0-7) of the configs to run (default: all)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed calls per cell, median reported (default: 15 for B <= 8, else 5)")
    parser.add_argument("--no-vllm", action="store_true", help="time corelib alone")
    parser.add_argument("--base", help="also time the cpu plugin of this git revision, in the same "
                                       "calls' rotation (benchmarks/cpu_ab.py's loader)")
    parser.add_argument("--logits", choices=("flat", "peaked"), default="flat",
                        help="the logits' profile (corelib.bench.make_logits): flat randn (default, "
                             "issue 13's table) or peaked, a language model's falling log-probabilities")
    parser.add_argument("--through-vllm", action="store_true",
                        help="corelib through CorelibSampler on a real vLLM InputBatch (see the docstring)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the logits' dtype (default float32)")
    parser.add_argument("--fresh-batch", action="store_true",
                        help="a new corelib batch every call (added, sampled, dropped)")
    parser.add_argument("--logprobs", type=int, default=None, help="every request asks for N logprobs")
    add_clock_argument(parser)
    args = parser.parse_args(argv)
    if args.through_vllm and args.fresh_batch:
        parser.error("--through-vllm and --fresh-batch: choose one")
    if args.logprobs is not None and args.logprobs < 0:
        parser.error(f"--logprobs must be >= 0, got {args.logprobs}")
    how = dict(through_vllm=args.through_vllm, dtype=getattr(torch, args.dtype),
               fresh_batch=args.fresh_batch, logprobs=args.logprobs)
    clock = clock_from(args, parser, args.threads)
    torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    names = list(CONFIGS)
    if args.configs:
        names = [names[int(i)] for i in args.configs.split(",")]
    vllm = None if args.no_vllm else load_vllm()
    if args.through_vllm and vllm is None:
        parser.error("--through-vllm needs vLLM (run with the vLLM venv, without --no-vllm)")
    version = ""
    if vllm is not None:
        version = f", vLLM {vllm.version}"
    print(f"{machine_description()}{version}, {args.threads} torch thread(s), {args.clock} clock, V = {V}, "
          f"{args.logits} {args.dtype} logits{', through vLLM' if args.through_vllm else ''}"
          f"{', a fresh batch per call' if args.fresh_batch else ''}"
          f"{'' if args.logprobs is None else f', {args.logprobs} logprobs'}, median of {args.repeats or '15 (B <= 8) or 5'} calls; load average {load_average():.2f} at start")
    Base = None
    if args.base:
        import tempfile
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from cpu_ab import load_base
        Base = load_base(args.base, tempfile.mkdtemp())
    cells = []
    for name in names:
        for B in batch_sizes:
            repeats = args.repeats or (15 if B <= 8 else 5)
            cells.append(bench_cell(vllm, name, B, repeats, clock, Base, args.logits, how))
            sys.stderr.write(f"\r{len(cells)}/{len(names) * len(batch_sizes)}   ")
            sys.stderr.flush()
    sys.stderr.write("\n")
    print(f"load average {load_average():.2f} at end\n")
    if vllm is not None:
        print("vLLM time / corelib cpu time (higher is better for corelib)\n")
        print(table(cells, batch_sizes, lambda c: f"{c.ratio:.1f}x", lambda n: TARGETS[n][1]))
        print("\nvLLM ms\n")
        print(table(cells, batch_sizes, lambda c: f"{c.vllm_ms:.3f}"))
    print("\ncorelib cpu ms\n")
    print(table(cells, batch_sizes, lambda c: f"{c.corelib_ms:.3f}"))
    print("\ncorelib cpu time / one clone() of the logits\n")
    print(table(cells, batch_sizes, lambda c: f"{c.corelib_ms / c.clone_ms:.1f}"))
    if Base is not None:
        if vllm is not None:
            print(f"\nvLLM time / {args.base}'s cpu time\n")
            print(table(cells, batch_sizes, lambda c: f"{c.base_ratio:.1f}x"))
        print(f"\n{args.base}'s cpu ms / this checkout's (above 1: this checkout is faster)\n")
        print(table(cells, batch_sizes, lambda c: f"{c.base_ms / c.corelib_ms:.2f}x"))
    if vllm is not None:
        print("\nTargets:")
        for line in verdicts(cells):
            print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
