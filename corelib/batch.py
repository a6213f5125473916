"""Batch state for continuous batching: one logits row per (request, child).

The host keeps the bookkeeping (which request owns which row, its parameters, how many tokens
each row has generated); the device keeps every per-row tensor a stage reads. Adding a request
writes only its own rows (its per-row values wait on the host until the state is next read,
so the requests that join between two steps take one write per tensor); removing requests
moves the last rows into the freed places (as vLLM's input batch does), one move for all the
requests of a call, so no operation rebuilds every row, and ``append`` updates running counts
instead of re-reading histories.

``SamplingBatch`` keeps the rows' bookkeeping and ``append`` here; the step states it gives
the sampler are ``batch_steps``'s, its per-row tensors and the values a request's rows start
from the row store's (``batch_store``), and the custom stages' rows are ``batch_stages``'s.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from . import catalog, pipeline, thinking
from .batch_selectors import SelectorRows
from .batch_stages import CustomStageRows, _stage_key  # noqa: F401  (the TPU plugin reads _stage_key here)
from .batch_steps import RequestFlags, StepStates
from .batch_store import _MIN_CAPACITY, RowStore
from .bitmask import bitmask_width
from .history import advance_matches
from .params import SamplingParams
from .reductions import torch_row_sum
from .stages import StageSpec
from .step_state import OPTIONAL_NEUTRAL as _OPTIONAL_NEUTRAL
from .step_state import StepState
from .transfer import upload

#: Where step 15's values come from: log-probabilities or logits, of the model's logits as
#: given (step 1) or of the final distribution.
LOGPROBS_MODES = ("raw", "processed", "raw_logits", "processed_logits")
#: The token id of a flagged row (no token this step), in outputs and in ``append``.
INVALID_TOKEN = -1
# append checks this many host ids or fewer in Python (a list), more with one tensor pass
_FEW_ROWS = 16
# Rows, children and positions are int32 on the device (and in the seeded-draw recipe).
_INT32_MAX = pipeline.INT32_MAX
MAX_ROWS = _INT32_MAX
_JUST_INT = {int}                  # the types of a list of plain ints (bools are not)


class UnknownRequestError(KeyError, ValueError):
    """A request id that is not in the batch: a KeyError for lookups, and a ValueError as the
    contract asks of every bad input."""


@dataclass
class _Request:
    request_id: str
    params: SamplingParams
    rows: list[int]
    flags: frozenset = frozenset()      # pipeline.request_flags(params)
    summary: Optional[RequestFlags] = None      # RequestFlags.of(params, vocab_size)


class SamplingBatch(StepStates, RowStore, CustomStageRows, SelectorRows):
    """The rows of one running batch and their device state (see the module docstring).

    Create it with ``sampler.new_batch(vocab_size, eos_token_id=None, logprobs_mode="raw")``.
    """

    #: The custom stages requests may name (``corelib.catalog``): ``new_batch`` sets the
    #: sampler's; a batch built directly reads the process-wide registry's.
    stage_catalog: catalog.StageCatalog = staticmethod(catalog.installed_stages)
    #: The row sum ``append`` advances the selectors' state with (``Sampler.row_sum``):
    #: ``new_batch`` sets the sampler's, so its steps and ``score`` sum the same way.
    row_sum = staticmethod(torch_row_sum)

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu",
                 eos_token_id: Optional[int] = None, logprobs_mode: str = "raw"):
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        if eos_token_id is not None and (
            isinstance(eos_token_id, bool) or not isinstance(eos_token_id, int)
            or not 0 <= eos_token_id < vocab_size
        ):
            raise ValueError(
                f"eos_token_id must be an int in [0, vocab_size={vocab_size}), got {eos_token_id!r}"
            )
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._on_host = self.device.type == "cpu"
        self.eos_token_id = eos_token_id
        self.logprobs_mode = logprobs_mode
        self._requests: dict[str, _Request] = {}
        self._row_keys: list[tuple[str, int]] = []
        self._row_params: list[SamplingParams] = []
        self._generated: list[int] = []
        self._capacity = 0
        # Per-row values of rows added since the state was last read, by tensor name, for
        # the rows from ``_pending_first`` on: written by ``_tensors`` (one write per
        # tensor for every row that joined, instead of one per tensor and request)
        self._pending: dict[str, list] = {}
        self._pending_first = 0
        self._tensors: dict[str, torch.Tensor] = {}
        # dtype -> (its scalar columns' block [columns, capacity], their neutral values
        # [columns, 1]), on the batch's device: see RowStore._first_rows
        self._scalar_blocks: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self._request_index: Optional[torch.Tensor] = None
        self._flags: Optional[dict] = None
        self._min_rows: Optional[list[int]] = None
        self._neutral = dict(_OPTIONAL_NEUTRAL)       # grows with custom stages' tensors
        self._stage_specs: Optional[dict] = None
        self._used_stages: Optional[list] = None
        self._engine_stages: dict[str, tuple[StageSpec, Optional[str]]] = {}   # use_stage
        self._stale_generated = False                 # device appends of [rows, K+1] ids
        self._history_bound = 0                       # upper bound of DRY rows' history length
        # The first rows of every tensor and the step state over them, for one row count:
        # kept until a request joins, leaves or moves, or a tensor is replaced (``_forget_views``)
        self._views: Optional[tuple[int, dict, dict]] = None
        self._template: Optional[StepState] = None
        self._all_true: Optional[torch.Tensor] = None     # bool [n] and int32 [n] ones
        self._one_step: Optional[torch.Tensor] = None
        # stage scalars no request of this batch has set yet: every row holds them neutral
        self._idle_scalars = {f.name for f in pipeline.stage_fields() + pipeline.state_fields()}
        self._orders: dict[tuple[str, ...], int] = {}       # filter order -> its filter_order
        self._selector_source: Optional[tuple[torch.Tensor, int]] = None
        self._sampled: Optional[tuple[torch.Tensor, int]] = None   # mark_sampled_ids
        self._ensure_capacity(_MIN_CAPACITY)

    # ------------------------------------------------------------------ public views
    @property
    def rows(self) -> list[tuple[str, int]]:
        """``[(request_id, child_index), ...]``, one per logits row, in row order."""
        return list(self._row_keys)

    @property
    def num_rows(self) -> int:
        return len(self._row_keys)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    @property
    def request_ids(self) -> list[str]:
        """Requests in the order of per-request logits rows (``[num_requests, V]``).

        Ordered by each request's first row, so with n = 1 everywhere it equals row order.
        """
        return sorted(self._requests, key=lambda rid: min(self._requests[rid].rows))

    def __len__(self) -> int:
        return len(self._row_keys)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def params_of(self, request_id: str) -> SamplingParams:
        return self._lookup(request_id).params

    def rows_of(self, request_id: str) -> list[int]:
        return list(self._lookup(request_id).rows)

    def generated_counts(self) -> list[int]:
        """Tokens generated so far, per row (host mirror of the device positions; after an
        ``append`` of ``[rows, K+1]`` ids on an accelerator it is read back from the device,
        which waits for it)."""
        self._refresh_generated()
        return list(self._generated)

    def add(self, request_id: str, params: SamplingParams,
            prompt_token_ids: Sequence[int] = (),
            output_token_ids: Optional[Sequence[int] | Sequence[Sequence[int]]] = None,
            child_offset: int = 0, sampler_state: Optional[Sequence[Sequence[float]]] = None) -> list[int]:
        """Add a request as ``params.n`` rows; returns their row indices (child order).

        ``output_token_ids`` resumes a request that already generated tokens: one list for
        n = 1, or one list per child. ``child_offset``: the child index its first row draws
        as (seeded draws are keyed by seed, child and position): an engine that splits a
        parallel request into n requests of n = 1 adds child i with ``child_offset=i``, so it
        draws exactly what row ``(parent, i)`` of the unsplit request draws.
        ``sampler_state``: what ``sampler_state(request_id)`` returned where the request ran
        before (its stateful selectors' state); None starts it afresh. Raises ValueError
        naming the request on any bad id or state.
        """
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already in the batch")
        if not isinstance(params, SamplingParams):
            raise TypeError(
                f"params of request {request_id!r} must be corelib.SamplingParams, "
                f"got {type(params).__name__}"
            )
        if len(self._row_keys) + params.n > MAX_ROWS:
            # Checked before anything is built per child: such an n would only exhaust memory.
            raise ValueError(
                f"request {request_id!r}: n={params.n} does not fit: a batch holds at most "
                f"{MAX_ROWS} rows (row and child indices are int32), it has {len(self._row_keys)}"
            )
        if (isinstance(child_offset, bool) or not isinstance(child_offset, int)
                or not 0 <= child_offset <= _INT32_MAX - params.n + 1):
            raise ValueError(f"request {request_id!r}: child_offset must be an int in "
                             f"[0, 2**31 - n], got {child_offset!r}")
        prompt = self._check_ids(request_id, "prompt_token_ids", prompt_token_ids)
        outputs = self._split_outputs(request_id, params.n, output_token_ids)
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise ValueError(f"request {request_id!r}: logprobs={params.logprobs} asks for more "
                             f"entries than the vocabulary has (vocab_size={self.vocab_size}; "
                             f"-1 asks for every token)")
        top = params.max_token_id()
        if top is not None and top >= self.vocab_size:
            raise ValueError(
                f"request {request_id!r}: token id {top} in its parameters is out of range "
                f"for vocab_size={self.vocab_size}"
            )
        self._stage_arguments(request_id, params)   # unknown stages or bad arguments raise here
        selector_rows = self._selector_rows(request_id, params, params.n, sampler_state)

        first = len(self._row_keys)
        rows = list(range(first, first + params.n))
        # All or nothing: an allocation that fails half-way (a huge n or vocabulary) must not
        # leave tensors of different capacities or widths behind, nor half-written free rows.
        saved_tensors, saved_capacity = dict(self._store), self._capacity
        saved_blocks = dict(self._scalar_blocks)
        try:
            self._ensure_capacity(first + params.n)
            self._allocate_optional_state(params, prompt, outputs)
            self._write_rows(rows, params, prompt, outputs, child_offset, selector_rows)
        except BaseException:
            self._tensors, self._capacity = saved_tensors, saved_capacity
            self._scalar_blocks = saved_blocks
            self._forget_views()
            self._reset_rows(rows)
            raise

        self._requests[request_id] = _Request(request_id, params, rows, pipeline.request_flags(params),
                                              RequestFlags.of(params, self.vocab_size))
        for child, out in enumerate(outputs):
            self._row_keys.append((request_id, child))
            self._row_params.append(params)
            self._generated.append(len(out))
        self._changed()
        return rows

    def remove(self, *request_ids: str) -> None:
        """Drop requests' rows; the last rows move into the freed places.

        Several requests leave as if removed one at a time in the given order (an engine's
        requests that finished in one step), with one move and one reset of the per-row state
        for all of them. Raises ``UnknownRequestError`` for an id that is not in the batch
        and ValueError for an id given twice, before anything changes.
        """
        requests = [self._lookup(request_id) for request_id in request_ids]
        if len(set(request_ids)) != len(request_ids):
            repeated = next(rid for rid in request_ids if request_ids.count(rid) > 1)
            raise ValueError(f"remove: request {repeated!r} is given more than once")
        if not requests:
            return
        old_len = len(self._row_keys)
        origin = removal_order(old_len, [request.rows for request in requests])
        for request in requests:
            del self._requests[request.request_id]
        moved = [(o, d) for d, o in enumerate(origin) if o != d]
        if moved:
            self._move_rows([o for o, _ in moved], [d for _, d in moved])
        new_len = len(origin)
        for rows in (self._row_keys, self._row_params, self._generated):
            sources = [rows[o] for o, _ in moved]
            for (_, d), value in zip(moved, sources):
                rows[d] = value
            del rows[new_len:]
        for _, d in moved:
            rid, child = self._row_keys[d]
            self._requests[rid].rows[child] = d
        self._reset_rows(list(range(new_len, old_len)))
        self._changed()

    def clear(self) -> None:
        self.remove(*self._requests)

    def swap_rows(self, a: int, b: int) -> None:
        """Exchange rows ``a`` and ``b`` with all their state, so the batch's rows follow an
        engine that reorders its own persistent batch (vLLM's ``swap_states``). Both requests
        keep every counter, seed position and history; only their row numbers change."""
        n = len(self._row_keys)
        for name, row in (("a", a), ("b", b)):
            if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < n:
                raise ValueError(f"swap_rows: row {name}={row!r} is not a row of this batch "
                                 f"(it has {n} rows)")
        if a == b:
            return
        self._move_rows([a, b], [b, a])
        for rows in (self._row_keys, self._row_params, self._generated):
            rows[a], rows[b] = rows[b], rows[a]
        for row in (a, b):
            rid, child = self._row_keys[row]
            self._requests[rid].rows[child] = row
        self._changed()

    # ------------------------------------------------------------------ append
    def append(self, token_ids: torch.Tensor | Sequence[int] | Sequence[Sequence[int]]) -> None:
        """Record the tokens each row generated: ``[num_rows]`` ids (one per row, from
        ``sample``) or ``[num_rows, K+1]`` (from ``verify``: each row's emitted tokens, then -1
        padding), any device.

        Updates positions, running output counts, the recent-token window, DRY histories and
        custom stages' state; never reads a history. With one id per row, -1 (a flagged row's
        id) is "no token this step": that row's state stays as it was, on every device, so
        ``batch.append(sampler.sample(logits, batch).token_ids)`` needs no filtering. Any other
        id outside ``[0, vocab_size)`` raises ValueError naming the row when the ids are on the
        host (a list or a CPU tensor); on an accelerator it cannot be checked without waiting,
        and is treated as -1. If a custom stage's state update fails, ``StageError`` is raised
        and nothing changes.
        """
        ids, every = self._checked_ids(token_ids)
        n = ids.shape[0]
        if n == 0:
            return
        # The host mirror of the positions: on the CPU the positions themselves are read back
        # when it is needed (``_refresh_generated``: no wait), so append leaves it stale
        counted_here = ids.is_cpu and not self._on_host
        steps = (ids >= 0).view(n, -1).sum(dim=1).tolist() if counted_here else None
        ids = upload(ids, self.device, torch.long)
        if every:       # host ids, all in [0, V): every row takes its token
            columns = [(ids, self._every_row(n))]
        elif ids.dim() == 1:
            live = (ids >= 0) & (ids < self.vocab_size)
            columns = [(ids, live)]
        else:
            live = torch.cumprod((ids >= 0).to(torch.int32), dim=1).to(torch.bool)
            columns = [(ids[:, j], live[:, j]) for j in range(ids.shape[1])]
        self._ensure_history_room(len(columns))
        t, _ = self._row_views(n)
        self._advance(t, columns, one_per_row=ids.dim() == 1, every=every)
        self._advance_selectors(t, columns)
        self._appended(columns, every)
        if steps is None:
            self._stale_generated = True     # read back from the positions when needed
        elif not self._stale_generated:
            self._generated = list(map(operator.add, self._generated, steps))

    def _appended(self, columns: list[tuple[torch.Tensor, torch.Tensor]], every: bool) -> None:
        """Called by ``append`` once the ids are checked and the batch's own state advanced:
        ``columns`` as in ``_advance`` (int64 ids on the batch's device, -1 or out of range
        where their bool ``advance`` is False), ``every``: one column whose ids are all in
        range. A subclass with per-row state of its own updates it here."""

    def _advance(self, t: dict[str, torch.Tensor],
                 columns: list[tuple[torch.Tensor, torch.Tensor]], one_per_row: bool = False,
                 every: bool = False) -> None:
        """Advance row state ``t`` (name -> tensor ``[n, ...]``, updated in place) by one token
        per column: ``columns`` holds (int64 ids ``[n]``, bool advance ``[n]``) pairs, applied in
        order. A row advances its position where ``advance`` holds; in-range ids are counted,
        enter the recent window and the DRY history, and update custom stages' state. Custom
        stages run first, on new tensors, so a failing one leaves ``t`` unchanged.
        ``one_per_row``: ``columns`` is append's one column, whose ``advance`` is exactly its
        ids in range; ``every``: and that is every row (all True)."""
        staged = self._advanced_stage_state(t, columns)
        for ids, advance in columns:
            self._advance_builtin(t, ids, advance, advance if one_per_row else None, every)
        for name, value in staged.items():
            t[name].copy_(value)

    def _advance_builtin(self, t: dict[str, torch.Tensor], ids: torch.Tensor,
                         advance: torch.Tensor, in_range: Optional[torch.Tensor] = None,
                         every: bool = False) -> None:
        """``in_range``: ``(ids >= 0) & (ids < V)`` when the caller has it and it implies
        ``advance`` (append's one id per row); ``every``: it holds on every row."""
        if in_range is None:
            in_range = (ids >= 0) & (ids < self.vocab_size)
            counted = in_range & advance
        else:
            counted = in_range
        if every:
            safe = ids
            self._advance_positions(t["position"])
        else:
            safe = torch.where(in_range, ids, torch.zeros_like(ids))
            t["position"] += advance.to(torch.int32)
        if "output_counts" in t:
            t["output_counts"].scatter_add_(1, safe[:, None], counted[:, None].to(torch.int32))
        if "recent" in t and t["recent"].shape[1] > 0:
            recent = t["recent"]
            shifted = torch.cat([recent[:, 1:], torch.where(in_range, ids, -1)[:, None]], dim=1)
            recent.copy_(torch.where(advance[:, None], shifted, recent))
        if "thinking_markers" in t:
            match, count = thinking.advance(t["thinking_markers"], t["thinking_match"],
                                            t["thinking_count"], safe, counted)
            t["thinking_match"].copy_(match)
            t["thinking_count"].copy_(count)
        if "dry_history" in t:
            live = counted & (t["dry_multiplier"] > 0)
            updated = advance_matches(t["dry_history"], t["dry_match"], t["dry_length"],
                                      t["dry_since_breaker"], t["dry_breakers"], safe, live)
            for name, value in zip(("dry_history", "dry_match", "dry_length", "dry_since_breaker"), updated):
                t[name].copy_(value)

    def _advance_positions(self, position: torch.Tensor) -> None:
        """One more token in every row: ``position`` int32 [n], the rows' view of the batch's
        positions, in place (``_every_row(n)`` has run). A subclass may write it its own way."""
        # a tensor operand: adding a Python scalar costs twice as much per call
        position += self._one_step

    def check_token_ids(self, token_ids) -> torch.Tensor:
        """``append``'s argument checks: one integer id per row (``[rows]``, -1 for a flagged
        row), or each row's emitted tokens (``[rows, K+1]``, -1 padding after them); other ids
        outside ``[0, vocab_size)`` raise when the ids are on the host (a list or a CPU
        tensor), since checking device ids would wait on the device. Returns them as a tensor
        (not copied to the batch's device)."""
        return self._checked_ids(token_ids)[0]

    def _every_row(self, n: int) -> torch.Tensor:
        """bool ``[n]`` all True on the batch's device (made once per row count; read only)."""
        every = self._all_true
        if every is None or every.shape[0] != n:
            every = self._all_true = torch.ones(n, dtype=torch.bool, device=self.device)
            self._one_step = torch.ones(n, dtype=torch.int32, device=self.device)
        return every

    def mark_sampled_ids(self, token_ids: torch.Tensor) -> None:
        """Called by a sampler that knows every id of its output ``token_ids`` (int64
        ``[rows]`` on the host, the tensor it returns) to lie in ``[0, vocab_size)``:
        ``append`` of that same tensor then skips reading the ids back for its range check,
        unless it was written in place since (its version counter moved). Any other
        argument, and an inference tensor (``torch.inference_mode`` keeps no version counter,
        so a write could not be seen), is checked as always."""
        self._sampled = None if token_ids.is_inference() else (token_ids, token_ids._version)

    def _checked_ids(self, token_ids) -> tuple[torch.Tensor, bool]:
        """``check_token_ids``, and whether the ids are one per row, on the host and all in
        ``[0, vocab_size)`` (no flagged row: every row takes its token)."""
        n = len(self._row_keys)
        sampled = self._sampled
        if (sampled is not None and token_ids is sampled[0] and token_ids._version == sampled[1]
                and token_ids.shape[0] == n):
            return token_ids, True
        try:
            # a tensor as it is: as_tensor's own path costs a cold step more than this test
            ids = token_ids if isinstance(token_ids, torch.Tensor) else torch.as_tensor(token_ids)
        except (RuntimeError, TypeError, ValueError) as exc:  # None, strings, ints past int64
            kind = ValueError if isinstance(exc, ValueError) else TypeError
            raise kind(f"append needs one integer token id per row, got "
                       f"{type(token_ids).__name__}: {exc}") from None
        if ids.dim() not in (1, 2) or ids.shape[0] != n:
            raise ValueError(
                f"append needs one token id per row: expected shape [{n}] (or [{n}, K+1] "
                f"from verify), got {list(ids.shape)}"
            )
        if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
            raise TypeError(f"append needs integer token ids, got dtype {ids.dtype}")
        if ids.dim() == 2:
            if n and ids.is_cpu:
                self._check_emitted(ids)
            return ids, False
        if n and ids.is_cpu:
            if n <= _FEW_ROWS:      # a list's min and max cost less than a pass and two reads
                values = ids.tolist()
                low, high = min(values), max(values)
            else:
                low, high = torch.aminmax(ids)      # one pass; the row is found only on failure
                low, high = int(low), int(high)
            if low >= INVALID_TOKEN and high < self.vocab_size:
                return ids, low >= 0
            bad = ((ids < INVALID_TOKEN) | (ids >= self.vocab_size)).nonzero()
            if bad.numel():
                row = int(bad[0, 0])
                raise ValueError(
                    f"append: token id {int(ids[row])} for row {row} (request "
                    f"{self._row_keys[row][0]!r}) is out of range for vocab_size={self.vocab_size} "
                    f"(-1, a flagged row's id, means no token this step)"
                )
        return ids, False

    def _check_emitted(self, ids: torch.Tensor) -> None:
        """Host ``[rows, K+1]`` ids: in range, with -1 only as trailing padding."""
        problem = padded_ids_problem(ids, self.vocab_size)
        if problem is None:
            return
        kind, row, col = problem
        if kind == "range":
            raise ValueError(
                f"append: token id {int(ids[row, col])} at row {row}, slot {col} (request "
                f"{self._row_keys[row][0]!r}) is out of range for vocab_size={self.vocab_size}")
        raise ValueError(
            f"append: row {row} (request {self._row_keys[row][0]!r}) has a token after -1 "
            f"padding: {ids[row].tolist()}; -1 may only pad the end of a row")

    def _refresh_generated(self) -> None:
        if self._stale_generated:
            self._generated = self._tensors["position"][: len(self._row_keys)].tolist()
            self._stale_generated = False

    def check_logits(self, logits: torch.Tensor) -> None:
        """Raise a clear error when logits cannot be sampled for this batch."""
        if not isinstance(logits, torch.Tensor):
            raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
        if not logits.dtype.is_floating_point:
            raise TypeError(
                f"logits must be a floating-point tensor (float32, float16, bfloat16, float64), "
                f"got {logits.dtype}"
            )
        if logits.dim() != 2:
            raise ValueError(f"logits must be 2-D [rows, vocab], got shape {list(logits.shape)}")
        rows, vocab = logits.shape
        if vocab != self.vocab_size:
            raise ValueError(
                f"logits have vocab size {vocab} but the batch was created with "
                f"vocab_size={self.vocab_size}"
            )
        if rows not in (self.num_rows, self.num_requests):
            raise ValueError(
                f"logits have {rows} rows; the batch has {self.num_rows} rows "
                f"({self.num_requests} requests): pass one row per batch row, or one per request"
            )
        # equal devices first: a device's type string is a slow path of its own on a cold step
        if logits.device != self.device and logits.device.type != self.device.type:
            raise ValueError(
                f"logits are on {logits.device} but this batch lives on {self.device}"
            )

    def check_token_bitmask(self, token_bitmask: torch.Tensor, slots: Optional[int] = None) -> torch.Tensor:
        """A caller's token bitmask checked and on the batch's device: int32
        ``[rows, ceil(V / 32)]`` (or ``[rows, slots, ceil(V / 32)]`` for ``verify``), on the host
        or this device; returned as ``[rows * slots, ceil(V / 32)]``. The copy does not block.
        Another dtype (a float or bool tensor included), shape, row count or device raises
        ValueError naming it."""
        if not isinstance(token_bitmask, torch.Tensor):
            raise TypeError(f"token_bitmask must be an int32 torch.Tensor, got {type(token_bitmask).__name__}")
        rows, width = self.num_rows, bitmask_width(self.vocab_size)
        expected = [rows, width] if slots is None else [rows, slots, width]
        if token_bitmask.dtype != torch.int32:
            raise ValueError(f"token_bitmask must be int32 (packed bits, as xgrammar and llguidance "
                             f"fill it), got dtype {token_bitmask.dtype}")
        if list(token_bitmask.shape) != expected:
            what = ("one row of ceil(V / 32) words per batch row" if slots is None else
                    "one row of ceil(V / 32) words per batch row and slot")
            raise ValueError(f"token_bitmask must be {expected} ({what}; vocab_size="
                             f"{self.vocab_size}, {rows} rows), got {list(token_bitmask.shape)}")
        if token_bitmask.device.type not in ("cpu", self.device.type):
            raise ValueError(f"token_bitmask is on {token_bitmask.device}; pass it on the host or "
                             f"on the batch's device {self.device}")
        return upload(token_bitmask.reshape(-1, width), self.device)

    # ------------------------------------------------------------------ internals
    def _changed(self) -> None:
        self._selector_source = None
        self._forget_views()
        self._request_index = None
        self._flags = None
        self._min_rows = None
        self._used_stages = None

    def _lookup(self, request_id: str) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise UnknownRequestError(f"request {request_id!r} is not in the batch") from None

    def _check_ids(self, request_id: str, what: str, ids) -> list[int]:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        ids = list(ids)
        # One check per list in C loops for the common case (a long prompt joins in a fraction
        # of the per-token loop's time); the loop below finds the offending id for the message.
        if not ids or (set(map(type, ids)) == _JUST_INT and min(ids) >= 0 and max(ids) < self.vocab_size):
            return ids
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise TypeError(f"request {request_id!r}: {what} must hold ints, got {t!r}")
            if not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"request {request_id!r}: {what} holds token id {t}, out of range for "
                    f"vocab_size={self.vocab_size}"
                )
        return ids

    def _split_outputs(self, request_id, n, output_token_ids) -> list[list[int]]:
        if output_token_ids is None:
            return [[] for _ in range(n)]
        if isinstance(output_token_ids, torch.Tensor):
            output_token_ids = output_token_ids.tolist()
        items = list(output_token_ids)
        nested = bool(items) and all(isinstance(x, (list, tuple)) for x in items)
        if n == 1 and not nested:
            return [self._check_ids(request_id, "output_token_ids", items)]
        if not nested or len(items) != n:
            raise ValueError(
                f"request {request_id!r}: output_token_ids needs one list per child "
                f"(n={n}), got {len(items)} items"
            )
        return [self._check_ids(request_id, f"output_token_ids[{c}]", x) for c, x in enumerate(items)]

    def request_index(self, num_rows: Optional[int] = None) -> torch.Tensor:
        """int64 ``[num_rows]``: each row's place in ``request_ids`` (padding rows: 0).

        Used to expand per-request logits to rows; cached until a request joins or leaves.
        """
        n = len(self._row_keys) if num_rows is None else num_rows
        if self._request_index is None or self._request_index.shape[0] != n:
            order = {rid: i for i, rid in enumerate(self.request_ids)}
            index = [order[rid] for rid, _ in self._row_keys]
            index += [0] * (n - len(index))
            self._request_index = upload(index, self.device, torch.long)
        return self._request_index


def removal_order(num_rows: int, leaving: list[list[int]]) -> list[int]:
    """The rows left after removing requests one at a time (``leaving``: each request's rows,
    numbered before any removal), as ``origin[new_row] = old_row``. Each removal moves the
    surviving rows among its last ``len(rows)`` rows, lowest first, into its holes below the
    new end, lowest first. Host row numbers only: the state moves once, afterwards."""
    origin = list(range(num_rows))
    where: dict[int, int] = {}          # old row -> its row now, for rows that moved
    for rows in leaving:
        holes = sorted(where.pop(row, row) for row in rows)
        last = len(origin)
        end = last - len(holes)
        hole_set = set(holes)
        tail = [r for r in range(end, last) if r not in hole_set]
        for source, hole in zip(tail, (h for h in holes if h < end)):
            origin[hole] = origin[source]
            where[origin[hole]] = hole
        del origin[end:]
    return origin




def padded_ids_problem(ids: torch.Tensor, vocab_size: int) -> Optional[tuple[str, int, int]]:
    """The first problem of host ids ``[rows, S]`` that may end in -1 padding: ("range", row,
    column) for an id outside [-1, V), ("gap", row, -1) for an id after a -1, else None."""
    bad = ((ids < -1) | (ids >= vocab_size)).nonzero()
    if bad.numel():
        row, col = bad[0].tolist()
        return "range", row, col
    pad = ids < 0
    gap = (pad[:, :-1] & ~pad[:, 1:]).nonzero()
    if gap.numel():
        return "gap", int(gap[0, 0]), -1
    return None
