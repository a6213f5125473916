"""The TPU backend's filter group (steps 10-13b) and step 14's selectors, traced: each stage
in an XLA conditional that runs it only when some row uses it (``xla.cond``), the paths of
steps 11-13 chosen inside the graph by the rows' ``route`` (``ROUTES``), and the per-request
filter orders each in a conditional on its rows. Mixed into ``TpuSampler`` (``sampler``).
Shapes: ``B`` rows of the bucket, ``V`` vocabulary.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch
from corelib import noise, pipeline
from corelib.sampler import Sampler

from . import filters, thresholds, xla
from .layout import ROUTES, XlaStepState

# Steps this backend runs inside a later stage's conditional, while the stage table puts
# nothing between them (a stage added there runs in its place, and these then run alone).
_FILTERS = [stage.name for stage in pipeline.stages_in("filter")]
MIN_P_IN_ROUTE = _FILTERS.index("min_p") + 1 == _FILTERS.index("top_k_top_p")
TYPICAL_P_IN_XTC = _FILTERS.index("typical_p") + 1 == _FILTERS.index("xtc")


def _reference(sampler: Sampler, method: str, field: str):
    """A conditional's branch running the core's stage ``method`` (one that reads the single
    per-row field ``field``) on its operands (x, the field's ``[B]`` tensor), with ``sampler``'s
    own parts (its ``row_sum``)."""
    def run(x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return getattr(Sampler, method)(sampler, x, SimpleNamespace(**{field: value}))
    return run


def _dynatemp_state(temperature, d, exponent, greedy) -> SimpleNamespace:
    """What the core's ``apply_temperature`` reads for a dynamic temperature."""
    return SimpleNamespace(temperature=temperature, dynatemp_range=d, dynatemp_exponent=exponent,
                           greedy=greedy, any_dynatemp=True)


#: The filter group's per-row fields, with the values that turn each filter off.
_FILTER_NEUTRAL = {f.name: f.neutral for stage in pipeline.stages_in("filter") for f in stage.fields}


def _rows_only(s: XlaStepState, rows: torch.Tensor) -> XlaStepState:
    """``s`` with the filter group's fields neutral outside ``rows`` (bool ``[B]``): [B]
    selects only, no pass over the logits."""
    return dataclasses.replace(s, **{name: torch.where(rows, getattr(s, name), neutral)
                                     for name, neutral in _FILTER_NEUTRAL.items()})


def _row_tensors(s: XlaStepState) -> dict:
    """The state's ``[B]`` tensors by field name: what a traced branch over the filter group
    takes as operands (it reads nothing else)."""
    return {f.name: getattr(s, f.name) for f in dataclasses.fields(s)
            if isinstance(getattr(s, f.name), torch.Tensor) and getattr(s, f.name).dim() == 1}


def filters_in_use(s: XlaStepState) -> list:
    """The filter group's stages whose flags ``s`` sets, in table order."""
    return [stage for stage, flags in pipeline.flagged_stages_in("filter")
            if any(getattr(s, flag) for flag in flags)]


def _unchanged(x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
    """The branch of a conditional stage that no row uses: its logits as they are."""
    return x


#: The filters few batches use, each run here in a conditional on its rows, with a predicate
#: (bool ``[B]``) that holds wherever that conditional's does; None for a filter that runs
#: inside another stage's route here (min-p in steps 11-13's). A run of them next to each
#: other in the table shares one outer conditional on "some row uses one of them"
#: (``FilterStages.run_group``). The predicates are the table's row fields
#: (``pipeline.row_switches``): the field away from its neutral value.
_FEW_ROWS = {stage.name: (lambda s, f=field: getattr(s, f.name) != f.neutral)
             for stage, _, field in pipeline.row_switches("filter")
             if stage.name not in ("temperature", "top_k_top_p")}
if MIN_P_IN_ROUTE:
    _FEW_ROWS["min_p"] = None


def _dynatemp_rows(s: XlaStepState) -> torch.Tensor:
    """bool ``[B]``: the rows whose step 10 is the dynamic temperature."""
    return (s.dynatemp_range > 0) & ~s.greedy


#: The smallest bucket whose ``sample`` graph runs the filter group in one conditional
#: (``FilterStages.run_group``). Measured on XLA:CPU at V = 128256, that graph against the
#: two conditionals around the route, same process, CPU time: B = 16, 32, 64 took 1.05-1.3x
#: less (top-k + top-p 1.1-1.3x, flat top-p 1.05-1.1x), B = 1 the same, B = 8 about 1.5x
#: more, for a reason not found in its HLO (the same conditionals and TopKs, the route once
#: more), so buckets below 16 keep the two.
GROUP_CONDITIONAL_MIN_ROWS = 16

#: The dynamic temperature's entry in a run of ``_FEW_ROWS`` (after step 10's division).
_DYNATEMP_RUN = "dynamic temperature"
_FEW_ROWS[_DYNATEMP_RUN] = _dynatemp_rows


def _name(item) -> str:
    """The ``_FEW_ROWS`` name of an entry of a run: a stage, or ``_DYNATEMP_RUN``."""
    return item if isinstance(item, str) else item.name


@dataclasses.dataclass
class RouteRecord:
    """What the filter group did around the candidate route, for the draw
    (``TpuSampler.sample_random``): the route's (ids int64 ``[B, K]``, edges float32
    ``[B, 3]``) (``thresholds.top_k_top_p_with_ids``), the predicates (bool 0-d) of the
    conditionals of the other filters that may have changed the logits, and whether a stage
    ran that leaves no predicate (then nothing is reused)."""

    candidates: list = dataclasses.field(default_factory=list)
    ran: list = dataclasses.field(default_factory=list)
    unknown: bool = False


class FilterStages:
    """Steps 10-14 of ``TpuSampler`` (which provides the graph runner and the other stages)."""

    #: While ``sample_random`` runs the filter group, a ``RouteRecord`` of what the draw may
    #: reuse of steps 11-13's candidate route; None otherwise.
    _route: "RouteRecord | None" = None

    def run_group(self, group: str, x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """The core's ``run_group``, the same stages in the same order. For the filter group of
        a ``sample`` step (``sample_random`` records the route: ``self._route``): when two or
        more of its stages are filters of ``_FEW_ROWS`` (the dynamic temperature counting as
        one) and the bucket holds at least ``GROUP_CONDITIONAL_MIN_ROWS`` rows, the whole
        group runs in one conditional on "some row uses one of them", whose
        other branch runs the group without them (step 10's division, the route of steps
        11-13, any stage with no predicate): a batch that uses none of them runs the route
        with no conditional around it. That graph holds the route twice, and maps about a
        quarter more regions; ``verify``'s and ``score``'s graphs (one per bucket and K or T)
        and the filter orders' conditionals keep the group as ``_filters_in_turn`` runs it, so
        that the documented warm-up and a process that compiles many graphs stay under the
        default ``vm.max_map_count``. Why: each conditional around a run of
        those filters cost far more than its ``[B, V]`` pass-through (the two runs on either
        side of the route: 1.41-1.45x of a top-k + top-p step at B = 32, where replacing the
        copy by a write of ``x * 1`` saved 1%), as XLA:CPU fuses nothing across a
        conditional's boundary. Inside the conditional's first branch each run of those
        filters still shares one conditional (``_filters_in_turn``). The route's candidates
        (``RouteRecord``) come out of the conditional as outputs. x float32 ``[B, V]``; not in
        place."""
        if group != "filter":
            return Sampler.run_group(self, group, x, s)
        stages = filters_in_use(s)
        names = [_DYNATEMP_RUN if stage.name == "temperature" and s.any_dynatemp else stage.name
                 for stage in stages]
        tests = [_FEW_ROWS[name] for name in names if name in _FEW_ROWS and _FEW_ROWS[name] is not None]
        record = self._route
        if len(tests) < 2 or record is None or x.shape[0] < GROUP_CONDITIONAL_MIN_ROWS:
            return self._filters_in_turn(x, s, stages)
        used = tests[0](s)
        for test in tests[1:]:
            used = used | test(s)
        rare = {name for name in names if name in _FEW_ROWS}
        lean = [stage for stage in stages if stage.name not in rare]
        routed = any(stage.name == "top_k_top_p" for stage in stages)
        record.ran.append(used.any())
        record.unknown |= any(stage.name not in ("temperature", "top_k_top_p") for stage in lean)
        rows = _row_tensors(s)

        def branch(chosen):
            def run(x, *values):
                on = dataclasses.replace(s, **dict(zip(rows, values)))
                if chosen is lean:
                    on = dataclasses.replace(on, any_dynatemp=False)
                outer, self._route = self._route, RouteRecord()
                try:
                    y = self._filters_in_turn(x, on, chosen)
                    inner = self._route
                finally:
                    self._route = outer
                return (y, *inner.candidates[0]) if routed else y
            return run

        key = ("filter group", type(self), tuple(names), tuple(rows), self.top_k_candidates)
        out = xla.cond(used.any(), branch(stages), branch(lean), [x, *rows.values()], key)
        if not routed:
            return out
        x, ids, edges = out
        record.candidates.append((ids, edges))
        return x

    def _filters_in_turn(self, x: torch.Tensor, s: XlaStepState, stages: list) -> torch.Tensor:
        """The filter group's ``stages`` in order, each run of two or more consecutive filters
        of ``_FEW_ROWS`` (the dynamic temperature counting as one, after step 10's division)
        in one conditional on "some row uses one of them", inside which each still runs in
        its own. Why: a conditional whose branch passes ``[B, V]`` logits through is not free
        in the HLO (its operand is materialised, and XLA:CPU copies it into the conditional's
        result buffer: a write and a read of ``[B, V]``), so a batch that uses none of these
        filters pays one such pass instead of one per filter."""
        run: list = []
        before = x
        for stage in stages:
            if stage.name in _FEW_ROWS:
                run.append(stage)
                continue
            x = self._few_rows_run(x, before, s, run)
            run = []
            if stage.name == "temperature" and s.any_dynatemp:
                # step 10's division is left to the run's conditional (x None: pending)
                before, x = x, None
                run.append(_DYNATEMP_RUN)
                continue
            if self._route is not None and stage.name not in ("temperature", "top_k_top_p"):
                self._route.unknown = True         # a stage with no predicate to tell it ran
            x = self.stage_method(stage)(x, s)
        return self._few_rows_run(x, before, s, run)

    def _few_rows_run(self, x: torch.Tensor, before: torch.Tensor, s: XlaStepState,
                      run: list) -> torch.Tensor:
        """``run``'s stages in order (``_DYNATEMP_RUN`` for the dynamic temperature), in one
        conditional when two or more of them have one of their own; ``before``: the logits
        before step 10, which the dynamic temperature reads. The branch takes the state's
        ``[B]`` tensors as operands (a traced branch reads nothing else) and runs the stages
        on a copy of ``s`` holding them. x None: step 10's static division of ``before`` is
        still to come, and both branches make it: the branch of a batch that uses none of
        the run's filters then writes the divided logits instead of copying them (XLA:CPU
        copies a conditional's pass-through operand into its result), one ``[B, V]`` write
        and read fewer per step."""
        tests = [_FEW_ROWS[_name(item)] for item in run if _FEW_ROWS[_name(item)] is not None]
        if x is None and len(tests) < 2:
            x = self._static_temperature(before, s)
        if not tests:
            return self._run_in_turn(x, before, s, run)
        used = tests[0](s)
        for test in tests[1:]:
            used = used | test(s)
        if self._route is not None:
            self._route.ran.append(used.any())
        if len(tests) < 2:
            return self._run_in_turn(x, before, s, run)
        rows = _row_tensors(s)
        names = tuple(rows)

        key = ("filters of few rows", type(self), tuple(_name(item) for item in run), names,
               self.top_k_candidates, x is None)
        if x is None:
            def divided(before, *values):
                on = dataclasses.replace(s, **dict(zip(names, values)))
                return self._run_in_turn(self._static_temperature(before, on), before, on, run)

            def divided_only(before, *values):
                return self._static_temperature(before, dataclasses.replace(s, **dict(zip(names, values))))
            return xla.cond(used.any(), divided, divided_only, [before, *rows.values()], key)

        def every(x, before, *values):
            return self._run_in_turn(x, before, dataclasses.replace(s, **dict(zip(names, values))), run)
        return xla.cond(used.any(), every, _unchanged, [x, before, *rows.values()], key)

    def _run_in_turn(self, x: torch.Tensor, before: torch.Tensor, s: XlaStepState,
                     run: list) -> torch.Tensor:
        """``run``'s stages one after the other, each with its own conditional."""
        for item in run:
            if item == _DYNATEMP_RUN:
                x = self._dynamic_temperature(x, before, s)
            else:
                x = self.stage_method(item)(x, s)
        return x

    def apply_temperature(self, x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """Step 10: ``x / temperature`` per row (greedy rows divide by 1), as in the core; the
        dynamic temperature (``dynatemp_range`` float32 ``[B]``, 0 = static; the core's
        ``dynamic_temperature``, entropy and kept count over the row) runs in a conditional
        only when some row uses it, from the same ``x`` (``run_group`` puts that conditional
        inside the one of the filters after it). Not in place."""
        static = self._static_temperature(x, s)
        return self._dynamic_temperature(static, x, s) if s.any_dynatemp else static

    @staticmethod
    def _static_temperature(x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        t = torch.where(s.greedy, torch.ones_like(s.temperature), s.temperature)
        return x / t[:, None]

    def _dynamic_temperature(self, static: torch.Tensor, x: torch.Tensor,
                             s: XlaStepState) -> torch.Tensor:
        """The dynamic temperature's conditional: rows with ``dynatemp_range`` > 0 from x
        (before step 10), the others' ``static`` (x divided by their temperature)."""
        def dynamic(static, x, temperature, d, exponent, greedy):
            return Sampler.apply_temperature(self, x, _dynatemp_state(temperature, d, exponent, greedy))
        return xla.cond(_dynatemp_rows(s).any(), dynamic, _unchanged,
                        [static, x, s.temperature, s.dynatemp_range, s.dynatemp_exponent, s.greedy],
                        "dynatemp")

    def apply_smoothing(self, x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """Step 10b, quadratic smoothing (the core's ``apply_smoothing``: smoothing_factor,
        smoothing_curve float32 ``[B]``, factor 0 = off), in a conditional that runs only when
        some row uses it. Not in place."""
        def run(x, factor, curve):
            return Sampler.apply_smoothing(self, x, SimpleNamespace(smoothing_factor=factor,
                                                                    smoothing_curve=curve))
        return xla.cond((s.smoothing_factor > 0).any(), run, _unchanged,
                        [x, s.smoothing_factor, s.smoothing_curve], "smoothing")

    def apply_top_a(self, x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """Step 11a (the core's ``apply_top_a``: top_a float32 ``[B]``, 0 = off), in a
        conditional that runs only when some row uses it. Not in place."""
        return xla.cond((s.top_a > 0).any(), _reference(self, "apply_top_a", "top_a"), _unchanged,
                        [x, s.top_a], "top_a")

    def apply_epsilon(self, x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """Step 11b (the core's ``apply_epsilon``: epsilon_cutoff float32 ``[B]``, 0 = off), in
        a conditional that runs only when some row uses it. Not in place."""
        return xla.cond((s.epsilon_cutoff > 0).any(), _reference(self, "apply_epsilon", "epsilon_cutoff"),
                        _unchanged, [x, s.epsilon_cutoff], "epsilon")

    def apply_eta(self, x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """Step 11c (the core's ``apply_eta``: eta_cutoff float32 ``[B]``, 0 = off), in a
        conditional that runs only when some row uses it. Not in place."""
        return xla.cond((s.eta_cutoff > 0).any(), _reference(self, "apply_eta", "eta_cutoff"),
                        _unchanged, [x, s.eta_cutoff], "eta")

    def apply_tfs(self, x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """Step 13c, tail-free (the core's ``apply_tfs``: tfs float32 ``[B]``, 1 = off), in a
        conditional that runs only when some row uses it. The one filter that sorts the
        vocabulary and sums in float64, as the reference does: its second differences need
        every kept probability in order. Not in place."""
        return xla.cond((s.tfs < 1).any(), _reference(self, "apply_tfs", "tfs"), _unchanged,
                        [x, s.tfs], "tfs")

    def apply_p_less(self, x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """Step 13d, p-less (the core's ``apply_p_less``: p_less int32 ``[B]``, 0 = off, 1
        plain, 2 norm), in a conditional that runs only when some row uses it. Not in place."""
        return xla.cond((s.p_less != pipeline.P_LESS_OFF).any(), _reference(self, "apply_p_less", "p_less"),
                        _unchanged, [x, s.p_less], "p_less")

    def apply_mirostat(self, x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """Step 14, mirostat v2 (the core's ``apply_mirostat``: mirostat_tau float32 ``[B]``, 0
        = off; mirostat_mu float32 ``[B]``, the batch's state), in a conditional that runs
        only when some row uses it. Not in place."""
        def run(x, tau, mu):
            return Sampler.apply_mirostat(self, x, SimpleNamespace(mirostat_tau=tau, mirostat_mu=mu))
        return xla.cond((s.mirostat_tau > 0).any(), run, _unchanged,
                        [x, s.mirostat_tau, s.mirostat_mu], "mirostat")

    def apply_adaptive_p(self, x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """Step 14, adaptive-p (the core's ``apply_adaptive_p``: adaptive_p_target float32
        ``[B]``, < 0 = off; adaptive_p_weighted and adaptive_p_total float32 ``[B]``, the
        batch's state), in a conditional that runs only when some row uses it. Not in place."""
        def run(x, target, weighted, total):
            return Sampler.apply_adaptive_p(self, x, SimpleNamespace(
                adaptive_p_target=target, adaptive_p_weighted=weighted, adaptive_p_total=total))
        return xla.cond((s.adaptive_p_target >= 0).any(), run, _unchanged,
                        [x, s.adaptive_p_target, s.adaptive_p_weighted, s.adaptive_p_total],
                        "adaptive_p")

    def run_orders(self, x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """The filter group when the graph traces orders besides the default one
        (``s.filter_orders``, the sampler's ``FilterOrders``): the default order over the
        batch with every other row's filter fields neutral (``_rows_only``), then each traced
        order in one conditional on "some row runs it", which runs the order's filters over
        the batch with the fields of rows outside it neutral (each filter's own conditional
        then runs only when a row of that order uses it) and keeps the result for its rows.
        An order no row runs costs its predicate. x float32 ``[B, V]``; not in place."""
        order = s.filter_order
        out = self.run_group("filter", x, _rows_only(s, order == 0))
        coin = self.row_uniforms(s, noise.STREAM_XTC) < s.xtc_probability
        fields = [getattr(s, name) for name in _FILTER_NEUTRAL]
        for index, names in s.filter_orders:
            rows = order == index

            def run(out, x, rows, greedy, coin, *values, names=names):
                on = SimpleNamespace(greedy=greedy, xtc_coin=coin, **{
                    name: torch.where(rows, value, neutral)
                    for (name, neutral), value in zip(_FILTER_NEUTRAL.items(), values)})
                y = x
                for name in names:
                    y = self._order_stage(name, y, on)
                return torch.where(rows[:, None], y, out)
            out = xla.cond(rows.any(), run, _unchanged, [out, x, rows, s.greedy, coin, *fields],
                           ("filter order", names, self.top_k_candidates))
        return out

    def _order_stage(self, name: str, x: torch.Tensor, s) -> torch.Tensor:
        """The filter ``sampler_order`` calls ``name`` alone, in a conditional on its rows
        (``s``: the filter fields, ``greedy`` and ``xtc_coin``, the step's XTC coin per row):
        top-k and top-p each by themselves (by the candidate set or bisection), min-p,
        typical-p and XTC outside the routes and conditionals they share in the default
        order, temperature only where some row's is not 1. Not in place."""
        if name == "temperature":
            on = ((s.temperature != 1) | (s.dynatemp_range > 0)) & ~s.greedy

            def run(x, temperature, d, exponent, greedy):
                return Sampler.apply_temperature(self, x, _dynatemp_state(temperature, d, exponent, greedy))
            return xla.cond(on.any(), run, _unchanged,
                            [x, s.temperature, s.dynatemp_range, s.dynatemp_exponent, s.greedy],
                            "temperature in an order")
        if name == "min_p":
            return xla.cond((s.min_p > 0).any(), thresholds.min_p_filter, _unchanged,
                            [x, s.min_p], "min_p")
        if name == "top_k":
            candidates = self.top_k_candidates

            def top_k(x, k):
                return xla.cond((k > candidates).any(), thresholds.top_k_by_bisection,
                                lambda x, k: thresholds.top_k_by_candidates(x, k, candidates),
                                [x, k], ("top_k alone", candidates))
            return xla.cond((s.top_k > 0).any(), top_k, _unchanged, [x, s.top_k],
                            ("top_k in an order", candidates))
        if name == "top_p":
            return xla.cond((s.top_p < 1).any(), thresholds.top_p_by_bisection, _unchanged,
                            [x, s.top_p], "top_p alone")
        if name == "typical_p":
            return xla.cond((s.typical_p < 1).any(), filters.typical_p_by_bisection, _unchanged,
                            [x, s.typical_p], "typical_p")
        if name == "xtc":
            coin = s.xtc_coin & (s.xtc_probability > 0)       # the coin outside its rows: off
            return xla.cond(coin.any(), filters.xtc_filter, _unchanged,
                            [x, s.xtc_threshold, coin], "xtc")
        stage, _ = pipeline.named_switch(name)
        return self.stage_method(stage)(x, s)

    def apply_top_n_sigma(self, x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """Step 10a (``filters.top_n_sigma_filter``): top_n_sigma float32 ``[B]``, 0 = off;
        runs only when some row uses it. Not in place."""
        return xla.cond((s.top_n_sigma > 0).any(), filters.top_n_sigma_filter, _unchanged,
                        [x, s.top_n_sigma], "top_n_sigma")

    def apply_min_p(self, x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """Step 11 runs in the route of steps 11-13 (``apply_top_k_top_p``: every route but
        plain applies ``thresholds.min_p_filter``, or the candidate path its equivalent), so
        a batch without min-p pays neither a pass nor a conditional for it: ``x`` as it is.
        While the stage table puts a stage between min-p and top-k (``MIN_P_IN_ROUTE``
        False), min-p runs here, in a conditional of its own, and the route without it."""
        if MIN_P_IN_ROUTE:
            return x
        return xla.cond((s.min_p > 0).any(), thresholds.min_p_filter, _unchanged,
                        [x, s.min_p], "min_p")

    def apply_top_k_top_p(self, x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """Steps 11-13 without a sort, by the step's route (``ROUTES``, one branch of an
        ``xla.switch``): none (plain), min-p alone, from the candidate set alone (steps 11-13
        together), or min-p, then top-k from the candidates and top-p by bisection (nucleus),
        or top-k and top-p both by bisection (exhaustive) (``thresholds``). min_p float32
        ``[B]`` (0 = off), top_k int32 ``[B]`` (0 = off), top_p float32 ``[B]`` (1 = off),
        route int32 ``[B]`` (the batch's, in every row). Not in place."""
        candidates = self.top_k_candidates
        K = min(candidates, x.shape[-1])

        def no_ids(x):
            return (x, torch.zeros((x.shape[0], K), dtype=torch.int64, device=x.device),
                    torch.zeros((x.shape[0], 3), dtype=torch.float32, device=x.device))

        def from_candidates(x, top_k, top_p, min_p):
            return thresholds.top_k_top_p_with_ids(x, top_k, top_p, min_p, candidates)

        def plain(x, top_k, top_p, min_p):
            return no_ids(x)

        def min_p_only(x, top_k, top_p, min_p):
            return no_ids(thresholds.min_p_filter(x, min_p))

        def nucleus(x, top_k, top_p, min_p):
            x = thresholds.top_k_by_candidates(thresholds.min_p_filter(x, min_p), top_k, candidates)
            return no_ids(thresholds.top_p_by_bisection(x, top_p))

        def exhaustive(x, top_k, top_p, min_p):
            x = thresholds.top_k_by_bisection(thresholds.min_p_filter(x, min_p), top_k)
            return no_ids(thresholds.top_p_by_bisection(x, top_p))

        def top_p_only(x, top_k, top_p, min_p):
            return no_ids(thresholds.top_p_by_bisection(x, top_p))

        routes = {"plain": plain, "min_p": min_p_only, "candidates": from_candidates,
                  "nucleus": nucleus, "exhaustive": exhaustive, "top_p": top_p_only}
        min_p = s.min_p if MIN_P_IN_ROUTE else torch.zeros_like(s.min_p)    # 0 = off
        x, ids, edges = xla.switch(s.route[0], [routes[name] for name in ROUTES],
                                   [x, s.top_k, s.top_p, min_p], ("top_k_top_p", candidates, "ids"))
        if self._route is not None:
            self._route.candidates.append((ids, edges))
        return x

    def apply_typical_p(self, x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """Step 13a runs in step 13b's conditional (``apply_xtc``), nothing running between
        them: a batch that uses neither takes one conditional for both. ``x`` as it is.
        While the stage table puts a stage between them (``TYPICAL_P_IN_XTC`` False), 13a
        runs here, in a conditional of its own, and 13b's without it."""
        if TYPICAL_P_IN_XTC:
            return x
        return xla.cond((s.typical_p < 1).any(), filters.typical_p_by_bisection, _unchanged,
                        [x, s.typical_p], "typical_p")

    def apply_xtc(self, x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """Steps 13a and 13b in one conditional that runs when some row uses typical-p or
        some row's XTC coin came up, each inside it in its own: 13a by bisection over the
        scores, no sort (``filters.typical_p_by_bisection``: typical_p float32 ``[B]``, 1 =
        off), then 13b (``filters.xtc_filter``), the coin from the XTC stream of
        ``row_uniforms`` (xtc_probability float32 ``[B]``, 0 = off; xtc_threshold float32
        ``[B]``). Not in place."""
        coin = self.row_uniforms(s, noise.STREAM_XTC) < s.xtc_probability

        def typical_then_xtc(x, typical_p, threshold, coin):
            x = xla.cond((typical_p < 1).any(), filters.typical_p_by_bisection, _unchanged,
                         [x, typical_p], "typical_p")
            return xla.cond(coin.any(), filters.xtc_filter, _unchanged, [x, threshold, coin], "xtc")

        typical_p = s.typical_p if TYPICAL_P_IN_XTC else torch.ones_like(s.typical_p)  # 1 = off
        return xla.cond((typical_p < 1).any() | coin.any(), typical_then_xtc, _unchanged,
                        [x, typical_p, s.xtc_threshold, coin], "typical_p, xtc")
