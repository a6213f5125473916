"""The cuda backend's batch: the core's batch plus host-side bounds for the filter stages.

Sort-free top-k / top-p need a host-side bound on how many candidates a row can keep (the
shape of ``torch.topk``), and FlashInfer's fast top-k path needs the largest top_k. Reading
either from the device tensors would wait on the GPU, so they are derived from the core's host
flags (``StepState.max_top_k``, ``any_top_p_without_top_k``, ``all_random_top_k``), which the
core recomputes only when requests join or leave.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from corelib import SamplingBatch, StepState


def exact_top_p_limit(vocab_size: int) -> float:
    """The largest top_p below 1 whose nucleus the radix select finds exactly
    (``CudaSampler.top_p_threshold``): a nucleus of probabilities >= 2**-29 only, whose float64
    sums are exact in any order. Probabilities below 2**-29 hold at most ``V * 2**-29`` of the
    mass, and a float32 softmax's total is within 2**-21 of 1, so a nucleus of mass <= this
    limit never reaches them."""
    return 1.0 - vocab_size * 2.0 ** -29 - 2.0 ** -20


@dataclass(frozen=True)
class FilterBounds:
    """Host facts about the random rows' top-k / top-p, for shapes and kernel choice.

    ``candidates``: the most tokens steps 12-13 can keep in any row before ties
    (``min(top_k, V)``; ``V`` for a row with top-p but no top-k; 0 when no row filters).
    ``max_top_k``: the largest effective top_k (0 when none). ``every_row_top_k``: every random
    row has a top_k (so no row asks for "all tokens" from FlashInfer's top-k-first fast path).
    ``exact_top_p``: every random row's top_p is 1 or at most :func:`exact_top_p_limit`, so
    step 13 can find its threshold by radix select instead of sorting the vocabulary.
    """

    candidates: int
    max_top_k: int
    every_row_top_k: bool
    exact_top_p: bool = False

    @classmethod
    def of(cls, s: StepState, max_top_p: float = 1.0) -> "FilterBounds":
        """The bounds of a step state's random rows (host flags only: no device read);
        ``max_top_p``: the largest top_p below 1 among them (1.0: unknown)."""
        max_top_k = min(s.max_top_k, s.vocab_size)
        candidates = s.vocab_size if s.any_top_p_without_top_k else max_top_k
        return cls(candidates, max_top_k, s.all_random_top_k, max_top_p <= exact_top_p_limit(s.vocab_size))


@dataclass
class CudaStepState(StepState):
    """``StepState`` plus the batch's host-side filter bounds (None: unknown, so sort),
    whether the final logits must be complete even where FlashInfer draws (a verify step with
    draft probabilities reads them for the ratio test), and the graph runner's memo."""

    bounds: Optional[FilterBounds] = None
    final_needed: bool = False
    #: what the graph runner derives from a kept step state (its capture key), shared by the
    #: step states ``CudaBatch.step_state`` copies from one kept state; None elsewhere
    graph_memo: Optional[dict] = field(default=None, compare=False, repr=False)


class CudaBatch(SamplingBatch):
    """``SamplingBatch`` whose step states carry :class:`FilterBounds`, which the cuda sampler
    uses to avoid sorting. The bounds of ``step_state`` are computed once per kept step state
    (the core keeps one until requests join, leave or move), not at every step."""

    #: the largest top_p below 1 among random rows, computed with the core's host flags
    max_top_p: float = 0.0

    def filter_bounds(self) -> FilterBounds:
        return FilterBounds.of(self.step_state(), self.max_top_p)

    def _compute_flags(self) -> dict:
        flags = super()._compute_flags()
        self.max_top_p = max((p.top_p for p in self._row_params if not p.is_greedy and p.top_p < 1.0),
                             default=0.0)
        return flags

    def _new_step_state(self, n: int) -> StepState:
        s = super()._new_step_state(n)
        return CudaStepState(**vars(s), bounds=FilterBounds.of(s, self.max_top_p), graph_memo={})
