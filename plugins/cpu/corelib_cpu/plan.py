"""What a step needs to know about its rows that only changes when requests join or leave.

Each row's parameters are fixed for its life, so which rows are greedy, seeded or use each
filter, the filters' effective per-row parameters (greedy rows get neutral ones), the blocks
the rows fall into and the index tensors of row subsets are worked out once and kept by the
batch (:meth:`CpuBatch.cached_plan`) until a request joins, leaves or moves. A step then
reads host lists instead of tensors, and only the row keys of seeded rows, which depend on
the position, are computed per step (one ``mix32`` per row: the seed and child part of the
key is kept). Shapes: ``B`` rows, ``n`` rows of a block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch
from corelib import StepState, pipeline
from corelib.noise import mix32_, row_key_prefix

from . import kernels
from .workspace import numpy_view


@dataclass
class BlockPlan:
    """The rows ``r0:r1`` of a step and what each of them uses (lists are block-local)."""

    r0: int
    r1: int
    greedy: list            # bool per row
    seeded: list            # bool per row: random rows with a seed
    temperature_on: bool    # some random row has a temperature other than 1
    temperature: torch.Tensor   # float32 [n, 1] (greedy rows: 1)
    min_p: torch.Tensor         # float32 [n]
    top_k: torch.Tensor         # int64 [n], 0 = off, at most V
    top_p: torch.Tensor         # float32 [n]
    top_k_max: int              # largest top_k of the block's top-k rows (0: none)
    #: The rows each filter and selector applies to, block-local, by the table's switches
    #: (``ROW_SWITCHES``): name -> its random rows of the default order (a selector's: every
    #: random row using it); a switch no row sets has no entry. ``min_p_rows`` and its
    #: siblings read it.
    stage_rows: dict = field(default_factory=dict)
    #: Random rows with a filter order of their own: order k (``StepState.filter_order``) ->
    #: its rows, ascending. The default order's lists above leave them out (neutral
    #: temperature too): ``CpuSampler.run_orders`` filters them on the generic path.
    order_rows: dict = field(default_factory=dict)
    any_greedy: bool = False
    all_greedy: bool = False
    any_seeded: bool = False
    any_unseeded: bool = False
    #: Every random row is a top-k row (or the min-p row of ``min_p_makes_candidates``) without
    #: top-n-sigma (or another stage that reads whole rows before step 12), and its min-p, if
    #: any, is at least ``MIN_P_ON_CANDIDATES``:
    #: no whole random row is filtered before step 12, so the temperature divides the
    #: candidates only (the division is monotone, so the top k of x / T are the top k of x
    #: divided) and steps 10-13 never write x itself.
    candidates_only: bool = False
    #: candidates_only with min-p rows: step 11 runs inside step 12, on the candidates
    #: (``select.min_p_of_candidates``). Min-p keeps an upper set of the logits, as top-k
    #: does, so min-p then top-k keeps the top-k candidates that pass min-p's rule.
    min_p_on_candidates: bool = False
    #: min_p_on_candidates in a one-row block without top-k: step 11 makes the candidates,
    #: the tokens near the top that can pass its rule (``FilterStages.min_p_candidates``;
    #: numba's ``kernels.collect_above``), so later stages read those only.
    min_p_makes_candidates: bool = False
    #: A stage this backend does not override runs on whole rows before step 12 (the
    #: reference on a dense view, ``CpuSampler.stage_method``): the temperature must then
    #: divide x itself, never the candidates only.
    whole_rows_first: bool = False
    #: Template group -> the methods of its stages this block runs (``CpuSampler.run_group``).
    groups: dict = field(default_factory=dict, repr=False)
    #: A compiled kernel's name -> the block's parameters as it takes them, or False where it
    #: does not serve the block (``FilterStages.candidate_chain``): made on the first step.
    kernel_args: dict = field(default_factory=dict, repr=False)
    _index: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.any_greedy, self.all_greedy = any(self.greedy), all(self.greedy)
        random = [i for i, g in enumerate(self.greedy) if not g]
        self.random_rows = random
        self.greedy_rows = [i for i, g in enumerate(self.greedy) if g]
        # the rows with and without a seed, of the block and of its random rows
        self.seeded_rows = [i for i, seeded in enumerate(self.seeded) if seeded]
        self.random_seeded = [i for i in random if self.seeded[i]]
        self.random_unseeded = [i for i in random if not self.seeded[i]]
        self.any_seeded = any(self.seeded)
        self.any_unseeded = any(not self.seeded[i] for i in random)
        top_k, whole = set(self.top_k_rows), set()
        # a one-row block whose min-p row has no top-k: step 11 makes its candidates
        makes = (self.r1 - self.r0 == 1 and not top_k and bool(self.min_p_rows)
                 and kernels.wanted())
        candidate_rows = top_k | (set(self.min_p_rows) if makes else set())
        for row in self.min_p_rows:      # read whole unless judged on candidates
            if row not in candidate_rows or float(self.min_p[row]) < MIN_P_ON_CANDIDATES:
                whole.add(row)
        for name in BEFORE_TOP_K:              # read whole rows before step 12
            whole |= set(self.stage_rows.get(name, ()))
        default = set(random).difference(*self.order_rows.values())
        self.candidates_only = (bool(default) and not self.whole_rows_first
                                and all(i in candidate_rows and i not in whole for i in default))
        self.min_p_on_candidates = self.candidates_only and bool(self.min_p_rows)
        self.min_p_makes_candidates = self.min_p_on_candidates and makes
        self.temperature_below_one = self.temperature_on and bool((self.temperature < 1.0).any())

    @property
    def n(self) -> int:
        return self.r1 - self.r0

    def rows_of(self, name: str) -> list:
        """The block-local rows of switch ``name`` (a key of ``ROW_SWITCHES``)."""
        return self.stage_rows.get(name, _NONE)

    min_p_rows = property(lambda self: self.rows_of("min_p"))
    top_k_rows = property(lambda self: self.rows_of("top_k"))
    top_p_rows = property(lambda self: self.rows_of("top_p"))
    top_n_sigma_rows = property(lambda self: self.rows_of("top_n_sigma"))
    typical_p_rows = property(lambda self: self.rows_of("typical_p"))
    xtc_rows = property(lambda self: self.rows_of("xtc"))
    #: random rows with a dynamic temperature: step 10 reads them whole
    dynatemp_rows = property(lambda self: self.rows_of("dynatemp"))

    def index(self, rows: list) -> torch.Tensor:
        """int64 tensor of block-local rows, made once per list of rows."""
        key = tuple(rows)
        tensor = self._index.get(key)
        if tensor is None:
            tensor = self._index[key] = torch.tensor(rows, dtype=torch.long)
        return tensor


@dataclass
class StepPlan:
    """The blocks of a step, and the seed-and-child part of each seeded row's key."""

    num_rows: int
    blocks: list
    key_prefix: Optional[torch.Tensor]   # int32 [B], or None when no random row is seeded
    sparse_penalties: bool

    def row_keys(self, s: StepState) -> Optional[torch.Tensor]:
        """int32 [B]: ``corelib.noise.row_keys`` of every row at its current position (a
        buffer of the plan's, rewritten each step)."""
        if self.key_prefix is None:
            return None
        keys, scratch = self._key_buffers
        arrays = (self._prefix_array, numpy_view(self._views, "position", s.position), self.keys_array)
        if kernels.row_keys_into(keys, self.key_prefix, s.position, arrays):
            return keys
        return mix32_(torch.bitwise_xor(self.key_prefix, s.position, out=keys), scratch)

    def __post_init__(self):
        size = 0 if self.key_prefix is None else self.key_prefix.shape[0]
        self._key_buffers = (torch.empty(size, dtype=torch.int32), torch.empty(size, dtype=torch.int32))
        #: the numpy view of the keys ``row_keys`` returns (the draw's kernels read it)
        self.keys_array = self._key_buffers[0].numpy()
        self._prefix_array = None if self.key_prefix is None else self.key_prefix.contiguous().numpy()
        self._views: dict = {}            # numpy_view's: the step state's position


def make_plan(s: StepState, rows_per_block: int, sparse_penalties: bool,
              whole_rows_first: bool = False) -> StepPlan:
    """The plan of a step state (see the module docstring): blocks of ``rows_per_block`` rows
    (a verify step's state passes a multiple of its slots, so a block holds whole rows).
    ``whole_rows_first``: see ``BlockPlan.whole_rows_first``."""
    B, V = s.num_rows, s.vocab_size
    temperature, min_p, top_p = s.temperature, s.min_p, s.top_p
    top_k = s.top_k.to(torch.long).clamp(max=V)
    greedy = s.greedy.tolist() if s.any_greedy else [False] * B
    if s.any_greedy:
        g = s.greedy
        temperature = torch.where(g, 1.0, temperature)
        min_p = torch.where(g, 0.0, min_p)
        top_k = torch.where(g, 0, top_k)
        top_p = torch.where(g, 1.0, top_p)
    random = [not g for g in greedy]
    orders = [0] * B
    if s.filter_orders:
        # rows of another filter order: out of the default order's lists (run_orders)
        orders = [k if r else 0 for k, r in zip(s.filter_order.tolist(), random)]
        custom = torch.tensor([k > 0 for k in orders])
        temperature = torch.where(custom, 1.0, temperature)
        min_p = torch.where(custom, 0.0, min_p)
        top_k = torch.where(custom, 0, top_k)
        top_p = torch.where(custom, 1.0, top_p)
        random_default = [r and k == 0 for r, k in zip(random, orders)]
    else:
        random_default = random
    off = [False] * B
    seeded = (s.seeded & ~s.greedy).tolist() if s.any_seeded else off
    temperature_on = (temperature != 1.0).tolist() if s.any_temperature else off
    top_k_list = top_k.tolist() if s.any_top_k else off
    stage_on = {}
    for name, switch in ROW_SWITCHES.items():
        if getattr(s, switch.flag):
            # the selectors run after the filter group, whichever order the row gave it
            rows = random if switch.stage.group == "select" else random_default
            stage_on[name] = _random_and(getattr(s, switch.field) != switch.neutral, rows)
    top_k_on = stage_on.get("top_k", off)
    key_prefix = None
    if any(seeded):
        key_prefix = kernels.key_prefix(s.seed_lo, s.seed_hi, s.child)
        if key_prefix is None:
            key_prefix = row_key_prefix(s.seed_lo, s.seed_hi, s.child)
    blocks = []
    for r0 in range(0, B, rows_per_block):
        r1 = min(r0 + rows_per_block, B)
        local = range(r0, r1)
        blocks.append(BlockPlan(
            r0, r1,
            greedy=greedy[r0:r1],
            seeded=seeded[r0:r1],
            temperature_on=any(temperature_on[r0:r1]),
            temperature=temperature[r0:r1, None],
            min_p=min_p[r0:r1],
            top_k=top_k[r0:r1],
            top_p=top_p[r0:r1],
            top_k_max=max((top_k_list[i] for i in local if top_k_on[i]), default=0),
            order_rows=_order_rows(orders, r0, r1),
            stage_rows={name: [i - r0 for i in local if on[i]] for name, on in stage_on.items()},
            whole_rows_first=whole_rows_first,
        ))
    return StepPlan(B, blocks, key_prefix, sparse_penalties)


def reads_logits_once(s: StepState) -> bool:
    """Whether the step reads its logits in one pass: every row greedy, no logprobs, and no
    stage that writes a copy (step 9's group maxima find each row's token and check step 3 at
    once)."""
    if not s.all_greedy or s.num_logprobs is not None or s.stages or s.any_thinking:
        return False
    for flag in _WRITING_FLAGS:
        if getattr(s, flag):
            return False
    return True


# The flags of the table's stages before the filters: each writes a copy of the logits.
_WRITING_FLAGS = tuple(flag for group in ("mask", "adjust")
                       for _, flags in pipeline.flagged_stages_in(group) for flag in flags)


#: The smallest min-p judged on top-k candidates (``BlockPlan.min_p_on_candidates``): at the
#: threshold a token's probability is then min_p / (at most V) >= 1e-20 / 2**31, far from
#: float32's subnormals, so the reference's rounding moves its log by a few 1e-6 only.
MIN_P_ON_CANDIDATES = 1e-20


class RowSwitch(NamedTuple):
    """A switch of the filter or select group as a plan reads it per row: a row uses it when
    its ``field`` is not ``neutral`` (``pipeline.Switch.row_field``)."""

    flag: str
    field: str
    neutral: object
    stage: pipeline.Stage


#: The switches whose rows a plan lists (``BlockPlan.stage_rows``), from the table: name (the
#: flag without its ``any_``) -> RowSwitch.
ROW_SWITCHES = {switch.flag.removeprefix("any_"): RowSwitch(switch.flag, field.name, field.neutral, stage)
                for stage, switch, field in pipeline.row_switches("filter", "select")}
_NONE: list = []
_FILTERS = [stage.name for stage in pipeline.stages_in("filter")]
#: The switches of filters before steps 12-13 in the default order, whose rows are read whole
#: before step 12 (min-p aside: it is judged on the candidates where it can be).
BEFORE_TOP_K = tuple(name for name, switch in ROW_SWITCHES.items()
                     if switch.stage.group == "filter" and name != "min_p"
                     and _FILTERS.index(switch.stage.name) < _FILTERS.index("top_k_top_p"))


def _order_rows(orders: list, r0: int, r1: int) -> dict:
    """Block rows r0:r1's non-default filter orders: k -> its block-local rows."""
    out: dict = {}
    for i in range(r0, r1):
        if orders[i]:
            out.setdefault(orders[i], []).append(i - r0)
    return out


def _random_and(on: torch.Tensor, random: list) -> list:
    """bool per row: ``on`` (bool [B]) for random rows, False for greedy ones."""
    return [bool(a) and b for a, b in zip(on.tolist(), random)]
