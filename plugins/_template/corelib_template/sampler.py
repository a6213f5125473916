"""The backend's sampler: the reference pipeline with one stage replaced.

Subclass ``corelib.Sampler`` and override the stages your device does better; the stage order
lives in the base class, so an override cannot reorder the contract. Every override must give
the same kept set as the reference (the conformance kit checks it, see tests/).
"""

from __future__ import annotations

import torch

import corelib

NEG_INF = float("-inf")


class TemplateSampler(corelib.Sampler):
    name = "template"
    default_device = "cpu"

    def apply_top_k_top_p(self, x: torch.Tensor, s: corelib.StepState) -> torch.Tensor:
        """Steps 12-13 with one sort instead of the reference's two.

        x: float32 ``[B, V]`` logits after steps 2-11, dropped tokens -inf. ``s.top_k`` int32
        ``[B]`` (0 = off), ``s.top_p`` float32 ``[B]`` (1 = off). Returns a new float32
        ``[B, V]`` tensor with dropped tokens at -inf; ``x`` is not modified.

        Sorting the logits once orders the probabilities too (softmax is monotone), so the
        top-p pass gathers probabilities into that order instead of sorting them again. The
        probabilities are computed in vocabulary order, exactly as the reference computes them,
        so the cumulative sums and the kept sets are bit-identical to the reference's.
        """
        ordered, order = torch.sort(x, dim=-1, descending=True)            # (B, V)
        if s.any_top_k:
            x = self._top_k_from_sorted(x, ordered, s.top_k)
        if s.any_top_p:
            x = self._top_p_in_order(x, order, s.top_p)
        return x

    @staticmethod
    def _top_k_from_sorted(x: torch.Tensor, ordered: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
        """Keep logits >= the k-th largest (ties at the boundary kept); k = 0 keeps all."""
        k = top_k.to(torch.long).clamp(max=x.shape[-1])
        kth = ordered.gather(1, (k - 1).clamp(min=0)[:, None])           # (B, 1)
        keep = (x >= kth) | (k == 0)[:, None]
        return x.masked_fill(~keep, NEG_INF)

    @staticmethod
    def _top_p_in_order(x: torch.Tensor, order: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """Keep the smallest most-likely set with mass >= top_p (ties kept); top_p 1 keeps all.

        ``order``: int64 ``[B, V]`` token ids sorting the logits in descending order. Tokens
        top-k dropped have probability 0 and still sort last, so the order stays valid.
        """
        probs = torch.softmax(x, dim=-1)                                  # (B, V)
        ordered = probs.gather(1, order)                                  # descending
        mass_before = ordered.double().cumsum(dim=-1) - ordered.double()
        in_nucleus = mass_before < top_p.double()[:, None]                # float64 sums: as the reference
        last = in_nucleus.sum(dim=-1, keepdim=True).clamp(min=1) - 1      # (B, 1)
        threshold = ordered.gather(1, last)
        keep = (probs >= threshold) | (top_p >= 1.0)[:, None]
        return x.masked_fill(~keep, NEG_INF)
