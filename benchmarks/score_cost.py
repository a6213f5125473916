"""What ``score`` over a sequence's T positions costs against T single steps: "is teacher
forcing a whole rollout at once cheaper than replaying it token by token?"

Per backend (cpu, reference) and configuration, one sequence of T given tokens (a prompt of
64, then the tokens) scored two ways, timed alternately in one run: ``whole``, one
``score`` call on ``[1, T, V]`` logits (position t sees the first t tokens appended, as
``verify``'s slots do); ``steps``, T calls of ``score`` on ``[1, V]`` with ``append`` after
each (what a trainer without the T-position form would do). Both give the same values
(checked bitwise here for each backend). Issue 34's target: whole <= steps.

    python benchmarks/score_cost.py                                 # T = 512, V = 32000
    python benchmarks/score_cost.py --positions 128 --backends cpu --repeats 5 --clock thread
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from corelib import SamplingParams, get_sampler
from corelib.bench import make_logits

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import add_run_arguments, interleaved, load_average, medians, run_settings  # noqa: E402

#: The rows scored: the common filters; penalties, whose state moves with every position.
CONFIGS = {
    "top_k_top_p_T": dict(top_k=50, top_p=0.9, temperature=0.8, seed=1),
    "min_p_T": dict(min_p=0.05, temperature=0.8, seed=2),
    "penalties": dict(repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2,
                      top_p=0.95, temperature=0.8, seed=3),
}


def new_batch(sampler, V: int, params: dict):
    batch = sampler.new_batch(V, eos_token_id=2)
    batch.add("seq", SamplingParams(**params), prompt_token_ids=list(range(10, 74)))
    return batch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--positions", type=int, default=512, help="T")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--backends", default="cpu,reference")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    add_run_arguments(parser, 3)
    args = parser.parse_args(argv)
    clock = run_settings(args, parser)
    T, V = args.positions, args.vocab_size
    logits = make_logits(T, V, "peaked")[None]                                 # [1, T, V]
    # tokens a sampler could have drawn: a likely token at most positions
    tokens = torch.topk(logits[0], 4, dim=-1).indices[torch.arange(T), torch.arange(T) % 4][None]
    print(f"score over T = {T} positions of one sequence vs {T} single steps with append, "
          f"V = {V}, {args.threads} thread(s), {args.clock} clock, medians of {args.repeats} "
          f"rounds, load average {load_average():.2f} at start")
    print(f"{'backend':10s} {'config':14s} {'whole ms':>9s} {'steps ms':>9s} {'steps/whole':>11s} "
          f"{'per position whole':>18s} {'per step':>9s}  same")
    for name in args.backends.split(","):
        sampler = get_sampler(name)
        for config in args.configs.split(","):
            params = CONFIGS[config]

            def whole():
                return sampler.score(logits, new_batch(sampler, V, params), tokens)

            def steps():
                batch = new_batch(sampler, V, params)
                out = []
                for t in range(T):
                    out.append(sampler.score(logits[:, t], batch, tokens[:, t]).logprobs)
                    batch.append(tokens[:, t])
                return torch.stack(out, dim=1)

            same = torch.equal(whole().logprobs, steps())
            m = medians(interleaved({"whole": whole, "steps": steps}, args.repeats, warmup=0,
                                    clock=clock))
            w, s = m["whole"], m["steps"]
            print(f"{name:10s} {config:14s} {w:9.1f} {s:9.1f} {s / w:10.2f}x {w / T:17.3f} "
                  f"{s / T:9.3f}  {same}", flush=True)
    print(f"load average {load_average():.2f} at end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
