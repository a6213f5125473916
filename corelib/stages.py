"""Custom stages: what a plugin describes so that every backend runs its stage at its slot.

A plugin returns :class:`StageSpec` objects from its ``corelib_stages`` hook. A request turns a
stage on with ``SamplingParams(stage_args={"stage-name": {...}})``; the batch checks the
arguments against the stage's pydantic model at ``add`` and keeps them as per-row tensors
(and the stage's persistent state, if it declares any) next to every other row tensor, so they
move on ``remove``, advance on ``append`` and resume from ``output_token_ids``.

The sampler calls ``apply`` once per step at the stage's slot, on the whole batch (a backend
may run it per block of rows); rows that do not use the stage keep their logits, whatever
``apply`` returns for them. ``apply`` must be plain, shape-static torch (no ``.item()``, no
boolean indexing, no Python branch on tensor values), so that XLA can trace it and a CUDA
graph can capture it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch
from pydantic import BaseModel

#: Where a custom stage runs: after the contract's step 8a (DRY), on every row; or after step
#: 13b (XTC), on random rows only (greedy rows skip it, as they skip steps 10-13b).
SLOTS = ("after_penalties", "after_filters")

#: Argument field types and the dtype of their per-row tensor.
ARG_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float32}


@dataclass(frozen=True)
class StageState:
    """A per-row tensor a stage keeps across steps (for example running counts).

    ``shape(vocab_size)``: the per-row shape (a tuple). ``init(prompt, output, args,
    vocab_size)``: the row's value (a CPU tensor of ``shape`` and ``dtype``) from its prompt and
    already generated tokens (lists of ints) and its validated arguments; called at ``add``.
    ``update(state, token_ids, live)``: the state after one token per row; ``state``
    ``[n, *shape]``, ``token_ids`` int64 ``[n]`` (in range where ``live``), ``live`` bool
    ``[n]`` (False: leave the row as it is); returns a new tensor, traceable like ``apply``.
    """

    name: str
    dtype: torch.dtype
    shape: Callable[[int], tuple[int, ...]]
    init: Callable[[list[int], list[int], BaseModel, int], torch.Tensor]
    update: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class StageInputs:
    """What a stage's ``apply`` receives besides the logits, for the step's ``B`` rows.

    ``active`` bool ``[B]``: rows that use the stage. ``args``: one tensor ``[B]`` per argument
    field (float32, int64 or bool; rows without the stage hold the field's default).
    ``state``: one tensor ``[B, *shape]`` per declared state. ``position`` int32 ``[B]``: tokens
    generated so far by the row.
    """

    active: torch.Tensor
    args: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor]
    position: torch.Tensor


@dataclass(frozen=True)
class StageSpec:
    """A plugin's description of one custom stage.

    ``apply(x, inputs)``: x float32 ``[B, V]`` (dropped tokens -inf), ``inputs`` a
    :class:`StageInputs`; returns a new float32 ``[B, V]`` (never modify ``x``). ``args``: a
    pydantic model whose fields are bool, int or float, each with a default.
    ``implementations``: faster versions of ``apply`` by backend name (same signature).
    """

    name: str
    slot: str
    args: type[BaseModel]
    apply: Callable[[torch.Tensor, StageInputs], torch.Tensor]
    state: tuple[StageState, ...] = ()
    description: str = ""
    implementations: Mapping[str, Callable[[torch.Tensor, StageInputs], torch.Tensor]] = field(
        default_factory=dict)

    def arg_fields(self) -> dict[str, tuple[torch.dtype, Any]]:
        """Argument name -> (tensor dtype, default)."""
        return {name: (ARG_DTYPES[info.annotation], info.default)
                for name, info in self.args.model_fields.items()}


class StageError(RuntimeError):
    """A custom stage failed during a step (its ``apply`` or its state ``update`` raised or
    returned a tensor of the wrong shape or dtype). The message names the stage and its plugin;
    the batch is left as it was before the call."""


def check_stage_spec(spec: Any, plugin_name: str) -> StageSpec:
    """Raise a clear TypeError/ValueError when a plugin's stage description is malformed."""
    if not isinstance(spec, StageSpec):
        raise TypeError(f"plugin {plugin_name!r} returned {spec!r}, expected corelib.StageSpec")
    if not isinstance(spec.name, str) or not spec.name:
        raise ValueError(f"plugin {plugin_name!r}: stage name must be a non-empty str, got {spec.name!r}")
    where = f"plugin {plugin_name!r}: stage {spec.name!r}"
    if spec.slot not in SLOTS:
        raise ValueError(f"{where}: slot must be one of {SLOTS}, got {spec.slot!r}")
    if not (isinstance(spec.args, type) and issubclass(spec.args, BaseModel)):
        raise TypeError(f"{where}: args must be a pydantic model class, got {spec.args!r}")
    for name, info in spec.args.model_fields.items():
        if info.annotation not in ARG_DTYPES:
            raise TypeError(f"{where}: argument {name!r} must be bool, int or float, got {info.annotation!r}")
        if info.is_required():
            raise ValueError(f"{where}: argument {name!r} needs a default (rows without the stage hold it)")
    if not callable(spec.apply):
        raise TypeError(f"{where}: apply must be callable")
    for state in spec.state:
        if not isinstance(state, StageState):
            raise TypeError(f"{where}: state entries must be corelib.StageState, got {state!r}")
    return spec


def run_stage(spec: StageSpec, impl: Callable, x: torch.Tensor, inputs: StageInputs,
              plugin: Optional[str] = None) -> torch.Tensor:
    """``impl(x, inputs)`` for the active rows (the others keep ``x``), with any failure
    reported as a :class:`StageError` naming the stage."""
    try:
        y = impl(x, inputs)
    except Exception as exc:
        raise StageError(f"{describe_stage(spec, plugin)} failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(y, torch.Tensor) or y.shape != x.shape or y.dtype != x.dtype:
        got = f"{y.dtype} {list(y.shape)}" if isinstance(y, torch.Tensor) else type(y).__name__
        raise StageError(f"{describe_stage(spec, plugin)} returned {got}, expected "
                         f"{x.dtype} {list(x.shape)}")
    return torch.where(inputs.active[:, None], y, x)


def describe_stage(spec: StageSpec, plugin: Optional[str] = None) -> str:
    return f"stage {spec.name!r}" + (f" (plugin {plugin!r})" if plugin else "")
