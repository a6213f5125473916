"""The blocks' outputs joined into the step's, in row order: a step of several blocks (the cpu
backend's unit of work) returns one ``SamplerOutput``, ``VerifyOutput`` or ``ScoreOutput``."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from corelib import Logprobs, SamplerOutput
from corelib.outputs import ScoreOutput
from corelib.sampler import VerifyOutput


def join_logprobs(pieces: list) -> Logprobs:
    return Logprobs(torch.cat([p.token_ids for p in pieces]),
                    torch.cat([p.logprobs for p in pieces]),
                    torch.cat([p.ranks for p in pieces]))


def join_samples(outputs: list) -> SamplerOutput:
    """The blocks' outputs as one, in row order."""
    logprobs = None if outputs[0].logprobs is None else join_logprobs([o.logprobs for o in outputs])
    return SamplerOutput(torch.cat([o.token_ids for o in outputs]), torch.cat([o.valid for o in outputs]),
                         logprobs, join_sources(outputs), join_kept(outputs))


def join_verifications(outputs: list) -> VerifyOutput:
    """The blocks' verification outputs as one, in row order."""
    logprobs = None if outputs[0].logprobs is None else join_logprobs([o.logprobs for o in outputs])
    return VerifyOutput(torch.cat([o.token_ids for o in outputs]), torch.cat([o.num_emitted for o in outputs]),
                        torch.cat([o.valid for o in outputs]), logprobs, join_sources(outputs),
                        join_kept(outputs))


def join_kept(outputs: list) -> Optional[torch.Tensor]:
    """The blocks' kept sets as one (int32 [rows, W], or [rows, K + 1, W] from verify), in
    row order; None when no row asked (every block then has None: the flag is the step's)."""
    if outputs[0].kept is None:
        return None
    return torch.cat([o.kept for o in outputs])


def join_sources(outputs: list, rows: Optional[Callable] = None) -> Optional[torch.Tensor]:
    """The blocks' ``selector_source`` as one float32 [rows, V], in row order; None when no
    block has one (no row uses a stateful selector). A block of greedy rows only has none
    (it draws nothing): zeros stand for its rows, whose state ``append`` never advances.
    ``rows``: an output's row count (default: its token ids', slots included)."""
    sources = [o.selector_source for o in outputs]
    known = next((source for source in sources if source is not None), None)
    if known is None:
        return None
    if rows is None:
        rows = lambda o: o.token_ids.shape[0] * (1 if o.token_ids.dim() == 1 else o.token_ids.shape[1])  # noqa: E731
    return torch.cat([source if source is not None else known.new_zeros((rows(o), known.shape[1]))
                      for o, source in zip(outputs, sources)])


def join_scores(outputs: list) -> ScoreOutput:
    """The blocks' score outputs as one, in row order (flat ``[B T]``; ``selector_source``
    joined as ``join_sources`` joins the samples')."""
    fields = ("logprobs", "raw_logprobs", "kept_token", "ranks", "valid")
    out = ScoreOutput(*(torch.cat([getattr(o, name) for o in outputs]) for name in fields))
    out.selector_source = join_sources(outputs, lambda o: o.valid.shape[0])
    return out
