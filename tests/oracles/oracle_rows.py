"""Logit rows and corelib's side of every oracle comparison.

The rows are fixed by their seeds: V = 50 and 1000, flat (logits ~ N(0, 0.5**2)), peaked
(N(0, 3**2)) and spiked (N(0, 1) with a few tokens raised by 4 to 8), so a filter meets both
long flat tails and one or two dominant tokens. Continuous random logits have no ties. The
kept sets must be equal, except for a token whose fate is decided within ``EDGE`` (relative)
of the rule's threshold, computed here in float64: there float32 rounding in one
implementation or the other may flip it, which tests the rounding, not the rule. Each test
names such tokens (``edge``) itself and allows a difference on them only.
"""

from __future__ import annotations

import torch

from corelib import Sampler, SamplingParams

REF = Sampler("cpu")
EDGE = 1e-4

SHAPES = ("flat", "peaked", "spiked")
VOCABS = (50, 1000)
ROW_IDS = [f"{shape}-V{vocab}-s{seed}" for vocab in VOCABS for shape in SHAPES for seed in (0, 1)]


def logit_row(row_id: str) -> torch.Tensor:
    """float32 ``[V]``: the row named by ``ROW_IDS`` (shape, vocabulary size, seed)."""
    shape, vocab, seed = row_id.split("-")
    vocab, seed = int(vocab[1:]), int(seed[1:])
    gen = torch.Generator().manual_seed(1000 * vocab + 10 * SHAPES.index(shape) + seed)
    if shape == "flat":
        return torch.randn(vocab, generator=gen) * 0.5
    if shape == "peaked":
        return torch.randn(vocab, generator=gen) * 3.0
    row = torch.randn(vocab, generator=gen)
    spikes = torch.randperm(vocab, generator=gen)[:3]
    row[spikes] += 4.0 + 4.0 * torch.rand(3, generator=gen)
    return row


def corelib_final(logits: torch.Tensor, **params) -> torch.Tensor:
    """float32 ``[V]``: the reference backend's processed logits of one request with
    ``params`` (dropped tokens -inf); not modified in place."""
    logits = torch.as_tensor(logits, dtype=torch.float32)
    batch = REF.new_batch(vocab_size=logits.shape[-1])
    batch.add("r", SamplingParams(**params))
    return REF.processed_logits(logits[None], batch)[0]


def corelib_kept(logits: torch.Tensor, **params) -> set[int]:
    return set(torch.isfinite(corelib_final(logits, **params)).nonzero().flatten().tolist())


def kept_of(scores: torch.Tensor) -> set[int]:
    """The token ids a ``[V]`` float tensor keeps (finite entries)."""
    return set(torch.isfinite(scores).nonzero().flatten().tolist())


def near(values, threshold: float) -> set[int]:
    """Indices whose value lies within ``EDGE`` (relative) of ``threshold``."""
    values = torch.as_tensor(values, dtype=torch.float64)
    close = (values - threshold).abs() <= EDGE * max(abs(threshold), 1e-12)
    return set(close.nonzero().flatten().tolist())


def cumulative_edge(masses, order, threshold: float) -> set[int]:
    """For a rule that keeps a prefix of ``order`` until the running mass reaches
    ``threshold``: the tokens whose running mass, before or after adding them, lies within
    ``EDGE`` of it. ``masses``: float64 ``[V]`` in token order; ``order``: ``[V]`` ids."""
    masses = torch.as_tensor(masses, dtype=torch.float64)[order]
    after = masses.cumsum(0)
    before = after - masses
    return {int(order[i]) for i in near(after, threshold) | near(before, threshold)}


def assert_kept_equal(ours: set[int], theirs: set[int], edge: set[int] = frozenset()) -> None:
    """Equal kept sets, except on ``edge`` tokens (see the module's docstring)."""
    differ = ours ^ theirs
    assert differ <= set(edge), (
        f"kept sets differ on {sorted(differ - set(edge))} (corelib keeps {len(ours)}, "
        f"the oracle {len(theirs)}; edge tokens {sorted(edge)})")
