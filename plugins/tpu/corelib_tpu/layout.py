"""The layout of the TPU batch's scalar table and of its step graphs: the table's columns (the
stage table's per-row fields, then this plugin's own), the values a request writes there, the
paths and routes of steps 11-13, and ``Variant``, what a step graph is compiled for. Read by
the batch (``batch``), the sampler and the graph runner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from corelib import pipeline, thinking
from corelib.batch import StepState
from corelib.noise import split_seed
from corelib.params import SamplingParams

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
#: The nucleus path of a batch whose random rows use neither min-p nor top-k takes the route
#: top_p, top-p by bisection alone (``route_of``): the nucleus route would still find each
#: row's max (min-p's floor) and its largest logits (top-k's threshold), two passes over the
#: logits and a topk, to keep every token; it comes second, as the common path it is.
ROUTES = ("candidates", "top_p", "plain", "min_p", "nucleus", "exhaustive")

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


def route_of(path: str, row_params: Sequence[SamplingParams], vocab_size: int) -> str:
    """The route (``ROUTES``) of a batch on ``path`` (``PATHS``; greedy batches take plain)."""
    if path == "nucleus" and not any(p.min_p > 0 or _top_k(p, vocab_size) > 0
                                     for p in row_params if not p.is_greedy):
        return "top_p"
    return path if path in ROUTES else "plain"


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
