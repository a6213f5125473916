"""The cpu backend's batch: the core's batch plus a sparse copy of the penalty state.

Steps 7-8 change only the tokens a row has seen (its prompt and its output), a few thousand at
most, while the core's dense state (``prompt_mask`` bool ``[B, V]``, ``output_counts`` int32
``[B, V]``) makes every step read ``B x V`` entries. This batch also keeps, per row that uses
penalties, the distinct seen tokens in slots: ``slot_ids`` int64 ``[rows, S]`` and
``slot_counts`` int32 ``[rows, S]`` (how often the token was generated; 0 for prompt-only
tokens), the first ``slot_len[row]`` slots being real. ``append`` updates them with ``[B, S]``
work, never reading a history; ``remove`` moves them with the rows, as the core moves its own.

It also keeps the sampler's step plan (:meth:`CpuBatch.cached_plan`): facts derived from the
rows' parameters, dropped whenever a request joins, leaves or moves (``add``, ``remove``,
``swap_rows``: every row change goes through them or the core's ``_move_rows``).
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Optional, Sequence

import torch
from corelib import SamplingBatch, SamplingParams

_MIN_SLOTS = 64
_MIN_ROWS = 8


class CpuBatch(SamplingBatch):
    """``SamplingBatch`` with sparse penalty slots (see the module docstring)."""

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu",
                 eos_token_id: Optional[int] = None, logprobs_mode: str = "raw"):
        super().__init__(vocab_size, device, eos_token_id, logprobs_mode)
        self._slot_ids = torch.zeros((_MIN_ROWS, _MIN_SLOTS), dtype=torch.long)
        self._slot_counts = torch.zeros((_MIN_ROWS, _MIN_SLOTS), dtype=torch.int32)
        self._slot_len = torch.zeros(_MIN_ROWS, dtype=torch.long)
        self._slot_rows = torch.zeros(_MIN_ROWS, dtype=torch.bool)   # row uses penalties
        self._penalty_requests = 0
        self._plans: dict = {}

    # ------------------------------------------------------------------ sampler's view
    def cached_plan(self, key, build: Callable[[], object]):
        """``build()``'s result, kept until a request joins, leaves or moves (the sampler keeps
        its per-row facts here: they depend on the rows' parameters only). ``key`` names the
        variant (row count, block size)."""
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = build()
        return plan

    @property
    def has_penalty_slots(self) -> bool:
        """True when some row uses penalties (and so has slots)."""
        return self._penalty_requests > 0

    def penalty_slots(self, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of the first ``num_rows`` rows: ``slot_ids`` int64 [n, S], ``slot_counts``
        int32 [n, S] and ``slot_len`` int64 [n] (slots past ``slot_len`` are free)."""
        self._ensure_rows(num_rows)
        return (self._slot_ids[:num_rows], self._slot_counts[:num_rows],
                self._slot_len[:num_rows])

    # ------------------------------------------------------------------ add / remove / append
    def add(self, request_id: str, params: SamplingParams,
            prompt_token_ids: Sequence[int] = (),
            output_token_ids=None) -> list[int]:
        rows = super().add(request_id, params, prompt_token_ids, output_token_ids)
        self._plans.clear()
        if params.uses_penalties:
            prompt = _as_list(prompt_token_ids)
            outputs = _per_child(output_token_ids, len(rows))
            for row, output in zip(rows, outputs):
                self._write_slots(row, prompt, output)
            self._penalty_requests += 1
        return rows

    def remove(self, request_id: str) -> None:
        uses_penalties = self.params_of(request_id).uses_penalties
        old_len = self.num_rows
        super().remove(request_id)          # moves the slots of the rows it moves
        self._plans.clear()
        self._ensure_rows(old_len)
        self._slot_len[self.num_rows:old_len] = 0
        self._slot_rows[self.num_rows:old_len] = False
        if uses_penalties:
            self._penalty_requests -= 1

    def append(self, token_ids) -> None:
        super().append(token_ids)   # validates the ids and updates the core's state
        n = self.num_rows
        if n == 0 or not self.has_penalty_slots:
            return
        ids = torch.as_tensor(token_ids).to("cpu", torch.long)
        # Slots grow only when a penalty row is written: rows added after it may lie past them.
        self._ensure_rows(n)
        self._count_tokens(ids, n)

    # ------------------------------------------------------------------ internals
    def _move_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """The core's row moves (``remove``, ``swap_rows``), applied to the slots as well."""
        super()._move_rows(src, dst)
        self._plans.clear()
        # Slots grow only when a penalty row is written; moving rows needs them all.
        self._ensure_rows(int(torch.cat([src, dst]).max()) + 1)
        for t in (self._slot_ids, self._slot_counts, self._slot_len, self._slot_rows):
            t.index_copy_(0, dst, t.index_select(0, src))

    def _count_tokens(self, ids: torch.Tensor, n: int) -> None:
        """One generated token per row: bump its slot, or open a slot for a new token."""
        slot_ids, slot_counts, slot_len = self._slot_ids[:n], self._slot_counts[:n], self._slot_len[:n]
        width = int(slot_len.max())
        real = torch.arange(width)[None, :] < slot_len[:, None]            # (n, width)
        hit = (slot_ids[:, :width] == ids[:, None]) & real
        slot_counts[:, :width] += hit.to(torch.int32)
        new = self._slot_rows[:n] & ~hit.any(dim=1)
        if not bool(new.any()):
            return
        rows = new.nonzero().flatten()
        self._ensure_slots(int(slot_len[rows].max()) + 1)
        at = self._slot_len[rows]
        self._slot_ids[rows, at] = ids[rows]
        self._slot_counts[rows, at] = 1
        self._slot_len[rows] += 1

    def _write_slots(self, row: int, prompt: list[int], output: list[int]) -> None:
        counts = Counter(output)
        tokens = sorted(set(prompt) | set(counts))
        self._ensure_rows(row + 1)
        self._ensure_slots(len(tokens))
        L = len(tokens)
        self._slot_ids[row].zero_()
        self._slot_counts[row].zero_()
        if L:
            self._slot_ids[row, :L] = torch.tensor(tokens, dtype=torch.long)
            self._slot_counts[row, :L] = torch.tensor([counts.get(t, 0) for t in tokens], dtype=torch.int32)
        self._slot_len[row] = L
        self._slot_rows[row] = True

    def _ensure_rows(self, rows: int) -> None:
        have = self._slot_ids.shape[0]
        if rows <= have:
            return
        grow = max(rows, 2 * have) - have
        self._slot_ids = torch.cat([self._slot_ids, self._slot_ids.new_zeros((grow, self._slot_ids.shape[1]))])
        self._slot_counts = torch.cat([self._slot_counts, self._slot_counts.new_zeros((grow, self._slot_counts.shape[1]))])
        self._slot_len = torch.cat([self._slot_len, self._slot_len.new_zeros(grow)])
        self._slot_rows = torch.cat([self._slot_rows, self._slot_rows.new_zeros(grow)])

    def _ensure_slots(self, width: int) -> None:
        have = self._slot_ids.shape[1]
        if width <= have:
            return
        grow = max(width, 2 * have) - have
        rows = self._slot_ids.shape[0]
        self._slot_ids = torch.cat([self._slot_ids, self._slot_ids.new_zeros((rows, grow))], dim=1)
        self._slot_counts = torch.cat([self._slot_counts, self._slot_counts.new_zeros((rows, grow))], dim=1)


def _as_list(ids) -> list[int]:
    return ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)


def _per_child(output_token_ids, n: int) -> list[list[int]]:
    """The outputs of each child, in the forms ``SamplingBatch.add`` accepts (it has already
    validated them): None, one list for n = 1, or one list per child."""
    if output_token_ids is None:
        return [[] for _ in range(n)]
    items = _as_list(output_token_ids)
    if items and all(isinstance(x, (list, tuple, torch.Tensor)) for x in items):
        return [_as_list(x) for x in items]
    return [items]
