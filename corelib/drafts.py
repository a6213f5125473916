"""``verify``'s flat form: the layout in which engines hold speculative tensors.

An engine that verifies drafts computes the target logits of every row's drafted slots and
bonus slot in one flat batch: for each row, in order, ``1 + k`` logits rows (its ``k`` drafts'
slots, then the bonus slot), the drafts of all rows in one flat tensor, the drafter's
probabilities one row per draft, a grammar bitmask one row per slot. ``sampler.verify(...,
num_drafts=k)`` takes them as they are (the contract's "Speculative decoding: verification").

:class:`DraftLayout` says where each row's slots lie in those tensors and makes the padded
``[rows, K + 1, ...]`` views the rest of ``verify`` works on (K the largest k). The logits,
the largest of them, need no padded copy: a backend reads its slots through
``DraftLayout.slot_rows`` (``StepState.logits_rows``), and only a backend that needs the padded
tensor (a fixed-shape graph) gathers it (:meth:`DraftLayout.logits`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .transfer import upload

NO_DRAFT = -1


@dataclass
class DraftLayout:
    """Where each of ``B`` rows' slots lie in the flat tensors, for rows with at most ``K``
    drafts. Index tensors are int64 on the device given to :meth:`of`; each method reads its
    tensor on that tensor's own device."""

    num_drafts: list[int]        # k per row, on the host
    slot_rows: torch.Tensor      # [B, K + 1]: the flat logits row of each slot; a row's slots
                                 # past its k + 1 repeat its bonus row (verify ignores them)
    draft_rows: torch.Tensor     # [B, K]: the flat draft of each slot, clamped past a row's k
    has_draft: torch.Tensor      # bool [B, K]: slot j < k

    @classmethod
    def of(cls, num_drafts, device: torch.device | str = "cpu") -> "DraftLayout":
        """The layout of ``num_drafts`` (ints >= 0, one per row: a sequence or a host
        tensor). ValueError names a count that is negative or not an integer. Built on the
        host from the counts (nothing read back from a device), uploaded without waiting."""
        counts = checked_num_drafts(num_drafts)
        K = max(counts, default=0)
        slot_rows, draft_rows, has_draft = [], [], []
        first_slot = first_draft = 0
        last_draft = max(sum(counts) - 1, 0)
        for k in counts:
            slot_rows.append([first_slot + min(j, k) for j in range(K + 1)])
            draft_rows.append([min(first_draft + j, last_draft) for j in range(K)])
            has_draft.append([j < k for j in range(K)])
            first_slot, first_draft = first_slot + k + 1, first_draft + k
        B = len(counts)
        return cls(counts, upload(torch.tensor(slot_rows, dtype=torch.long).view(B, K + 1), device),
                   upload(torch.tensor(draft_rows, dtype=torch.long).view(B, K), device),
                   upload(torch.tensor(has_draft, dtype=torch.bool).view(B, K), device))

    @property
    def num_rows(self) -> int:
        return len(self.num_drafts)

    @property
    def max_drafts(self) -> int:
        """K, the most drafts of a row."""
        return self.has_draft.shape[1]

    @property
    def num_slots(self) -> int:
        """Rows of the flat logits and bitmask: ``sum(k) + B``."""
        return sum(self.num_drafts) + self.num_rows

    @property
    def uniform(self) -> bool:
        """Every row has K drafts: the flat rows are already ``[B, K + 1]`` in order."""
        return all(k == self.max_drafts for k in self.num_drafts)

    def logits(self, flat: torch.Tensor) -> torch.Tensor:
        """``[B, K + 1, V]`` from the flat ``[sum(k) + B, V]`` logits: a view when every row
        has K drafts, else a copy of whole rows (``index_select`` copies each row as one
        block)."""
        B, V = self.num_rows, flat.shape[-1]
        if self.uniform:
            return flat.reshape(B, self.max_drafts + 1, V)
        rows = self.slot_rows.to(flat.device, non_blocking=True).reshape(-1)
        return flat.index_select(0, rows).view(B, self.max_drafts + 1, V)

    def draft_token_ids(self, flat: torch.Tensor) -> torch.Tensor:
        """int64 ``[B, K]`` from the flat ``[sum(k)]`` drafts, -1 after each row's own. A -1
        among a row's drafts ends them: the drafts after it count as padding too (an engine
        marks a draft its grammar rejected so, without moving the others)."""
        device = flat.device
        ids = flat.to(torch.long).index_select(0, self.draft_rows.to(device, non_blocking=True).reshape(-1))
        ids = torch.where(self.has_draft.to(device, non_blocking=True), ids.view(self.has_draft.shape), NO_DRAFT)
        # only -1 ends a row: another negative id stays, to be refused or flagged as out of range
        kept = torch.cumprod((ids != NO_DRAFT).to(torch.int32), dim=1).to(torch.bool)
        return torch.where(kept, ids, NO_DRAFT)

    def draft_probs(self, flat: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``[B, K, V]`` from the flat ``[sum(k), V]`` draft probabilities (None stays None).
        Slots without a draft hold another slot's row, which verify ignores."""
        if flat is None:
            return None
        rows = self.draft_rows.to(flat.device, non_blocking=True).reshape(-1)
        return flat.index_select(0, rows).view(self.num_rows, self.max_drafts, flat.shape[-1])

    def bitmask(self, flat: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``[B, K + 1, W]`` from a flat ``[sum(k) + B, W]`` bitmask (None stays None)."""
        if flat is None:
            return None
        rows = self.slot_rows.to(flat.device, non_blocking=True).reshape(-1)
        return flat.index_select(0, rows).view(self.num_rows, self.max_drafts + 1, flat.shape[-1])


def checked_num_drafts(num_drafts) -> list[int]:
    """``num_drafts`` as a list of ints: one integer >= 0 per row (a sequence of ints or an
    integer tensor on the host); ValueError naming the problem otherwise."""
    if isinstance(num_drafts, torch.Tensor):
        if (num_drafts.dtype.is_floating_point or num_drafts.dtype == torch.bool
                or num_drafts.dim() != 1 or num_drafts.device.type != "cpu"):
            raise ValueError(f"verify: num_drafts must be one integer per row on the host, got a "
                             f"{num_drafts.dtype} tensor of shape {list(num_drafts.shape)} on "
                             f"{num_drafts.device}")
        counts = num_drafts.tolist()
    elif isinstance(num_drafts, Sequence) and all(
            isinstance(k, int) and not isinstance(k, bool) for k in num_drafts):
        counts = list(num_drafts)
    else:
        raise ValueError(f"verify: num_drafts must be one integer per row, got {num_drafts!r}")
    for row, k in enumerate(counts):
        if k < 0:
            raise ValueError(f"verify: num_drafts[{row}] = {k} is negative")
    return counts


def checked_flat_arguments(layout: DraftLayout, logits, batch, draft_token_ids, draft_probs,
                           token_bitmask) -> tuple:
    """The flat form's arguments after the checks of their shapes (ValueError naming the
    argument, TypeError for what cannot be a tensor): logits ``[sum(k) + B, V]`` of a kind
    ``batch.check_logits`` accepts, draft_token_ids integer ``[sum(k)]`` (on the host: each
    in ``[-1, V)``), draft_probs None or ``[sum(k), V]``, token_bitmask None or
    ``[sum(k) + B, W]``. Returns (logits, draft_token_ids, draft_probs, token_bitmask), the
    last three as tensors; their dtypes are checked on the padded views, as in the padded
    form."""
    B, slots, drafted = layout.num_rows, layout.num_slots, sum(layout.num_drafts)
    if B != batch.num_rows:
        raise ValueError(f"verify: num_drafts has {B} entries; the batch has {batch.num_rows} "
                         f"rows (one count per batch row)")
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] != slots:
        shape = list(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"verify: with num_drafts, logits must be [sum(num_drafts) + rows, "
                         f"vocab] = [{slots}, vocab] (each row's drafted slots, then its bonus "
                         f"slot), got {shape}")
    batch.check_logits(logits[:B])
    V = logits.shape[1]
    ids = tensor_argument("draft_token_ids", draft_token_ids)
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        raise ValueError(f"verify: draft_token_ids must hold integer ids, got dtype {ids.dtype}")
    if ids.dim() != 1 or ids.shape[0] != drafted:
        raise ValueError(f"verify: with num_drafts, draft_token_ids must be [sum(num_drafts)] = "
                         f"[{drafted}], got {list(ids.shape)}")
    if ids.device.type == "cpu" and drafted:
        _check_flat_ids(ids, V, layout, batch)
    probs = None
    if draft_probs is not None:
        probs = tensor_argument("draft_probs", draft_probs)
        if probs.dim() != 2 or tuple(probs.shape) != (drafted, V):
            raise ValueError(f"verify: with num_drafts, draft_probs must be [sum(num_drafts), "
                             f"vocab] = [{drafted}, {V}], got {list(probs.shape)}")
    mask = None
    if token_bitmask is not None:
        mask = token_bitmask
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[0] != slots:
            shape = list(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(f"verify: with num_drafts, token_bitmask must be [sum(num_drafts) "
                             f"+ rows, ceil(vocab / 32)] = [{slots}, ...], got {shape}")
    return logits, ids, probs, mask


def padded_arguments(layout: DraftLayout, logits, batch, draft_token_ids, draft_probs,
                     token_bitmask) -> tuple:
    """The flat form's arguments, checked (:func:`checked_flat_arguments`), in the padded
    form: (logits ``[B, K + 1, V]``, draft ids int64 ``[B, K]``, draft probs ``[B, K, V]`` or
    None, bitmask ``[B, K + 1, W]`` or None). For a backend that runs the padded form only (a
    fixed-shape graph); the logits are a copy unless every row has K drafts."""
    logits, ids, probs, mask = checked_flat_arguments(layout, logits, batch, draft_token_ids,
                                                      draft_probs, token_bitmask)
    return layout.logits(logits), layout.draft_token_ids(ids), layout.draft_probs(probs), layout.bitmask(mask)


def tensor_argument(name: str, value, call: str = "verify") -> torch.Tensor:
    """The argument ``name`` of ``call`` (``verify``, ``score``) as a tensor (TypeError naming
    it when it cannot be one)."""
    if isinstance(value, torch.Tensor):
        return value
    try:
        return torch.as_tensor(value)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise TypeError(f"{call}: {name} must be a tensor, got {type(value).__name__}: {exc}") from None


def _check_flat_ids(ids: torch.Tensor, vocab_size: int, layout: DraftLayout, batch) -> None:
    """Host flat draft ids: each in [-1, V) (-1 ends its row's drafts)."""
    bad = ((ids < NO_DRAFT) | (ids >= vocab_size)).nonzero()
    if not bad.numel():
        return
    at = int(bad[0, 0])
    ends = torch.cumsum(torch.tensor(layout.num_drafts), 0)
    row = int(torch.searchsorted(ends, at, right=True))
    first = int(ends[row]) - layout.num_drafts[row]
    raise ValueError(f"verify: draft_token_ids[{at}] = {int(ids[at])} (row {row}'s draft "
                     f"{at - first}, request {batch.rows[row][0]!r}) is out of range for "
                     f"vocab_size={vocab_size} (-1 ends a row's drafts)")
