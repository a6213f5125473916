"""A digest of the tokens and logprobs the tpu backend draws for seeded rows, to compare
between revisions of the plugin: a change of any seeded token or logprob changes it.

    PJRT_DEVICE=CPU python plugins/tpu/benchmarks/digest.py            # XLA:CPU
    PJRT_DEVICE=CPU python plugins/tpu/benchmarks/digest.py --eager    # the same code eagerly on CPU

Each configuration is one batch of seeded rows (greedy rows and unseeded-free: every random
row has a seed) run for a few ``sample`` + ``append`` steps at a small vocabulary; the
digest hashes every step's token ids, validity and, where asked, logprobs and their ids.
Configurations cover the paths a step can take: the candidate route, flat top-p (nucleus
by bisection), top-k above the candidates, min-p, penalties, DRY with a history, the token
bitmask, logprobs in both modes, step 8b, every newer filter, mixed orders, the selectors.
"""

from __future__ import annotations

import argparse
import hashlib

import torch

from corelib import SamplingParams

V = 1000
ROWS = 6
STEPS = 4

CONFIGS = {
    "top-k + top-p": dict(top_k=50, top_p=0.9, temperature=0.7),
    "flat top-p": dict(top_p=0.9),
    "top-k beyond the candidates": dict(top_k=300, top_p=0.95),
    "min-p": dict(min_p=0.05, temperature=0.8),
    "penalties": dict(repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2),
    "dry": dict(dry_multiplier=0.8, dry_allowed_length=2, top_k=40),
    "logprobs raw": dict(top_k=40, logprobs=3),
    "logprobs processed": dict(top_p=0.8, logprobs=2),
    "thinking budget": dict(thinking_budget=1, thinking_start_token_ids=[5],
                            thinking_end_token_ids=[6], top_k=20),
    "top-n-sigma": dict(top_n_sigma=1.0, temperature=0.9),
    "smoothing, top-a": dict(smoothing_factor=0.3, top_a=0.1),
    "epsilon, eta": dict(epsilon_cutoff=0.001, eta_cutoff=0.002),
    "typical, xtc": dict(typical_p=0.8, xtc_probability=0.5, xtc_threshold=0.01),
    "tfs, p-less": dict(tfs=0.9, p_less="plain"),
    "dynatemp": dict(dynatemp_range=0.5, top_k=60),
    "mirostat": dict(mirostat_tau=3.0),
    "temperature last": dict(top_k=30, temperature=1.5, temperature_last=True),
}


def run(device, eager: bool) -> tuple[str, dict]:
    """``device``: None for the default XLA device, chosen by the sampler itself (as a user's
    first sampler does, after its XLA:CPU options: docs/tpu.md), or ``cpu``."""
    from corelib_tpu.sampler import TpuSampler
    sampler = TpuSampler(device, buckets=(8,), max_rows=8)
    device = sampler.device
    gen = torch.Generator().manual_seed(0)
    h = hashlib.sha256()
    each = {}
    for name, params in CONFIGS.items():
        part = hashlib.sha256()
        batch = sampler.new_batch(V, logprobs_mode="processed" if "processed" in name else "raw")
        history = torch.randint(0, 40, (64,), generator=gen).tolist()
        for i in range(ROWS):
            row = dict(params, seed=1000 + i) if i % 3 else dict(temperature=0.0)
            batch.add(f"r{i}", SamplingParams(**row), prompt_token_ids=history)
        mask = None
        if name in ("top-k + top-p", "flat top-p"):
            from corelib.bitmask import pack_bitmask
            mask = pack_bitmask(torch.rand((ROWS, V), generator=gen) < 0.7)
        for step in range(STEPS):
            logits = torch.randn((ROWS, V), generator=gen) * (0.01 if name == "flat top-p" else 3.0)
            out = sampler.sample(logits.to(device), batch, mask)
            for t in (out.token_ids, out.valid):
                part.update(t.cpu().numpy().tobytes())
            if out.logprobs is not None:
                part.update(out.logprobs.token_ids.cpu().numpy().tobytes())
                part.update(out.logprobs.logprobs.cpu().numpy().tobytes())
            batch.append(out.token_ids)
        each[name] = part.hexdigest()[:12]
        h.update(part.digest())
    return h.hexdigest(), each


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eager", action="store_true", help="run on the CPU device, eagerly")
    args = parser.parse_args()
    digest, each = run(torch.device("cpu") if args.eager else None, args.eager)
    for name, value in each.items():
        print(f"{name:30s} {value}")
    print(digest)


if __name__ == "__main__":
    main()
