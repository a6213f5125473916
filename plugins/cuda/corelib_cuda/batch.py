"""The cuda backend's batch: the core's batch plus host-side bounds for the filter stages.

Sort-free top-k / top-p need a host-side bound on how many candidates a row can keep (the
shape of ``torch.topk``), and FlashInfer's fast top-k path needs the largest top_k. Reading
either from the device tensors would wait on the GPU, so they are derived from the core's host
flags (``StepState.max_top_k``, ``any_top_p_without_top_k``, ``all_random_top_k``), which the
core recomputes only when requests join or leave.
"""

from __future__ import annotations

from dataclasses import dataclass

from corelib import SamplingBatch, StepState


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

    @classmethod
    def of(cls, s: StepState) -> "FilterBounds":
        """The bounds of a step state's random rows (host flags only: no device read)."""
        max_top_k = min(s.max_top_k, s.vocab_size)
        candidates = s.vocab_size if s.any_top_p_without_top_k else max_top_k
        return cls(candidates, max_top_k, s.all_random_top_k)


class CudaBatch(SamplingBatch):
    """``SamplingBatch`` whose :meth:`filter_bounds` the cuda sampler uses to avoid sorting."""

    def filter_bounds(self) -> FilterBounds:
        return FilterBounds.of(self.step_state())
