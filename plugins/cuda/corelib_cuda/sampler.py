"""The ``cuda`` backend's sampler: the contract's stages without host synchronisation.

Steps 1-11 are the reference's torch stages (each is already free of host reads). What this
class changes:

- steps 12-13 (top-k, top-p) select candidates with ``torch.topk`` instead of sorting the whole
  vocabulary, with a host-side bound on the candidate count (``CudaBatch.filter_bounds``), and
  keep exactly the reference's sets (same softmax, same float64 nucleus sums, ties kept);
- step 14 draws by a Gumbel race (``argmax(x + g)``, never ``torch.multinomial``): seeded rows
  with the contract's noise, so they give the reference's tokens; unseeded rows with this
  sampler's generator, or through FlashInfer's sorting-free kernels when that path is active
  (FlashInfer reads one seed for the whole batch, so it cannot serve seeded rows);
- everything is fixed-shape and branches only on host flags, so a step can be captured in a
  CUDA graph (see ``corelib_cuda.graph``).

Shapes: ``B`` rows, ``V`` vocabulary, ``K`` candidates. Stages return new tensors; none
modifies its input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from corelib import Sampler, SamplingBatch, StepState
from corelib.noise import row_keys, seeded_gumbel
from corelib.sampler import NEG_INF, nucleus_keep

from .batch import CudaBatch, FilterBounds


@dataclass
class CudaStepState(StepState):
    """``StepState`` plus the batch's host-side filter bounds (None: unknown, so sort)."""

    bounds: Optional[FilterBounds] = None


class CudaSampler(Sampler):
    """The ``cuda`` backend. ``CudaSampler("cpu", use_flashinfer=False)`` runs its torch path
    on CPU tensors (the same code the GPU runs, minus FlashInfer).

    ``use_flashinfer``: None = use it when it imports and runs on this GPU (the reason is in
    ``path_reason`` when not); True = require it (raise if it cannot run); False = torch path.
    ``top_k_first``: let FlashInfer use its radix top-k fast path when every random row has a
    top_k <= 256 and V >= 65536. It is faster, but keeps exactly k tokens where the contract
    keeps every token tied with the k-th, so it is off unless asked for.
    """

    name = "cuda"
    default_device = "cuda"
    batch_class = CudaBatch
    #: Steps 12-13 use torch.topk while candidates * SORT_FRACTION <= V, else a full sort.
    SORT_FRACTION = 4

    def __init__(self, device: torch.device | str | None = None,
                 generator: Optional[torch.Generator] = None,
                 use_flashinfer: Optional[bool] = None, top_k_first: bool = False):
        super().__init__(device, generator)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.top_k_first = top_k_first
        self.flashinfer = None
        self.path, self.path_reason = self._choose_path(use_flashinfer)

    def __repr__(self) -> str:
        return f"CudaSampler(device={str(self.device)!r}, path={self.path!r})"

    # ------------------------------------------------------------------ path choice
    def _choose_path(self, use_flashinfer: Optional[bool]) -> tuple[str, str]:
        if use_flashinfer is False:
            return "torch", "torch path active because use_flashinfer=False"
        if self.device.type != "cuda":
            if use_flashinfer:
                raise ValueError(f"use_flashinfer=True needs a CUDA device, got {self.device}")
            return "torch", f"torch path active because the device is {self.device}, not a CUDA GPU"
        from .probe import flashinfer_choice
        choice = flashinfer_choice(torch.cuda.get_device_capability(self.device))
        if not choice.flashinfer:
            if use_flashinfer:
                raise RuntimeError(f"use_flashinfer=True but {choice.reason}")
            return "torch", choice.reason
        from .flashinfer_ops import FlashInferDraw
        try:
            self.flashinfer = FlashInferDraw(self.device, self._flashinfer_seed())
            self.flashinfer.self_test(self.top_k_first)
        except Exception as exc:  # a JIT compile without nvcc, a kernel the GPU cannot run
            self.flashinfer = None
            reason = f"torch path active because FlashInfer kernels failed to run: {type(exc).__name__}: {exc}"
            if use_flashinfer:
                raise RuntimeError(reason) from exc
            return "torch", reason
        return "flashinfer", choice.reason

    def _flashinfer_seed(self) -> int:
        """FlashInfer's Philox seed, from this sampler's generator (or torch's global seed)."""
        if self.generator is not None:
            return self.generator.initial_seed() & (2**63 - 1)
        return int(torch.randint(0, 2**62, (1,)))  # host CPU generator: follows torch.manual_seed

    # ------------------------------------------------------------------ template
    def step_state(self, logits: torch.Tensor, batch: SamplingBatch) -> StepState:
        return with_bounds(super().step_state(logits, batch), batch)

    def sample_random(self, x: torch.Tensor, s: StepState) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 10-14 for every row. x float32 [B, V] (after step 8). Returns (int64 [B]
        token ids, float32 [B, V] final logits). The final logits are fully filtered only when
        something reads them: seeded rows, the torch draw, or processed logprobs; with only
        FlashInfer drawing, steps 12-13 happen inside its kernels and the second value is x
        after steps 10-11."""
        if s.any_temperature:
            x = self.apply_temperature(x, s)                                # step 10
        if s.any_min_p:
            x = self.apply_min_p(x, s)                                      # step 11
        by_flashinfer = self.flashinfer is not None and s.any_unseeded
        needs_final = (not by_flashinfer or s.any_seeded
                       or (s.num_logprobs is not None and s.logprobs_mode == "processed"))
        final = x
        if needs_final and (s.any_top_k or s.any_top_p):
            final = self.apply_top_k_top_p(x, s)                            # steps 12-13
        token_ids = None
        if by_flashinfer:                                                   # steps 12-14
            token_ids = self.flashinfer.draw(x, s, getattr(s, "bounds", None), self.top_k_first)
        elif s.any_unseeded:
            token_ids = self.draw_unseeded(final)                           # step 14
        if s.any_seeded:
            seeded = self.draw_seeded(final, s)                             # step 14
            token_ids = seeded if token_ids is None else torch.where(s.seeded, seeded, token_ids)
        return token_ids, final

    # ------------------------------------------------------------------ row checks
    def finite_rows(self, x: torch.Tensor) -> torch.Tensor:
        """bool [B]: rows free of NaN and +inf, from one float64 sum per row instead of three
        elementwise passes: NaN and +inf survive a sum (+inf with -inf gives NaN), -inf with
        finite values gives -inf, and float64 cannot overflow on float32 inputs."""
        total = x.sum(dim=-1, dtype=torch.float64)
        return ~(torch.isnan(total) | (total == float("inf")))

    def any_token_left(self, x: torch.Tensor) -> torch.Tensor:
        """bool [B]: rows with a token above -inf (one reduction; NaN rows are flagged by
        ``finite_rows`` already)."""
        return x.amax(dim=-1) > NEG_INF

    # ------------------------------------------------------------------ steps 12-13
    def apply_top_k_top_p(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Steps 12-13 without a full sort when the batch bounds the candidates.

        x float32 [B, V] (dropped tokens -inf); ``s.top_k`` int32 [B] (0 = off), ``s.top_p``
        float32 [B] (1 = off). ``torch.topk`` takes the K largest logits, K = the batch's
        largest top_k; the k-th largest is read from them, and top-p sums the same softmax
        probabilities the reference sums, in the same order and precision, so the kept sets
        are the reference's (every token tied with the threshold is kept). A row with top-p
        but no top-k needs the whole vocabulary: then the batch takes the reference's sort.
        Not in place."""
        V = x.shape[-1]
        bounds = getattr(s, "bounds", None)
        K = V if bounds is None else bounds.candidates
        if K == 0:
            return x
        if K * self.SORT_FRACTION > V:
            return super().apply_top_k_top_p(x, s)
        values, ids = torch.topk(x, K, dim=-1)                              # (B, K), descending
        if s.any_top_k:
            x = self.top_k_from_candidates(x, values, s)
        if s.any_top_p:
            x = self.top_p_from_candidates(x, ids, s)
        return x

    def top_k_from_candidates(self, x: torch.Tensor, values: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 12 given ``values`` float32 [B, K], each row's K largest logits, descending:
        keep logits >= the k-th largest (top_k 0 keeps all). Not in place."""
        K = values.shape[-1]
        k = s.top_k.to(torch.long).clamp(max=K)       # greedy rows may ask for more; unused
        kth = values.gather(1, (k - 1).clamp(min=0)[:, None])               # (B, 1)
        keep = (x >= kth) | (k == 0)[:, None]
        return x.masked_fill(~keep, NEG_INF)

    def top_p_from_candidates(self, x: torch.Tensor, ids: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 13 given ``ids`` int64 [B, K], the K most likely tokens in descending order,
        a superset of every row's top-k survivors (ties aside: a tie with the last candidate
        has its probability, which is all the threshold needs). Mass summed in float64, as in
        the reference. Not in place."""
        probs = torch.softmax(x, dim=-1)
        ordered = probs.gather(1, ids)                                      # (B, K)
        return x.masked_fill(~nucleus_keep(probs, ordered, s.top_p), NEG_INF)

    # ------------------------------------------------------------------ step 14
    def draw(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 14 in torch for every row: int64 [B] from final logits x float32 [B, V]."""
        token_ids = self.draw_unseeded(x) if s.any_unseeded else None
        if s.any_seeded:
            seeded = self.draw_seeded(x, s)
            token_ids = seeded if token_ids is None else torch.where(s.seeded, seeded, token_ids)
        return token_ids

    def draw_seeded(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """int64 [B]: ``argmax(x + contract noise)`` over the whole vocabulary (the reference's
        exact computation, so the tokens are the reference's). x float32 [B, V]."""
        V = x.shape[-1]
        keys = row_keys(s.seed_lo, s.seed_hi, s.child, s.position)[:, None]  # (B, 1)
        vocab = torch.arange(V, dtype=torch.int32, device=x.device)[None, :]
        return torch.argmax(x + seeded_gumbel(keys, vocab), dim=-1)

    def draw_unseeded(self, x: torch.Tensor) -> torch.Tensor:
        """int64 [B]: a Gumbel race with this sampler's generator (no torch.multinomial, which
        would wait on the host). x float32 [B, V], dropped tokens -inf."""
        u = torch.rand(x.shape, generator=self.generator, device=x.device)
        # u == 0 would give a -inf key and could lose even a row's only kept token.
        u = u.clamp_min_(torch.finfo(torch.float32).tiny)
        return torch.argmax(x - torch.log(-torch.log(u)), dim=-1)


def with_bounds(s: StepState, batch: SamplingBatch) -> StepState:
    """``s`` as a :class:`CudaStepState` carrying the batch's filter bounds (a batch other than
    ``CudaBatch`` gives None, and steps 12-13 then sort)."""
    if isinstance(s, CudaStepState):
        return s
    bounds = FilterBounds.of(s) if isinstance(batch, CudaBatch) else None
    return CudaStepState(**vars(s), bounds=bounds)
