"""Speculative decoding: vLLM's draft verification done by corelib's ``verify``.

With a speculative config, vLLM's V1 runner calls its ``rejection_sampler`` instead of its
sampler on every step (``GPUModelRunner._sample``), with vLLM's flattened tensors: for each row
of its batch, in order, ``1 + drafts`` rows of target logits (the drafts' slots, then the bonus
slot), the drafts of all rows in one flat tensor, and the drafter's probabilities (None for
drafters without them, such as ngram, and for draft models that draft greedily). The runner
expects int32 ``[rows, K + 1]`` tokens padded with -1 (K the step's most drafts) and, when a
request asks for logprobs, one logprobs row per (row, slot).

``DraftLayout`` maps these onto corelib's ``[rows, K + 1, ...]`` slots and
``CorelibRejectionSampler`` is the object the runner calls; corelib's ``verify`` and the batch
append happen in ``CorelibSampler.verify_drafts``.

vLLM's ``rejection_sample_method`` chooses corelib's verification rule (``verify_method``):
``"standard"`` is corelib's token rule, ``"block"`` its block verification (rows without draft
probabilities keep the token rule). ``"synthetic"`` (acceptance at fixed rates, for load
tests) follows no rule that keeps the target distribution and is refused.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Optional

import torch

NO_DRAFT = -1
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


@dataclass
class DraftLayout:
    """Where each row's slots are in vLLM's flat speculative tensors, for ``B`` rows with at
    most ``K`` drafts. All index tensors are int64 on the logits' device."""

    num_drafts: list[int]        # per row, on the host
    slot_rows: torch.Tensor      # [B, K + 1]: the logits row of each slot; a row's slots past
                                 # its own drafts repeat its bonus row (verify ignores them)
    draft_rows: torch.Tensor     # [B, K]: the flat draft index of each slot (clamped past a
                                 # row's drafts; ``has_draft`` tells)
    has_draft: torch.Tensor      # bool [B, K]

    @classmethod
    def of(cls, num_drafts: list[int], device: torch.device) -> "DraftLayout":
        counts = torch.tensor(num_drafts, dtype=torch.long)
        K = int(counts.max()) if len(num_drafts) else 0
        slots = torch.arange(K + 1)
        first_logits_row = torch.cumsum(counts + 1, 0) - (counts + 1)
        slot_rows = first_logits_row[:, None] + torch.minimum(slots[None, :], counts[:, None])
        first_draft = torch.cumsum(counts, 0) - counts
        has_draft = slots[None, :K] < counts[:, None]
        draft_rows = (first_draft[:, None] + slots[None, :K]).clamp(max=max(int(counts.sum()) - 1, 0))
        return cls(list(num_drafts), slot_rows.to(device, non_blocking=True),
                   draft_rows.to(device, non_blocking=True), has_draft.to(device, non_blocking=True))

    @property
    def max_drafts(self) -> int:
        return self.has_draft.shape[1]

    @property
    def uniform(self) -> bool:
        """Every row has K drafts: vLLM's flat rows are already ``[B, K + 1]`` in order."""
        return all(n == self.max_drafts for n in self.num_drafts)

    def logits(self, flat: torch.Tensor) -> torch.Tensor:
        """``[B, K + 1, V]`` from vLLM's ``[sum(1 + drafts), V]`` target logits: a view when
        every row has K drafts, else a copy of whole rows (corelib's verify never writes to
        its logits). ``index_select`` copies each row as one block, where indexing with a
        ``[B, K + 1]`` tensor went element by element at twice the time."""
        B, V = len(self.num_drafts), flat.shape[-1]
        if self.uniform:
            return flat.reshape(B, self.max_drafts + 1, V)
        return flat.index_select(0, self.slot_rows.reshape(-1)).view(B, self.max_drafts + 1, V)

    def bitmask(self, flat: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """int32 ``[B, K + 1, W]`` from a bitmask at the logits' rows (or None)."""
        return None if flat is None else flat.to(self.slot_rows.device, non_blocking=True)[self.slot_rows]

    def draft_token_ids(self, flat: torch.Tensor) -> torch.Tensor:
        """int64 ``[B, K]`` drafts, -1 after each row's own. vLLM may pad a row's drafts with -1
        itself (drafts the grammar rejected); whatever follows a -1 counts as padding too."""
        ids = flat.to(torch.long)[self.draft_rows]
        ids = torch.where(self.has_draft, ids, NO_DRAFT)
        kept = torch.cumprod((ids >= 0).to(torch.int32), dim=1).to(torch.bool)
        return torch.where(kept, ids, NO_DRAFT)

    def draft_probs(self, flat: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """float32 ``[B, K, V]`` from vLLM's ``[sum(drafts), V]`` draft probabilities (None
        stays None). Slots without a draft hold another slot's row, which verify ignores."""
        return None if flat is None else flat[self.draft_rows].to(torch.float32)


class SpeculationStats:
    """Running totals of the verification steps, kept on the device (reading them waits on it):
    rows that had drafts, their drafts, the drafts accepted, and accepted drafts by position."""

    def __init__(self, device: torch.device):
        self.device = device
        self.verified_rows = torch.zeros((), dtype=torch.long, device=device)
        self.draft_tokens = torch.zeros((), dtype=torch.long, device=device)
        self.accepted_tokens = torch.zeros((), dtype=torch.long, device=device)
        self.accepted_by_position = torch.zeros(0, dtype=torch.long, device=device)

    def record(self, layout: DraftLayout, num_emitted: torch.Tensor) -> None:
        """One step: ``num_emitted`` int64 ``[B]`` from corelib's verify. A row accepted
        ``num_emitted - 1`` drafts (vLLM's count too); rows without drafts are not counted."""
        K = layout.max_drafts
        if K == 0:
            return
        counts = torch.tensor(layout.num_drafts, dtype=torch.long).to(self.device, non_blocking=True)
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
