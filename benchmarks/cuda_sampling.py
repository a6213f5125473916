"""Benchmark of the cuda backend against a sort-based torch sampler and bare FlashInfer calls.

    python benchmarks/cuda_sampling.py                       # B in 1,32,128,256; V = 128256
    python benchmarks/cuda_sampling.py --json out.json --iters 50
    python benchmarks/cuda_sampling.py --device cpu --vocab 4096 --batch-sizes 1,4 --iters 2   # smoke

Every number comes from the same run and process, so the ratios compare like with like. Times
are per call (mean over ``--iters`` back-to-back calls, median of ``--repeats``), measured with
CUDA events on a GPU. Each batch size's row is printed, and ``--json`` rewritten, as soon as
it is measured, so a run cut short keeps every batch size it finished. Rows:

- ``sort``: a sort-based torch sampler (temperature, one full sort, top-k by rank, top-p by
  cumulative sum, exponential-race draw), the usual way without custom kernels;
- ``reference``: corelib's reference backend (the contract in plain torch; sorts twice);
- ``fi-bare``: FlashInfer's ``top_k_top_p_sampling_from_logits`` alone on float32 logits with
  scalar top_k / top_p (its radix top-k fast path), temperature not included;
- ``fi-bare-rows``: the same with per-row tensors and no ``top_k_max`` (the tie-keeping mask
  path the backend uses by default);
- ``cuda``: ``corelib.get_sampler("cuda")``-equivalent ``CudaSampler.sample`` (eager);
- ``cuda-fast``: ``CudaSampler(top_k_first=True)`` (FlashInfer's fast path, exact-k ties);
  ``cuda-fast`` and ``fi-bare`` run only with ``--top-k-first``: both call FlashInfer's top-k
  module, whose first use on a machine without FlashInfer's precompiled kernels builds it with
  nvcc for minutes (``plugins/cuda/gpu_check.sh`` builds it in the background and passes the
  flag once it is built);
- ``cuda-graph``: ``GraphedSampler`` replays of the default sampler;
- ``cuda-torch``: the torch path (``use_flashinfer=False``), eager.

Configurations (columns ``name/config``): ``top_k_top_p``, ``full`` (penalties, min-p,
min-tokens, logit bias, logprobs), ``top_k_top_p_seeded``, and, timed on ``cuda`` and
``cuda-graph`` only, ``fourth`` (dynamic temperature, smoothing, top-a, epsilon, eta around
top-k / top-p, then tail-free and p-less: no fused FlashInfer draw) and ``mirostat`` (mirostat
v2 after top-k / top-p: the torch draw, and the selector source every step). A step's
``append`` is not timed, so mirostat's state stays where it starts.

A second table (engine features, ``--engine-batch-sizes``, K = ``--k``) times, on the default
sampler unless named:

- ``plain``: ``sample`` with top-k + top-p + temperature (the reference point of the ratios);
- ``mask``: the same with a token bitmask (half the tokens allowed; the mask already on the
  device); ``mask-kernel`` / ``mask-torch``: step 3 alone on a float32 ``[B, V]`` copy, by the
  Triton kernel (on CUDA; the torch expression elsewhere) and by the torch expression;
- ``samplers``: DRY over a 1,000-token prompt and 256 outputs, top-n-sigma, typical-p and XTC
  on top of ``plain``;
- ``rows``: ``sample`` over the ``B (K + 1)`` rows a verify step scores (what verification
  would cost as plain sampling); ``verify``: ``verify`` without draft probabilities (seeded
  rows: the draws of plain sampling); ``verify-q``: with draft probabilities, unseeded rows
  (FlashInfer's chain kernel on the flashinfer path); ``verify-q-torch``: the same on the torch
  path; ``verify-graph``: ``GraphedSampler.verify`` replays of ``verify-q``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable, Optional

import torch
from corelib import Sampler, SamplingParams

from corelib_cuda import CudaSampler, GraphedSampler

TOP_K, TOP_P, TEMPERATURE = 50, 0.9, 0.7
PROMPT_LEN, GENERATED = 1000, 256
CONFIGS = {
    "top_k_top_p": dict(temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P),
    "full": dict(temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P, min_p=0.01,
                 repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1,
                 min_tokens=300, stop_token_ids=[2], logprobs=5,
                 logit_bias={7: 1.5, 99: -2.0, 1234: 0.5, 2000: 3.0, 3000: -1.0}),
    "top_k_top_p_seeded": dict(temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P, seed=0),
    # the fourth release: its filters around top-k / top-p (tail-free and p-less after them,
    # so FlashInfer draws from the filtered logits), and mirostat v2 (the stateful selector)
    "fourth": dict(temperature=TEMPERATURE, dynatemp_range=0.3, smoothing_factor=0.3, top_a=0.02,
                   epsilon_cutoff=0.0003, eta_cutoff=0.0009, top_k=TOP_K, top_p=TOP_P, tfs=0.95,
                   p_less="norm"),
    "mirostat": dict(temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P, mirostat_tau=3.0, mirostat_eta=0.1),
}
#: The configurations only the default sampler and its graph runner time (the check's budget:
#: the other samplers' paths for them are the default one's, or the reference's sort).
DEFAULT_ONLY = ("fourth", "mirostat")


def sort_based_sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The common sort-based sampler: one sort, top-k by rank, top-p by cumulative mass."""
    x = logits.float() / temperature
    values, order = torch.sort(x, dim=-1, descending=True)
    ranks = torch.arange(x.shape[-1], device=x.device)
    values = values.masked_fill(ranks >= top_k, float("-inf"))
    probs = torch.softmax(values, dim=-1)
    values = values.masked_fill(probs.cumsum(dim=-1) - probs > top_p, float("-inf"))
    race = torch.softmax(values, dim=-1) / torch.empty_like(probs).exponential_()
    return order.gather(1, race.argmax(dim=-1, keepdim=True)).squeeze(1)


def time_call(fn: Callable[[], object], device: torch.device, iters: int, repeats: int) -> float:
    """Milliseconds per call: mean over ``iters`` calls, median over ``repeats``."""
    for _ in range(3):
        fn()
    results = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            torch.cuda.synchronize(device)
            results.append(start.elapsed_time(end) / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            results.append((time.perf_counter() - t0) * 1e3 / iters)
    return statistics.median(results)


def build_batch(sampler, B: int, V: int, params: dict, gen: torch.Generator):
    batch = sampler.new_batch(V, eos_token_id=1)
    for i in range(B):
        p = dict(params)
        if "seed" in p:
            p["seed"] = i
        prompt = torch.randint(V, (PROMPT_LEN,), generator=gen).tolist()
        outputs = torch.randint(V, (GENERATED,), generator=gen).tolist()
        batch.add(f"r{i}", SamplingParams(**p), prompt_token_ids=prompt, output_token_ids=outputs)
    return batch


def flashinfer_module(device: torch.device):
    if device.type != "cuda":
        return None
    try:
        from flashinfer import sampling
    except Exception as exc:  # reported in the table, not fatal
        print(f"# flashinfer unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
    return sampling


def run(device: torch.device, batch_sizes: list[int], V: int, iters: int, repeats: int,
        emit: Callable[[dict], None] = lambda row: None, top_k_first: bool = False) -> list[dict]:
    samplers: dict[str, object] = {
        "reference": Sampler(device),
        "cuda": CudaSampler(device),
        "cuda-torch": CudaSampler(device, use_flashinfer=False),
    }
    if top_k_first and samplers["cuda"].path == "flashinfer":
        # its first construction on a machine builds FlashInfer's top-k module (minutes)
        start = time.perf_counter()
        samplers["cuda-fast"] = CudaSampler(device, top_k_first=True)
        print(f"# cuda-fast: constructed in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    if device.type == "cuda":
        samplers["cuda-graph"] = GraphedSampler(samplers["cuda"])
    print(f"# cuda backend path: {samplers['cuda'].path} ({samplers['cuda'].path_reason})", file=sys.stderr)
    fs = flashinfer_module(device) if samplers["cuda"].path == "flashinfer" else None
    rows = []
    for B in batch_sizes:
        gen = torch.Generator().manual_seed(B)
        logits = (torch.randn((B, V), generator=gen) * 3).to(device=device, dtype=torch.bfloat16)
        scaled = logits.float() / TEMPERATURE
        row = {"B": B, "V": V}
        row["sort"] = time_call(lambda: sort_based_sample(logits, TEMPERATURE, TOP_K, TOP_P), device, iters, repeats)
        if fs is not None:
            k_rows = torch.full((B,), TOP_K, dtype=torch.int32, device=device)
            p_rows = torch.full((B,), TOP_P, dtype=torch.float32, device=device)
            if top_k_first:   # scalar top_k at this V: FlashInfer's fast path, the top-k module
                row["fi-bare"] = time_call(lambda: fs.top_k_top_p_sampling_from_logits(scaled, TOP_K, TOP_P), device, iters, repeats)
            row["fi-bare-rows"] = time_call(lambda: fs.top_k_top_p_sampling_from_logits(scaled, k_rows, p_rows), device, iters, repeats)
        for config, params in CONFIGS.items():
            for name, sampler in samplers.items():
                if config != "top_k_top_p" and name in ("reference",) and B > 32:
                    continue   # the reference's cost is known from top_k_top_p; keep the run short
                if config in DEFAULT_ONLY and name not in ("cuda", "cuda-graph"):
                    continue
                batch = build_batch(sampler, B, V, params, gen)
                row[f"{name}/{config}"] = time_call(lambda: sampler.sample(logits, batch), device, iters, repeats)
        rows.append(row)
        emit(row)
    return rows


ENGINE_BASE = dict(temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P)
ENGINE_SAMPLERS = dict(ENGINE_BASE, dry_multiplier=0.8, dry_allowed_length=2, top_n_sigma=2.0,
                       typical_p=0.95, xtc_probability=0.5, xtc_threshold=0.1)


def random_bitmask(rows: int, V: int, gen: torch.Generator) -> torch.Tensor:
    from corelib.bitmask import pack_bitmask
    return pack_bitmask(torch.rand((rows, V), generator=gen) < 0.5)


def run_engine(device: torch.device, batch_sizes: list[int], V: int, K: int, iters: int,
               repeats: int, emit: Callable[[dict], None] = lambda row: None) -> list[dict]:
    """The engine-feature rows (bitmask, new samplers, verification); see the module docstring."""
    from corelib_cuda.bitmask import apply_token_bitmask_, torch_apply_token_bitmask_
    sampler = CudaSampler(device)
    torch_path = CudaSampler(device, use_flashinfer=False)
    graphs = GraphedSampler(sampler) if device.type == "cuda" else None
    print(f"# bitmask path: {sampler.bitmask_path}", file=sys.stderr)
    rows = []
    for B in batch_sizes:
        gen = torch.Generator().manual_seed(100 + B)
        row = {"B": B, "V": V, "K": K}
        logits = (torch.randn((B, V), generator=gen) * 3).to(device=device, dtype=torch.bfloat16)
        mask = random_bitmask(B, V, gen).to(device)
        batch = build_batch(sampler, B, V, ENGINE_BASE, gen)
        row["plain"] = time_call(lambda: sampler.sample(logits, batch), device, iters, repeats)
        row["mask"] = time_call(lambda: sampler.sample(logits, batch, token_bitmask=mask), device, iters, repeats)
        work = logits.float()
        row["mask-kernel"] = time_call(lambda: apply_token_bitmask_(work, mask), device, iters, repeats)
        row["mask-torch"] = time_call(lambda: torch_apply_token_bitmask_(work, mask), device, iters, repeats)
        dry_batch = build_batch(sampler, B, V, ENGINE_SAMPLERS, gen)
        row["samplers"] = time_call(lambda: sampler.sample(logits, dry_batch), device, iters, repeats)
        S = K + 1
        flat = (torch.randn((B * S, V), generator=gen) * 3).to(device=device, dtype=torch.bfloat16)
        wide = build_batch(sampler, B * S, V, ENGINE_BASE, gen)
        row["rows"] = time_call(lambda: sampler.sample(flat, wide), device, iters, repeats)
        spec_logits = flat.view(B, S, V)
        drafts = torch.randint(V, (B, K), generator=gen).to(device)
        probs = torch.softmax(torch.randn((B, K, V), generator=gen), dim=-1).to(device)
        seeded = build_batch(sampler, B, V, dict(ENGINE_BASE, seed=0), gen)
        row["verify"] = time_call(lambda: sampler.verify(spec_logits, seeded, drafts), device, iters, repeats)
        unseeded = build_batch(sampler, B, V, ENGINE_BASE, gen)
        row["verify-q"] = time_call(lambda: sampler.verify(spec_logits, unseeded, drafts, probs),
                                    device, iters, repeats)
        torch_batch = build_batch(torch_path, B, V, ENGINE_BASE, gen)
        row["verify-q-torch"] = time_call(lambda: torch_path.verify(spec_logits, torch_batch, drafts, probs),
                                          device, iters, repeats)
        if graphs is not None:
            row["verify-graph"] = time_call(lambda: graphs.verify(spec_logits, unseeded, drafts, probs),
                                            device, iters, repeats)
        rows.append(row)
        emit(row)
    return rows


ENGINE_HEAD = ["B", "K", "plain", "mask", "mask-kernel", "mask-torch", "samplers", "rows", "verify",
               "verify-q", "verify-q-torch", "verify-graph", "mask/plain", "samplers/plain",
               "verify/rows", "verify-q/rows", "fi/torch verify-q"]


def engine_line(r: dict) -> str:
    """One row of the engine-feature table (ms, then ratios)."""
    vals = [str(r["B"]), str(r["K"])] + [_ms(r.get(k)) for k in ENGINE_HEAD[2:12]]
    vals += [_x(ratio(r, "mask", "plain")), _x(ratio(r, "samplers", "plain")),
             _x(ratio(r, "verify", "rows")), _x(ratio(r, "verify-q", "rows")),
             _x(ratio(r, "verify-q", "verify-q-torch"))]
    return "| " + " | ".join(vals) + " |"


def engine_summary(rows: list[dict]) -> str:
    """A markdown table of the engine-feature times (ms) and their ratios."""
    return "\n".join([_head(ENGINE_HEAD)] + [engine_line(r) for r in rows])


def _head(head: list[str]) -> str:
    return "| " + " | ".join(head) + " |\n" + "|" + "---|" * len(head)


def _ms(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.3f}"


def _x(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}x"


def ratio(row: dict, num: str, den: str) -> Optional[float]:
    if num in row and den in row and row[den] > 0:
        return row[num] / row[den]
    return None


SUMMARY_HEAD = ["B", "sort", "reference", "fi-bare", "fi-bare-rows", "cuda", "cuda-fast", "cuda-graph",
                "cuda-torch", "full", "seeded", "fourth", "mirostat", "mirostat-graph", "sort/cuda",
                "cuda/fi-bare", "fast/fi-bare", "graph/fi-bare", "full/cuda", "fourth/cuda", "mirostat/cuda"]


def summary(rows: list[dict]) -> str:
    """A markdown table of times (ms) and the target ratios."""
    return "\n".join([_head(SUMMARY_HEAD)] + [summary_line(r) for r in rows])


def summary_line(r: dict) -> str:
    """One row of the sampling table (ms, then the target ratios)."""
    cfg = "top_k_top_p"
    vals = [str(r["B"]), _ms(r.get("sort")), _ms(r.get(f"reference/{cfg}")), _ms(r.get("fi-bare")),
            _ms(r.get("fi-bare-rows")), _ms(r.get(f"cuda/{cfg}")), _ms(r.get(f"cuda-fast/{cfg}")),
            _ms(r.get(f"cuda-graph/{cfg}")), _ms(r.get(f"cuda-torch/{cfg}")), _ms(r.get("cuda/full")),
            _ms(r.get("cuda/top_k_top_p_seeded")), _ms(r.get("cuda/fourth")), _ms(r.get("cuda/mirostat")),
            _ms(r.get("cuda-graph/mirostat")),
            _x(ratio(r, "sort", f"cuda/{cfg}")), _x(ratio(r, f"cuda/{cfg}", "fi-bare")),
            _x(ratio(r, f"cuda-fast/{cfg}", "fi-bare")), _x(ratio(r, f"cuda-graph/{cfg}", "fi-bare")),
            _x(ratio(r, "cuda/full", f"cuda/{cfg}")), _x(ratio(r, "cuda/fourth", f"cuda/{cfg}")),
            _x(ratio(r, "cuda/mirostat", f"cuda/{cfg}"))]
    return "| " + " | ".join(vals) + " |"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-sizes", default="1,32,128,256")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engine-batch-sizes", default="1,32,128",
                        help="batch sizes of the engine-feature table ('' skips it)")
    parser.add_argument("--k", type=int, default=4, help="draft slots of the verify rows")
    parser.add_argument("--skip-main", action="store_true", help="only the engine-feature table")
    parser.add_argument("--top-k-first", action="store_true",
                        help="also time cuda-fast and fi-bare (FlashInfer's top-k module: minutes to "
                             "build on its first use)")
    parser.add_argument("--json", default=None, help="also write the raw times here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU: run with --device cpu for a smoke test", file=sys.stderr)
        return 2
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    engine_sizes = [int(b) for b in args.engine_batch_sizes.split(",") if b]
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "rows": [], "engine": []}

    def emit(kind: str, line: Callable[[dict], str]) -> Callable[[dict], None]:
        # Each batch size is printed and saved as it finishes: a run cut short keeps them.
        def emit_row(row: dict) -> None:
            results[kind].append(row)
            print(line(row), flush=True)
            if args.json:
                with open(args.json + ".tmp", "w") as f:
                    json.dump(results, f, indent=1)
                os.replace(args.json + ".tmp", args.json)
        return emit_row

    # The engine table first: the main table (the longer run) prints last.
    if engine_sizes:
        print(_head(ENGINE_HEAD), flush=True)
        run_engine(device, engine_sizes, args.vocab, args.k, args.iters, args.repeats,
                   emit("engine", engine_line))
        print()
    if not args.skip_main:
        print(_head(SUMMARY_HEAD), flush=True)
        run(device, batch_sizes, args.vocab, args.iters, args.repeats, emit("rows", summary_line),
            top_k_first=args.top_k_first)
    return 0


if __name__ == "__main__":
    sys.exit(main())
