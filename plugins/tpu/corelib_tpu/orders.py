"""The filter orders a ``TpuSampler``'s graphs trace besides the default one.

A request that orders the filter group its own way (``sampler_order``, ``temperature_last``)
runs an order the step graph must hold: its stages are traced in that order, in a conditional
that runs only when some row of the step uses it. So that one graph per bucket serves every
mix of orders, the sampler keeps one list of orders, shared by its batches, and every random
graph traces all of them; a row's ``filter_order`` column is its order's place in that list
(1, 2, ...; 0 the default order). The list only grows: ``warmup(orders=...)`` fills it before
compiling, and a request whose order it does not serve adds its own (the graphs then compile
again, which strict mode refuses after warm-up).

A listed filter that a row leaves off does nothing to it, so one traced order serves every
request whose enabled filters (``SamplingParams.filter_order``) appear in it in the same
relative order.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence, Union

from corelib import pipeline

#: ``warmup(orders=...)``'s name for the order ``temperature_last=True`` runs.
TEMPERATURE_LAST = "temperature_last"
_LAST = ("temperature", "smoothing")


def full_order(order: Union[str, Sequence[str]]) -> tuple[str, ...]:
    """An order as the graphs trace it: a list of distinct ``sampler_order`` names, or
    ``TEMPERATURE_LAST`` (every filter in the default order, temperature then smoothing
    last). Raises ValueError naming ``orders`` on anything else."""
    if order == TEMPERATURE_LAST:
        names = pipeline.order_names()
        return tuple(n for n in names if n not in _LAST) + tuple(n for n in _LAST if n in names)
    if isinstance(order, str) or not isinstance(order, Sequence):
        raise ValueError(f"orders: each order must be a list of filter names or "
                         f"{TEMPERATURE_LAST!r}, got {order!r}")
    known = pipeline.order_names()
    for name in order:
        if name not in known:
            raise ValueError(f"orders: unknown filter name {name!r} in {list(order)!r} "
                             f"(known: {', '.join(known)})")
    if len(set(order)) != len(order):
        raise ValueError(f"orders: {list(order)!r} names a filter twice")
    return tuple(order)


def _serves(traced: tuple[str, ...], wanted: tuple[str, ...]) -> bool:
    """``wanted`` appears in ``traced`` in the same relative order."""
    rest = iter(traced)
    return all(name in rest for name in wanted)


class FilterOrders:
    """The sampler's list of traced orders (module docstring)."""

    def __init__(self, orders: Iterable[Union[str, Sequence[str]]] = ()):
        self._orders: list[tuple[str, ...]] = []
        self.extend(orders)

    def extend(self, orders: Iterable[Union[str, Sequence[str]]]) -> None:
        """Trace ``orders`` too (see ``full_order``); orders already served are skipped."""
        for order in orders:
            order = full_order(order)
            if self.lookup(order) is None:
                self._orders.append(order)

    def lookup(self, wanted: tuple[str, ...]) -> Optional[int]:
        """The ``filter_order`` value (1-based) of the first traced order that serves
        ``wanted`` (the request's enabled filters in its order), None when none does."""
        for k, traced in enumerate(self._orders, start=1):
            if _serves(traced, wanted):
                return k
        return None

    def index(self, wanted: Optional[tuple[str, ...]]) -> int:
        """``filter_order`` for a request's ``SamplingParams.filter_order``: 0 for the
        default order; an order no traced one serves is added."""
        if wanted is None:
            return 0
        k = self.lookup(wanted)
        if k is None:
            self._orders.append(tuple(wanted))
            k = len(self._orders)
        return k

    @property
    def traced(self) -> tuple[tuple[str, ...], ...]:
        return tuple(self._orders)

    def __len__(self) -> int:
        return len(self._orders)
