"""The batch's side of the fourth release's per-request choices: the order each request runs
the filter group in (numbered per batch, read per row as ``filter_order``), and the state of
step 14's stateful selectors (mirostat's mu, adaptive-p's sums), which ``append`` advances from
the distribution the last ``sample`` or ``verify`` recorded, and which a request takes with it
when it moves (``sampler_state``, ``add(..., sampler_state=...)``). ``SamplingBatch``
inherits it.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from . import pipeline, selectors
from .params import SamplingParams


class SelectorRows:
    """Filter orders and selector state of a batch's rows (mixed into ``SamplingBatch``)."""

    def sampler_state(self, request_id: str) -> list[list[float]]:
        """The state of the request's stateful selectors, one list of plain floats per child
        (mirostat: [mu]; adaptive-p: [weighted sum, total weight]; empty lists when it uses
        none). ``add(..., sampler_state=...)`` with ``output_token_ids`` resumes it exactly,
        in this batch or another, on any backend. Reads the device (waits for it)."""
        request = self._lookup(request_id)
        names = [f.name for f in _used_state(request.params)]
        if not names:
            return [[] for _ in request.rows]
        t = self._tensors
        rows = torch.tensor(request.rows, dtype=torch.long, device=self.device)
        columns = [t[name].index_select(0, rows).tolist() for name in names]
        return [[float(column[c]) for column in columns] for c in range(len(request.rows))]

    def keep_selector_source(self, source: Optional[torch.Tensor], slots: int = 1) -> None:
        """Keep what the next ``append`` advances the selectors' state from: the sampler's
        float32 ``[rows * slots, V]`` log-probabilities after the filter group (``sample``:
        slots 1; ``verify``: K + 1, slot-major per row; rows may be padded past the batch's);
        None when no row uses a selector. ``Sampler.sample`` and ``verify`` call it; a request
        joining, leaving or moving drops it (append right after the step it follows)."""
        self._selector_source = None if source is None else (source, slots)

    def _advance_selectors(self, t: dict[str, torch.Tensor],
                           columns: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Advance the selectors' state of rows ``t`` (views, updated in place) by append's
        columns, column j from slot j of the kept source; then drop the source. Rows that
        take no token (advance False), greedy rows and rows without a selector keep theirs; a
        stage no request of the batch turns on is not run (its advance would keep every
        row's state: a whole-row pass or more each for nothing)."""
        kept, self._selector_source = self._selector_source, None
        if kept is None:
            return
        flags = self._host_flags()      # a flag set per step, not by requests, counts as set
        stages = [stage for stage in pipeline.stateful_stages()
                  if any(flags.get(flag, True) for flag in stage.flags)]
        if not stages:
            return
        source, slots = kept
        n = t["position"].shape[0]
        if len(columns) > slots:
            return      # not the step this source came from
        logp = source.reshape(-1, slots, source.shape[-1])[:n]
        random = ~t["greedy"]
        for j, (ids, advance) in enumerate(columns):
            live = advance & random & (ids >= 0) & (ids < self.vocab_size)
            safe = torch.where(live, ids, 0)
            for stage in stages:
                state = {f.name: t[f.name] for f in stage.state}
                fields = {f.name: t[f.name] for f in stage.fields}
                moved = getattr(selectors, stage.advance)(state, fields, logp[:, j], safe,
                                                          row_sum=self.row_sum)
                for name, value in moved.items():
                    t[name].copy_(torch.where(live, value, t[name]))

    def _selector_rows(self, request_id: str, params: SamplingParams, n: int,
                       sampler_state) -> dict[str, list]:
        """The selector state a request's ``n`` rows start with: ``sampler_state`` (as
        ``sampler_state()`` returns it) when given, else each stage's initial value. Raises
        ValueError naming ``sampler_state`` when it does not fit the request."""
        used = _used_state(params)
        if sampler_state is None:
            if not used:     # neutral: only what rows of the batch already hold is written
                return {f.name: [f.neutral] * n for f in pipeline.state_fields()
                        if f.name not in self._idle_scalars}
            return {f.name: [f.value(params)] * n for f in pipeline.state_fields()}
        values = {f.name: [f.value(params)] * n for f in pipeline.state_fields()}
        where = f"request {request_id!r}: sampler_state"
        if not isinstance(sampler_state, (list, tuple)) or len(sampler_state) != n:
            raise ValueError(f"{where} must be a list of {n} lists (one per child), got {sampler_state!r}")
        for c, child in enumerate(sampler_state):
            if not isinstance(child, (list, tuple)) or len(child) != len(used):
                raise ValueError(f"{where}[{c}] must be a list of {len(used)} floats "
                                 f"({', '.join(f.name for f in used) or 'no selector'}), got {child!r}")
            for f, value in zip(used, child):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise ValueError(f"{where}[{c}]: {f.name} must be a finite float, got {value!r}")
                values[f.name][c] = float(value)
        return values

    def _order_index(self, params: SamplingParams) -> int:
        """The batch's number for the request's filter order: 0 for the default order."""
        order = params.filter_order
        if order is None:
            return 0
        return self._orders.setdefault(order, len(self._orders) + 1)

    def _filter_orders(self, used: set) -> tuple:
        """StepState.filter_orders: (number, names) of each non-default order (``used``: the
        orders random rows run) in the batch's numbering."""
        return tuple(sorted((self._orders[order], order) for order in used))


def _used_state(params: SamplingParams) -> list[pipeline.Field]:
    """The state fields of the stateful stages ``params`` turns on, in table order."""
    return [f for stage in pipeline.stateful_stages()
            if any(switch.uses(params) for switch in stage.switches) for f in stage.state]
