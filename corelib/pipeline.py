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
#: then, after the row-validity check, "adjust"; ``Sampler.filter`` runs "filter").
GROUPS = ("mask", "adjust", "filter")
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
    Stage("10", "temperature", "apply_temperature", "filter", RANDOM_ROWS,
          (Switch("any_temperature", lambda p: p.temperature != 1.0),),
          (Field("temperature", torch.float32, 1.0),),
          rule="temperature", example=dict(temperature=0.7)),
    Stage("10a", "top_n_sigma", "apply_top_n_sigma", "filter", RANDOM_ROWS,
          (Switch("any_top_n_sigma", lambda p: p.top_n_sigma > 0.0),),
          (Field("top_n_sigma", torch.float32, 0.0),),
          rule="top-n-sigma: drop logits below max - n * sigma",
          example=dict(top_n_sigma=1.0, temperature=0.8)),
    Stage("11", "min_p", "apply_min_p", "filter", RANDOM_ROWS,
          (Switch("any_min_p", lambda p: p.min_p > 0.0),),
          (Field("min_p", torch.float32, 0.0),),
          rule="min_p", example=dict(min_p=0.05)),
    # One stage for steps 12 and 13: backends cut both in one pass (a sort, a kernel).
    Stage("12-13", "top_k_top_p", "apply_top_k_top_p", "filter", RANDOM_ROWS,
          (Switch("any_top_k", lambda p: p.effective_top_k > 0),
           Switch("any_top_p", lambda p: p.top_p < 1.0)),
          (Field("top_k", torch.int32, 0, lambda p: p.effective_top_k),
           Field("top_p", torch.float32, 1.0)),
          rule="top_k then top_p, ties at the boundary kept", example=dict(top_k=20, top_p=0.8)),
    Stage("13a", "typical_p", "apply_typical_p", "filter", RANDOM_ROWS,
          (Switch("any_typical_p", lambda p: p.typical_p < 1.0),),
          (Field("typical_p", torch.float32, 1.0),),
          rule="typical-p: smallest set of most typical tokens, ties kept",
          example=dict(typical_p=0.6)),
    Stage("13b", "xtc", "apply_xtc", "filter", RANDOM_ROWS,
          (Switch("any_xtc", lambda p: p.uses_xtc),),
          (Field("xtc_threshold", torch.float32, 0.1),
           Field("xtc_probability", torch.float32, 0.0)),
          rule="XTC: drop the likely tokens but the least likely of them, by a seeded coin",
          example=dict(xtc_probability=1.0, xtc_threshold=0.02)),
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
    return tuple(f for stage in STAGES for f in stage.fields)


def switches() -> tuple[tuple[Stage, Switch], ...]:
    """Every (stage, switch) of the table, in table order."""
    return tuple((stage, switch) for stage in STAGES for switch in stage.switches)


def stage_flags(params: list, random: list) -> dict[str, bool]:
    """The host flags of the switches computed from requests: ``params`` every row's
    ``SamplingParams``, ``random`` those of the random rows."""
    flags = {}
    for stage, switch in switches():
        if switch.uses is not None:
            rows = random if stage.rows == RANDOM_ROWS else params
            flags[switch.flag] = any(switch.uses(p) for p in rows)
    return flags


def reindex() -> None:
    """Rebuild the group indexes from ``STAGES``: after ``STAGES`` is replaced in a fresh
    interpreter, before the rest of corelib is imported (the batch, the step state and the
    backends read the table when they are; ``corelib.testing.added_stage`` does this)."""
    global _BY_GROUP, _FLAGGED
    _BY_GROUP = {group: tuple(s for s in STAGES if s.group == group) for group in GROUPS}
    _FLAGGED = {group: tuple((s, s.flags) for s in stages) for group, stages in _BY_GROUP.items()}


_BY_GROUP: dict = {}
_FLAGGED: dict = {}
reindex()
assert all(s.group in GROUPS and s.rows in (ALL_ROWS, RANDOM_ROWS) for s in STAGES)
