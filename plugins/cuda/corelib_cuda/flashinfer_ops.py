"""Steps 12-14 for unseeded rows through FlashInfer's sorting-free sampling kernels.

Imported only when a sampler on a GPU chooses the FlashInfer path. Facts this relies on
(flashinfer/sampling.py, 0.7.4):

- ``top_k_top_p_sampling_from_logits(logits, top_k, top_p, ...)`` takes per-row ``top_k`` /
  ``top_p`` tensors; with ``filter_apply_order="top_k_first"`` and no ``top_k_max`` it masks
  with ``top_k_mask_logits`` (keeps logits >= the k-th largest, so ties are kept; ``k >= V``
  keeps every token), then softmax and top-p rejection sampling. With ``top_k_max`` (<= 256,
  V >= 65536) it takes a radix top-k of exactly k tokens instead.
- ``seed`` / ``offset`` given as int64 device tensors make the kernels read them on the device
  (CUDA-graph safe); otherwise FlashInfer reads and advances the generator on the host. The
  kernels use one seed for the whole batch (the row index picks the Philox subsequence), so
  per-row seeds cannot be honoured: seeded rows never come here.
- The wrappers reserve ``rows * 32`` Philox offsets per call for top-k/top-p sampling and
  ``rows * V`` for ``sampling_from_logits``; this module advances its offset tensor the same.
- ``chain_speculative_sampling(draft_probs [B, K, V], draft_token_ids [B, K], target_probs
  [B, K + 1, V], maybe_output_accepted_token_num, maybe_output_emitted_draft_token_num, ...,
  seed, offset)`` returns (int32 ``[B, K + 1]`` ids: accepted drafts, then the residual or
  bonus draw, then -1; the accepted count; the emitted draft count, each row's first rejected
  slot ``pos``), the two counts added into the tensors passed in. Draft d at slot j passes when ``u * q(d) < p(d)``, the rule of the
  contract; one seed for the batch (the row picks the Philox subsequence), so seeded rows
  never come here. It reads ``draft_token_ids`` as indices without checking them, and it has no
  notion of a row with fewer than K drafts: ``verify`` below clamps the ids and leaves slots
  past a row's drafts to the caller (the core's ``judge_drafts`` emits such a slot's own draw).
  It reserves ``B * (K + 2)`` Philox offsets per call.
"""

from __future__ import annotations

from typing import Optional

import torch
from corelib import StepState
from corelib.sampler import Drafts

from .batch import FilterBounds

#: FlashInfer's top-k-first fast path applies for top_k_max <= 256 and V >= 65536.
FAST_TOP_K_MAX = 256
FAST_MIN_VOCAB = 65536


class FlashInferDraw:
    """Owns FlashInfer's Philox seed and offset as device tensors and calls its kernels."""

    def __init__(self, device: torch.device, seed: int):
        from flashinfer import sampling
        self._sampling = sampling
        self.device = device
        self.seed = torch.full((1,), seed, dtype=torch.int64, device=device)
        self.offset = torch.zeros(1, dtype=torch.int64, device=device)

    def draw(self, x: torch.Tensor, s: StepState, bounds: Optional[FilterBounds],
             top_k_first: bool = False) -> torch.Tensor:
        """int64 [B]: one token per row from x float32 [B, V] (after steps 1-11) with the
        rows' top_k int32 [B] (0 = off) and top_p float32 [B] (1 = off). Rows that are greedy
        or seeded get a token too; the caller replaces it. Never waits on the host."""
        B, V = x.shape
        if not (s.any_top_k or s.any_top_p):
            ids = self._sampling.sampling_from_logits(x, seed=self.seed, offset=self.offset)
            self._advance(B * V)
            return ids.long()
        top_k = torch.where(s.top_k > 0, s.top_k, V).clamp(max=V)          # V keeps all tokens
        top_k_max = None
        if (top_k_first and bounds is not None and bounds.every_row_top_k
                and 0 < bounds.max_top_k <= FAST_TOP_K_MAX and V >= FAST_MIN_VOCAB):
            top_k_max = bounds.max_top_k
        ids = self._sampling.top_k_top_p_sampling_from_logits(
            x, top_k, s.top_p, seed=self.seed, offset=self.offset, top_k_max=top_k_max)
        self._advance(B * 32)
        return ids.long()

    def verify(self, target_probs: torch.Tensor, drafts: Drafts) -> tuple[torch.Tensor, torch.Tensor]:
        """The ratio test and residual draw for every row, in one kernel: (bool [B, K] passed,
        int64 [B, K] recovered), as ``Sampler.rejection_sample`` returns them. target_probs
        float32 [B, K + 1, V]; drafts with probs float32 [B, K, V]. Never waits on the host.

        ``passed[:, j]`` is ``j < pos`` (the kernel stops at its first rejection ``pos``, so
        later slots are never reached); ``recovered[:, pos]`` is its residual draw. A residual
        that is zero everywhere (p == q) makes the kernel return -1; then the draft itself,
        which was drawn from q = p, is the right token."""
        B, K = drafts.token_ids.shape
        V = target_probs.shape[-1]
        ids = drafts.token_ids
        safe = torch.where((ids >= 0) & (ids < V), ids, 0).to(torch.int32)
        emitted = torch.zeros(B, dtype=torch.int32, device=ids.device)
        accepted = torch.zeros(B, dtype=torch.int32, device=ids.device)
        out, _, emitted = self._sampling.chain_speculative_sampling(
            drafts.probs, safe, target_probs, accepted, emitted,
            seed=self.seed, offset=self.offset)
        self._advance(B * (K + 2))
        out = out[:, :K].long()
        slot = torch.arange(K, device=ids.device)[None, :]
        passed = slot < emitted.long()[:, None]
        recovered = torch.where(out >= 0, out, safe.long())
        return passed, recovered

    def _advance(self, used: int) -> None:
        # In place, on the device: the next call (or graph replay) draws fresh numbers.
        self.offset.add_((used + 3) // 4 * 4)

    def self_test(self, top_k_first: bool = False) -> None:
        """Run the kernels this path uses (sampling and chain verification) on a tiny batch,
        compiling them if FlashInfer JITs, so that a missing compiler or an unsupported GPU
        shows up now, not mid-step."""
        V = FAST_MIN_VOCAB if top_k_first else 512
        gen = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn((2, V), generator=gen).to(self.device)
        s = _TinyState(self.device)
        bounds = FilterBounds(candidates=8, max_top_k=8, every_row_top_k=True)
        ids = self.draw(x, s, bounds, top_k_first)
        plain = self._sampling.sampling_from_logits(x, seed=self.seed, offset=self.offset)
        self._advance(2 * V)
        K = 2
        probs = torch.softmax(x[:, None, :].expand(2, K + 1, V), dim=-1).contiguous()
        drafts = Drafts(torch.tensor([[1, 2], [3, -1]], device=self.device),
                        torch.tensor([2, 1], device=self.device), probs[:, :K].contiguous(),
                        torch.ones(2, dtype=torch.bool, device=self.device))
        _, recovered = self.verify(probs, drafts)
        torch.cuda.synchronize(self.device)
        for out in (ids, plain, recovered):
            if not bool(((out >= 0) & (out < V)).all()):
                raise RuntimeError(f"FlashInfer returned out-of-range token ids {out.tolist()}")


class _TinyState:
    """The few StepState fields ``FlashInferDraw.draw`` reads, for the self-test."""

    any_top_k = True
    any_top_p = True

    def __init__(self, device: torch.device):
        self.top_k = torch.tensor([8, 3], dtype=torch.int32, device=device)
        self.top_p = torch.tensor([0.9, 1.0], dtype=torch.float32, device=device)
