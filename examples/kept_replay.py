"""Which sampling configurations ``score`` reproduces, with and without the rollout's kept sets.

    python examples/kept_replay.py [--backend NAME]

For each configuration: ``sample`` 8 rows (processed logprobs, ``return_kept=True``), then
``score`` the drawn tokens on the same logits, on a fresh batch of the same requests, with
``kept=out.kept`` and without. It prints a markdown table: "yes" where every row's score equals
the sampled token's processed logprob bitwise, else the largest difference.
"""

from __future__ import annotations

import argparse
from typing import Optional

import torch

import corelib
from corelib import SamplingParams

VOCAB = 256
ROWS = 8

CASES: dict[str, dict] = {
    "temperature, top-k, top-p, min-p": dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05),
    "penalties, logit bias": dict(temperature=0.7, top_p=0.9, repetition_penalty=1.3,
                                  frequency_penalty=0.5, logit_bias={3: 2.0}),
    "dynamic temperature (default order)": dict(temperature=0.8, dynatemp_range=0.5, min_p=0.05),
    "smoothing (default order)": dict(temperature=0.8, smoothing_factor=0.3, top_k=30),
    "top-n-sigma, smoothing": dict(temperature=0.8, top_n_sigma=1.0, smoothing_factor=0.3),
    "typical-p, tail-free, eta": dict(temperature=0.8, typical_p=0.9, tfs=0.9, eta_cutoff=0.01),
    "temperature_last, static temperature": dict(temperature=0.6, min_p=0.05, temperature_last=True),
    "temperature_last, smoothing": dict(temperature=0.5, smoothing_factor=0.3, top_k=30,
                                        temperature_last=True),
    "XTC, seeded": dict(temperature=0.8, xtc_threshold=0.05, xtc_probability=0.5),
    "XTC, unseeded": dict(temperature=0.8, xtc_threshold=0.05, xtc_probability=0.5, seed=None),
    "mirostat": dict(temperature=0.8, mirostat_tau=3.0),
    "greedy": dict(temperature=0.0),
    "temperature_last, dynamic temperature": dict(temperature=0.8, dynatemp_range=0.5, min_p=0.05,
                                                  temperature_last=True),
    "sampler_order: min_p, then dynamic temperature": dict(
        temperature=0.8, dynatemp_range=0.5, min_p=0.05, sampler_order=["min_p", "temperature"]),
    "sampler_order: smoothing before temperature": dict(
        temperature=0.5, smoothing_factor=0.3, top_k=30, sampler_order=["smoothing", "temperature", "top_k"]),
    "adaptive-p": dict(temperature=0.8, adaptive_p_target=0.3),
}


def compare(sampler, case: dict, generator: torch.Generator) -> tuple[float, float]:
    """(max |score with kept= - sampled|, max |score without kept= - sampled|) for one case."""
    case = dict(case)
    seed = case.pop("seed", 7)
    logits = torch.randn(ROWS, VOCAB, generator=generator) * 3

    def batch(params):
        b = sampler.new_batch(VOCAB, logprobs_mode="processed")
        for i in range(ROWS):
            b.add(str(i), params, prompt_token_ids=[1, 2, 3, 10 + i])
        return b

    params = SamplingParams(seed=seed, **case)
    out = sampler.sample(logits, batch(params.model_copy(update={"logprobs": 0, "return_kept": True})))
    drawn = out.logprobs.logprobs[:, 0]
    replayed = sampler.score(logits, batch(params), out.token_ids, kept=out.kept).logprobs
    recomputed = sampler.score(logits, batch(params), out.token_ids).logprobs
    return difference(replayed, drawn), difference(recomputed, drawn)


def difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b|, 0 where both are the same infinity, inf where one is NaN or infinite alone."""
    gap = torch.where(a == b, 0.0, (a - b).abs())
    return float(torch.where(torch.isnan(gap), float("inf"), gap).max())


def run(backend: Optional[str] = None) -> dict[str, tuple[float, float]]:
    sampler = corelib.get_sampler(backend)
    generator = torch.Generator().manual_seed(0)
    return {name: compare(sampler, case, generator) for name, case in CASES.items()}


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default=None,
                        help="corelib backend (default: corelib.get_sampler()'s choice)")
    args = parser.parse_args(argv)
    print("| configuration | score(kept=) bitwise | score() bitwise |")
    print("|---|---|---|")
    for name, differences in run(args.backend).items():
        cells = ["yes" if d == 0 else f"no ({d:.3g})" for d in differences]
        print(f"| {name} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
