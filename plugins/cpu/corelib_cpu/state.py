"""The cpu backend's step states: the step's (:class:`CpuStepState`) and one block's
(:class:`BlockState`), as the core template reads them.

The cpu backend runs the core's template (``Sampler.sample_state``, ``verify_state``,
``processed_state``) once per block of rows. :class:`BlockState` gives that run the block's view
of the step: every per-row tensor of the step state sliced to the block's rows (on first use,
so a step slices only what its stages read), the custom stages' inputs sliced the same way, and
host flags that say which stages the block's own rows use (a stage no row of the block uses is
skipped, as the template skips a stage no row of the batch uses). It also carries what the
cpu's stages need besides the core's state: the block's plan (:class:`~corelib_cpu.plan.BlockPlan`),
its rows' seeded keys and the logits row of each of its rows.

Every field of both is declared: :class:`CpuStepState` (the step state of the cpu backend's
batch, and of any step this backend runs: ``cpu_state``) declares the penalty slots and the
fields a block's run sets; :class:`BlockState` declares its own and reads every other one from
the step state's declared fields (an undeclared name raises AttributeError).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
from corelib import StageInputs, StepState

from .plan import BlockPlan


@dataclass
class CpuStepState(StepState):
    """``StepState`` plus what the cpu backend keeps with a step.

    The penalty slots of its rows (``corelib_cpu.batch``; None when no row uses penalties):
    ``slot_ids`` int64 ``[B, S]``, ``slot_counts`` int32 ``[B, S]``, ``slot_len`` int64
    ``[B]``. The fields of a block's run (``block_states``, when one block holds every row of
    the step): ``plan``, the block's :class:`~corelib_cpu.plan.BlockPlan`; ``keys`` int32
    ``[B]``, the rows' seeded keys (None when no row is seeded), and ``keys_array`` their numpy
    view (the plan's, made once); ``undrawn``, the rows whose draw verification never reads
    (``verification.undrawn_slots``)."""

    slot_ids: Optional[torch.Tensor] = None
    slot_counts: Optional[torch.Tensor] = None
    slot_len: Optional[torch.Tensor] = None
    plan: Optional[BlockPlan] = None
    keys: Optional[torch.Tensor] = None
    keys_array: Optional[object] = None
    undrawn: frozenset = frozenset()


def cpu_state(s: StepState) -> CpuStepState:
    """``s`` as a :class:`CpuStepState`: ``s`` itself when it is one, else a shallow copy whose
    cpu fields hold their defaults (the copy shares ``s``'s tensors, as the core's per-step
    copies do: no field is computed again)."""
    if isinstance(s, CpuStepState):
        return s
    out = object.__new__(CpuStepState)
    out.__dict__.update(s.__dict__)
    return out


def block_states(s: CpuStepState, plans: list, keys: Optional[torch.Tensor],
                 logits_rows: Optional[torch.Tensor], keys_array=None) -> list:
    """The states the template runs on, one per block (``plans``: the step's BlockPlans): a
    :class:`BlockState` each, or, when one block holds every row of the step, the step state
    itself with the block's ``plan``, ``keys`` (and ``keys_array``, their numpy view),
    ``logits_rows`` and ``undrawn`` in its fields (its flags are the block's already; this
    spares the one block of a small batch the wrapper's cost)."""
    if len(plans) == 1 and plans[0].r0 == 0 and plans[0].r1 == s.num_rows:
        s.plan, s.keys, s.logits_rows, s.undrawn = plans[0], keys, logits_rows, frozenset()
        s.keys_array = keys_array
        return [s]
    # the step's host values every block shares (its flags, the logprobs asked for, ...)
    shared = {name: getattr(s, name) for name in _SHARED}
    if not s.stages:
        shared["stages"] = ()
    return [BlockState(s, plan, keys, logits_rows, shared) for plan in plans]


class BlockState:
    """Rows ``plan.r0:plan.r1`` of step state ``s`` (duck-types ``CpuStepState``).

    ``keys``: int32 [B] row keys of the whole step (or None when no row is seeded);
    ``logits_rows``: int64 [B], the logits row of each row of the step (per-request logits,
    verify's flat form), or None when row i reads logits row i; the block keeps its own."""

    # The block's own fields; every other attribute is a field of the step state
    # (``CpuStepState``), read on first use and sliced to the block's rows.
    plan: BlockPlan
    undrawn: frozenset                 # verification sets it (``verification.undrawn_slots``)
    keys: Optional[torch.Tensor]       # int32 [n]
    keys_array: None                   # a block's keys are a slice: none kept
    logits_rows: Optional[torch.Tensor]  # int64 [n]
    num_rows: int
    any_greedy: bool
    all_greedy: bool
    any_random: bool
    any_seeded: bool
    any_unseeded: bool
    any_temperature: bool
    any_min_p: bool
    any_top_k: bool
    any_top_p: bool
    any_top_n_sigma: bool
    any_typical_p: bool
    any_xtc: bool

    def __init__(self, s: CpuStepState, plan: BlockPlan, keys: Optional[torch.Tensor],
                 logits_rows: Optional[torch.Tensor], shared: Optional[dict] = None):
        whole = plan.r0 == 0 and plan.r1 == s.num_rows
        if shared:
            self.__dict__.update(shared)
        self._s = s
        self._rows = None if whole else slice(plan.r0, plan.r1)
        self.plan = plan
        self.undrawn = frozenset()
        self.keys = keys if keys is None or whole else keys[plan.r0:plan.r1]
        self.keys_array = None
        self.logits_rows = logits_rows if logits_rows is None or whole else logits_rows[plan.r0:plan.r1]
        self.num_rows = plan.n
        # The block's own flags; those of optional state the batch holds (penalties, masks,
        # bias, DRY, stages) stay the step's: rows that do not use it hold neutral values.
        self.any_greedy = plan.any_greedy
        self.all_greedy = plan.all_greedy
        self.any_random = not plan.all_greedy
        self.any_seeded = plan.any_seeded
        self.any_unseeded = plan.any_unseeded
        self.any_temperature = plan.temperature_on
        self.any_min_p = bool(plan.min_p_rows)
        self.any_top_k = bool(plan.top_k_rows)
        self.any_top_p = bool(plan.top_p_rows)
        self.any_top_n_sigma = bool(plan.top_n_sigma_rows)
        self.any_typical_p = bool(plan.typical_p_rows)
        self.any_xtc = bool(plan.xtc_rows)

    def __getattr__(self, name):
        # Called only for attributes not set yet: the step state's, sliced to the block once.
        if name not in _STEP_FIELDS:
            raise AttributeError(f"BlockState has no field {name!r} (its fields are its own and "
                                 f"CpuStepState's)")
        value = getattr(self._s, name)
        if self._rows is not None:
            if isinstance(value, torch.Tensor):
                value = value[self._rows]
            elif name == "stages":
                value = tuple((spec, slice_inputs(inputs, self._rows), plugin)
                              for spec, inputs, plugin in value)
        setattr(self, name, value)
        return value

    def as_step_state(self) -> CpuStepState:
        """The block's rows as a :class:`CpuStepState` of their own (every field read through
        this view: tensors sliced, the block's flags), for core code that copies a step
        state with ``dataclasses.replace``."""
        return CpuStepState(**{name: getattr(self, name) for name in _INIT_FIELDS})

    def with_fields(self, changes: dict) -> "BlockState":
        """A copy of this view with ``changes`` (field name -> value of the block's rows) in
        place of those fields; the rest shared."""
        out = object.__new__(BlockState)
        out.__dict__.update(self.__dict__)
        out.__dict__.update(changes)
        return out

    def stages_at(self, slot: str) -> list:
        """The custom stages some row of the step uses at ``slot`` (``StepState.stages_at``)."""
        return [entry for entry in self.stages if entry[0].slot == slot]


_STEP_FIELDS = frozenset(f.name for f in dataclasses.fields(CpuStepState))
_BLOCK_FLAGS = frozenset(name for name in BlockState.__annotations__ if name.startswith(("any_", "all_")))
_INIT_FIELDS = tuple(f.name for f in dataclasses.fields(CpuStepState) if f.init)


def rows_state(s, index: torch.Tensor) -> CpuStepState:
    """The step state (a :class:`CpuStepState` or a :class:`BlockState`, ``n`` rows) of rows
    ``index`` (int64 [m], rows of ``s``) alone: every per-row tensor (first dimension n)
    gathered, host values and flags as ``s``'s (a flag true for ``s`` may be true for rows
    that do not use its stage: they hold its neutral values, as in any step)."""
    n = s.num_rows
    values = {}
    # a block's own flags follow its plan, which leaves rows of other orders out: the step's
    step = s._s if isinstance(s, BlockState) else s
    for name in _INIT_FIELDS:
        value = getattr(step if name in _BLOCK_FLAGS else s, name)
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == n:
            value = value.index_select(0, index)
        values[name] = value
    values["num_rows"] = index.shape[0]
    values["plan"], values["undrawn"], values["stages"] = None, frozenset(), ()
    return CpuStepState(**values)

# StepState's host values every block shares (the flags of the stages a block's plan knows
# its rows for are set from the plan instead; see BlockState).
_SHARED = ("vocab_size", "logprobs_mode", "num_logprobs", "max_top_k", "any_top_p_without_top_k",
           "all_random_top_k", "any_allowed", "any_bias", "any_min_tokens", "any_bad_words",
           "any_bitmask", "any_dry", "any_penalties")


def slice_inputs(inputs: StageInputs, rows: slice) -> StageInputs:
    """A custom stage's inputs for the rows ``rows`` (views)."""
    return StageInputs(inputs.active[rows], {k: v[rows] for k, v in inputs.args.items()},
                       {k: v[rows] for k, v in inputs.state.items()}, inputs.position[rows])
