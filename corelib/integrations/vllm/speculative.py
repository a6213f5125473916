"""Speculative decoding: vLLM's draft verification done by corelib's ``verify``.

With a speculative config, vLLM's V1 runner calls its ``rejection_sampler`` instead of its
sampler on every step (``GPUModelRunner._sample``), with vLLM's flattened tensors: for each row
of its batch, in order, ``1 + drafts`` rows of target logits (the drafts' slots, then the bonus
slot), the drafts of all rows in one flat tensor, and the drafter's probabilities (None for
drafters without them, such as ngram, and for draft models that draft greedily). The runner
expects int32 ``[rows, K + 1]`` tokens padded with -1 (K the step's most drafts) and, when a
request asks for logprobs, one logprobs row per (row, slot).

This is corelib's flat form of ``verify`` (``corelib.drafts``): ``CorelibSampler.verify_drafts``
passes the tensors as vLLM made them, with each row's draft count, and appends the emitted
tokens to the batch; ``CorelibRejectionSampler`` is the object the runner calls.

vLLM's ``rejection_sample_method`` chooses corelib's verification rule (``verify_method``):
``"standard"`` is corelib's token rule, ``"block"`` its block verification (rows without draft
probabilities keep the token rule). ``"synthetic"`` (acceptance at fixed rates, for load
tests) follows no rule that keeps the target distribution and is refused.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch

from ...transfer import upload

STANDARD_REJECTION, BLOCK_REJECTION = "standard", "block"
# vLLM's rejection_sample_method -> the method of corelib's verify.
VERIFY_METHODS = {STANDARD_REJECTION: "token", BLOCK_REJECTION: "block"}


def verify_method(speculative_config: Any, sampler: Any) -> str:
    """The ``method`` of corelib's verify for vLLM's ``speculative_config`` (None: no
    speculation, "token"). Raises ValueError naming ``rejection_sample_method`` for a method
    corelib does not implement, and for block verification on a backend whose ``verify``
    has no ``method`` argument (written before it)."""
    if speculative_config is None:
        return VERIFY_METHODS[STANDARD_REJECTION]
    choice = speculative_config.rejection_sample_method
    if choice not in VERIFY_METHODS:
        raise ValueError(
            f"speculative decoding with rejection_sample_method={choice!r} is not supported: "
            f"corelib verifies drafts by {sorted(VERIFY_METHODS)} (standard: the token rule, "
            f"block: block verification)")
    method = VERIFY_METHODS[choice]
    if method != "token" and "method" not in inspect.signature(sampler.verify).parameters:
        raise ValueError(
            f"rejection_sample_method={choice!r} needs block verification, which corelib "
            f"backend {sampler.name!r} does not offer (its verify has no method argument)")
    return method


class SpeculationStats:
    """Running totals of the verification steps, kept on the device (reading them waits on it):
    rows that had drafts, their drafts, the drafts accepted, and accepted drafts by position."""

    def __init__(self, device: torch.device):
        self.device = device
        self.verified_rows = torch.zeros((), dtype=torch.long, device=device)
        self.draft_tokens = torch.zeros((), dtype=torch.long, device=device)
        self.accepted_tokens = torch.zeros((), dtype=torch.long, device=device)
        self.accepted_by_position = torch.zeros(0, dtype=torch.long, device=device)

    def record(self, num_drafts: list[int], num_emitted: torch.Tensor) -> None:
        """One step: each row's drafts, and ``num_emitted`` int64 ``[B]`` from corelib's
        verify. A row accepted ``num_emitted - 1`` drafts (vLLM's count too); rows without
        drafts are not counted."""
        K = max(num_drafts, default=0)
        if K == 0:
            return
        counts = upload(num_drafts, self.device, torch.long)
        drafted = counts > 0
        accepted = torch.minimum((num_emitted - 1).clamp(min=0), counts) * drafted
        self.verified_rows += drafted.sum()
        self.draft_tokens += counts.sum()
        self.accepted_tokens += accepted.sum()
        by_position = (torch.arange(K, device=self.device)[None, :] < accepted[:, None]).sum(dim=0)
        if self.accepted_by_position.numel() < K:
            grown = torch.zeros(K, dtype=torch.long, device=self.device)
            grown[: self.accepted_by_position.numel()] = self.accepted_by_position
            self.accepted_by_position = grown
        self.accepted_by_position[:K] += by_position

    def as_dict(self) -> dict[str, Any]:
        return {"verified_rows": int(self.verified_rows), "draft_tokens": int(self.draft_tokens),
                "accepted_tokens": int(self.accepted_tokens),
                "accepted_by_position": self.accepted_by_position.tolist()}


class CorelibRejectionSampler:
    """What vLLM's V1 runner calls as its ``rejection_sampler``:
    ``(spec_decode_metadata, draft_probs, logits, sampling_metadata) -> SamplerOutput``, here
    corelib's ``verify`` through the runner's ``CorelibSampler``."""

    def __init__(self, sampler: Any):
        self.sampler = sampler

    def __call__(self, metadata: Any, draft_probs: Optional[torch.Tensor], logits: torch.Tensor,
                 sampling_metadata: Any):
        return self.sampler.verify_drafts(metadata, draft_probs, logits, sampling_metadata)
