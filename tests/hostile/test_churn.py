"""State churn: 10,000 random add / remove / resume / swap / append / sample / verify
operations on one batch.

After every operation the batch must equal a batch rebuilt from scratch (by the reference
backend) with the same live requests and histories: same rows, positions and running counts,
same per-row parameters and flags, same processed logits (masks, bias, penalties, bad words,
min-tokens, DRY), same seeded and greedy draws, and neutral padding rows past the end. A
verification step's seeded and greedy emitted tokens must equal the reference's on the rebuilt
batch.
"""

from __future__ import annotations

import os
import random
import zlib

import pytest
import torch

from corelib import SamplingParams
from hostile_support import Request, assert_same_state, build_batch, on, per_key

V = 64
OPERATIONS = int(os.environ.get("HOSTILE_CHURN_OPERATIONS", 10_000))
MAX_REQUESTS = 8
EOS = 63
def random_params(rng: random.Random) -> SamplingParams:
    """Parameters that exercise every piece of batch state, sometimes wider than any before
    (logit_bias, bad-word count and length) so the padded tensors widen mid-run."""
    temperature = rng.choice([0.0, 0.7, 1.0, 1.3])
    kw = dict(temperature=temperature, n=rng.choice([1, 1, 2, 3]) if temperature > 0 else 1)
    if rng.random() < 0.85:
        kw["seed"] = rng.randrange(2**63)
    if rng.random() < 0.3:
        kw["top_k"] = rng.randrange(1, 20)
    if rng.random() < 0.12:
        kw["top_p"] = rng.uniform(0.3, 1.0)
    if rng.random() < 0.2:
        kw["min_p"] = rng.uniform(0.0, 0.2)
    if rng.random() < 0.35:
        kw["repetition_penalty"] = rng.uniform(0.8, 1.5)
        kw["frequency_penalty"] = rng.uniform(-1, 1)
        kw["presence_penalty"] = rng.uniform(-1, 1)
    if rng.random() < 0.3:
        width = rng.choice([1, 3, 8, 8, 40])
        kw["logit_bias"] = {rng.randrange(V): rng.uniform(-5, 5) for _ in range(width)}
    if rng.random() < 0.3:
        words = rng.choice([1, 2, 2, 5])
        kw["bad_words"] = [[rng.randrange(8) for _ in range(rng.choice([1, 2, 2, 3, 6]))]
                           for _ in range(words)]
    if rng.random() < 0.25:
        kw["min_tokens"] = rng.randrange(1, 6)
        kw["stop_token_ids"] = [rng.randrange(V) for _ in range(rng.randrange(0, 4))]
    if rng.random() < 0.15:
        kw["allowed_token_ids"] = rng.sample(range(V), rng.randrange(8, 40))
    if rng.random() < 0.2:
        kw["logprobs"] = rng.randrange(0, 4)
    if rng.random() < 0.2:
        kw.update(dry_multiplier=rng.uniform(0.2, 2.0), dry_allowed_length=rng.choice([1, 2, 3]),
                  dry_range=rng.choice([0, 0, 5, 30]),
                  dry_sequence_breakers=[rng.randrange(8) for _ in range(rng.randrange(3))])
    if rng.random() < 0.15:
        kw["top_n_sigma"] = rng.uniform(0.5, 3.0)
    if rng.random() < 0.15:
        kw["typical_p"] = rng.uniform(0.3, 1.0)
    if rng.random() < 0.15:
        kw.update(xtc_probability=rng.uniform(0.0, 1.0), xtc_threshold=rng.uniform(0.0, 0.3))
    return SamplingParams(**kw)


def logits_for(key, step: int) -> torch.Tensor:
    """float32 [V]: a deterministic logits row for (request, child) at a given step; small
    tokens are favoured so bad-word prefixes (ids < 8) actually occur."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr((key, step)).encode()))
    row = torch.randn(V, generator=gen) * 2
    row[:8] += 2.0
    return row


@pytest.mark.slow
def test_ten_thousand_operations_keep_the_state_of_a_rebuilt_batch(sampler, reference):
    rng = random.Random(20240607)
    batch = sampler.new_batch(V, eos_token_id=EOS)
    live: dict[str, Request] = {}
    next_id = 0
    kinds = ["add", "remove", "resume", "swap", "append", "sample", "verify"]
    counts = dict.fromkeys(kinds, 0)
    for step in range(OPERATIONS):
        op = rng.choices(kinds, [30, 15, 10, 8, 20, 15, 12])[0]
        if op == "add" and len(live) < MAX_REQUESTS:
            r = Request(f"req-{next_id}", random_params(rng), prompt=[rng.randrange(V) for _ in range(rng.randrange(6))])
            if rng.random() < 0.3:   # joins with tokens already generated (migration)
                r.outputs = [[rng.randrange(8) for _ in range(rng.randrange(5))] for _ in range(r.params.n)]
            next_id += 1
            batch.add(r.request_id, r.params, prompt_token_ids=r.prompt, output_token_ids=r.output_arg())
            live[r.request_id] = r
        elif op in ("remove", "resume") and live:
            rid = rng.choice(sorted(live))
            batch.remove(rid)
            if op == "resume":       # preempted and resumed: continues where it stopped
                r = live[rid]
                batch.add(rid, r.params, prompt_token_ids=r.prompt, output_token_ids=r.output_arg())
            else:
                del live[rid]
        elif op == "swap" and len(batch) > 1:
            batch.swap_rows(rng.randrange(len(batch)), rng.randrange(len(batch)))
        elif op == "verify" and len(batch):
            emitted = verify_step(sampler, reference, batch, live, rng, step)
            for (rid, child), tokens in zip(batch.rows, emitted):
                live[rid].outputs[child].extend(tokens)
        elif op == "append" and len(batch):
            ids = [rng.randrange(8) if rng.random() < 0.7 else rng.randrange(V) for _ in batch.rows]
            batch.append(ids)
            for (rid, child), t in zip(batch.rows, ids):
                live[rid].outputs[child].append(t)
        elif op == "sample" and len(batch):
            logits = torch.stack([logits_for(key, -step) for key in batch.rows])
            out = sampler.sample(on(sampler, logits), batch)
            ids = torch.where(out.valid, out.token_ids, torch.zeros_like(out.token_ids)).cpu().tolist()
            batch.append(ids)        # a flagged row gets token 0, as an engine's placeholder
            for (rid, child), t in zip(batch.rows, ids):
                live[rid].outputs[child].append(t)
        else:
            continue
        counts[op] += 1
        rebuilt = build_batch(reference, [live[rid] for rid in sorted(live)], V, EOS)
        assert_same_state(batch, rebuilt, sampler, reference, f"after operation {step}",
                          {key: logits_for(key, step) for key in rebuilt.rows})
    assert min(counts.values()) > OPERATIONS // 20, counts     # every kind of operation ran


def verify_step(sampler, reference, batch, live, rng: random.Random, step: int) -> list[list[int]]:
    """One verify + append on ``batch`` with random drafts (and sometimes draft
    probabilities); seeded and greedy rows must emit what the reference emits on a rebuilt
    batch. Returns each row's emitted tokens."""
    K = rng.randrange(0, 4)
    proposals = {key: [rng.randrange(8) for _ in range(rng.randrange(0, K + 1))] for key in batch.rows}
    drafts = torch.full((len(batch), K), -1, dtype=torch.long)
    for row, key in enumerate(batch.rows):
        drafts[row, : len(proposals[key])] = torch.tensor(proposals[key], dtype=torch.long)
    table = {key: torch.stack([logits_for(key, -step * 10 - j) for j in range(K + 1)]) for key in batch.rows}
    q = None
    if rng.random() < 0.5 and K:
        gen = torch.Generator().manual_seed(step)
        q = {key: torch.softmax(torch.randn((K, V), generator=gen), -1) for key in batch.rows}
    rebuilt = build_batch(reference, [live[rid] for rid in sorted(live)], V, EOS)
    outs = []
    for b, s in ((batch, sampler), (rebuilt, reference)):
        d = torch.stack([torch.tensor(proposals[k] + [-1] * (K - len(proposals[k])), dtype=torch.long)
                         for k in b.rows]) if K else torch.empty((len(b), 0), dtype=torch.long)
        probs = None if q is None else torch.stack([q[k] for k in b.rows])
        logits = torch.stack([table[k] for k in b.rows])
        out = s.verify(on(s, logits), b, on(s, d), None if probs is None else on(s, probs))
        outs.append(per_key(b, [row[:n] for row, n in zip(out.token_ids.cpu().tolist(),
                                                        out.num_emitted.cpu().tolist())]))
    mine, theirs = outs
    for key in theirs:
        params = batch.params_of(key[0])
        if params.seed is not None or params.temperature == 0.0:
            assert mine[key] == theirs[key], f"verify at operation {step}: {key} params={params!r}"
        assert len(mine[key]) <= len(proposals[key]) + 1
    emitted = [mine[key] for key in batch.rows]
    width = K + 1
    ids = torch.tensor([tokens + [-1] * (width - len(tokens)) for tokens in emitted], dtype=torch.long)
    batch.append(ids)
    return emitted
