"""The cpu backend's batch: the core's batch plus a sparse copy of the penalty state.

Steps 7-8 change only the tokens a row has seen (its prompt and its output), a few thousand at
most, while the core's dense state (``prompt_mask`` bool ``[B, V]``, ``output_counts`` int32
``[B, V]``) makes every step read ``B x V`` entries. This batch also keeps, per row that uses
penalties, the distinct seen tokens in slots: ``slot_ids`` int64 ``[rows, S]`` and
``slot_counts`` int32 ``[rows, S]`` (how often the token was generated; 0 for prompt-only
tokens), the first ``slot_len[row]`` slots being real. ``append`` updates them with ``[B, S]``
work, never reading a history; ``remove`` moves them with the rows, as the core moves its own.

Its step states carry the slots of their rows (:class:`~corelib_cpu.state.CpuStepState`); a
verification step's state (``speculative_state``) carries each slot's penalty slots advanced
by the earlier drafts, and, asked with ``slots_only``, leaves out the dense ``[B, V]`` tensors
the core would copy ``K + 1`` times.

It also keeps the sampler's step plan (:meth:`CpuBatch.cached_plan`): facts derived from the
rows' parameters, dropped whenever a request joins, leaves or moves (``add``, ``remove``,
``swap_rows``: every row change goes through them or the core's ``_move_rows``).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Callable, Optional, Sequence

import torch
from corelib import SamplingBatch, SamplingParams, StepState

from .state import CpuStepState, cpu_state

_MIN_SLOTS = 64
_MIN_ROWS = 8
# The core's dense penalty state, which the sampler does not read when the slots exist.
_DENSE_PENALTY_STATE = ("prompt_mask", "output_counts")


def with_slots(s: StepState, ids: torch.Tensor, counts: torch.Tensor, length: torch.Tensor) -> CpuStepState:
    """``s`` as a :class:`CpuStepState` carrying the given slots."""
    fields = {f.name: getattr(s, f.name) for f in dataclasses.fields(StepState)}
    return CpuStepState(**fields, slot_ids=ids, slot_counts=counts, slot_len=length)


def count_into_slots(ids: torch.Tensor, counts: torch.Tensor, length: torch.Tensor,
                     tokens: torch.Tensor, live: torch.Tensor, width: Optional[int] = None) -> int:
    """One token per row into slots, in place: bump the token's slot, or open the next free
    slot for it (the caller leaves room: ``length < S`` on every row). ids int64 [n, S],
    counts int32 [n, S], length int64 [n], tokens int64 [n], live bool [n] (False: the row is
    left as it is); ``width``: a bound >= ``length.max()`` when the caller knows one. Returns
    the new ``length.max()`` (0 for no rows)."""
    if not length.numel():
        return 0
    width = int(length.max()) if width is None else width
    real = torch.arange(width) < length[:, None]                            # (n, width)
    hit = (ids[:, :width] == tokens[:, None]) & real & live[:, None]
    counts[:, :width].add_(hit)
    new = live & ~hit.any(dim=1)
    # every row writes its first free slot: the token where it is new, else what is there
    at = length[:, None]
    ids.scatter_(1, at, torch.where(new[:, None], tokens[:, None], ids.gather(1, at)))
    counts.scatter_(1, at, torch.where(new[:, None], 1, counts.gather(1, at)))
    length += new
    return int(length.max())


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
        self._slot_width = 0        # >= every row's slot_len (see _count_tokens)
        self._plans: dict = {}
        self._position_view: Optional[tuple] = None    # (positions' row view, its memoryview)

    # ------------------------------------------------------------------ sampler's view
    def cached_plan(self, key, build: Callable[[], object]):
        """``build()``'s result, kept until a request joins, leaves or moves (the sampler keeps
        its per-row facts here: they depend on the rows' parameters only). ``key`` names the
        variant (row count, block size)."""
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = build()
        return plan

    #: Most rows whose positions ``_advance_positions`` writes one by one from Python.
    FEW_POSITIONS = 4

    def _advance_positions(self, position: torch.Tensor) -> None:
        """``SamplingBatch._advance_positions``: a few rows are written through a memoryview of
        their positions' memory, kept while the rows' view is the same tensor, where torch's
        in-place add is an operator call (measured: 12-15 us of a B = 1 step after the cache
        flush, about 4% of a top-k step)."""
        held = self._position_view
        if held is None or held[0] is not position:
            few = position.shape[0] <= self.FEW_POSITIONS and position.is_contiguous()
            held = self._position_view = (position, memoryview(position.numpy()) if few else None)
        view = held[1]
        if view is None:
            super()._advance_positions(position)
            return
        for row in range(len(view)):
            view[row] += 1

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

    def _new_step_state(self, n: int) -> StepState:
        """The core's step state as a ``CpuStepState``, with the rows' penalty slots when some
        row uses penalties (kept by the core with its views; ``_ensure_rows`` and
        ``_ensure_slots`` drop it when they replace the slots)."""
        if not self.has_penalty_slots:
            return cpu_state(super()._new_step_state(n))
        slots = self.penalty_slots(n)
        return with_slots(super()._new_step_state(n), *slots)

    def speculative_state(self, draft_token_ids: torch.Tensor, num_rows: Optional[int] = None,
                          dense_by_row: bool = False, *, slots_only: bool = False) -> StepState:
        """The core's verification state as a ``CpuStepState``, with each slot's penalty slots
        advanced by the row's earlier drafts. ``dense_by_row``: as the core's (for the
        reference's stages on this batch: its differentiable ``score``). ``slots_only``: leave
        out the dense penalty tensors (the core would copy each ``K + 1`` times; a sampler that
        reads the slots does not need them)."""
        if not self.has_penalty_slots:
            return cpu_state(super().speculative_state(draft_token_ids, num_rows, dense_by_row))
        dense = {}
        if slots_only:
            dense = {name: self._tensors.pop(name) for name in _DENSE_PENALTY_STATE if name in self._tensors}
        try:
            s = super().speculative_state(draft_token_ids, num_rows, dense_by_row)
        finally:
            self._tensors.update(dense)
        n = len(self._row_keys) if num_rows is None else num_rows
        return with_slots(s, *self._speculative_slots(draft_token_ids.to("cpu", torch.long), n))

    def _speculative_slots(self, drafts: torch.Tensor, n: int):
        """Slots of the ``n (K + 1)`` virtual rows: row r's slot j holds r's slots after its
        first j drafts (int64 [n S, A + K] ids, int32 counts, int64 [n S] lengths; A the
        slots' allocated width), as ``count_into_slots`` would leave them draft after draft,
        computed for every j at once: each draft's slot (its token's among the row's slots,
        or the next one opened at its token's first occurrence among the drafts), and the
        counts as a running sum over the drafts. ``score``'s T positions are K = T - 1
        drafts: one draft at a time would cost K passes over all K + 1 slots' state."""
        K = drafts.shape[1]
        S = K + 1
        ids, counts, length = self.penalty_slots(n)
        if K == 0:
            return ids.clone(), counts.clone(), length.clone()
        A = ids.shape[1]
        live = (drafts >= 0) & self._slot_rows[:n, None]                      # (n, K)
        d = drafts.clamp(min=0)
        width = int(length.max()) if n else 0
        real = torch.arange(width) < length[:, None]                           # (n, width)
        match = (d[:, :, None] == ids[:, None, :width]) & real[:, None, :]      # (n, K, width)
        in_base = match.any(dim=-1)
        # the row's slots are distinct: one match at most (none while no row has a slot)
        base_slot = match.to(torch.uint8).argmax(dim=-1) if width else torch.zeros_like(d)
        position = torch.arange(K)
        # each draft's first occurrence among the row's live drafts (itself when it is the first)
        same = (d[:, :, None] == d[:, None, :]) & live[:, None, :] & (position[:, None] >= position[None, :])
        first = same.to(torch.uint8).argmax(dim=-1)                             # (n, K)
        opens = live & ~in_base & (first == position)                          # opens a slot
        rank = opens.cumsum(dim=-1) - 1                                          # its new slot's rank
        slot = torch.where(in_base, base_slot, length[:, None] + rank.gather(1, first))
        slot = torch.where(live, slot, 0)
        added = torch.zeros((n, K, A + K), dtype=torch.int32)
        added.scatter_(2, slot[:, :, None], live[:, :, None].to(torch.int32))
        before = torch.cat([torch.zeros((n, 1, A + K), dtype=torch.int32),
                            added.cumsum(dim=1, dtype=torch.int32)], dim=1)      # (n, S, A + K)
        opened = torch.cat([torch.zeros((n, 1), dtype=torch.long), opens.cumsum(dim=-1)], dim=1)  # (n, S)
        # the tokens of the slots opened, by rank (column K takes the drafts that open none)
        new_ids = torch.zeros((n, K + 1), dtype=torch.long).scatter_(1, torch.where(opens, rank, K), d)
        column = torch.arange(A + K)[None, None, :]
        offset = column - length[:, None, None]                                 # (n, 1, A + K)
        is_new = (offset >= 0) & (offset < opened[:, :, None])                  # (n, S, A + K)
        wide_ids = torch.cat([ids, ids.new_zeros((n, K))], dim=1)[:, None, :]
        wide_counts = torch.cat([counts, counts.new_zeros((n, K))], dim=1)[:, None, :]
        taken = new_ids.gather(1, offset[:, 0].clamp(0, K - 1))[:, None, :]
        out_ids = torch.where(is_new, taken, wide_ids)
        out_counts = torch.where(is_new | (offset < 0), before + torch.where(offset < 0, wide_counts, 0),
                                 wide_counts)
        return (out_ids.reshape(n * S, A + K), out_counts.reshape(n * S, A + K),
                (length[:, None] + opened).reshape(n * S))

    # ------------------------------------------------------------------ add / remove / append
    def add(self, request_id: str, params: SamplingParams,
            prompt_token_ids: Sequence[int] = (),
            output_token_ids=None, child_offset: int = 0, sampler_state=None) -> list[int]:
        rows = super().add(request_id, params, prompt_token_ids, output_token_ids, child_offset,
                           sampler_state=sampler_state)
        self._plans.clear()
        if params.uses_penalties:
            prompt = _as_list(prompt_token_ids)
            outputs = _per_child(output_token_ids, len(rows))
            for row, output in zip(rows, outputs):
                self._write_slots(row, prompt, output)
            self._penalty_requests += 1
        return rows

    def remove(self, *request_ids: str) -> None:
        leaving = sum(self.params_of(request_id).uses_penalties for request_id in request_ids)
        old_len = self.num_rows
        super().remove(*request_ids)        # moves the slots of the rows it moves
        self._penalty_requests -= leaving   # once the core took every id (it checks first)
        self._plans.clear()
        self._ensure_rows(old_len)
        self._slot_len[self.num_rows:old_len] = 0
        self._slot_rows[self.num_rows:old_len] = False

    def _appended(self, columns: list, every: bool) -> None:
        """``append``'s tokens into the slots, once the core has checked them and advanced its
        own state (``SamplingBatch._appended``): one column per token of a row, where its
        ``advance`` holds (-1, a flagged row or padding, counts nothing)."""
        n = self.num_rows
        if n == 0 or not self.has_penalty_slots:
            return
        # Slots grow only when a penalty row is written: rows added after it may lie past them.
        self._ensure_rows(n)
        for ids, advance in columns:
            self._count_tokens(ids if every else ids.clamp(min=0), None if every else advance, n)

    # ------------------------------------------------------------------ internals
    def _move_rows(self, src: list[int], dst: list[int]) -> None:
        """The core's row moves (``remove``, ``swap_rows``), applied to the slots as well."""
        super()._move_rows(src, dst)
        self._plans.clear()
        # Slots grow only when a penalty row is written; moving rows needs them all.
        self._ensure_rows(max(src + dst) + 1)
        src, dst = torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long)
        for t in (self._slot_ids, self._slot_counts, self._slot_len, self._slot_rows):
            t.index_copy_(0, dst, t.index_select(0, src))

    def _count_tokens(self, ids: torch.Tensor, live: Optional[torch.Tensor], n: int) -> None:
        """One generated token per row (where ``live``; None: every row): bump its slot, or
        open a slot for a new token. ``_slot_width`` bounds the rows' slot counts on the
        host (exact after each count; rows that leave may only lower the true maximum)."""
        self._ensure_slots(self._slot_width + 1)
        uses = self._slot_rows[:n]
        self._slot_width = count_into_slots(self._slot_ids[:n], self._slot_counts[:n],
                                            self._slot_len[:n], ids,
                                            uses if live is None else live & uses, self._slot_width)

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
        self._slot_width = max(self._slot_width, L)

    def _ensure_rows(self, rows: int) -> None:
        have = self._slot_ids.shape[0]
        if rows <= have:
            return
        grow = max(rows, 2 * have) - have
        self._slot_ids = torch.cat([self._slot_ids, self._slot_ids.new_zeros((grow, self._slot_ids.shape[1]))])
        self._slot_counts = torch.cat([self._slot_counts, self._slot_counts.new_zeros((grow, self._slot_counts.shape[1]))])
        self._slot_len = torch.cat([self._slot_len, self._slot_len.new_zeros(grow)])
        self._slot_rows = torch.cat([self._slot_rows, self._slot_rows.new_zeros(grow)])
        self._forget_views()

    def _ensure_slots(self, width: int) -> None:
        have = self._slot_ids.shape[1]
        if width <= have:
            return
        grow = max(width, 2 * have) - have
        rows = self._slot_ids.shape[0]
        self._slot_ids = torch.cat([self._slot_ids, self._slot_ids.new_zeros((rows, grow))], dim=1)
        self._slot_counts = torch.cat([self._slot_counts, self._slot_counts.new_zeros((rows, grow))], dim=1)
        self._forget_views()


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
