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
- step 3's token bitmask is applied in place on the working copy, by a Triton kernel on CUDA
  (``corelib_cuda.bitmask``): no ``[B, V]`` boolean;
- step 8a (DRY) scatters its penalties into the working copy in place (O(B H) besides);
- step 13a (typical-p) finds its threshold among the top-k candidates when every random row
  has a top_k, instead of sorting the vocabulary; so does step 13c (tail-free) for its sorted
  head;
- a request's own order of the filter group runs each named filter with filter bounds that
  hold in that order (``switch_state``); FlashInfer's fused path steps aside for own orders,
  stateful selectors and every filter after steps 12-13 (``flashinfer_draws``);
- verification judges unseeded rows with draft probabilities by FlashInfer's
  ``chain_speculative_sampling`` when that path is active; seeded rows keep the contract's noise;
- kept sets (``return_kept``) are packed from the final logits on the device in three passes
  (``kept_set``); a step where a row asks filters in torch and FlashInfer only draws from that
  result, so the set is the one the token came from;
- ``score`` is the template's, differentiable: the in-place stages take the reference's form
  when the logits require grad;
- every float row sum that feeds a threshold, mask or constant (``row_sum``, the core's hook)
  is a Triton kernel on CUDA whose bits depend on the row alone (``corelib_cuda.row_sum``), so
  ``score`` over ``B T`` rows equals ``B``-row steps bitwise, as the contract asks;
- everything is fixed-shape and branches only on host flags, so a step (and a verify step) can
  be captured in a CUDA graph (see ``corelib_cuda.graph``).

The stage order is the core template's (``corelib.Sampler``); this class only overrides stages.
Shapes: ``B`` rows, ``V`` vocabulary, ``K`` candidates. Stages 3 and 8a work in place on the
working copy that ``prepare`` owns (their docstrings say so); the others return new tensors.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch
from corelib import Sampler, SamplingBatch, StepState, pipeline
from corelib.noise import row_keys
from corelib.sampler import NEG_INF, Drafts, nucleus_keep, tail_free_length

from .batch import CudaBatch, CudaStepState, FilterBounds
from .bitmask import choose_bitmask_path
from .race import choose_race_path
from .row_sum import choose_row_sum_path
from .probe import ENV_FLASHINFER


#: The filter stages after steps 12-13, which FlashInfer's fused kernels would run before.
AFTER_TOP_K_TOP_P = pipeline.stages_in("filter")[
    [stage.name for stage in pipeline.stages_in("filter")].index("top_k_top_p") + 1:]


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
        #: seconds FlashInfer's self-test took ({"subprocess": s, "in_process": s}; empty
        #: off the FlashInfer path): a FlashInfer without precompiled kernels JIT-compiles
        #: them in the first one
        self.flashinfer_setup_s: dict[str, float] = {}
        self.path, self.path_reason = self._choose_path(use_flashinfer)
        #: step 3's implementation on this device, decided (and on CUDA launched once) now
        self.bitmask = choose_bitmask_path(self.device)
        #: step 14's seeded race on this device, decided (and on CUDA launched once) now
        self.race = choose_race_path(self.device)
        #: the stages' row sums on this device, decided (and on CUDA launched once) now
        self.sums = choose_row_sum_path(self.device)

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
        problem = self._start_flashinfer()
        if problem is not None:
            reason = f"torch path active because FlashInfer kernels failed to run: {problem}"
            if use_flashinfer:
                raise RuntimeError(reason)
            return "torch", reason
        return "flashinfer", choice.reason

    def _start_flashinfer(self, sampling=None) -> Optional[str]:
        """Set ``self.flashinfer`` after its self-test passed, first in a child process (a
        kernel that crashes takes only the child down), then here; None, or why not (then
        ``self.flashinfer`` stays None and this process can still run the torch path).
        ``sampling``: the FlashInfer module to call (tests pass a transcription)."""
        from .flashinfer_ops import FlashInferDraw, self_test_in_subprocess
        start = time.perf_counter()
        problem = self_test_in_subprocess(str(self.device), self.top_k_first)
        self.flashinfer_setup_s["subprocess"] = time.perf_counter() - start
        if problem is not None:
            return problem
        start = time.perf_counter()
        try:
            draw = FlashInferDraw(self.device, self._flashinfer_seed(), sampling)
            draw.self_test(self.top_k_first)
        except Exception as exc:  # passed in the child, fails here: report, keep the torch path
            problem = f"{type(exc).__name__}: {exc}"
            if not context_usable(self.device):
                raise RuntimeError(f"the CUDA context of {self.device} is unusable after "
                                   f"FlashInfer's self-test failed in this process ({problem}); "
                                   f"set {ENV_FLASHINFER}=0 to use the torch path") from exc
            return problem
        self.flashinfer_setup_s["in_process"] = time.perf_counter() - start
        self.flashinfer = draw
        return None

    def _flashinfer_seed(self) -> int:
        """FlashInfer's Philox seed, drawn from this sampler's own generator: ``generator``,
        or the default generator of its device (the one its torch path draws from), so it
        follows ``torch.manual_seed`` and leaves every other generator alone. One read on the
        host, when the sampler starts."""
        return int(torch.randint(0, 2**62, (1,), generator=self.generator, device=self.device))

    @property
    def race_path(self) -> str:
        """How step 14 draws seeded rows here: "triton" (one pass), or "torch (why)"."""
        return self.race.description

    @property
    def bitmask_path(self) -> str:
        """How step 3 applies token bitmasks here: "triton", or "torch (why)"."""
        return self.bitmask.description

    @property
    def row_sum_path(self) -> str:
        """How the stages sum rows here (``row_sum``): "triton" (bits that depend on the row
        alone), or "torch (why)"."""
        return self.sums.description

    def row_sum(self, values: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
        """The core's hook (``corelib.Sampler.row_sum``): each row's sum over the last
        dimension of float ``[B, V]`` values, ``[B]`` (``[B, 1]`` with ``keepdim``). On CUDA a
        Triton kernel sums each row in one program in an order fixed by V alone, so a row's
        bits do not depend on how many rows the tensor holds (torch's CUDA sum chooses its
        layout from the row count); elsewhere, or where the kernel failed its first launch,
        torch's sum (``row_sum_path`` says which). Differentiable; no host read."""
        return self.sums.sum(values, keepdim=keepdim)

    # ------------------------------------------------------------------ template
    def step_state(self, logits: torch.Tensor, batch: SamplingBatch) -> StepState:
        return with_bounds(super().step_state(logits, batch), batch)

    def speculative_step_state(self, batch: SamplingBatch, drafts: Drafts,
                               num_rows: Optional[int] = None) -> StepState:
        """The verify step's state (``batch.speculative_state``) with the filter bounds, and
        the final logits marked as needed when the drafts carry probabilities. ``num_rows``:
        a padded row count (the graph runner's buckets; drafts then have that many rows)."""
        if num_rows is None:
            s = super().speculative_step_state(batch, drafts)
        else:
            s = batch.speculative_state(drafts.token_ids, num_rows=num_rows,
                                        dense_by_row=self.dense_by_row())
        s = with_bounds(s, batch)
        return dataclasses.replace(s, final_needed=drafts.probs is not None)

    def flashinfer_draws(self, s: StepState) -> bool:
        """Whether FlashInfer draws this step's unseeded rows. Its kernels fuse steps 12-14, so
        only while top-k and top-p are the last filters every row runs before the draw: no row
        uses a stage the table puts after steps 12-13 (``AFTER_TOP_K_TOP_P``: typical-p,
        tail-free, p-less, XTC, any stage added there) or a custom "after_filters" stage, no
        row orders the filter group its own way (``s.filter_orders``: top-k or top-p may come
        before other filters there) and no row uses a stateful selector (``s.any_selector``:
        the draw takes the selector's reshaped distribution, and the batch advances the state
        from the filtered one). The filters before 12-13 (temperature, dynamic or not,
        top-n-sigma, smoothing, min-p, top-a, epsilon, eta) run in torch before the kernels,
        in the reference's order."""
        return (self.flashinfer is not None and s.any_unseeded
                and not s.any_selector and not s.filter_orders
                and not any(stage.enabled(s) for stage in AFTER_TOP_K_TOP_P)
                and not s.stages_at("after_filters"))

    def sample_random(self, x: torch.Tensor, s: StepState) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 10-14 for every row. x float32 [B, V] (after step 8a). Returns (int64 [B]
        token ids, -1 for a row FlashInfer found nothing to draw in; float32 [B, V] final
        logits).

        The torch path is the template's ``filter`` and this class's ``draw``. When FlashInfer
        draws, steps 12-13 run once, where they are needed:

        - nothing reads the final logits: ``filter`` without steps 12-13, and FlashInfer's
          kernels apply them while drawing; the second value is x after steps 10-11 (the
          drawn token's logit, all ``drawn_is_finite`` reads, is the same there);
        - seeded rows (drawn from them), processed logprobs or a ratio test
          (``final_needed``) read them: the whole ``filter``, and FlashInfer only draws the
          unseeded rows from its result (``draw_filtered``), without filtering again."""
        if not self.flashinfer_draws(s):
            return super().sample_random(x, s)                              # steps 10-14
        if not self.final_logits_read(s):
            unfused = dataclasses.replace(s, any_top_k=False, any_top_p=False)
            before = self.filter(x, unfused)                                # steps 10-11
            return self.flashinfer.draw(before, s, s.bounds, self.top_k_first), before  # 12-14
        final = self.filter(x, s)                                           # steps 10-13
        token_ids = self.flashinfer.draw_filtered(final)                    # step 14
        if s.any_seeded:
            token_ids = torch.where(s.seeded, self.draw_seeded(final, s), token_ids)
        return token_ids, final

    def switch_state(self, s: StepState, stage: pipeline.Stage, switch: pipeline.Switch) -> StepState:
        """The state a named filter of a request's own order runs with (``run_orders``): the
        core's (top-k or top-p alone: the other's fields and flags neutral) with filter bounds
        that hold wherever the order puts the filter. The batch's bounds describe the default
        order, where typical-p and tail-free run after top-k and top-p with it; in another
        order top-p alone may see the whole vocabulary (its threshold by radix select when the
        batch's top_p allow it, else the reference's sort), top-k alone needs its own
        candidates only, and typical-p and tail-free may run before top-k (so they take the
        reference's sort, not the top-k candidates). No device read."""
        out = super().switch_state(s, stage, switch)
        bounds = getattr(s, "bounds", None)
        if bounds is None:
            return out
        if switch.owns == ("top_p",):
            bounds = FilterBounds(s.vocab_size if s.any_top_p else 0, 0, False, bounds.exact_top_p)
        elif switch.owns == ("top_k",):
            bounds = FilterBounds(bounds.max_top_k, bounds.max_top_k, bounds.every_row_top_k,
                                  bounds.exact_top_p)
        else:
            bounds = dataclasses.replace(bounds, every_row_top_k=False)
        return dataclasses.replace(out, bounds=bounds)

    @staticmethod
    def final_logits_read(s: StepState) -> bool:
        """Whether anything reads the final logits beyond the drawn token's: seeded rows'
        draws, processed logprobs, a ratio test (``final_needed``), a kept set
        (``any_kept``). FlashInfer's fused kernels give no kept set, so a step where a row
        asks for one filters in torch and FlashInfer draws from that result: the kept bits
        and the draw then read the same final logits, and the set is exact."""
        processed = s.num_logprobs is not None and s.logprobs_mode == "processed"
        return (s.any_seeded or processed or s.any_kept
                or getattr(s, "final_needed", False))

    # ------------------------------------------------------------------ row checks
    def finite_rows(self, x: torch.Tensor) -> torch.Tensor:
        """bool [B]: rows free of NaN and +inf, from one float64 sum per row instead of three
        elementwise passes: NaN and +inf survive a sum (+inf with -inf gives NaN), -inf with
        finite values gives -inf, and float64 cannot overflow on float32 inputs."""
        total = x.sum(dim=-1, dtype=torch.float64)
        return ~(torch.isnan(total) | (total == float("inf")))

    def draft_probs_sane(self, probs: torch.Tensor) -> torch.Tensor:
        """bool [B, K]: the slot's draft distribution (float32 [B, K, V]) is free of NaN,
        +-inf and negative values, from one pass (``aminmax``) instead of four: NaN propagates
        to both ends, -inf and negative values make the minimum negative, +inf the maximum
        infinite. Not in place."""
        low, high = torch.aminmax(probs, dim=-1)
        return (low >= 0) & (high < float("inf"))

    def any_token_left(self, x: torch.Tensor) -> torch.Tensor:
        """bool [B]: rows with a token above -inf (one reduction; NaN rows are flagged by
        ``finite_rows`` already)."""
        return x.amax(dim=-1) > NEG_INF

    # ------------------------------------------------------------------ steps 3 and 8a
    def apply_token_bitmask(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 3, structured output: tokens whose bit is 0 in ``s.token_bitmask`` (int32
        [B, ceil(V / 32)], bit j % 32 of word j // 32; -1 words disable it) -> -inf. IN PLACE
        on x float32 [B, V] (the working copy ``prepare`` owns); returns x. On CUDA a Triton
        kernel writes only the masked tokens (no [B, V] boolean), launched on x's device; where
        its first launch failed, or off CUDA, ``masked_fill_`` (``self.bitmask_path`` says
        which). Under autograd (``score`` of logits that require grad) the reference's
        ``masked_fill``, not in place."""
        if x.requires_grad:
            return super().apply_token_bitmask(x, s)
        return self.bitmask.apply(x, s.token_bitmask)

    def apply_dry(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 8a, DRY, IN PLACE on x float32 [B, V] (the working copy ``prepare`` owns);
        returns x. The reference's computation (``Sampler.apply_dry``: repeat lengths from the
        batch's history arrays ``dry_history`` int64 [B, H], ``dry_match`` int32 [B, H], O(B H)),
        with the penalties scattered into x itself instead of into a copy, so the vocabulary is
        touched only where a history token lands. ``dry_multiplier`` 0 disables it. Under
        autograd (``score`` of logits that require grad) the reference's stage, not in place:
        an in-place scatter would overwrite what the backward pass of the stages before it
        reads."""
        if x.requires_grad:
            return super().apply_dry(x, s)
        tokens, penalty = self.dry_penalties(s)
        # x[t] - (the largest penalty on t): an amin over the history's entries for t.
        return x.scatter_reduce_(1, tokens, x.gather(1, tokens) - penalty, reduce="amin")

    # ------------------------------------------------------------------ steps 12-13a
    def apply_top_k_top_p(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Steps 12-13 without sorting the vocabulary when the batch's bounds allow it.

        x float32 [B, V] (dropped tokens -inf); ``s.top_k`` int32 [B] (0 = off), ``s.top_p``
        float32 [B] (1 = off). When every random row with top-p has a top_k, ``torch.topk``
        takes the K largest logits, K = the batch's largest top_k; the k-th largest is read
        from them, and top-p sums the same softmax probabilities the reference sums, in the
        same order and precision, so the kept sets are the reference's (every token tied with
        the threshold is kept). A row with top-p but no top-k needs the whole vocabulary: its
        threshold is found by radix select over the probabilities' bits
        (:meth:`top_p_threshold`), exact while every top_p is at most
        ``exact_top_p_limit(V)`` (about 0.9997 at V = 128256); a batch with a larger top_p
        below 1, or without bounds, or float64 logits (``score``'s gradient checks: the radix
        select reads float32 bits), takes the reference's sort. Not in place."""
        V = x.shape[-1]
        bounds = getattr(s, "bounds", None)
        K = V if bounds is None else bounds.candidates
        if K == 0:
            return x
        if K * self.SORT_FRACTION <= V:
            values, ids = torch.topk(x, K, dim=-1)                          # (B, K), descending
            if s.any_top_k:
                x = self.top_k_from_candidates(x, values, s)
            if s.any_top_p:
                x = self.top_p_from_candidates(x, ids, s)
            return x
        if (bounds is None or not bounds.exact_top_p or x.dtype != torch.float32
                or bounds.max_top_k * self.SORT_FRACTION > V):
            return super().apply_top_k_top_p(x, s)
        if s.any_top_k:
            x = self.top_k_from_candidates(x, torch.topk(x, bounds.max_top_k, dim=-1).values, s)
        probs = torch.softmax(x, dim=-1)
        return x.masked_fill(probs < self.top_p_threshold(probs, s.top_p), NEG_INF)

    #: The radix select's digits (shift, bits) over a probability's float32 bits: a
    #: non-negative float's bits, read as int32, order like its value.
    SELECT_DIGITS = ((20, 12), (10, 10), (0, 10))

    def top_p_threshold(self, probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """float32 [B, 1]: step 13's threshold, the smallest kept probability, so that the
        nucleus is ``probs >= threshold``, without a sort. probs float32 [B, V], a softmax;
        top_p float32 [B] in (0, 1] (1: threshold 0, every token).

        The reference keeps a token when the mass of the probabilities strictly above it is
        < top_p; its threshold v* is the smallest such value. Three radix passes find v*'s
        bits: each sums the mass per digit (12, 10, then 10 bits) of the tokens in range, with
        the tokens below and above the range in a bin each (one float64 ``scatter_add``), and
        keeps the lowest digit whose mass strictly above is < top_p. Exact, so the reference's
        set, while v* >= 2**-29 (the batch's top_p <= ``exact_top_p_limit(V)``): every sum
        that decides is of float32 multiples of 2**-52 below 2, exact in float64 in any order,
        as the reference's own cumulative sums are; sums that reach smaller values are only
        compared where they already exceed top_p without them. No host read; fixed shapes.
        Not in place."""
        B = probs.shape[0]
        bits = probs.view(torch.int32).long()       # int64: scatter's index dtype, no copies later
        weights = probs.double()
        limit = top_p.double()[:, None]
        prefix = None
        for shift, width in self.SELECT_DIGITS:
            digits = 1 << width
            mass = torch.zeros((B, digits + 2), dtype=torch.float64, device=probs.device)
            if prefix is None:                      # the top digit: every token in range
                # (clamped: a NaN row's negative bits, flagged invalid anyway, stay in bounds;
                # bin = digit + 1 through the view)
                mass[:, 1:].scatter_add_(1, torch.bitwise_right_shift(bits, shift).clamp_(0, digits), weights)
            else:
                # bin 0: below the range, 1..digits: the digit + 1, digits + 1: above the
                # range (its mass, of values > v*, is part of every digit's mass above)
                high = torch.bitwise_right_shift(bits, shift) if shift else bits
                bins = (high - ((prefix >> shift) - 1)).clamp_(0, digits + 1)
                mass.scatter_add_(1, bins, weights)
            # mass strictly above each bin: the suffix sums shifted by one
            higher = mass.flip(-1).cumsum(-1).flip(-1)
            strictly_above = torch.cat([higher[:, 1:], higher.new_zeros((B, 1))], dim=-1)
            # the lowest digit whose mass above is < top_p (a row whose whole mass is below
            # top_p keeps every token: then digit 0)
            chosen = (digits + 2) - (strictly_above < limit).sum(dim=-1, keepdim=True)
            digit = (chosen - 1).clamp_(0, digits - 1)
            prefix = (digit << shift) if prefix is None else prefix | (digit << shift)
        # rows with top_p 1 keep every token: a threshold of 0
        prefix = torch.where((top_p >= 1.0)[:, None], 0, prefix)
        return prefix.to(torch.int32).view(torch.float32)

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

    def apply_typical_p(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 13a, typical-p: the reference's kept set (``typical_p`` float32 [B], 1 = off;
        H, scores and the final mask computed as the reference computes them, over the whole
        row), with the threshold found among the top-k candidates when every random row has a
        top_k (``bounds.every_row_top_k``) and the batch's largest top_k is small against V:
        then only those candidates are sorted, not the vocabulary. Else the reference's sort.
        x float32 [B, V]; not in place."""
        V = x.shape[-1]
        bounds = getattr(s, "bounds", None)
        if (bounds is None or not bounds.every_row_top_k or bounds.max_top_k == 0
                or bounds.max_top_k * self.SORT_FRACTION > V):
            return super().apply_typical_p(x, s)
        logp = torch.log_softmax(x, dim=-1)
        p = logp.exp()
        entropy = -self.row_sum(torch.where(p > 0, p * logp, 0.0), keepdim=True)
        score = torch.where(p > 0, (-logp - entropy).abs(), float("inf"))
        threshold = self.typical_threshold(x, p, score, s.typical_p, bounds.max_top_k)
        keep = (score <= threshold) | (s.typical_p >= 1.0)[:, None]
        return x.masked_fill(~keep, NEG_INF)

    def apply_tfs(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 13c, tail-free (``tfs`` float32 [B], 1 = off): the reference's kept set, from
        the top-k candidates when every random row has a top_k (``bounds.every_row_top_k``)
        and the batch's largest top_k K is small against V; else the reference's sort. x
        float32 [B, V]; not in place.

        In the default order tail-free runs after top-k, so a row's n kept tokens are its K
        largest logits' tokens but for ties of the K-th, which share its probability: the
        sorted probabilities the reference builds are the candidates' (same softmax, so the
        same values), then that probability again up to n, then zeros. Its second differences
        past the candidates are then exact zeros, so the candidates' K, with the K-th value
        twice more after them, carry every term: the same float64 terms in the same places, the
        running sums over the same prefix, and a cut past the candidates lands on the tie
        value, as the reference's does. In another order tail-free may come before top-k:
        ``switch_state`` clears ``every_row_top_k`` there, so it sorts."""
        V = x.shape[-1]
        bounds = getattr(s, "bounds", None)
        if (bounds is None or not bounds.every_row_top_k or bounds.max_top_k == 0
                or bounds.max_top_k * self.SORT_FRACTION > V):
            return super().apply_tfs(x, s)
        K = bounds.max_top_k
        p = torch.softmax(x, dim=-1)
        head = p.gather(1, torch.topk(x, K, dim=-1).indices)              # (B, K), descending
        last = head[:, -1:]
        q = torch.cat([head, last, last], dim=-1).double()                # (B, K + 2)
        n = (x > NEG_INF).sum(dim=-1, keepdim=True)
        j = tail_free_length(q, n, s.tfs, self.row_sum)     # past K + 2 only inside the K-th's ties
        threshold = q.gather(1, (j - 1).clamp(max=K + 1)).to(p.dtype)
        keep = (p >= threshold) | (n <= 2) | (s.tfs >= 1.0)[:, None]
        return x.masked_fill(~keep, NEG_INF)

    @staticmethod
    def typical_threshold(x: torch.Tensor, p: torch.Tensor, score: torch.Tensor,
                          typical_p: torch.Tensor, K: int) -> torch.Tensor:
        """float32 [B, 1]: the smallest score t with mass(score <= t) >= typical_p, found
        among the K largest logits of x float32 [B, V] (p, score float32 [B, V]).

        Every row's kept tokens are its top-k survivors (k <= K), so the K candidates hold all
        of them except ties of the smallest candidate, which share its logit, probability and
        score: their mass is added as (survivors - candidates kept) * its probability. Mass in
        float64, as in the reference; +inf (keep all) when rounding leaves it below
        typical_p."""
        values, ids = torch.topk(x, K, dim=-1)                             # (B, K), descending
        cand_p, cand_score = p.gather(1, ids), score.gather(1, ids)
        survivors = (x > NEG_INF).sum(dim=-1) - (values > NEG_INF).sum(dim=-1)   # (B,)
        tie_mass = survivors.double() * cand_p[:, -1].double()                   # (B,)
        tie_score = cand_score[:, -1:]                                           # (B, 1)
        order = torch.argsort(cand_score, dim=-1, stable=True)
        ordered_score = cand_score.gather(1, order)
        mass = cand_p.gather(1, order).double().cumsum(dim=-1)
        mass = mass + torch.where(ordered_score >= tie_score, tie_mass[:, None], 0.0)
        reached = mass >= typical_p.double()[:, None]
        first = reached.to(torch.int32).argmax(dim=-1, keepdim=True)             # (B, 1)
        found = reached.any(dim=-1, keepdim=True)
        return torch.where(found, ordered_score.gather(1, first), float("inf"))

    # ------------------------------------------------------------------ verification
    def rejection_sample(self, final: torch.Tensor, s: StepState,
                         drafts: Drafts) -> tuple[torch.Tensor, torch.Tensor]:
        """The ratio test and residual draws at the draft slots (see
        ``Sampler.rejection_sample``): (bool [B, K] passed, int64 [B, K] recovered). final
        float32 [B S, V]; drafts with probs float32 [B, K, V]. Unseeded rows go through
        FlashInfer's ``chain_speculative_sampling`` when that path is active (one fused kernel,
        its own Philox stream); seeded rows, and every row on the torch path, through the
        reference's computation with the contract's noise. Not in place."""
        if self.flashinfer is None or not s.any_unseeded:
            return super().rejection_sample(final, s, drafts)
        B, K = drafts.token_ids.shape
        p = torch.softmax(final, dim=-1).view(B, K + 1, -1)
        passed, recovered = self.flashinfer.verify(p, drafts)
        if s.any_seeded:
            seeded = s.seeded.view(B, K + 1)[:, :K]
            torch_passed, torch_recovered = super().rejection_sample(final, s, drafts)
            passed = torch.where(seeded, torch_passed, passed)
            recovered = torch.where(seeded, torch_recovered, recovered)
        return passed, recovered

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
        computation, so the tokens are the reference's). x float32 [B, V]. On CUDA one Triton
        kernel hashes the noise and races in one read of x (``corelib_cuda.race``; the torch
        expression's ~20 passes over [B, V] elsewhere, ``race_path`` says which)."""
        keys = row_keys(s.seed_lo, s.seed_hi, s.child, s.position)           # (B,)
        return self.race.draw(x, keys)

    def draw_unseeded(self, x: torch.Tensor) -> torch.Tensor:
        """int64 [B]: a Gumbel race with this sampler's generator (no torch.multinomial, which
        would wait on the host). x float32 [B, V], dropped tokens -inf."""
        # -log(E) of an exponential E is standard Gumbel noise: four passes over [B, V]
        # instead of the uniform's six. E == 0 would give a +inf key (NaN on a -inf logit)
        # and let a dropped token win.
        e = torch.empty(x.shape, device=x.device).exponential_(generator=self.generator)
        e = e.clamp_min_(torch.finfo(torch.float32).tiny)
        return torch.argmax(x - e.log_(), dim=-1)


def context_usable(device: torch.device) -> bool:
    """Whether the CUDA context of ``device`` still runs work (an illegal memory access makes
    every later call fail). Waits for the device."""
    try:
        torch.cuda.synchronize(device)
        torch.zeros(1, device=device).add_(1).cpu()
    except Exception:
        return False
    return True


def with_bounds(s: StepState, batch: SamplingBatch) -> StepState:
    """``s`` as a :class:`CudaStepState` carrying the batch's filter bounds (a batch other than
    ``CudaBatch`` gives None, and steps 12-13 then sort)."""
    if isinstance(s, CudaStepState):
        return s
    bounds = FilterBounds.of(s, batch.max_top_p) if isinstance(batch, CudaBatch) else None
    return CudaStepState(**vars(s), bounds=bounds)
