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
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from corelib.batch import SamplingBatch, StepState, _stage_key
from corelib.batch_selectors import _used_state
from corelib import pipeline, selectors, thinking
from corelib.bitmask import bitmask_width
from corelib.noise import split_seed
from corelib.params import ALL_LOGPROBS, SamplingParams
from corelib.stages import StageError, StageInputs, StageSpec, describe_stage

from . import dry, xla
from .buckets import Buckets
from .orders import FilterOrders

NEG_INF = float("-inf")

# The scalar table's columns: the stage table's per-row fields (corelib.pipeline), float32
# and int32, then the columns of this plugin's own.
_FLOAT_FIELDS = tuple(f for f in pipeline.stage_fields() if f.dtype == torch.float32)
_INT_FIELDS = tuple(f for f in pipeline.stage_fields() if f.dtype == torch.int32)
assert len(_FLOAT_FIELDS) + len(_INT_FIELDS) == len(pipeline.stage_fields()), \
    "the TPU scalar table holds float32 and int32 stage fields only"
#: Fields of the stages greedy rows skip (steps 10-13b): neutral in a greedy row, which keeps
#: the graphs' invariants.
_RANDOM_ONLY = frozenset(f.name for stage in pipeline.STAGES if stage.rows == pipeline.RANDOM_ROWS
                         for f in stage.fields)
FLOAT_COLUMNS = tuple(f.name for f in _FLOAT_FIELDS)
NEUTRAL_FLOATS = tuple(float(f.neutral) for f in _FLOAT_FIELDS)
INT_COLUMNS = tuple(f.name for f in _INT_FIELDS) + (
    "seed_lo", "seed_hi", "child", "position", "seeded", "greedy", "random_key",
    "thinking_budget", "route", "logprobs_on", "filter_order", "return_kept")
_NEUTRAL_INTS = tuple(int(f.neutral) for f in _INT_FIELDS)
_COL = {name: i for i, name in enumerate(FLOAT_COLUMNS + INT_COLUMNS)}
_POSITION = INT_COLUMNS.index("position")
_RANDOM_KEY = INT_COLUMNS.index("random_key")
_THINKING_BUDGET = INT_COLUMNS.index("thinking_budget")
_ROUTE = INT_COLUMNS.index("route")
_LOGPROBS_ON = INT_COLUMNS.index("logprobs_on")
_GREEDY = INT_COLUMNS.index("greedy")
_FILTER_ORDER = INT_COLUMNS.index("filter_order")
_RETURN_KEPT = INT_COLUMNS.index("return_kept")
#: The stateful selectors' per-row state (``pipeline.state_fields``: mirostat's mu,
#: adaptive-p's sums): float32 ``[C]`` device tensors, since ``append`` advances them from the
#: step's distribution, which stays on the device.
STATE_FIELDS = pipeline.state_fields()
_INT32_MAX = 2**31 - 1

#: The methods of steps 11-13, chosen on the host from the rows' parameters (only random rows
#: count; greedy rows skip steps 10-13b): greedy = every row greedy (no filter, no draw; a
#: graph of its own, ``Variant.random`` False); plain = no row uses min-p, top-k or top-p;
#: min_p = some row uses min-p, none top-k or top-p; candidates = every top-k fits the
#: candidate set and every top-p row has such a top-k (steps 11-13 from one small topk);
#: nucleus = some row uses top-p without top-k (top-p by bisection over the vocabulary);
#: exhaustive = some top-k exceeds the candidate set (top-k by bisection too).
PATHS = ("greedy", "plain", "min_p", "candidates", "nucleus", "exhaustive")
#: The paths of a random graph: its ``route`` column picks one inside the graph (an XLA
#: conditional, ``xla.switch``), so one compiled graph serves them all. The candidate path
#: comes first: a switch is nested conditionals, and the first branch is the shallowest.
ROUTES = ("candidates", "plain", "min_p", "nucleus", "exhaustive")

#: ``append`` marks rows (or slots) that do not advance with this id: their state is left as
#: it is (a flagged row's -1 becomes this). -1 advances the position without counting a
#: token (an out-of-range id among a device verify row's emitted tokens).
NOT_LIVE = -2


@dataclass(frozen=True)
class Variant:
    """What a step graph is compiled for besides its shapes (bucket, vocabulary, K).

    random: some row samples (steps 10-14 traced; False: every row greedy, argmax only);
    logprobs: some row asks for logprobs (step 15 traced); stages: the custom stages the graph
    traces, in registration order (a stage a variant leaves out is not traced at all);
    folded: the one random variant of ``sample`` and verify's one variant, where step 15 runs
    inside a conditional on the step's ``logprobs_on`` column, so one graph per bucket (or per
    (bucket, K)) serves every batch that samples, with or without logprobs; greedy_batches:
    the graph also serves batches whose rows are all greedy (verify's), so the noise is made
    inside a conditional on "some row is random" (elsewhere it fuses into the draw, with no
    ``[B, V]`` buffer of its own). Everything else a random graph holds is chosen inside it: the path
    of steps 11-13 by the ``route`` column (``ROUTES``), and steps 8a, 10a, 13a and 13b
    each run only when some row uses them (``xla.cond``).
    """

    random: bool = True
    logprobs: bool = False
    stages: tuple[str, ...] = ()
    folded: bool = False
    greedy_batches: bool = False
    #: some random row uses a stateful selector (step 14's group "select"): the graph also
    #: returns the distribution after the filter group, which ``append`` advances the state from
    selectors: bool = False
    #: the filter orders besides the default one the graph traces (``FilterOrders``): row
    #: ``filter_order`` k runs ``orders[k - 1]``, each in a conditional on its rows
    orders: tuple[tuple[str, ...], ...] = ()


@dataclass
class XlaStepState(StepState):
    """``StepState`` plus the plugin's dense tensors and its static graph choice.

    Every tensor has ``num_rows`` = the bucket size (times K + 1 in ``verify``) as first
    dimension; padding rows hold neutral values (or stale dense state that no live row reads).
    ``dry_history``, ``dry_match`` and ``dry_since_breaker`` hold DRY's window (``dry``: int32
    ``[B, H]``, int32 ``[B, H]``, int32 ``[B]``), not the core's layout. The reasoning budget's
    tensors (step 8b) have the core's layout, with the marker width fixed at
    ``max_thinking_marker_length``.
    """

    variant: Variant = Variant()
    static_add: Optional[torch.Tensor] = None   # float32 [B, V]: 0, bias, or -inf
    stop_mask: Optional[torch.Tensor] = None    # bool [B, V]: stop ids and eos of min-tokens rows
    random_key: Optional[torch.Tensor] = None   # int32 [B]: unseeded rows' noise keys this step
    live_rows: int = 0                          # rows before the padding
    logprobs_asked: Optional[int] = None        # the batch's real N (num_logprobs is padded)
    route: Optional[torch.Tensor] = None        # int32 [B]: the index in ROUTES, every row alike
    logprobs_on: Optional[torch.Tensor] = None  # bool [B]: some row asks for logprobs (alike)


class XlaSamplingBatch(SamplingBatch):
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
        path = self.path() if self._row_keys else "greedy"
        self._ints[:B, _ROUTE] = ROUTES.index(path if path in ROUTES else "plain")
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

    # ------------------------------------------------------------------ internals: rows
    def _allocate(self) -> None:
        C, V, dev = self.capacity, self.vocab_size, self.device
        W, P, H = self.max_bad_words, self._prefix_width, self.dry_window
        L = self.max_thinking_marker_length
        self._floats = torch.tensor(NEUTRAL_FLOATS, dtype=torch.float32).repeat(C, 1)
        self._ints = torch.zeros((C, len(INT_COLUMNS)), dtype=torch.int32)
        self._ints[:, _THINKING_BUDGET] = thinking.NO_BUDGET
        self._state = {
            "static_add": torch.zeros((C, V), dtype=torch.float32, device=dev),
            "prompt_mask": torch.zeros((C, V), dtype=torch.bool, device=dev),
            "output_counts": torch.zeros((C, V), dtype=torch.int32, device=dev),
            "stop_mask": torch.zeros((C, V), dtype=torch.bool, device=dev),
            "bad_prefix": torch.full((C, W, P), -2, dtype=torch.long, device=dev),
            "bad_last": torch.zeros((C, W), dtype=torch.long, device=dev),
            "bad_valid": torch.zeros((C, W), dtype=torch.bool, device=dev),
            "recent": torch.full((C, P), -1, dtype=torch.long, device=dev),
            "dry_history": torch.full((C, H), dry.EMPTY, dtype=torch.int32, device=dev),
            "dry_match": torch.zeros((C, H), dtype=torch.int32, device=dev),
            "dry_since": torch.zeros(C, dtype=torch.int32, device=dev),
            "dry_breakers": torch.full((C, self.max_dry_breakers), -1, dtype=torch.int32, device=dev),
            "thinking_markers": torch.full((C, 3, L), -1, dtype=torch.long, device=dev),
            "thinking_match": torch.zeros((C, 3, L), dtype=torch.bool, device=dev),
            "thinking_count": torch.full((C,), thinking.NOT_THINKING, dtype=torch.int32, device=dev),
            **{f.name: torch.full((C,), float(f.neutral), dtype=torch.float32, device=dev)
               for f in STATE_FIELDS},
        }
        with self.guard.watch("allocating a batch"):
            xla.launch(list(self._state.values()))

    def _allocate_stages(self, specs: Sequence[StageSpec]) -> None:
        """The switch, argument and state tensors of custom stages, at full capacity."""
        C = self.capacity
        for spec in specs:
            for name, (dtype, value, shape) in _stage_tensors(spec, self.vocab_size).items():
                self._state[name] = torch.full((C, *shape), value, dtype=dtype, device=self.device)
        with self.guard.watch("allocating a custom stage's state"):
            xla.launch(list(self._state.values()))

    def _spec(self, name: str) -> StageSpec:
        specs = self.stage_specs()
        if name not in specs:
            known = ", ".join(sorted(specs)) or "none"
            raise ValueError(f"stages names unknown stage {name!r} (known stages: {known})")
        return specs[name][0]

    @property
    def _prefix_width(self) -> int:
        return max(1, self.max_bad_word_length - 1)

    def _check_fits(self, request_id: str, params: SamplingParams) -> None:
        if self.num_rows + params.n > self.capacity:
            raise ValueError(
                f"request {request_id!r}: n={params.n} does not fit: this batch holds at most "
                f"{self.capacity} rows (the sampler's largest bucket), it has {self.num_rows}")
        multi = [w for w in params.bad_words if len(w) > 1]
        if len(multi) > self.max_bad_words:
            raise ValueError(
                f"request {request_id!r}: bad_words holds {len(multi)} words of two or more "
                f"tokens; the tpu backend was created with max_bad_words={self.max_bad_words}")
        longest = max((len(w) for w in multi), default=0)
        if longest > self.max_bad_word_length:
            raise ValueError(
                f"request {request_id!r}: bad_words holds a word of {longest} tokens; the tpu "
                f"backend was created with max_bad_word_length={self.max_bad_word_length}")
        breakers = len(set(params.dry_sequence_breakers))
        if params.uses_dry and breakers > self.max_dry_breakers:
            raise ValueError(
                f"request {request_id!r}: dry_sequence_breakers holds {breakers} token ids; the "
                f"tpu backend was created with max_dry_breakers={self.max_dry_breakers}")
        if params.uses_thinking_budget:
            L = self.max_thinking_marker_length
            for name, marker in (("thinking_start_token_ids", params.thinking_start_token_ids),
                                 ("thinking_end_token_ids", params.thinking_end_token_ids),
                                 ("thinking_forced_token_ids", params.forced_thinking_ids)):
                if len(marker) > L:
                    raise ValueError(
                        f"request {request_id!r}: {name} holds {len(marker)} tokens; the tpu "
                        f"backend was created with max_thinking_marker_length={L}")
        if params.logprobs is not None:
            asked = self.vocab_size if params.logprobs == ALL_LOGPROBS else params.logprobs
            if asked > self.max_logprobs:
                every = " (-1 asks for every token of the vocabulary)" if params.logprobs == ALL_LOGPROBS else ""
                raise ValueError(
                    f"request {request_id!r}: logprobs={params.logprobs} asks for {asked} top "
                    f"logprobs{every}; the tpu backend was created with max_logprobs="
                    f"{self.max_logprobs} (its graphs have fixed shapes: create it with "
                    f"TpuSampler(max_logprobs=...) to allow more)")
        if self.fixed_stages is not None:
            for name in params.stage_args:
                if name not in self.fixed_stages:
                    raise ValueError(
                        f"request {request_id!r}: stage_args names stage {name!r}, which this "
                        f"sampler's graphs do not trace (created with stages={self.fixed_stages})")

    def _request_rows(self, params: SamplingParams, prompt: list[int]) -> dict[str, torch.Tensor]:
        """Host ``[1, ...]`` rows shared by a request's children: additive row, prompt mask,
        stop mask, bad-word tables, DRY's breakers, the reasoning budget's markers."""
        V, W, P = self.vocab_size, self.max_bad_words, self._prefix_width
        add = torch.zeros(V, dtype=torch.float32)
        if params.allowed_token_ids is not None:
            add.fill_(NEG_INF)
            add[params.allowed_token_ids] = 0.0
        for word in params.bad_words:
            if len(word) == 1:
                add[word[0]] = NEG_INF
        for token, bias in params.logit_bias.items():
            add[token] += bias                     # -inf stays -inf: masks win over bias
        prompt_mask = torch.zeros(V, dtype=torch.bool)
        prompt_mask[prompt] = True
        stop = torch.zeros(V, dtype=torch.bool)
        if params.min_tokens > 0:
            stop[list(params.stop_token_ids)] = True
            if self.eos_token_id is not None:
                stop[self.eos_token_id] = True
        prefix = torch.full((W, P), -2, dtype=torch.long)
        last = torch.zeros(W, dtype=torch.long)
        valid = torch.zeros(W, dtype=torch.bool)
        for i, word in enumerate(w for w in params.bad_words if len(w) > 1):
            prefix[i, P - (len(word) - 1):] = torch.tensor(word[:-1], dtype=torch.long)
            last[i], valid[i] = word[-1], True
        breakers = torch.full((self.max_dry_breakers,), -1, dtype=torch.int32)
        if params.uses_dry:
            stops = sorted(set(params.dry_sequence_breakers))
            breakers[: len(stops)] = torch.tensor(stops, dtype=torch.int32)
        L = self.max_thinking_marker_length
        markers = torch.full((3, L), -1, dtype=torch.long)
        if params.uses_thinking_budget:
            markers = thinking.marker_table(params.thinking_start_token_ids,
                                            params.thinking_end_token_ids,
                                            params.forced_thinking_ids, L)
        rows = dict(static_add=add, prompt_mask=prompt_mask, stop_mask=stop, bad_prefix=prefix,
                    bad_last=last, bad_valid=valid, dry_breakers=breakers, thinking_markers=markers)
        return {name: t[None] for name, t in rows.items()}

    def _child_rows(self, params: SamplingParams, prompt: list[int], outputs: list[int],
                    stages: dict) -> dict[str, torch.Tensor]:
        """Host ``[1, ...]`` rows of one child: output counts, recent-token window, DRY's
        window, the reasoning budget's matches and count (``corelib.thinking.replay`` of its
        history), and every allocated custom stage's switch, arguments and state."""
        V, P, H = self.vocab_size, self._prefix_width, self.dry_window
        counts = torch.bincount(torch.tensor(outputs, dtype=torch.long), minlength=V).to(torch.int32)
        recent = torch.full((P,), -1, dtype=torch.long)
        tail = outputs[-P:]
        if tail:
            recent[P - len(tail):] = torch.tensor(tail, dtype=torch.long)
        tokens = prompt + outputs if params.uses_dry else []
        history, match, since = dry.initial_window(tokens, params.dry_sequence_breakers, H)
        L = self.max_thinking_marker_length
        think_match = torch.zeros((3, L), dtype=torch.bool)
        think_count = thinking.NOT_THINKING
        if params.uses_thinking_budget:
            bits, think_count = thinking.replay(prompt + outputs, params.thinking_start_token_ids,
                                                params.thinking_end_token_ids,
                                                params.forced_thinking_ids)
            think_match = thinking.bits_tensor(bits, L)
        rows = dict(output_counts=counts, recent=recent, dry_history=history, dry_match=match,
                    dry_since=torch.tensor(min(since, _INT32_MAX), dtype=torch.int32),
                    thinking_match=think_match,
                    thinking_count=torch.tensor(min(think_count, _INT32_MAX), dtype=torch.int32))
        rows.update(self._stage_rows(prompt, outputs, stages))
        return {name: t[None] for name, t in rows.items()}

    def _stage_rows(self, prompt: list[int], outputs: list[int], stages: dict) -> dict[str, torch.Tensor]:
        """Every allocated custom stage's row: the request's switch, arguments and initial
        state (``StageState.init``) where it uses the stage, neutral values elsewhere."""
        rows: dict[str, torch.Tensor] = {}
        for name in self._allocated_stages():
            spec = self._spec(name)
            neutral = _stage_tensors(spec, self.vocab_size)
            used = stages.get(name)
            for key, (dtype, value, shape) in neutral.items():
                rows[key] = torch.full(shape, value, dtype=dtype)
            if used is None:
                continue
            _, args = used
            rows[_stage_key(name, "active")] = torch.tensor(True)
            for field in spec.arg_fields():
                key = _stage_key(name, "arg", field)
                rows[key] = torch.tensor(getattr(args, field), dtype=rows[key].dtype)
            for state in spec.state:
                key = _stage_key(name, "state", state.name)
                rows[key] = _initial_state(spec, state, prompt, outputs, args, self.vocab_size, rows[key])
        return rows

    def _allocated_stages(self) -> list[str]:
        prefix, suffix = "stage:", ":active"
        return [key[len(prefix):-len(suffix)] for key in self._state
                if key.startswith(prefix) and key.endswith(suffix)]

    def _neutral_row(self) -> dict[str, torch.Tensor]:
        rows = self._request_rows(SamplingParams(), [])
        rows.update(self._child_rows(SamplingParams(), [], [], {}))
        rows.update({f.name: torch.tensor([float(f.neutral)]) for f in STATE_FIELDS})
        return rows

    def _order_index(self, params: SamplingParams) -> int:
        """A row's ``filter_order``: its order's place among the sampler's traced orders
        (``FilterOrders``; one it does not trace yet is added), 0 for the default order."""
        return self.orders.index(params.filter_order)

    def _write_device_row(self, row: int, values: dict[str, torch.Tensor]) -> None:
        """Write one row of every dense tensor (one graph: the row number is data)."""
        index = torch.tensor([row], dtype=torch.long).to(self.device)
        for name, tensor in self._state.items():
            tensor.index_copy_(0, index, values[name].to(self.device))
        with self.guard.watch("writing a row (add)"):
            xla.launch(list(self._state.values()))

    def _move_device_rows(self, src: list[int], dst: list[int]) -> None:
        """Copy dense rows ``src`` to rows ``dst`` at once (one graph per pair count: the row
        numbers are data): all are read before any is written."""
        index = torch.tensor(src + dst, dtype=torch.long).to(self.device)
        m = len(src)
        for tensor in self._state.values():
            tensor.index_copy_(0, index[m:], tensor.index_select(0, index[:m]))
        with self.guard.watch(f"moving rows (remove, swap_rows: {m} at once)"):
            xla.launch(list(self._state.values()))

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


def choose_path(row_params: Sequence[SamplingParams], candidates: int,
                vocab_size: int = 2**31 - 1) -> str:
    """The static graph variant for these rows (``PATHS``). Greedy rows skip steps 10-13, so
    only random rows decide; a top-k of at least the vocabulary keeps everything (off)."""
    random = [p for p in row_params if not p.is_greedy]
    if not random:
        return "greedy"
    top_k = [_top_k(p, vocab_size) for p in random]
    filtering = [(p, k) for p, k in zip(random, top_k) if k > 0 or p.top_p < 1.0]
    if not filtering:
        return "min_p" if any(p.min_p > 0 for p in random) else "plain"
    if any(k > candidates for _, k in filtering):
        return "exhaustive"
    if all(p.top_p >= 1.0 or k > 0 for p, k in filtering):
        return "candidates"
    return "nucleus"


def _top_k(params: SamplingParams, vocab_size: int) -> int:
    """The top-k a row runs with: 0 (off) for greedy rows and for k >= the vocabulary."""
    k = params.effective_top_k
    return 0 if params.is_greedy or k >= vocab_size else k


def flags_for(variant: Variant, asked: Optional[int], padded_logprobs: int) -> dict:
    """The core template's stage flags for a static variant: every stage the variant traces
    runs (neutral values make it an identity for rows that do not use it; a random graph holds
    every filter, each inside a conditional that runs it only when some row uses it, see
    ``TpuSampler``). ``any_bias`` is
    False because the bias is part of the additive row of step 3; ``any_bitmask`` and
    ``any_dry`` are True because the mask is always an input (all -1 without one) and DRY is
    in every graph (multiplier 0 = off); so is the reasoning budget (``any_thinking``: budget
    -1 = off), whose step 8b is one pass over the logits, and the kept sets (``any_kept``:
    computed in a conditional on the rows' ``return_kept``, so asking for them compiles
    nothing new). ``any_greedy`` is True only when
    every row is greedy: otherwise greedy rows, whose filter parameters are neutral, get their
    argmax from the draw (``TpuSampler.draw``). The stateful selectors (``any_selector``) and
    the filter orders besides the default one (``filter_orders``: (k, names) for each of the
    variant's ``orders``) are the variant's."""
    random = variant.random
    stages = {switch.flag: stage.rows == pipeline.ALL_ROWS or random
              for stage, switch in pipeline.switches()}
    return dict(
        stages, any_bias=False,
        any_greedy=not random, all_greedy=not random, any_random=random, any_seeded=random,
        any_unseeded=random, any_thinking=True, any_kept=True,
        num_logprobs=None if asked is None else padded_logprobs,
        any_selector=random and variant.selectors,
        filter_orders=tuple(enumerate(variant.orders, start=1)) if random else (),
    )


def _per_slot(tensor: torch.Tensor, slots: int) -> torch.Tensor:
    """``[B, ...]`` -> ``[B * slots, ...]``, each row repeated for its slots, as a broadcast
    and a reshape (which XLA fuses into the readers instead of copying)."""
    B = tensor.shape[0]
    return tensor[:, None].expand(B, slots, *tensor.shape[1:]).reshape(B * slots, *tensor.shape[1:])


def _stage_tensors(spec: StageSpec, vocab_size: int) -> dict[str, tuple[torch.dtype, object, tuple]]:
    """A custom stage's per-row tensors: name -> (dtype, neutral value, per-row shape)."""
    tensors = {_stage_key(spec.name, "active"): (torch.bool, False, ())}
    for field, (dtype, default) in spec.arg_fields().items():
        tensors[_stage_key(spec.name, "arg", field)] = (dtype, default, ())
    for state in spec.state:
        shape = tuple(state.shape(vocab_size))
        tensors[_stage_key(spec.name, "state", state.name)] = (state.dtype, 0, shape)
    return tensors


def _initial_state(spec: StageSpec, state, prompt: list[int], outputs: list[int], args,
                   vocab_size: int, like: torch.Tensor) -> torch.Tensor:
    """``state.init`` for one row, checked like the core checks it (``StageError`` naming the
    stage on failure or a wrong shape)."""
    try:
        value = torch.as_tensor(state.init(list(prompt), list(outputs), args, vocab_size))
    except Exception as exc:
        raise StageError(f"{describe_stage(spec)}: state {state.name!r} init failed: "
                         f"{type(exc).__name__}: {exc}") from exc
    if tuple(value.shape) != tuple(like.shape):
        raise StageError(f"{describe_stage(spec)}: state {state.name!r} init returned shape "
                         f"{list(value.shape)}, expected {list(like.shape)}")
    return value.to(like.dtype)


class _HostView:
    """What ``SamplingBatch.check_token_bitmask`` reads of a batch, with the host as its
    device: the core's checks and messages for a host mask, without its upload."""

    def __init__(self, batch: SamplingBatch):
        self.num_rows, self.vocab_size = batch.num_rows, batch.vocab_size
        self.device = torch.device("cpu")


def _host_checked_bitmask(batch: SamplingBatch, mask: torch.Tensor, slots: Optional[int]) -> torch.Tensor:
    return SamplingBatch.check_token_bitmask(_HostView(batch), mask, slots)


def _stage_value(field: pipeline.Field, params: SamplingParams, vocab_size: int):
    """A row's value of a stage field: neutral where a greedy row skips the stage; top_k as
    the routes read it (``_top_k``)."""
    if field.name == "top_k":
        return _top_k(params, vocab_size)
    if params.is_greedy and field.name in _RANDOM_ONLY:
        return field.neutral
    return field.value(params)


def _float_values(params: SamplingParams, vocab_size: int) -> list[float]:
    return [_stage_value(f, params, vocab_size) for f in _FLOAT_FIELDS]


def _int_values(params: SamplingParams, child: int, position: int, vocab_size: int) -> list[int]:
    seed_lo, seed_hi = split_seed(params.seed) if params.seed is not None else (0, 0)
    budget = (thinking.NO_BUDGET if params.thinking_budget is None
              else min(params.thinking_budget, _INT32_MAX))
    return [*(_stage_value(f, params, vocab_size) for f in _INT_FIELDS),
            seed_lo, seed_hi, child, position, int(params.seed is not None),
            int(params.is_greedy), 0, budget, 0, 0,   # random_key, route and logprobs_on: per step
            0,                                       # filter_order: the batch's (_order_index)
            int(params.return_kept)]


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value
