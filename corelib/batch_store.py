"""A batch's per-row tensors: the padded store (capacity doubling, optional tensors allocated
and widened as requests need them, rows moved and reset), and the host values a request's
rows start from (one encoder per feature: penalties, allowed ids, bias, stop ids, bad words,
DRY's history, the reasoning budget), written at ``add`` or kept pending until the state is
next read. ``SamplingBatch`` inherits it.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import pipeline, thinking
from .history import match_lengths, trailing_run
from .noise import split_seed
from .params import SamplingParams
from .step_state import OPTIONAL_NEUTRAL as _OPTIONAL_NEUTRAL
from .step_state import SCALARS as _SCALARS
from .transfer import upload

_MIN_CAPACITY = 8
_RIGHT_ALIGNED = {"bad_prefix", "recent"}
_MIN_HISTORY = 64
# dtype -> (the scalar columns of that dtype in SCALARS' order, their neutral values [n, 1])
_SCALAR_BLOCKS: dict[torch.dtype, tuple[list[str], torch.Tensor]] = {
    dtype: ([name for name, (d, _) in _SCALARS.items() if d == dtype],
            torch.tensor([v for d, v in _SCALARS.values() if d == dtype], dtype=dtype)[:, None])
    for dtype in dict.fromkeys(d for d, _ in _SCALARS.values())}


class RowStore:
    """The per-row tensors of a batch (mixed into ``SamplingBatch``)."""

    @property
    def _tensors(self) -> dict[str, torch.Tensor]:
        """Every per-row tensor by name, with the values of rows added since the last read
        written first. Everything that reads or moves rows goes through here; only ``add``'s
        own writes to other tensors than the pending ones use ``_store`` directly."""
        if self._pending:
            self._write_pending()
        return self._store

    @_tensors.setter
    def _tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self._store = tensors

    def _stage_row_values(self, first: int, values: dict[str, list]) -> None:
        """Keep per-row values of rows ``first, first + 1, ...`` (one list per tensor name, as
        long as the rows) for the next read of the state. Rows join at the end, so the rows
        added between two reads follow each other."""
        pending = self._pending
        if pending and first != self._pending_first + len(next(iter(pending.values()))):
            self._write_pending()
            pending = self._pending             # a new, empty one
        if not pending:
            self._pending_first = first
        for name, column in values.items():
            pending.setdefault(name, []).extend(column)

    def _write_pending(self) -> None:
        pending, self._pending = self._pending, {}
        first = self._pending_first
        for name, values in pending.items():
            rows = self._store[name][first:first + len(values)]
            if len(values) == 1:
                rows.fill_(values[0])
            else:
                rows.copy_(upload(values, self.device, rows.dtype))

    def _ensure_capacity(self, rows: int) -> None:
        if rows <= self._capacity:
            return
        capacity = max(_MIN_CAPACITY, self._capacity)
        while capacity < rows:
            capacity *= 2
        # The scalar columns of one dtype are rows of one block: three allocations and copies
        # where one per column made a new batch cost about forty small torch calls.
        store = self._tensors               # rows added since the last read written first
        for dtype, (names, neutrals) in _SCALAR_BLOCKS.items():
            neutral = neutrals.to(self.device)
            block = neutral.expand(-1, capacity).contiguous()
            if dtype in self._scalar_blocks:
                old = self._scalar_blocks[dtype][0]
                block[:, :old.shape[1]] = old
            self._scalar_blocks[dtype] = (block, neutral)
            store.update(zip(names, block.unbind(0)))
        for name, tensor in list(store.items()):
            if name in _SCALARS:
                continue
            self._grow(name, torch.full((capacity, *tensor.shape[1:]), self._neutral[name],
                                        dtype=tensor.dtype, device=self.device))
        self._capacity = capacity
        self._forget_views()

    def _first_rows(self, n: int) -> dict[str, torch.Tensor]:
        """name -> the first ``n`` rows of every per-row tensor (views). The scalar columns
        are sliced a block at a time: a slice per column made each step after a request
        joined or left pay about fifty small torch calls."""
        blocks = self._scalar_blocks
        if not blocks:          # a subclass that allocates its tensors its own way
            return {name: tensor[:n] for name, tensor in self._tensors.items()}
        first = {name: tensor[:n] for name, tensor in self._tensors.items() if name not in _SCALARS}
        for dtype, (block, _) in blocks.items():
            first.update(zip(_SCALAR_BLOCKS[dtype][0], block[:, :n].unbind(0)))
        return first

    def _grow(self, name: str, fresh: torch.Tensor) -> None:
        """Replace tensor ``name`` by ``fresh`` (more rows, neutral), its rows copied over.
        Not for a scalar column: those are rows of ``_scalar_blocks``, which ``_first_rows``
        slices, and are only replaced with their block (``_ensure_capacity``)."""
        old = self._tensors.get(name)
        if old is not None:
            fresh[: old.shape[0]] = old
        self._tensors[name] = fresh

    def _new_optional(self, name: str, width: int, dtype: torch.dtype, *extra: int) -> torch.Tensor:
        tensor = torch.full((self._capacity, width, *extra), self._neutral[name],
                            dtype=dtype, device=self.device)
        self._tensors[name] = tensor
        self._forget_views()
        return tensor

    def _widen(self, name: str, width: int, dim: int = 1) -> None:
        """Grow dimension ``dim`` of an optional padded tensor to at least ``width``."""
        old = self._tensors[name]
        if old.shape[dim] >= width:
            return
        shape = list(old.shape)
        shape[dim] = max(width, 2 * old.shape[dim])
        fresh = torch.full(shape, self._neutral[name], dtype=old.dtype, device=self.device)
        # Only the token-position dimension (the last) is right-aligned; widening bad_prefix
        # along its word dimension must keep each word in the slot bad_last/bad_valid use.
        if name in _RIGHT_ALIGNED and dim == old.dim() - 1:
            fresh.narrow(dim, shape[dim] - old.shape[dim], old.shape[dim]).copy_(old)
        else:
            fresh.narrow(dim, 0, old.shape[dim]).copy_(old)
        self._tensors[name] = fresh
        self._forget_views()

    def _allocate_optional_state(self, params: SamplingParams, prompt: list[int],
                                 outputs: list[list[int]]) -> None:
        """Create (or widen) the optional tensors this request needs (none of them is a
        pending one: the checks read the store as it is)."""
        V, t = self.vocab_size, self._store
        if params.uses_dry:
            longest = len(prompt) + max(len(out) for out in outputs)
            self._history_bound = max(self._history_bound, longest)
            breakers = max(len(params.dry_sequence_breakers), 1)
            if "dry_history" not in t:
                self._new_optional("dry_history", _MIN_HISTORY, torch.long)
                self._new_optional("dry_match", _MIN_HISTORY, torch.int32)
                self._new_optional("dry_breakers", breakers, torch.long)
            self._widen("dry_breakers", breakers)
            self._ensure_history_room(1)
        if params.uses_thinking_budget:
            width = max(len(params.thinking_start_token_ids), len(params.thinking_end_token_ids),
                        len(params.forced_thinking_ids))
            if "thinking_markers" not in t:
                self._new_optional("thinking_markers", 3, torch.long, width)
                self._new_optional("thinking_match", 3, torch.bool, width)
            self._widen("thinking_markers", width, dim=2)
            self._widen("thinking_match", width, dim=2)
        for name, (spec, args) in self._stage_arguments("", params).items():
            self._allocate_stage(spec)
        if params.uses_penalties and "output_counts" not in t:
            self._new_optional("prompt_mask", V, torch.bool)
            # Rows added before this point start counting now: they do not use penalties
            # (parameters never change), so their counts are never read.
            self._new_optional("output_counts", V, torch.int32)
        if params.allowed_token_ids is not None and "allowed_mask" not in t:
            self._new_optional("allowed_mask", V, torch.bool)
        if params.logit_bias:
            width = len(params.logit_bias)
            if "bias_ids" not in t:
                self._new_optional("bias_ids", width, torch.long)
                self._new_optional("bias_values", width, torch.float32)
            self._widen("bias_ids", width)
            self._widen("bias_values", width)
        if params.min_tokens > 0:
            width = len(set(params.stop_token_ids) | self._eos_set())
            width = max(width, 1)
            if "stop_ids" not in t:
                self._new_optional("stop_ids", width, torch.long)
                self._new_optional("stop_valid", width, torch.bool)
            self._widen("stop_ids", width)
            self._widen("stop_valid", width)
        if params.bad_words:
            words = len(params.bad_words)
            prefix = max(len(w) for w in params.bad_words) - 1
            if "bad_last" not in t:
                self._new_optional("bad_last", words, torch.long)
                self._new_optional("bad_valid", words, torch.bool)
                self._new_optional("bad_prefix", words, torch.long, max(prefix, 1))
                # Rows without bad words never read the window, so it may start empty.
                self._new_optional("recent", max(prefix, 1), torch.long)
            self._widen("bad_last", words)
            self._widen("bad_valid", words)
            self._widen("bad_prefix", words)
            if prefix > self._tensors["recent"].shape[1]:
                self._widen("bad_prefix", prefix, dim=2)
                # Older rows' words are shorter than the old window: their prefixes are
                # padded with wildcards on the left, so the new empty slots are never read.
                self._widen("recent", prefix)

    def _ensure_history_room(self, tokens: int) -> None:
        """Widen the DRY history so every row can take ``tokens`` more (host bound, no sync)."""
        if "dry_history" not in self._tensors:
            return
        self._history_bound += tokens
        if self._history_bound > self._tensors["dry_history"].shape[1]:
            self._widen("dry_history", self._history_bound)
            self._widen("dry_match", self._history_bound)

    def _eos_set(self) -> set[int]:
        return set() if self.eos_token_id is None else {self.eos_token_id}

    def _write_rows(self, rows: list[int], params: SamplingParams, prompt: list[int],
                    outputs: list[list[int]], child_offset: int = 0,
                    row_values: Optional[dict[str, list]] = None) -> None:
        n = len(rows)
        sl = slice(rows[0], rows[0] + n)
        t, dev = self._store, self.device     # the tensors below are not pending ones
        seed_lo, seed_hi = split_seed(params.seed) if params.seed is not None else (0, 0)
        # a field the request left at its default holds the neutral value: where every row
        # of the batch holds it too (idle), there is nothing to read or write
        given, idle = params.model_fields_set, self._idle_scalars
        scalar_values = {f.name: f.value(params) for f in pipeline.stage_fields()
                         if f.name in given or f.name not in idle}
        scalar_values.update(
            seed_lo=seed_lo, seed_hi=seed_hi, seeded=params.seed is not None,
            greedy=params.is_greedy, return_kept=params.return_kept, filter_order=self._order_index(params),
            thinking_budget=(thinking.NO_BUDGET if params.thinking_budget is None
                             else min(params.thinking_budget, pipeline.INT32_MAX)))

        V = self.vocab_size
        if "output_counts" in t:
            # Built on the host and uploaded once (a device write from host values would wait).
            prompt_mask = torch.zeros(V, dtype=torch.bool)
            if prompt:
                prompt_mask[torch.tensor(prompt, dtype=torch.long)] = True
            t["prompt_mask"][sl] = upload(prompt_mask, dev)
            if any(outputs):
                counts = torch.zeros((n, V), dtype=torch.int32)
                for c, out in enumerate(outputs):
                    if out:
                        counts[c] = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=V)
                t["output_counts"][sl] = upload(counts, dev)
            else:
                t["output_counts"][sl] = 0
        if "allowed_mask" in t:
            if params.allowed_token_ids is None:
                t["allowed_mask"][sl] = True
            else:
                allowed = torch.zeros(V, dtype=torch.bool)
                allowed[torch.tensor(params.allowed_token_ids, dtype=torch.long)] = True
                t["allowed_mask"][sl] = upload(allowed, dev)
        if "bias_ids" in t:
            width = t["bias_ids"].shape[1]
            ids = torch.zeros(width, dtype=torch.long)
            vals = torch.zeros(width, dtype=torch.float32)
            for i, (token, bias) in enumerate(sorted(params.logit_bias.items())):
                ids[i], vals[i] = token, bias
            t["bias_ids"][sl] = upload(ids, dev)
            t["bias_values"][sl] = upload(vals, dev)
        if "stop_ids" in t:
            width = t["stop_ids"].shape[1]
            ids = torch.zeros(width, dtype=torch.long)
            valid = torch.zeros(width, dtype=torch.bool)
            if params.min_tokens > 0:
                stops = sorted(set(params.stop_token_ids) | self._eos_set())
                ids[: len(stops)] = torch.tensor(stops, dtype=torch.long)
                valid[: len(stops)] = True
            t["stop_ids"][sl] = upload(ids, dev)
            t["stop_valid"][sl] = upload(valid, dev)
        if "bad_last" in t:
            words, width = t["bad_prefix"].shape[1:]
            last = torch.zeros(words, dtype=torch.long)
            valid = torch.zeros(words, dtype=torch.bool)
            prefix = torch.full((words, width), _OPTIONAL_NEUTRAL["bad_prefix"], dtype=torch.long)
            for i, word in enumerate(params.bad_words):
                last[i], valid[i] = word[-1], True
                if len(word) > 1:
                    prefix[i, width - (len(word) - 1):] = torch.tensor(word[:-1], dtype=torch.long)
            t["bad_last"][sl] = upload(last, dev)
            t["bad_valid"][sl] = upload(valid, dev)
            t["bad_prefix"][sl] = upload(prefix, dev)
            recent = torch.full((n, t["recent"].shape[1]), -1, dtype=torch.long)
            for c, out in enumerate(outputs):
                tail = out[-recent.shape[1]:]
                if tail:
                    recent[c, recent.shape[1] - len(tail):] = torch.tensor(tail, dtype=torch.long)
            t["recent"][sl] = upload(recent, dev)
        if "dry_history" in t:
            self._write_history(sl, params, prompt, outputs)
        if "thinking_markers" in t:
            self._write_thinking(sl, params, prompt, outputs)
        for name, (spec, args) in self._stage_arguments("", params).items():
            self._write_stage(sl, spec, args, prompt, outputs)
        for spec, _ in self._engine_stages.values():
            self._write_stage(sl, spec, spec.args(), prompt, outputs)
        # Last, once nothing above can fail: a failed add leaves no pending values behind
        values = {name: [value] * n for name, value in scalar_values.items()}
        values["child"] = list(range(child_offset, child_offset + n))
        values["position"] = [len(o) for o in outputs]
        values.update(row_values or {})
        self._stage_row_values(rows[0], self._without_idle(values))

    def _write_history(self, sl: slice, params: SamplingParams, prompt: list[int],
                       outputs: list[list[int]]) -> None:
        """DRY's history, repeat lengths and breakers for the rows ``sl`` (one per child)."""
        t, n = self._tensors, len(outputs)
        width, nb = t["dry_history"].shape[1], t["dry_breakers"].shape[1]
        history = torch.full((n, width), -1, dtype=torch.long)
        match = torch.zeros((n, width), dtype=torch.int32)
        length = torch.zeros(n, dtype=torch.int32)
        since = torch.zeros(n, dtype=torch.int32)
        breakers = torch.full((nb,), -1, dtype=torch.long)
        if params.uses_dry:
            stops = params.dry_sequence_breakers
            breakers[: len(stops)] = torch.tensor(stops, dtype=torch.long)
            for c, out in enumerate(outputs):
                h = prompt + out
                if h:
                    history[c, : len(h)] = torch.tensor(h, dtype=torch.long)
                    match[c, : len(h)] = torch.tensor(match_lengths(h), dtype=torch.int32)
                length[c], since[c] = len(h), trailing_run(h, stops)
        for name, value in (("dry_history", history), ("dry_match", match), ("dry_length", length),
                            ("dry_since_breaker", since), ("dry_breakers", breakers)):
            t[name][sl] = upload(value, self.device)

    def _write_thinking(self, sl: slice, params: SamplingParams, prompt: list[int],
                        outputs: list[list[int]]) -> None:
        """Step 8b's markers, match bits and think count for the rows ``sl`` (one per child),
        replayed from each child's history (``corelib.thinking.replay``)."""
        t, n = self._tensors, len(outputs)
        width = t["thinking_markers"].shape[2]
        markers = torch.full((n, 3, width), -1, dtype=torch.long)
        match = torch.zeros((n, 3, width), dtype=torch.bool)
        count = torch.full((n,), thinking.NOT_THINKING, dtype=torch.int32)
        if params.uses_thinking_budget:
            start, end = params.thinking_start_token_ids, params.thinking_end_token_ids
            forced = params.forced_thinking_ids
            markers[:] = thinking.marker_table(start, end, forced, width)
            for c, out in enumerate(outputs):
                bits, count[c] = thinking.replay(prompt + out, start, end, forced)
                match[c] = thinking.bits_tensor(bits, width)
        for name, value in (("thinking_markers", markers), ("thinking_match", match),
                            ("thinking_count", count)):
            t[name][sl] = upload(value, self.device)

    def _move_rows(self, src: list[int], dst: list[int]) -> None:
        """Copy rows ``src`` to rows ``dst`` (host row numbers, equal lengths) in every per-row
        tensor, as one permutation: every source row is read before any row is written, so
        ``swap_rows`` passes ``[a, b] -> [b, a]``. The row numbers are uploaded once, without
        waiting. Subclasses with state of their own override this (and call it) to move that
        state too."""
        s, d = (upload(rows, self.device, torch.long) for rows in (src, dst))
        for name, tensor in self._unblocked_tensors():
            tensor.index_copy_(0, d, tensor.index_select(0, s))
        for block, _ in self._scalar_blocks.values():   # a row is a column of its block
            block.index_copy_(1, d, block.index_select(1, s))

    def _reset_rows(self, rows: list[int]) -> None:
        if not rows:
            return
        sl = slice(rows[0], rows[-1] + 1)
        for name, tensor in self._unblocked_tensors():
            tensor[sl] = _SCALARS[name][1] if name in _SCALARS else self._neutral[name]
        for block, neutral in self._scalar_blocks.values():
            block[:, sl] = neutral

    def _unblocked_tensors(self):
        """(name, tensor) of the per-row tensors that rows move and reset one at a time: not
        the scalar columns of ``_scalar_blocks`` (moved a block at a time), nor the stage
        scalars no request has set (``_idle_scalars``: neutral in every row)."""
        skip = _SCALARS if self._scalar_blocks else self._idle_scalars
        return [(name, tensor) for name, tensor in self._tensors.items() if name not in skip]

    def _without_idle(self, values: dict[str, list]) -> dict[str, list]:
        """``values`` (name -> per-row values of rows being added) less the stage scalars that
        every row holds neutral and these rows leave neutral too (``_idle_scalars``: a batch
        where no request ever used a stage does not write, move or reset its scalars). A
        scalar a request first sets leaves the idle set, after the rows still pending are
        written (pending rows of one read share one set of names)."""
        idle = self._idle_scalars
        if not idle:
            return values
        woken = []
        for name, column in values.items():
            if name in idle:
                neutral = _SCALARS[name][1]
                if column[0] != neutral or (len(column) > 1 and any(v != neutral for v in column)):
                    woken.append(name)
        if woken:
            if self._pending:
                self._write_pending()
            idle.difference_update(woken)
        return {name: v for name, v in values.items() if name not in idle}
