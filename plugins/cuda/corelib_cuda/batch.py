"""The cuda backend's batch: the core's batch plus host-side bounds for the filter stages.

Sort-free top-k / top-p need a host-side bound on how many candidates a row can keep (the
shape of ``torch.topk``), and FlashInfer's fast top-k path needs the largest top_k. Reading
either from the device tensors would wait on the GPU, so they are computed from the requests'
parameters on the host, once per change of the batch's membership.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from corelib import SamplingBatch


@dataclass(frozen=True)
class FilterBounds:
    """Host facts about the random rows' top-k / top-p, for shapes and kernel choice.

    ``candidates``: the most tokens steps 12-13 can keep in any row before ties
    (``min(top_k, V)``; ``V`` for a row with top-p but no top-k; 0 when no row filters).
    ``max_top_k``: the largest effective top_k (0 when none). ``every_row_top_k``: every random
    row has a top_k (so no row asks for "all tokens" from FlashInfer's top-k-first fast path).
    """

    candidates: int
    max_top_k: int
    every_row_top_k: bool


class CudaBatch(SamplingBatch):
    """``SamplingBatch`` with :meth:`filter_bounds` cached until requests join or leave."""

    _bounds: Optional[FilterBounds] = None

    def filter_bounds(self) -> FilterBounds:
        if self._bounds is None:
            self._bounds = self._compute_bounds()
        return self._bounds

    def _compute_bounds(self) -> FilterBounds:
        V = self.vocab_size
        params = [self.params_of(rid) for rid in self.request_ids]
        random = [p for p in params if not p.is_greedy]
        candidates, max_top_k = 0, 0
        for p in random:
            k = min(p.effective_top_k, V)
            max_top_k = max(max_top_k, k)
            if k > 0:
                candidates = max(candidates, k)
            elif p.top_p < 1.0:
                candidates = V
        every_row_top_k = bool(random) and all(p.effective_top_k > 0 for p in random)
        return FilterBounds(candidates, max_top_k, every_row_top_k)

    def _changed(self) -> None:
        # The core calls this whenever a request joins or leaves (its own caches reset here).
        super()._changed()
        self._bounds = None
