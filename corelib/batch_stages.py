"""The custom stages' side of a batch: which stages requests may name, their per-row switch,
arguments and state tensors, how that state starts at ``add`` and advances at ``append``.
``SamplingBatch`` inherits it; the tensors live in the batch's row store (``batch_store``).
"""

from __future__ import annotations

from typing import Optional

import torch

from .params import SamplingParams
from .stages import StageError, StageInputs, StageSpec, check_stage_spec, describe_stage
from .transfer import upload


class CustomStageRows:
    """Custom stages' rows (mixed into ``SamplingBatch``, whose state it reads and writes)."""

    def stage_specs(self) -> dict[str, tuple[StageSpec, Optional[str]]]:
        """Custom stages a request may name in ``stage_args``: name -> (spec, plugin name),
        from ``stage_catalog`` (read on first use)."""
        if self._stage_specs is None:
            self._stage_specs = self.stage_catalog()
        return self._stage_specs

    def use_stage(self, spec: StageSpec, plugin_name: Optional[str] = None) -> None:
        """Run the custom stage ``spec`` on every row of this batch, with no plugin registry
        entry and no ``stage_args``: for an engine that brings stages of its own. Its arguments
        hold their defaults; its state starts from each row's prompt and output at ``add``.
        At its slot it runs after the registry's stages, in the order of these calls.
        ``plugin_name`` names it in errors (``StageError``). Call it before the first ``add``;
        a batch with rows, or a name already in use, raises ValueError; a malformed ``spec``
        raises as a plugin's would (``check_stage_spec``)."""
        check_stage_spec(spec, plugin_name or "engine")
        if self._row_keys:
            raise ValueError(f"use_stage({spec.name!r}): the batch already has rows; call it "
                             f"before the first add")
        if spec.name in self._engine_stages or spec.name in self.stage_specs():
            raise ValueError(f"use_stage({spec.name!r}): a stage of that name is already in "
                             f"use by this batch or its plugins")
        self._engine_stages[spec.name] = (spec, plugin_name)
        self._allocate_stage(spec)
        self._changed()

    # ------------------------------------------------------------------ add / remove

    def _advanced_stage_state(self, t: dict[str, torch.Tensor],
                              columns: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Custom stages' state after ``columns`` (see ``_advance``), as new tensors."""
        staged: dict[str, torch.Tensor] = {}
        for spec, plugin in self._stages_in_use():
            active = t[_stage_key(spec.name, "active")]
            for state in spec.state:
                key = _stage_key(spec.name, "state", state.name)
                value = t[key]
                for ids, advance in columns:
                    live = advance & active & (ids >= 0) & (ids < self.vocab_size)
                    safe = torch.where(live, ids, torch.zeros_like(ids))
                    try:
                        new = state.update(value, safe, live)
                    except Exception as exc:
                        raise StageError(f"{describe_stage(spec, plugin)}: state {state.name!r} "
                                         f"update failed: {type(exc).__name__}: {exc}") from exc
                    if not isinstance(new, torch.Tensor) or new.shape != value.shape:
                        raise StageError(f"{describe_stage(spec, plugin)}: state {state.name!r} "
                                         f"update returned the wrong shape")
                    value = torch.where(live.view(-1, *([1] * (value.dim() - 1))), new.to(value.dtype), value)
                staged[key] = value
        return staged

    def _stage_inputs(self, t: dict[str, torch.Tensor]) -> tuple:
        entries = []
        for spec, plugin in self._stages_in_use():
            args = {field: t[_stage_key(spec.name, "arg", field)] for field in spec.arg_fields()}
            state = {st.name: t[_stage_key(spec.name, "state", st.name)] for st in spec.state}
            inputs = StageInputs(t[_stage_key(spec.name, "active")], args, state, t["position"])
            entries.append((spec, inputs, plugin))
        return tuple(entries)

    def _stages_in_use(self) -> list[tuple[StageSpec, Optional[str]]]:
        """Custom stages some live request uses, in registration order, then the batch's
        own (``use_stage``) (cached)."""
        if self._used_stages is None:
            named = {name for p in self._row_params for name in p.stage_args}
            specs = self._stage_specs or {}
            self._used_stages = ([specs[name] for name in specs if name in named]
                                 + list(self._engine_stages.values()))
        return self._used_stages

    def _stage_arguments(self, request_id: str, params: SamplingParams) -> dict:
        """``params.stage_args`` checked against the stages' models: name -> (spec, validated
        arguments). Raises ValueError naming the request and the stage."""
        if not params.stage_args:
            return {}
        specs = self.stage_specs()
        checked = {}
        for name, raw in params.stage_args.items():
            if name not in specs:
                known = ", ".join(sorted(specs)) or "none"
                raise ValueError(f"request {request_id!r}: stage_args names unknown stage {name!r} "
                                 f"(known stages: {known})")
            spec, _ = specs[name]
            unknown = sorted(set(raw) - set(spec.args.model_fields))
            if unknown:
                raise ValueError(f"request {request_id!r}: stage_args[{name!r}] has unknown "
                                 f"arguments {unknown} (stage {name!r} takes "
                                 f"{sorted(spec.args.model_fields)})")
            try:
                checked[name] = (spec, spec.args.model_validate(raw))
            except ValueError as exc:
                raise ValueError(f"request {request_id!r}: stage_args[{name!r}] is invalid: {exc}") from exc
        return checked

    def _allocate_stage(self, spec: StageSpec) -> None:
        key = _stage_key(spec.name, "active")
        if key in self._tensors:
            return
        tensors = {key: (torch.bool, False, ())}
        for field, (dtype, default) in spec.arg_fields().items():
            tensors[_stage_key(spec.name, "arg", field)] = (dtype, default, ())
        for state in spec.state:
            tensors[_stage_key(spec.name, "state", state.name)] = (state.dtype, 0, tuple(state.shape(self.vocab_size)))
        for name, (dtype, neutral, shape) in tensors.items():
            self._neutral[name] = neutral
            self._tensors[name] = torch.full((self._capacity, *shape), neutral, dtype=dtype, device=self.device)
        self._forget_views()

    def _write_stage(self, sl: slice, spec: StageSpec, args, prompt: list[int],
                     outputs: list[list[int]]) -> None:
        """A custom stage's switch, arguments and initial state for the rows ``sl``."""
        t = self._tensors
        t[_stage_key(spec.name, "active")][sl] = True
        for field in spec.arg_fields():
            t[_stage_key(spec.name, "arg", field)][sl] = getattr(args, field)
        for state in spec.state:
            key = _stage_key(spec.name, "state", state.name)
            for c, out in enumerate(outputs):
                try:
                    value = torch.as_tensor(state.init(list(prompt), list(out), args, self.vocab_size))
                except Exception as exc:
                    raise StageError(f"{describe_stage(spec)}: state {state.name!r} init failed: "
                                     f"{type(exc).__name__}: {exc}") from exc
                if tuple(value.shape) != tuple(t[key].shape[1:]):
                    raise StageError(f"{describe_stage(spec)}: state {state.name!r} init returned "
                                     f"shape {list(value.shape)}, expected {list(t[key].shape[1:])}")
                t[key][sl.start + c] = upload(value.to(t[key].dtype), self.device)


def _stage_key(stage: str, kind: str, name: str = "") -> str:
    """Name of a custom stage's tensor in the batch: its switch, an argument or a state."""
    return f"stage:{stage}:{kind}" + (f":{name}" if name else "")
