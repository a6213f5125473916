"""What ``sample`` and ``verify`` return, and the checks that raise on their flagged rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .batch import INVALID_TOKEN, SamplingBatch


@dataclass
class Logprobs:
    """Step 15's result. Column 0 is the sampled token, columns 1..N the top-N, best first."""

    token_ids: torch.Tensor  # int64 [B, N + 1]
    logprobs: torch.Tensor   # float32 [B, N + 1]
    ranks: torch.Tensor      # int64 [B]: tokens whose logprob >= the sampled token's


@dataclass
class SamplerOutput:
    """What ``Sampler.sample`` returns.

    ``valid[row]`` is False for a row whose logits held NaN or +inf, or whose every token was
    masked by steps 3-5, or whose drawn token's logit was not finite because float32 overflowed
    in steps 6-13b (finite logits near 3e38, a subnormal temperature); such a row's token id is
    -1, which ``batch.append`` takes as "no token this step" (the row's state stays as it was).
    """

    token_ids: torch.Tensor            # int64 [B]
    valid: torch.Tensor                # bool [B]
    logprobs: Optional[Logprobs] = None
    # float32 [B, V]: the log-probabilities after the filter group, from which ``batch.append``
    # advances the stateful selectors' state (``Sampler.sample`` hands it to the batch); None
    # when no row uses one
    selector_source: Optional[torch.Tensor] = None
    # int32 [B, ceil(V / 32)]: each row's kept set (``SamplingParams.return_kept``), the
    # tokens of the distribution it drew from as packed bits (``corelib.bitmask``); zeros for
    # rows that did not ask and flagged rows; None when no row asked
    kept: Optional[torch.Tensor] = None

    def raise_on_invalid(self, batch: SamplingBatch) -> None:
        """Raise ValueError naming the first flagged row's request (waits on the device)."""
        raise_on_flagged(self.valid, batch, "has no token to sample: its logits are NaN/+inf, "
                         "or every token is masked by allowed_token_ids, token_bitmask, "
                         "bad_words and min_tokens, or float32 overflowed in steps 6-13b")


@dataclass
class VerifyOutput:
    """What ``Sampler.verify`` returns for ``B`` rows and ``K`` draft slots.

    ``token_ids`` int64 ``[B, K + 1]``: each row's emitted tokens first (accepted drafts, then
    the token of the slot where it stopped), -1 after; pass it to ``batch.append`` as it is.
    ``num_emitted`` int64 ``[B]``: 1 to k + 1, 0 for a flagged row. ``valid`` bool ``[B]``:
    False when slot 0 had no token (NaN/+inf logits, every token masked) or the row's drafts
    were unusable (ids out of range on an accelerator, negative or NaN draft probabilities).
    ``logprobs``: ``token_ids`` and ``logprobs`` ``[B, K + 1, N + 1]``, ``ranks`` ``[B, K + 1]``;
    column 0 is the token emitted at that slot (id -1, logprob NaN and rank 0 at slots that
    emitted nothing), columns 1..N the slot's top-N.
    """

    token_ids: torch.Tensor
    num_emitted: torch.Tensor
    valid: torch.Tensor
    logprobs: Optional[Logprobs] = None
    # float32 [B (K + 1), V]: each slot's log-probabilities after the filter group (as
    # ``SamplerOutput.selector_source``, one per slot); None when no row uses a selector
    selector_source: Optional[torch.Tensor] = None
    # int32 [B, K + 1, ceil(V / 32)]: slot j's kept set (the target distribution at slot j,
    # as ``SamplerOutput.kept``); zeros at slots past what the row reached; None when no row
    # asked (``return_kept``)
    kept: Optional[torch.Tensor] = None

    def raise_on_invalid(self, batch: SamplingBatch) -> None:
        """Raise ValueError naming the first flagged row's request (waits on the device)."""
        raise_on_flagged(self.valid, batch, "emitted no token: its first slot's logits are "
                         "NaN/+inf or fully masked, or its drafts are unusable (ids out of "
                         "range, negative or NaN draft probabilities)")


@dataclass
class ScoreOutput:
    """What ``Sampler.score`` returns for ``B`` rows and ``T`` positions (every tensor ``[B]``
    when the logits were ``[B, V]``).

    ``logprobs`` float32 ``[B, T]``: each given token's processed log-probability at its
    position (the distribution the row would draw from; -inf where the token is not kept;
    greedy rows: after step 8b). ``raw_logprobs`` float32 ``[B, T]``: step 1's (the model's
    log_softmax). ``kept_token`` bool ``[B, T]``: the token is in the kept set (greedy rows:
    it is the argmax). ``ranks`` int64 ``[B, T]``: tokens whose processed logprob >= the
    given token's. ``valid`` bool ``[B, T]``: the position was scored; False at padding (token
    -1: logprobs and raw_logprobs 0, rank 0, so a masked loss stays finite) and where the
    position has no distribution (NaN/+inf logits, every token masked: logprobs NaN).
    Differentiable with respect to the logits when they require grad.
    """

    logprobs: torch.Tensor
    raw_logprobs: torch.Tensor
    kept_token: torch.Tensor
    ranks: torch.Tensor
    valid: torch.Tensor
    # float32 [B T, V]: what ``append`` advances the selectors' state from (as
    # ``SamplerOutput.selector_source``); None when no row uses a selector or kept= was given
    selector_source: Optional[torch.Tensor] = None


def raise_on_flagged(valid: torch.Tensor, batch: SamplingBatch, why: str) -> None:
    """ValueError ``row R (request 'id', child C) <why>`` for the first False of ``valid``."""
    bad = (~valid).nonzero()
    if bad.numel():
        row = int(bad[0, 0])
        rid, child = batch.rows[row]
        raise ValueError(f"row {row} (request {rid!r}, child {child}) {why}")


def slot_logprobs(logprobs: Logprobs, emitted: torch.Tensor) -> Logprobs:
    """Step 15 of ``verify``: flat ``[B S, ...]`` logprobs given a slot axis; column 0 at
    slots that emitted nothing becomes id -1, logprob NaN, rank 0."""
    B, S = emitted.shape
    width = logprobs.token_ids.shape[-1]
    ids = logprobs.token_ids.view(B, S, width).clone()
    values = logprobs.logprobs.view(B, S, width).clone()
    ranks = logprobs.ranks.view(B, S).clone()
    none = emitted < 0
    ids[..., 0] = torch.where(none, INVALID_TOKEN, ids[..., 0])
    values[..., 0] = torch.where(none, float("nan"), values[..., 0])
    ranks = torch.where(none, 0, ranks)
    return Logprobs(ids, values, ranks)


def slot_kept(kept: torch.Tensor, num_emitted: torch.Tensor) -> torch.Tensor:
    """``verify``'s kept sets: int32 ``[B, S, W]`` from the flat ``[B S, W]`` of every slot,
    zeros at the slots past the ``num_emitted`` (int64 ``[B]``) the row reached. Not in
    place."""
    B = num_emitted.shape[0]
    kept = kept.view(B, -1, kept.shape[-1])
    reached = torch.arange(kept.shape[1], device=kept.device)[None, :] < num_emitted[:, None]
    return kept.masked_fill(~reached[..., None], 0)
