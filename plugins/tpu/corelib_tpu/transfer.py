"""The one transfer of a step: what a step graph outputs, its results packed into one int32
tensor on the device, read back once, and unpacked on the host.

A step graph's token ids, validity flags, ranks and logprobs (float32 as their bits) are
columns of one int32 tensor, so that a step costs one device-to-host transfer whatever it
reports; the kept sets ride in the same fetch only when a row asks for them. These functions
are pure tensor code, traced inside the step graph (``pack*``) or run on the host
(``unpack*``); ``corelib_tpu.graph`` calls them around each launch.
"""

from __future__ import annotations

from typing import Optional

import torch
from corelib.outputs import Logprobs, SamplerOutput, ScoreOutput, VerifyOutput

from . import xla
from .batch import XlaSamplingBatch

__all__ = ["each_score", "empty_output", "empty_verify_output", "fetch", "outputs", "pack",
           "pack_score", "pack_verify", "unpack", "unpack_score", "unpack_verify"]


def outputs(packed: torch.Tensor, out) -> list[torch.Tensor]:
    """What a step graph computes: the packed results, the kept sets (int32 ``[B, W]``, or
    ``[B, K + 1, W]``; zeros unless a row asks, ``TpuSampler.kept_set``: an output of every
    step graph, so that asking compiles nothing new), and the distribution after the filter
    group where rows use a stateful selector (it stays on the device for ``append``)."""
    extra = [t for t in (getattr(out, "kept", None), out.selector_source) if t is not None]
    return [packed, *extra]


def fetch(packed: torch.Tensor, kept: Optional[torch.Tensor],
           batch: XlaSamplingBatch) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The step's results on the host in one transfer: the packed tensor, and the kept sets
    when some row asks for them (``batch.asks_kept``; otherwise they stay on the device and
    None is returned)."""
    if kept is None or not batch.asks_kept():
        return packed.cpu(), None
    host, words = xla.fetch([packed, kept])
    return host, words


def pack(out: SamplerOutput) -> torch.Tensor:
    """int32 ``[B, 2]`` (token, valid), or ``[B, 3 + 2 (N+1)]`` with (rank, logprob ids,
    logprob values as their float32 bits): everything the host needs in one tensor."""
    cols = [out.token_ids[:, None].to(torch.int32), out.valid[:, None].to(torch.int32)]
    if out.logprobs is not None:
        lp = out.logprobs
        cols += [lp.ranks[:, None].to(torch.int32), lp.token_ids.to(torch.int32),
                 xla.bitcast(lp.logprobs, torch.int32)]
    return torch.cat(cols, dim=1)


def unpack(host: torch.Tensor, asked: Optional[int], has_logprobs: bool) -> SamplerOutput:
    """The inverse of ``pack`` on the host, keeping the batch's real N + 1 logprob columns."""
    token_ids, valid = host[:, 0].to(torch.long), host[:, 1].to(torch.bool)
    logprobs = None
    if has_logprobs and asked is not None:
        width = (host.shape[1] - 3) // 2
        take = asked + 1
        ids = host[:, 3:3 + take].to(torch.long)
        values = host[:, 3 + width:3 + width + take].contiguous().view(torch.float32)
        logprobs = Logprobs(ids, values, host[:, 2].to(torch.long))
    return SamplerOutput(token_ids, valid, logprobs)


def pack_verify(out: VerifyOutput) -> torch.Tensor:
    """int32 ``[B, S + 2]`` (emitted tokens, their count, valid), or ``[B, 2 S + 2 + 2 S (N+1)]``
    with the slots' ranks, logprob ids and logprob bits: one tensor, one transfer."""
    B, S = out.token_ids.shape
    cols = [out.token_ids.to(torch.int32), out.num_emitted[:, None].to(torch.int32),
            out.valid[:, None].to(torch.int32)]
    if out.logprobs is not None:
        lp = out.logprobs
        cols += [lp.ranks.to(torch.int32), lp.token_ids.reshape(B, -1).to(torch.int32),
                 xla.bitcast(lp.logprobs.reshape(B, -1), torch.int32)]
    return torch.cat(cols, dim=1)


def unpack_verify(host: torch.Tensor, slots: int, graph_slots: int, asked: Optional[int],
                   has_logprobs: bool) -> VerifyOutput:
    """The inverse of ``pack_verify`` on the host, cut to the caller's ``slots`` and the
    batch's real N + 1 logprob columns."""
    S = graph_slots
    emitted = host[:, :slots].to(torch.long)
    num_emitted, valid = host[:, S].to(torch.long), host[:, S + 1].to(torch.bool)
    logprobs = None
    if has_logprobs and asked is not None:
        n = host.shape[0]
        width = (host.shape[1] - 2 - 2 * S) // (2 * S)
        take = asked + 1
        ranks = host[:, S + 2:2 * S + 2]
        ids = host[:, 2 * S + 2:2 * S + 2 + S * width].reshape(n, S, width)
        bits = host[:, 2 * S + 2 + S * width:].reshape(n, S, width)
        logprobs = Logprobs(ids[:, :slots, :take].to(torch.long),
                            bits[:, :slots, :take].contiguous().view(torch.float32),
                            ranks[:, :slots].to(torch.long))
    return VerifyOutput(emitted, num_emitted, valid, logprobs)


def pack_score(out: ScoreOutput) -> torch.Tensor:
    """int32 ``[B T, 5]``: (logprob bits, raw logprob bits, kept_token, rank, valid), one
    tensor for one transfer."""
    return torch.stack([xla.bitcast(out.logprobs.to(torch.float32), torch.int32),
                        xla.bitcast(out.raw_logprobs.to(torch.float32), torch.int32),
                        out.kept_token.to(torch.int32), out.ranks.to(torch.int32),
                        out.valid.to(torch.int32)], dim=1)


def unpack_score(host: torch.Tensor, rows: int, T: int) -> ScoreOutput:
    """The inverse of ``pack_score`` on the host, as ``[rows, T]`` tensors."""
    host = host.reshape(rows, T, 5)
    return ScoreOutput(host[..., 0].contiguous().view(torch.float32),
                       host[..., 1].contiguous().view(torch.float32), host[..., 2].to(torch.bool),
                       host[..., 3].to(torch.long), host[..., 4].to(torch.bool))


def each_score(out: ScoreOutput, f) -> ScoreOutput:
    return ScoreOutput(f(out.logprobs), f(out.raw_logprobs), f(out.kept_token), f(out.ranks),
                       f(out.valid))


def empty_output() -> SamplerOutput:
    return SamplerOutput(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.bool), None)


def empty_verify_output(slots: int) -> VerifyOutput:
    return VerifyOutput(torch.empty((0, slots), dtype=torch.long), torch.empty(0, dtype=torch.long),
                        torch.empty(0, dtype=torch.bool), None)
