"""Batch state laid out for fixed XLA graphs.

The core's ``SamplingBatch`` writes rows with Python slices and grows its tensors as options
appear; on XLA each distinct slice or shape is a new graph. ``XlaSamplingBatch`` keeps the
same public behaviour with a layout that never changes shape:

- Per-row scalars (temperature, top-k, seeds, positions, DRY and XTC parameters, ...) live on
  the host, in one float32 and one int32 table of ``capacity`` rows; each step uploads the
  first ``bucket`` rows as one int32 block. Rows past the live ones hold neutral values.
- Dense per-row state lives on the device at full capacity from the start: one float32
  ``[C, V]`` additive row (allowed ids, one-token bad words and logit bias), the prompt mask and
  running output counts for penalties, the min-tokens stop mask, fixed-width bad-word tables,
  DRY's history window (``dry``), and the custom stages' switches, arguments and state. Rows
  are written, moved and counted one graph each, with the row numbers passed as data (index
  tensors), so adding, removing, swapping and appending never compile anything new.

``capacity`` is the largest bucket. Limits that shape the graphs are set per sampler:
``max_bad_words`` words of two or more tokens per request, each at most
``max_bad_word_length`` tokens (one-token words are unlimited: they go into the additive row);
``dry_window`` tokens of history and ``max_dry_breakers`` sequence breakers per row; the custom
stages the graphs trace (``stages``); ``max_thinking_marker_length`` tokens per reasoning-budget
marker (step 8b: start, end and forced sequence); ``num_logprobs`` top logprobs per row (the
step graphs compute that many whenever a row asks for any).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch
from corelib.batch import SamplingBatch, _stage_key
from corelib.batch_selectors import _used_state
from corelib import pipeline, selectors, thinking
from corelib.bitmask import bitmask_width
from corelib.params import ALL_LOGPROBS, SamplingParams
from corelib.stages import StageSpec

from . import dry, xla
from .buckets import Buckets
from .device_rows import DeviceRows
from .layout import (
    _COL, _FILTER_ORDER, _GREEDY, _INT_FIELDS, _LOGPROBS_ON, _NEUTRAL_INTS, _POSITION,
    _RANDOM_KEY, _ROUTE, _THINKING_BUDGET, FLOAT_COLUMNS, NEUTRAL_FLOATS, NOT_LIVE, ROUTES,
    STATE_FIELDS, Variant, XlaStepState, _float_values, _int_values, choose_path, flags_for, route_of,
)
from .orders import FilterOrders

NEG_INF = float("-inf")

class XlaSamplingBatch(DeviceRows, SamplingBatch):
    """A ``SamplingBatch`` whose per-step work is a fixed set of XLA graphs (module docstring).

    Created by ``TpuSampler.new_batch``; ``guard`` is the sampler's compile watch. ``stages``:
    None traces the custom stages the live rows use (a new combination is a new graph), or a
    tuple of stage names traced in every step (requests may use only those). num_logprobs: the
    most top logprobs a row may ask for (-1, every token, needs it to be at least the
    vocabulary); max_thinking_marker_length: the longest reasoning-budget marker; orders: the
    sampler's ``FilterOrders`` (the filter orders its graphs trace besides the default one).
    """

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu",
                 eos_token_id: Optional[int] = None, logprobs_mode: str = "raw", *,
                 buckets: Optional[Buckets] = None, top_k_candidates: int = 64,
                 max_bad_words: int = 8, max_bad_word_length: int = 8, dry_window: int = 1024,
                 max_dry_breakers: int = 64, stages: Optional[Sequence[str]] = None,
                 num_logprobs: int = 20, max_thinking_marker_length: int = 8,
                 guard: Optional[xla.CompileGuard] = None, orders: Optional[FilterOrders] = None):
        self.buckets = buckets if buckets is not None else Buckets()
        self.top_k_candidates = _positive("top_k_candidates", top_k_candidates)
        self.max_bad_words = _positive("max_bad_words", max_bad_words)
        self.max_bad_word_length = _positive("max_bad_word_length", max_bad_word_length)
        self.dry_window = _positive("dry_window", dry_window)
        self.max_dry_breakers = _positive("max_dry_breakers", max_dry_breakers)
        self.fixed_stages = None if stages is None else tuple(stages)
        self.max_logprobs = _positive("num_logprobs", num_logprobs)
        self.max_thinking_marker_length = _positive("max_thinking_marker_length",
                                                    max_thinking_marker_length)
        # the N every logprobs graph computes: more than V columns do not exist
        self.padded_logprobs = min(num_logprobs, vocab_size)
        self.guard = guard if guard is not None else xla.CompileGuard()
        # the sampler's traced filter orders (shared by its batches): rows' filter_order indexes it
        self.orders = orders if orders is not None else FilterOrders()
        self._state: dict[str, torch.Tensor] = {}
        self._variant: Optional[Variant] = None
        self._path: Optional[str] = None
        self._route: Optional[str] = None
        self._asked: Optional[tuple[Optional[int]]] = None
        self._sources: dict[tuple[int, bool], torch.Tensor] = {}
        self._cached: dict[tuple, torch.Tensor] = {}
        super().__init__(vocab_size, device, eos_token_id, logprobs_mode)
        if self.fixed_stages is not None:
            self._allocate_stages([self._spec(name) for name in self.fixed_stages])

    # ------------------------------------------------------------------ public additions
    @property
    def capacity(self) -> int:
        """Most rows this batch holds (the largest bucket)."""
        return self.buckets.largest

    def bucket(self, rows: Optional[int] = None) -> int:
        """The bucket a step of ``rows`` rows (default: the live rows) runs in."""
        return self.buckets.for_rows(max(1, self.num_rows if rows is None else rows))

    def variant(self) -> Variant:
        """The static graph variant the current rows need (``Variant``): greedy, with or
        without step 15, or the folded random one (``Variant.folded``) once any row samples,
        with the stateful selectors when a random row uses one; a random one traces every
        filter order of the sampler (``FilterOrders``)."""
        if self._variant is None:
            stages = tuple(spec.name for spec, _ in self._stages_in_use())
            if self.path() == "greedy":
                self._variant = Variant(random=False, logprobs=self._asked_logprobs() is not None,
                                        stages=stages)
            else:
                self._variant = Variant(random=True, logprobs=True, stages=stages, folded=True,
                                        selectors=self.uses_selectors())
        if self._variant.random and self._variant.orders != self.orders.traced:
            # another batch of the sampler may have added an order since
            self._variant = dataclasses.replace(self._variant, orders=self.orders.traced)
        return self._variant

    def uses_selectors(self) -> bool:
        """Some random row uses a stateful selector (mirostat, adaptive-p)."""
        return any(not p.is_greedy and (p.uses_mirostat or p.uses_adaptive_p)
                   for p in self._row_params)

    def sampler_state(self, request_id: str) -> list[list[float]]:
        """As ``SamplingBatch.sampler_state``: the request's selector state, one list of plain
        floats per child, read from the device columns (one transfer per state field)."""
        request = self._lookup(request_id)
        names = [f.name for f in _used_state(request.params)]
        if not names:
            return [[] for _ in request.rows]
        columns = [self._state[name].cpu()[request.rows].tolist() for name in names]
        return [[float(column[c]) for column in columns] for c in range(len(request.rows))]

    def path(self) -> str:
        """The path of steps 11-13 the current rows need (see ``PATHS``)."""
        if self._path is None:
            self._path = choose_path(self._row_params, self.top_k_candidates, self.vocab_size)
        return self._path

    def _route_name(self) -> str:
        """The route of steps 11-13 the current rows take in a random graph (``ROUTES``)."""
        if not self._row_keys:
            return "plain"
        if self._route is None:
            self._route = route_of(self.path(), self._row_params, self.vocab_size)
        return self._route

    def row_sources(self, bucket: int, per_request: bool) -> torch.Tensor:
        """int64 ``[bucket]`` host tensor: the logits row each batch row reads (its own row, or
        its request's row for per-request logits); padding rows read row 0."""
        key = (bucket, per_request)
        if key not in self._sources:
            if per_request:
                order = {rid: i for i, rid in enumerate(self.request_ids)}
                index = [order[rid] for rid, _ in self._row_keys]
            else:
                index = list(range(self.num_rows))
            index += [0] * (bucket - len(index))
            self._sources[key] = torch.tensor(index, dtype=torch.long)
        return self._sources[key]

    def padded_bitmask(self, token_bitmask: Optional[torch.Tensor], bucket: int,
                       slots: Optional[int] = None, graph_slots: Optional[int] = None) -> torch.Tensor:
        """The token bitmask of a step in ``bucket`` rows, on the device: int32 ``[bucket, W]``
        for ``sample`` (``slots`` None), ``[bucket, graph_slots, W]`` for ``verify`` (``slots``
        = the caller's K + 1, ``graph_slots`` the graph's, default ``slots``); padding rows and
        slots unconstrained (-1).

        None gives a cached all -1 tensor (no upload). A mask is checked as the core checks it
        (``SamplingBatch.check_token_bitmask``: dtype, shape, rows), or may come padded to
        ``bucket`` rows. A host mask is padded on the host and uploaded without blocking; a
        device mask of the right shape is used as it is (an input of the step graph, like the
        all -1 one); one that needs padding goes through a one-op graph per row count."""
        W = bitmask_width(self.vocab_size)
        shape = (bucket, W) if slots is None else (bucket, graph_slots or slots, W)
        if token_bitmask is None:
            return self._constant(("no_bitmask", shape), shape, -1, torch.int32)
        n = self.num_rows
        padded_shape = [bucket, W] if slots is None else [bucket, slots, W]
        padded = (isinstance(token_bitmask, torch.Tensor) and bucket != n
                  and list(token_bitmask.shape) == padded_shape and token_bitmask.dtype == torch.int32
                  and token_bitmask.device.type in ("cpu", self.device.type))
        if not padded:
            if isinstance(token_bitmask, torch.Tensor) and token_bitmask.device.type == "cpu":
                _host_checked_bitmask(self, token_bitmask, slots)
            else:
                self.check_token_bitmask(token_bitmask, slots)      # the result is a view: unused
        return xla.fit_block(token_bitmask, shape, -1, torch.int32, self.device, self.guard,
                             f"padding a device token bitmask ({list(token_bitmask.shape)})")

    # ------------------------------------------------------------------ add / append
    def add(self, request_id: str, params: SamplingParams,
            prompt_token_ids: Sequence[int] = (),
            output_token_ids=None, child_offset: int = 0, sampler_state=None) -> list[int]:
        """As ``SamplingBatch.add``; also raises ValueError when the request needs more than
        the graphs were sized for (rows past the largest bucket, too many or too long
        multi-token bad words, too many DRY sequence breakers, a reasoning-budget marker longer
        than ``max_thinking_marker_length``, more top logprobs than ``num_logprobs``, a custom
        stage the sampler's graphs do not trace)."""
        if isinstance(params, SamplingParams):
            self._check_fits(request_id, params)
        return super().add(request_id, params, prompt_token_ids, output_token_ids, child_offset,
                           sampler_state=sampler_state)

    def append(self, token_ids) -> None:
        """Record each row's generated tokens: ``[num_rows]`` ids (from ``sample``) or
        ``[num_rows, K+1]`` (from ``verify``: emitted tokens, then -1 padding).

        A -1 in ``[num_rows]`` ids (a flagged row) is "no token this step": the row's state
        stays as it was. Host ids (a list or CPU tensor, as ``TpuSampler`` returns them) are
        checked as in the core (any other id out of range raises). Device ids are read back
        first (one transfer); there, any out-of-range id is treated as -1. One graph per
        bucket and id width updates the running counts, the recent-token window, DRY's
        window, custom stages' state and, right after a step whose rows use a stateful
        selector, the selectors' state (from that step's distribution, which stayed on the
        device: one more graph per bucket and id width); if a custom stage's update fails,
        ``StageError`` is raised and nothing changes.
        """
        ids = self.check_token_ids(token_ids)   # the core's checks and messages
        source, self._selector_source = self._selector_source, None
        n = ids.shape[0]
        if n == 0:
            return
        ids = ids.cpu().to(torch.long)
        in_range = (ids >= 0) & (ids < self.vocab_size)
        if ids.dim() == 1:
            advance = in_range[:, None]
            ids, in_range = ids[:, None], in_range[:, None]
        else:
            advance = torch.cumprod((ids >= 0).to(torch.int32), dim=1).to(torch.bool)
        padded = torch.full((self.bucket(n), ids.shape[1]), NOT_LIVE, dtype=torch.long)
        padded[:n] = torch.where(advance, torch.where(in_range, ids, -1), NOT_LIVE)
        if source is not None and (not STATE_FIELDS or padded.shape[1] > source[1]):
            source = None           # not the step this source came from
        self._record_tokens(padded, source)
        steps = advance.sum(dim=1).to(torch.int32)
        self._ints[:n, _POSITION] += steps
        for i, step in enumerate(steps.tolist()):
            self._generated[i] += step

    # ------------------------------------------------------------------ step state
    def step_state(self, num_rows: Optional[int] = None,
                   random_keys: Optional[torch.Tensor] = None) -> XlaStepState:
        """The first ``num_rows`` rows (default: the live rows; the sampler asks for its
        bucket, rows past the live ones being neutral padding) as device tensors.

        random_keys: int32 ``[num_rows]`` host tensor, the unseeded rows' noise keys for this
        step (the sampler draws them from its generator); zeros when omitted. One
        host-to-device transfer: the per-row scalars as one int32 block (floats as
        their bits). Dense state is sliced, not copied.
        """
        B = self._rows_for(num_rows)
        table = self._upload_table(self._host_table(B, random_keys))
        dense = {name: tensor[:B] for name, tensor in self._state.items()}
        return self._state_of(table, dense, B)

    def speculative_state(self, draft_token_ids: torch.Tensor, num_rows: Optional[int] = None,
                          random_keys: Optional[torch.Tensor] = None) -> XlaStepState:
        """``verify``'s state: ``num_rows * (K + 1)`` virtual rows, row ``r`` slot ``j`` at
        ``r * (K + 1) + j``, each with the row's state advanced by its first ``j`` drafts
        (position, penalty counts, recent window, DRY window, reasoning-budget state, custom
        stages' state).

        draft_token_ids: int64 ``[num_rows, K]`` on the device (-1 = no draft, a suffix; rows
        past the live ones all -1). random_keys: int32 ``[num_rows * (K + 1)]`` host tensor.
        The scalars are uploaded once, expanded on the host; dense ``[B, V]`` state is
        broadcast to the slots inside the graph (XLA fuses the broadcast into its readers)
        and the drafts' counts are added by K compares, so no ``[B (K+1), V]`` copy of the
        counts is made. The batch itself is not changed.
        """
        B = self._rows_for(num_rows)
        K = draft_token_ids.shape[1]
        S = K + 1
        host = self._host_table(B, None).repeat_interleave(S, dim=0)
        if random_keys is not None:
            host[:, len(FLOAT_COLUMNS) + _RANDOM_KEY] = random_keys
        table = self._upload_table(host)
        slot = self._constant(("slots", B, S), None, None, None,
                              make=lambda: torch.arange(S, dtype=torch.int32).repeat(B))
        drafts = _per_slot(draft_token_ids.to(torch.long), S)                 # (B S, K)
        columns = []
        for j in range(K):
            advance = (slot > j) & (drafts[:, j] >= 0)
            ids = torch.where(advance, drafts[:, j], NOT_LIVE)
            columns.append((ids, advance))
        dense = {name: _per_slot(tensor[:B], S) for name, tensor in self._state.items()
                 if name != "output_counts"}
        vocab = xla.iota(self.vocab_size, torch.int64, self.device)
        counts = _per_slot(self._state["output_counts"][:B], S)
        for ids, advance in columns:
            counts = counts + ((vocab == ids[:, None]) & advance[:, None]).to(torch.int32)
        dense["output_counts"] = counts
        self._advance_rows(dense, columns)
        position = table[:, _COL["position"]] + sum(a.to(torch.int32) for _, a in columns) \
            if columns else table[:, _COL["position"]]
        s = self._state_of(table, dense, B * S, position=position)
        # the draft after each slot advances the selectors' state to the next slot (the
        # sampler's selector_slot_state); the last slot has none
        last = torch.full((drafts.shape[0], 1), -1, dtype=drafts.dtype, device=drafts.device)
        after = torch.cat([drafts, last], dim=1)         # K = 0 (score's one position): [-1]
        s.verify_slots = S
        s.verify_drafts = after.gather(1, slot.to(torch.long)[:, None])[:, 0]
        return s

    def warm_state_graphs(self, slots: Sequence[int] = (1,), selectors: bool = True) -> None:
        """Compile the row-write, row-move and per-bucket append graphs (for ids of each width
        in ``slots``: 1 for ``sample``, K + 1 for ``verify``; with ``selectors``, also those
        that advance the stateful selectors from a step's distribution) without changing any
        live row: writes and moves target the last slot when it is free, appends mark every
        row not live."""
        free = self.capacity - 1
        if free >= self.num_rows:
            self._write_device_row(free, self._neutral_row())
            self._move_device_rows([free, free], [free, free])
        for bucket in self.buckets:
            for width in slots:
                ids = torch.full((bucket, width), NOT_LIVE, dtype=torch.long)
                self._record_tokens(ids)
                if selectors and STATE_FIELDS:
                    source = torch.zeros((bucket * width, self.vocab_size)).to(self.device)
                    self._record_tokens(ids, (source, width))

    # ------------------------------------------------------------------ core hooks
    def _changed(self) -> None:
        super()._changed()
        self._variant = None
        self._path = None
        self._route = None
        self._asked = None
        self._sources = {}

    def _ensure_capacity(self, rows: int) -> None:
        """Allocate everything at full capacity once; ``add`` checks the row limit first."""
        if not self._state:
            self._allocate()

    def _allocate_optional_state(self, params: SamplingParams, prompt: list[int],
                                 outputs: list[list[int]]) -> None:
        """Every built-in tensor exists at full size from the start; a custom stage's tensors
        are allocated when a request first names it (without ``stages``)."""
        new = [spec for _, (spec, _) in self._stage_arguments("", params).items()
               if _stage_key(spec.name, "active") not in self._state]
        if new:
            self._allocate_stages(new)

    def _stages_in_use(self) -> list[tuple[StageSpec, Optional[str]]]:
        """The custom stages the graphs trace: the sampler's ``stages`` when given, else those
        some live row uses (the core's rule), in registration order."""
        if self.fixed_stages is None:
            return super()._stages_in_use()
        if self._used_stages is None:
            specs = self.stage_specs()
            self._used_stages = [specs[name] for name in specs if name in self.fixed_stages]
        return self._used_stages

    def _write_rows(self, rows: list[int], params: SamplingParams, prompt: list[int],
                    outputs: list[list[int]], child_offset: int = 0,
                    row_values: Optional[dict[str, list]] = None) -> None:
        """The request's rows: host scalars, and one device write per child of its dense rows,
        ``row_values`` (the core's per-child selector state) included."""
        shared = self._request_rows(params, prompt)
        stages = self._stage_arguments("", params)
        for i, (row, out) in enumerate(zip(rows, outputs)):
            child = child_offset + i
            values = dict(shared, **self._child_rows(params, prompt, out, stages))
            for f in STATE_FIELDS:     # the core leaves out neutral state of a request without one
                column = (row_values or {}).get(f.name)
                value = f.neutral if column is None else column[i]
                values[f.name] = torch.tensor([value], dtype=torch.float32)
            self._floats[row] = torch.tensor(_float_values(params, self.vocab_size))
            self._ints[row] = torch.tensor(_int_values(params, child, len(out), self.vocab_size),
                                           dtype=torch.int32)
            self._ints[row, _FILTER_ORDER] = 0 if params.is_greedy else self._order_index(params)
            self._write_device_row(row, values)

    def _move_rows(self, src: list[int], dst: list[int]) -> None:
        """Rows ``src`` to rows ``dst`` (host row numbers) as one permutation (every source read
        before any row is written: ``swap_rows`` passes ``[a, b] -> [b, a]``). The host tables
        move by index; the device state moves two rows per graph, both read before both are
        written. Moves whose sources and targets are disjoint (``remove``) go two by two;
        overlapping moves of more than two rows (no core operation makes them) take one graph
        of their size."""
        self._floats[dst] = self._floats[src].clone()
        self._ints[dst] = self._ints[src].clone()
        if len(src) > 2 and set(src) & set(dst):
            self._move_device_rows(src, dst)
            return
        for i in range(0, len(src), 2):
            s, d = src[i:i + 2], dst[i:i + 2]
            self._move_device_rows(s * (3 - len(s)), d * (3 - len(d)))   # one pair: twice

    def _reset_rows(self, rows: list[int]) -> None:
        """Freed rows become padding: neutral host scalars. Their dense device rows are stale
        but never read by a live row; the next request placed there overwrites them."""
        if rows:
            self._floats[rows] = torch.tensor(NEUTRAL_FLOATS)
            self._ints[rows] = 0
            self._ints[rows, :len(_INT_FIELDS)] = torch.tensor(_NEUTRAL_INTS, dtype=torch.int32)
            self._ints[rows, _THINKING_BUDGET] = thinking.NO_BUDGET

    # ------------------------------------------------------------------ internals: state
    def _rows_for(self, num_rows: Optional[int]) -> int:
        B = len(self._row_keys) if num_rows is None else num_rows
        if B > self.capacity:
            raise ValueError(f"step_state needs num_rows <= {self.capacity}, got {B}")
        return B

    def _host_table(self, B: int, random_keys: Optional[torch.Tensor]) -> torch.Tensor:
        """int32 ``[B, columns]``: the per-row scalars, floats as their bits, and the batch's
        route and logprobs switch in every row."""
        self._ints[:B, _RANDOM_KEY] = 0 if random_keys is None else random_keys
        self._ints[:B, _ROUTE] = ROUTES.index(self._route_name())
        self._ints[:B, _LOGPROBS_ON] = int(self._asked_logprobs() is not None)
        table = torch.cat([self._floats[:B].view(torch.int32), self._ints[:B]], dim=1)
        # Padding rows count as greedy: they draw no noise, and they keep the sampler's draw
        # over the candidate set (TpuSampler.draw) open to the live rows.
        table[len(self._row_keys):, len(FLOAT_COLUMNS) + _GREEDY] = 1
        return table

    def _upload_table(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.device)

    def _state_of(self, table: torch.Tensor, dense: dict[str, torch.Tensor], B: int,
                  position: Optional[torch.Tensor] = None) -> XlaStepState:
        """An XlaStepState over ``B`` rows from the uploaded scalar table and dense tensors."""
        col = lambda name: table[:, _COL[name]]                             # noqa: E731
        floats = xla.bitcast(table[:, :len(FLOAT_COLUMNS)], torch.float32)
        position = col("position") if position is None else position
        asked = self._asked_logprobs()
        variant = self.variant() if self._row_keys else Variant(
            random=False, stages=tuple(spec.name for spec, _ in self._stages_in_use()))
        dense = dict(dense, position=position)
        return XlaStepState(
            num_rows=B, vocab_size=self.vocab_size, logprobs_mode=self.logprobs_mode,
            **{name: floats[:, _COL[name]] for name in FLOAT_COLUMNS},
            **{f.name: col(f.name) for f in _INT_FIELDS},
            seed_lo=col("seed_lo"), seed_hi=col("seed_hi"),
            child=col("child"), position=position,
            seeded=col("seeded") != 0, greedy=col("greedy") != 0, random_key=col("random_key"),
            prompt_mask=dense["prompt_mask"], output_counts=dense["output_counts"],
            bad_prefix=dense["bad_prefix"], bad_last=dense["bad_last"],
            bad_valid=dense["bad_valid"], recent=dense["recent"],
            static_add=dense["static_add"], stop_mask=dense["stop_mask"],
            dry_history=dense["dry_history"], dry_match=dense["dry_match"],
            dry_since_breaker=dense["dry_since"], dry_breakers=dense["dry_breakers"],
            thinking_budget=col("thinking_budget"), thinking_count=dense["thinking_count"],
            thinking_markers=dense["thinking_markers"], thinking_match=dense["thinking_match"],
            filter_order=col("filter_order"), return_kept=col("return_kept") != 0,
            **{f.name: dense[f.name] for f in STATE_FIELDS},
            stages=self._stage_inputs(dense),
            variant=variant, live_rows=len(self._row_keys), logprobs_asked=asked,
            route=col("route"), logprobs_on=col("logprobs_on") != 0,
            # folded: step 15 is traced at the fixed width, and runs when some row asks
            **flags_for(variant, self.padded_logprobs if variant.folded else asked,
                        self.padded_logprobs),
        )

    def _record_tokens(self, padded: torch.Tensor,
                       source: Optional[tuple[torch.Tensor, int]] = None) -> None:
        """Advance every row by its ids: ``padded`` int64 ``[bucket, S]`` host ids, a row's
        tokens in order; -1 advances the position without a token, ``NOT_LIVE`` leaves the
        row (or the rest of it) alone. One graph per (bucket, S) and whether ``source`` is
        given; the count update touches ``bucket * S`` entries, not the vocabulary.
        ``source``: (float32 ``[bucket * slots, V]`` device log-probabilities after the filter
        group, ``slots`` >= S), from which column j advances the stateful selectors' state
        (``_advance_selectors``)."""
        B, S = padded.shape
        ids = padded.to(self.device)
        columns = [(ids[:, j], ids[:, j] != NOT_LIVE) for j in range(S)]
        rows = {name: tensor[:B] for name, tensor in self._state.items()}
        what = f"append (bucket {B}, {S} id(s) per row{', selectors' if source is not None else ''})"
        with self.guard.watch(what):
            changed = self._advance_rows(rows, columns)
            if source is not None:
                changed += self._advance_selectors_on_device(rows, columns, *source)
            counts = self._state["output_counts"]
            row_ids = xla.iota(B, torch.int64, self.device)[0].repeat(S)
            tokens = torch.cat([i for i, _ in columns])
            counted = (tokens >= 0) & (tokens < self.vocab_size)
            counts.index_put_((row_ids, torch.where(counted, tokens, 0)), counted.to(torch.int32),
                              accumulate=True)
            for name in changed:
                self._state[name][:B] = rows[name]
            xla.launch(list(self._state.values()))

    def _advance_selectors_on_device(self, t: dict[str, torch.Tensor],
                                     columns: list[tuple[torch.Tensor, torch.Tensor]],
                                     source: torch.Tensor, slots: int) -> list[str]:
        """The core's ``_advance_selectors`` inside the append graph: each stateful stage's
        ``advance`` (``corelib.selectors``) on column j's ids with slot j of ``source``, for
        rows that take a token; the stages' fields come from the host table (one small upload).
        Entries of ``t`` are replaced; returns their names."""
        B = columns[0][0].shape[0]
        logp = source.reshape(B, slots, -1)
        names = [f.name for stage in pipeline.stateful_stages() for f in stage.fields]
        fields = self._floats[:B, [_COL[name] for name in names]].to(self.device)
        field = {name: fields[:, i] for i, name in enumerate(names)}
        for j, (ids, advance) in enumerate(columns):
            live = advance & (ids >= 0) & (ids < self.vocab_size)
            safe = torch.where(live, ids, 0)
            for stage in pipeline.stateful_stages():
                state = {f.name: t[f.name] for f in stage.state}
                moved = getattr(selectors, stage.advance)(
                    state, {f.name: field[f.name] for f in stage.fields}, logp[:, j], safe)
                for name, value in moved.items():
                    t[name] = torch.where(live, value, t[name])
        return [f.name for f in STATE_FIELDS]

    def _advance_rows(self, t: dict[str, torch.Tensor],
                      columns: list[tuple[torch.Tensor, torch.Tensor]]) -> list[str]:
        """Advance row state ``t`` (name -> tensor ``[n, ...]``; entries replaced, not written
        in place) by one id per column, in order: custom stages' state first (so a failing
        update changes nothing), then the recent window, DRY's window and the reasoning
        budget's marker matches and count (``corelib.thinking.advance``); ``output_counts`` is
        the caller's (a scatter of all columns at once, or compares in ``verify``). Returns
        the names of the entries it replaced."""
        staged = self._advanced_stage_state(t, columns)
        for ids, advance in columns:
            counted = advance & (ids >= 0) & (ids < self.vocab_size)
            safe = torch.where(counted, ids, 0)
            recent = t["recent"]
            shifted = torch.cat([recent[:, 1:], torch.where(counted, ids, -1)[:, None]], dim=1)
            t["recent"] = torch.where(advance[:, None], shifted, recent)
            t["dry_history"], t["dry_match"], t["dry_since"] = dry.advance(
                t["dry_history"], t["dry_match"], t["dry_since"], t["dry_breakers"], safe, counted)
            t["thinking_match"], t["thinking_count"] = thinking.advance(
                t["thinking_markers"], t["thinking_match"], t["thinking_count"], safe, counted)
        t.update(staged)
        return ["recent", "dry_history", "dry_match", "dry_since", "thinking_match",
                "thinking_count", *staged]

    def _constant(self, key, shape, value, dtype, make=None) -> torch.Tensor:
        """A device tensor made once per batch and reused (an input of each graph, never an
        upload per step)."""
        if key not in self._cached:
            host = make() if make is not None else torch.full(shape, value, dtype=dtype)
            self._cached[key] = host.to(self.device)
        return self._cached[key]

    def asks_kept(self) -> bool:
        """Some live row asks for its kept set (``SamplingParams.return_kept``): the step
        graphs compute kept sets whenever a row's ``return_kept`` column is set (a conditional
        on the device), and the host reads them back only then."""
        return any(p.return_kept for p in self._row_params)

    def _asked_logprobs(self) -> Optional[int]:
        """The batch's real N: the largest ``logprobs`` of a row (V for -1), None if none asks."""
        if self._asked is None:
            asked = [self.vocab_size if p.logprobs == ALL_LOGPROBS else p.logprobs
                     for p in self._row_params if p.logprobs is not None]
            self._asked = (max(asked) if asked else None,)
        return self._asked[0]


def _per_slot(tensor: torch.Tensor, slots: int) -> torch.Tensor:
    """``[B, ...]`` -> ``[B * slots, ...]``, each row repeated for its slots, as a broadcast
    and a reshape (which XLA fuses into the readers instead of copying)."""
    B = tensor.shape[0]
    return tensor[:, None].expand(B, slots, *tensor.shape[1:]).reshape(B * slots, *tensor.shape[1:])


class _HostView:
    """What ``SamplingBatch.check_token_bitmask`` reads of a batch, with the host as its
    device: the core's checks and messages for a host mask, without its upload."""

    def __init__(self, batch: SamplingBatch):
        self.num_rows, self.vocab_size = batch.num_rows, batch.vocab_size
        self.device = torch.device("cpu")


def _host_checked_bitmask(batch: SamplingBatch, mask: torch.Tensor, slots: Optional[int]) -> torch.Tensor:
    return SamplingBatch.check_token_bitmask(_HostView(batch), mask, slots)


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value
