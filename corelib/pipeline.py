"""The stage table: everything the core knows about each built-in stage, in one place.

One :class:`Stage` per built-in stage of the contract's order: its step, its name, the
``Sampler`` method that runs it, the group of the template it runs in, the rows it applies
to, the ``SamplingParams`` fields it reads (each with its dtype and the neutral value that
disables it) and the host flags that say whether any row of a batch uses it. What was
written by hand in several places is derived from this table:

- the per-row scalar tensors of ``SamplingBatch`` and the ``StepState`` fields that carry
  them (``stage_fields``), and the values a request writes there (``Field.value``);
- the host flags of ``StepState`` and how a batch computes them (``Switch``);
- the order in which ``Sampler.prepare`` and ``Sampler.filter`` call the stages
  (``stages_in``): the template loops over its groups, and nothing else repeats the order.

A backend overrides a stage by overriding its method; it never re-states the order. Adding a
built-in stage is one entry here, its reference method on ``Sampler``, its fields on
``SamplingParams``, its tests and its docs (docs/architecture.md, "Adding a stage").

This module imports no other part of corelib: the batch, the sampler and every backend read
it, so it sits below all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

#: The groups of the template, in the order a step runs them (``Sampler.prepare`` runs "mask"
#: then, after the row-validity check, "adjust"; ``Sampler.filter`` runs "filter", whose
#: order a request may change, then "select": the stateful selectors of step 14).
GROUPS = ("mask", "adjust", "filter", "select")
#: Rows a stage applies to: every row, or random rows only (greedy rows skip steps 10-13b).
ALL_ROWS, RANDOM_ROWS = "all", "random"
# Rows, children and positions are int32 on the device; larger ints are clamped to this
# (a top_k above V keeps every token, a count above it is never reached).
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Field:
    """A per-row scalar a stage reads: ``StepState.<name>``, a ``[B]`` tensor of ``dtype``
    whose ``neutral`` value disables the stage for that row (padding rows hold it too).
    ``read``: the row's value from its ``SamplingParams`` (default: the field of the same
    name); int32 values are clamped to ``INT32_MAX``."""

    name: str
    dtype: torch.dtype
    neutral: Any
    read: Optional[Callable[[Any], Any]] = None

    def value(self, params) -> Any:
        value = self.read(params) if self.read is not None else getattr(params, self.name)
        if self.dtype == torch.int32:
            value = min(value, INT32_MAX)
        return value


@dataclass(frozen=True)
class Switch:
    """A host flag of ``StepState`` (``flag``, a bool) that is True when some row the stage
    applies to has ``uses(params)``. ``uses`` None: the flag is set per call or per step by
    the batch or the template (the grammar bitmask, min_tokens while it is pending)."""

    flag: str
    uses: Optional[Callable[[Any], bool]] = None
    #: In the filter group: the name ``sampler_order`` gives this filter, and the stage's
    #: fields it owns (a stage with two switches runs one of them alone under that name).
    name: Optional[str] = None
    owns: tuple[str, ...] = ()
    #: The stage's field whose value other than its neutral one is ``uses`` for a row, read
    #: from the step state's tensors (a backend's per-row lists of the rows a filter or a
    #: selector applies to); None where no single field says it.
    row_field: Optional[str] = None


@dataclass(frozen=True)
class Stage:
    """One built-in stage. ``method``: the ``Sampler`` method ``(x, s) -> x`` that runs it (x
    float32 ``[B, V]``); it runs when any of its ``switches`` is set. ``rows``: ALL_ROWS or
    RANDOM_ROWS (what its switches look at). ``rule``: the contract's rule, as the conformance
    suite's failure messages name it. ``example``: ``SamplingParams`` fields that turn the
    stage on, for a vocabulary of 256 (the conformance suite's kept-set case for it, which
    every backend runs); None for a stage turned on per call (the grammar bitmask)."""

    step: str
    name: str
    method: str
    group: str
    rows: str
    switches: tuple[Switch, ...]
    fields: tuple[Field, ...] = ()
    rule: str = ""
    example: Optional[dict] = None
    #: Per-row state the batch keeps for the stage (its ``Field``s: ``read`` gives a joining
    #: row's initial value) and how appending a token advances it: the name of a function of
    #: ``corelib.selectors``, ``advance(state, fields, logp, ids)`` with ``state`` and
    #: ``fields`` dicts of float32 [R] tensors, ``logp`` float32 [R, V] the row's distribution
    #: after the filter group at the step the token was drawn in, ``ids`` int64 [R] the
    #: appended tokens; it returns the new state (float32 [R]).
    state: tuple[Field, ...] = ()
    advance: Optional[str] = None
    #: A filter that drops tokens (every filter but temperature and smoothing): ``score``
    #: with given kept sets runs the filter group's other stages, then the kept sets.
    truncates: bool = True

    @property
    def flags(self) -> tuple[str, ...]:
        """The names of its switches' flags."""
        return tuple(switch.flag for switch in self.switches)

    def enabled(self, s) -> bool:
        """Whether the stage runs in the step of ``s`` (a ``StepState``)."""
        for switch in self.switches:
            if getattr(s, switch.flag):
                return True
        return False


#: ``p_less`` as the int32 column its stage reads: off, "plain", "norm".
P_LESS_OFF = 0
P_LESS_MODES = {None: P_LESS_OFF, "plain": 1, "norm": 2}
STAGES: tuple[Stage, ...] = (
    Stage("3", "allowed_token_ids", "apply_allowed_ids", "mask", ALL_ROWS,
          (Switch("any_allowed", lambda p: p.allowed_token_ids is not None),),
          rule="allowed_token_ids", example=dict(allowed_token_ids=[3, 5, 7, 11, 200])),
    Stage("3", "token_bitmask", "apply_token_bitmask", "mask", ALL_ROWS,
          (Switch("any_bitmask"),), rule="token_bitmask: only tokens whose bit is set"),
    Stage("4", "bad_words", "apply_bad_words", "mask", ALL_ROWS,
          (Switch("any_bad_words", lambda p: bool(p.bad_words)),),
          rule="bad_words", example=dict(bad_words=[[4], [1, 2], [9, 9, 8]])),
    Stage("5", "min_tokens", "apply_min_tokens", "mask", ALL_ROWS,
          (Switch("any_min_tokens"),),
          (Field("min_tokens", torch.int32, 0),),
          rule="min_tokens masks stop ids and eos",
          example=dict(min_tokens=3, stop_token_ids=[6, 10])),
    Stage("6", "logit_bias", "apply_logit_bias", "adjust", ALL_ROWS,
          (Switch("any_bias", lambda p: bool(p.logit_bias)),),
          rule="logit_bias", example=dict(logit_bias={0: 5.0, 17: -100.0, 42: 2.5})),
    Stage("7-8", "penalties", "apply_penalties", "adjust", ALL_ROWS,
          (Switch("any_penalties", lambda p: p.uses_penalties),),
          (Field("repetition_penalty", torch.float32, 1.0),
           Field("frequency_penalty", torch.float32, 0.0),
           Field("presence_penalty", torch.float32, 0.0)),
          rule="repetition, frequency and presence penalties",
          example=dict(repetition_penalty=0.8, frequency_penalty=-1.0, presence_penalty=1.5)),
    Stage("8a", "dry", "apply_dry", "adjust", ALL_ROWS,
          (Switch("any_dry", lambda p: p.uses_dry),),
          (Field("dry_multiplier", torch.float32, 0.0),
           Field("dry_base", torch.float32, 1.75),
           Field("dry_allowed_length", torch.int32, 2),
           Field("dry_range", torch.int32, 0)),
          rule="DRY: tokens extending a repeat are penalised by its length",
          example=dict(dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2)),
    # Steps 10-13b: the filter group, whose order a request may change (``sampler_order``,
    # by the switches' names); the table's order is the default one.
    Stage("10", "temperature", "apply_temperature", "filter", RANDOM_ROWS,
          (Switch("any_temperature", lambda p: p.temperature != 1.0 or p.uses_dynatemp,
                  "temperature"),
           Switch("any_dynatemp", lambda p: p.uses_dynatemp, row_field="dynatemp_range")),
          (Field("temperature", torch.float32, 1.0),
           Field("dynatemp_range", torch.float32, 0.0),
           Field("dynatemp_exponent", torch.float32, 1.0)),
          rule="temperature, dynamic with the entropy when dynatemp_range > 0",
          example=dict(temperature=0.7, dynatemp_range=0.5, dynatemp_exponent=1.5),
          truncates=False),
    Stage("10a", "top_n_sigma", "apply_top_n_sigma", "filter", RANDOM_ROWS,
          (Switch("any_top_n_sigma", lambda p: p.top_n_sigma > 0.0, "top_n_sigma", row_field="top_n_sigma"),),
          (Field("top_n_sigma", torch.float32, 0.0),),
          rule="top-n-sigma: drop logits below max - n * sigma",
          example=dict(top_n_sigma=1.0, temperature=0.8)),
    Stage("10b", "smoothing", "apply_smoothing", "filter", RANDOM_ROWS,
          (Switch("any_smoothing", lambda p: p.smoothing_factor > 0.0, "smoothing",
                  row_field="smoothing_factor"),),
          (Field("smoothing_factor", torch.float32, 0.0),
           Field("smoothing_curve", torch.float32, 1.0)),
          rule="quadratic smoothing around the largest kept logit",
          example=dict(smoothing_factor=0.3, smoothing_curve=2.0), truncates=False),
    Stage("11", "min_p", "apply_min_p", "filter", RANDOM_ROWS,
          (Switch("any_min_p", lambda p: p.min_p > 0.0, "min_p", row_field="min_p"),),
          (Field("min_p", torch.float32, 0.0),),
          rule="min_p", example=dict(min_p=0.05)),
    Stage("11a", "top_a", "apply_top_a", "filter", RANDOM_ROWS,
          (Switch("any_top_a", lambda p: p.top_a > 0.0, "top_a", row_field="top_a"),),
          (Field("top_a", torch.float32, 0.0),),
          rule="top-a: drop p < top_a * max(p)**2", example=dict(top_a=0.2)),
    Stage("11b", "epsilon", "apply_epsilon", "filter", RANDOM_ROWS,
          (Switch("any_epsilon", lambda p: p.epsilon_cutoff > 0.0, "epsilon",
                  row_field="epsilon_cutoff"),),
          (Field("epsilon_cutoff", torch.float32, 0.0),),
          rule="epsilon: drop p < epsilon_cutoff", example=dict(epsilon_cutoff=0.003)),
    Stage("11c", "eta", "apply_eta", "filter", RANDOM_ROWS,
          (Switch("any_eta", lambda p: p.eta_cutoff > 0.0, "eta", row_field="eta_cutoff"),),
          (Field("eta_cutoff", torch.float32, 0.0),),
          rule="eta: drop p < min(eta, sqrt(eta) * exp(-H))", example=dict(eta_cutoff=0.004)),
    # One stage for steps 12 and 13: backends cut both in one pass (a sort, a kernel); a
    # request that orders them apart runs each switch alone (``Switch.owns``).
    Stage("12-13", "top_k_top_p", "apply_top_k_top_p", "filter", RANDOM_ROWS,
          (Switch("any_top_k", lambda p: p.effective_top_k > 0, "top_k", ("top_k",), "top_k"),
           Switch("any_top_p", lambda p: p.top_p < 1.0, "top_p", ("top_p",), "top_p")),
          (Field("top_k", torch.int32, 0, lambda p: p.effective_top_k),
           Field("top_p", torch.float32, 1.0)),
          rule="top_k then top_p, ties at the boundary kept", example=dict(top_k=20, top_p=0.8)),
    Stage("13a", "typical_p", "apply_typical_p", "filter", RANDOM_ROWS,
          (Switch("any_typical_p", lambda p: p.typical_p < 1.0, "typical_p", row_field="typical_p"),),
          (Field("typical_p", torch.float32, 1.0),),
          rule="typical-p: smallest set of most typical tokens, ties kept",
          example=dict(typical_p=0.6)),
    Stage("13c", "tfs", "apply_tfs", "filter", RANDOM_ROWS,
          (Switch("any_tfs", lambda p: p.tfs < 1.0, "tfs", row_field="tfs"),),
          (Field("tfs", torch.float32, 1.0),),
          rule="tail-free: keep the head before the second differences' mass passes tfs",
          example=dict(tfs=0.7)),
    Stage("13d", "p_less", "apply_p_less", "filter", RANDOM_ROWS,
          (Switch("any_p_less", lambda p: p.p_less is not None, "p_less", row_field="p_less"),),
          (Field("p_less", torch.int32, P_LESS_OFF, lambda p: P_LESS_MODES[p.p_less]),),
          rule="p-less: drop p < sum p**2 (normalised by V for 'norm')",
          example=dict(p_less="plain")),
    Stage("13b", "xtc", "apply_xtc", "filter", RANDOM_ROWS,
          (Switch("any_xtc", lambda p: p.uses_xtc, "xtc", row_field="xtc_probability"),),
          (Field("xtc_threshold", torch.float32, 0.1),
           Field("xtc_probability", torch.float32, 0.0)),
          rule="XTC: drop the likely tokens but the least likely of them, by a seeded coin",
          example=dict(xtc_probability=1.0, xtc_threshold=0.02)),
    # Step 14's stateful selectors: they reshape what the draw sees, after the filter group.
    Stage("14", "mirostat", "apply_mirostat", "select", RANDOM_ROWS,
          (Switch("any_mirostat", lambda p: p.uses_mirostat, row_field="mirostat_tau"),),
          (Field("mirostat_tau", torch.float32, 0.0),
           Field("mirostat_eta", torch.float32, 0.1)),
          rule="mirostat v2: drop tokens of more than mu bits, mu follows tau",
          example=dict(mirostat_tau=3.0, mirostat_eta=0.1),
          state=(Field("mirostat_mu", torch.float32, 0.0, lambda p: 2.0 * p.mirostat_tau),),
          advance="advance_mirostat"),
    Stage("14", "adaptive_p", "apply_adaptive_p", "select", RANDOM_ROWS,
          (Switch("any_adaptive_p", lambda p: p.uses_adaptive_p, row_field="adaptive_p_target"),),
          (Field("adaptive_p_target", torch.float32, -1.0,
                 lambda p: -1.0 if p.adaptive_p_target is None else p.adaptive_p_target),
           Field("adaptive_p_decay", torch.float32, 0.9)),
          rule="adaptive-p: favour tokens near a probability that tracks the target",
          example=dict(adaptive_p_target=0.3, adaptive_p_decay=0.9),
          # w = target / (1 - decay), s = 1 / (1 - decay) when the request joins
          state=(Field("adaptive_p_weighted", torch.float32, 0.0, lambda p: (
                     p.adaptive_p_target / (1.0 - p.adaptive_p_decay) if p.uses_adaptive_p else 0.0)),
                 Field("adaptive_p_total", torch.float32, 0.0, lambda p: (
                     1.0 / (1.0 - p.adaptive_p_decay) if p.uses_adaptive_p else 0.0))),
          advance="advance_adaptive_p"),
)


def stages_in(group: str) -> tuple[Stage, ...]:
    """The stages of ``group`` (one of ``GROUPS``), in the contract's order."""
    return _BY_GROUP[group]


def flagged_stages_in(group: str) -> tuple[tuple[Stage, tuple[str, ...]], ...]:
    """``stages_in(group)`` with each stage's flag names: what a template loop tests per step
    (made once: the loop runs on every step's critical path)."""
    return _FLAGGED[group]


def stage_fields() -> tuple[Field, ...]:
    """Every stage's per-row scalars, in table order."""
    return _FIELDS


def switches() -> tuple[tuple[Stage, Switch], ...]:
    """Every (stage, switch) of the table, in table order."""
    return tuple((stage, switch) for stage in STAGES for switch in stage.switches)


def row_switches(*groups: str) -> tuple[tuple[Stage, Switch, Field], ...]:
    """Every (stage, switch, its ``row_field``'s Field) of the given groups whose switch names
    a row field, in table order: a row uses the switch where that field is not ``neutral``."""
    return tuple((stage, switch, next(f for f in stage.fields if f.name == switch.row_field))
                 for group in groups for stage in stages_in(group)
                 for switch in stage.switches if switch.row_field is not None)


def request_flags(params) -> frozenset[str]:
    """The switches' flags one request sets (a greedy request: only those of stages that
    apply to every row). A batch keeps them per request, so that its flags after a join or a
    leave are a union, not a test of every switch on every row."""
    greedy = params.is_greedy
    return frozenset(switch.flag for stage, switch in _COMPUTED
                     if not (greedy and stage.rows == RANDOM_ROWS) and switch.uses(params))


def computed_flags() -> tuple[str, ...]:
    """The flags ``request_flags`` may set (those of switches computed from requests)."""
    return tuple(switch.flag for _, switch in _COMPUTED)


def order_names() -> tuple[str, ...]:
    """The names ``sampler_order`` accepts, in the default order of the filter group."""
    return _ORDER_NAMES


def filters_on(params) -> tuple[str, ...]:
    """The names of the filters ``params`` turns on, in the default order."""
    return tuple(switch.name for _, switch in _NAMED if switch.uses(params))


def named_switch(name: str) -> tuple[Stage, Switch]:
    """The filter stage and switch ``sampler_order`` calls ``name``."""
    return _BY_NAME[name]


def replayed_stages() -> tuple[Stage, ...]:
    """The filter group's stages that drop no token (``Stage.truncates`` False), in the
    default order: what ``score`` runs before applying given kept sets."""
    return _REPLAYED


def stateful_stages() -> tuple[Stage, ...]:
    """The stages that keep per-row state in the batch (``Stage.state``), in table order."""
    return _STATEFUL


def state_fields() -> tuple[Field, ...]:
    """Every stage's per-row state scalars, in table order."""
    return _STATE


def reindex() -> None:
    """Rebuild the group indexes from ``STAGES``: after ``STAGES`` is replaced in a fresh
    interpreter, before the rest of corelib is imported (the batch, the step state and the
    backends read the table when they are; ``corelib.testing.added_stage`` does this)."""
    global _BY_GROUP, _FLAGGED, _NAMED, _ORDER_NAMES, _BY_NAME, _STATEFUL, _COMPUTED, _FIELDS, _STATE
    global _REPLAYED
    _BY_GROUP = {group: tuple(s for s in STAGES if s.group == group) for group in GROUPS}
    _FLAGGED = {group: tuple((s, s.flags) for s in stages) for group, stages in _BY_GROUP.items()}
    _NAMED = tuple((s, w) for s in _BY_GROUP["filter"] for w in s.switches if w.name is not None)
    _ORDER_NAMES = tuple(w.name for _, w in _NAMED)
    _BY_NAME = {w.name: (s, w) for s, w in _NAMED}
    _STATEFUL = tuple(s for s in STAGES if s.state)
    _REPLAYED = tuple(s for s in _BY_GROUP["filter"] if not s.truncates)
    _COMPUTED = tuple((s, w) for s in STAGES for w in s.switches if w.uses is not None)
    _FIELDS = tuple(f for stage in STAGES for f in stage.fields)
    _STATE = tuple(f for stage in _STATEFUL for f in stage.state)


_BY_GROUP: dict = {}
_FLAGGED: dict = {}
_NAMED: tuple = ()
_ORDER_NAMES: tuple = ()
_BY_NAME: dict = {}
_STATEFUL: tuple = ()
_COMPUTED: tuple = ()
_FIELDS: tuple = ()
_STATE: tuple = ()
_REPLAYED: tuple = ()
reindex()
assert all(s.group in GROUPS and s.rows in (ALL_ROWS, RANDOM_ROWS) for s in STAGES)
