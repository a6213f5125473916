"""Steps 12-14 for unseeded rows through FlashInfer's sorting-free sampling kernels.

Imported only when a sampler on a GPU chooses the FlashInfer path. Facts this relies on
(flashinfer/sampling.py, csrc/sampling.cu and include/flashinfer/sampling.cuh, 0.7.4):

- ``top_k_top_p_sampling_from_logits(logits, top_k, top_p, ...)`` with the default
  ``filter_apply_order="top_k_first"`` and no fast path is ``top_k_mask_logits`` (keeps logits
  >= the k-th largest, so ties are kept; ``k >= V`` copies the row, a ``[B, V]`` write), a
  softmax and ``top_p_sampling_from_probs``. That last kernel knows when a row has no token (no
  positive probability: all zero, or NaN after the softmax of a row with +inf logits): it
  writes 0 and ``valid = False``, but only ``top_p_sampling_from_probs(return_valid=True)``
  returns ``valid``; the fused entry point drops it, so such a row would come back as token 0.
  :meth:`FlashInferDraw.draw` therefore calls the three parts itself and returns -1 there.
- With ``top_k_max`` (<= 256, V >= 65536) the fused entry point takes a radix top-k of exactly
  k tokens instead (the ``top_k_first`` fast path). A degenerate row then maps to the row's
  largest logit (+inf), which the core's ``drawn_is_finite`` flags.
- ``sampling_from_logits`` is a Gumbel race (NaN never wins; a row without a finite winner
  gives 0, and a row with +inf gives a +inf token): ``drawn_is_finite`` flags both.
- ``seed`` / ``offset`` given as int64 device tensors make the kernels read them on the device
  (CUDA-graph safe); otherwise FlashInfer reads and advances the generator on the host. The
  kernels use one seed for the whole batch (the row index picks the Philox subsequence), so
  per-row seeds cannot be honoured: seeded rows never come here.
- The wrappers reserve ``rows * 32`` Philox offsets per call for top-p sampling and
  ``rows * V`` for ``sampling_from_logits``; this module advances its offset tensor the same.
- ``chain_speculative_sampling(draft_probs [B, K, V], draft_token_ids [B, K], target_probs
  [B, K + 1, V], maybe_output_accepted_token_num, maybe_output_emitted_draft_token_num, ...,
  seed, offset)`` returns (int32 ``[B, K + 1]`` ids: accepted drafts, then the residual or
  bonus draw, then -1; the accepted count; the emitted draft count, each row's first rejected
  slot ``pos``), the two counts added into the tensors passed in. Draft d at slot j passes when
  ``u * q(d) < p(d)``, the rule of the contract. Its inputs must be contiguous (CHECK_INPUT; the
  core's ``check_drafts`` makes draft_probs so). It reads ``draft_token_ids`` as indices without
  checking them, and it has no notion of a row with fewer than K drafts: ``verify`` below clamps
  the ids and leaves slots past a row's drafts to the caller (the core's ``judge_drafts`` emits
  such a slot's own draw). It reserves ``B * (K + 2)`` Philox offsets per call.
- Every kernel runs on its tensors' device (a device guard in csrc), on that device's current
  stream.

An illegal memory access inside a kernel poisons the process's CUDA context, after which no
fallback can run, so the kernels are first tried in a child process
(:func:`self_test_in_subprocess`), and only then once in this process.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from typing import Optional

import torch
from corelib import StepState
from corelib.sampler import Drafts
from corelib.transfer import upload

from .batch import FilterBounds

#: FlashInfer's top-k-first fast path applies for top_k_max <= 256 and V >= 65536.
FAST_TOP_K_MAX = 256
FAST_MIN_VOCAB = 65536
#: Seconds the child process may take for the self-test: a FlashInfer without precompiled
#: kernels compiles its sampling module with nvcc on first use (minutes on a slow machine).
SELF_TEST_TIMEOUT_S = 900


class FlashInferDraw:
    """Owns FlashInfer's Philox seed and offset as device tensors and calls its kernels.

    ``sampling``: the module whose functions are called (default ``flashinfer.sampling``;
    tests pass a transcription with the same signatures)."""

    def __init__(self, device: torch.device, seed: int, sampling=None):
        if sampling is None:
            from flashinfer import sampling
        self._sampling = sampling
        self.device = device
        self.seed = torch.full((1,), seed, dtype=torch.int64, device=device)
        self.offset = torch.zeros(1, dtype=torch.int64, device=device)

    def draw(self, x: torch.Tensor, s: StepState, bounds: Optional[FilterBounds],
             top_k_first: bool = False) -> torch.Tensor:
        """Steps 12-14: int64 [B], one token per row from x float32 [B, V] (after steps 1-11)
        with the rows' top_k int32 [B] (0 = off) and top_p float32 [B] (1 = off); -1 for a
        row that has no token to draw (the kernel's ``valid`` is False). Rows that are greedy
        or seeded get a token too; the caller replaces it. Never waits on the host.

        Each filter runs only where a row asks for it: no filter, a Gumbel race over x; no
        row with a top_k, the top-p entry point on softmax(x) (no ``[B, V]`` top-k copy);
        else FlashInfer's top-k mask, with V for rows without one; the fast path when asked."""
        B, V = x.shape
        if not (s.any_top_k or s.any_top_p):
            return self.draw_filtered(x)
        if not s.any_top_k:
            return self._top_p_draw(torch.softmax(x, dim=-1), s.top_p)
        top_k = torch.where(s.top_k > 0, s.top_k, V).clamp(max=V)          # V keeps all tokens
        if (top_k_first and bounds is not None and bounds.every_row_top_k
                and 0 < bounds.max_top_k <= FAST_TOP_K_MAX and V >= FAST_MIN_VOCAB):
            ids = self._sampling.top_k_top_p_sampling_from_logits(
                x, top_k, s.top_p, seed=self.seed, offset=self.offset, top_k_max=bounds.max_top_k)
            self._advance(B * 32)
            return ids.long()
        masked = self._sampling.top_k_mask_logits(x, top_k)
        return self._top_p_draw(torch.softmax(masked, dim=-1), s.top_p)

    def draw_filtered(self, final: torch.Tensor) -> torch.Tensor:
        """Step 14 alone: int64 [B] drawn from final logits float32 [B, V] (steps 12-13
        already applied, dropped tokens -inf) by FlashInfer's Gumbel race. Never waits."""
        ids = self._sampling.sampling_from_logits(final, seed=self.seed, offset=self.offset)
        self._advance(final.shape[0] * final.shape[1])
        return ids.long()

    def _top_p_draw(self, probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        ids, valid = self._sampling.top_p_sampling_from_probs(
            probs, top_p, seed=self.seed, offset=self.offset, return_valid=True)
        self._advance(probs.shape[0] * 32)
        return torch.where(valid, ids.long(), -1)

    def verify(self, target_probs: torch.Tensor, drafts: Drafts) -> tuple[torch.Tensor, torch.Tensor]:
        """The ratio test and residual draw for every row, in one kernel: (bool [B, K] passed,
        int64 [B, K] recovered), as ``Sampler.rejection_sample`` returns them. target_probs
        float32 [B, K + 1, V] contiguous; drafts with probs float32 [B, K, V] contiguous (as
        ``check_drafts`` makes them). Never waits on the host.

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
        """Run every kernel this path uses (each sampling entry point and chain verification)
        on a tiny batch, compiling them if FlashInfer JITs, and check the ids they return, so
        that a missing compiler or an unsupported GPU shows up now, not mid-step. Waits for
        the device; raises RuntimeError on a wrong result."""
        V = FAST_MIN_VOCAB if top_k_first else 512
        gen = torch.Generator(device="cpu").manual_seed(0)
        x = upload(torch.randn((2, V), generator=gen), self.device)
        bounds = FilterBounds(candidates=8, max_top_k=8, every_row_top_k=True)
        outputs = [self.draw(x, _TinyState(self.device, top_k=True), bounds, top_k_first),
                   self.draw(x, _TinyState(self.device, top_k=False), bounds),
                   self.draw_filtered(x)]
        K = 2
        probs = torch.softmax(x[:, None, :].expand(2, K + 1, V), dim=-1).contiguous()
        drafts = Drafts(upload([[1, 2], [3, -1]], self.device, torch.long),
                        upload([2, 1], self.device, torch.long), probs[:, :K].contiguous(),
                        torch.ones(2, dtype=torch.bool, device=self.device))
        outputs.append(self.verify(probs, drafts)[1])
        for out in outputs:
            ids = out.cpu()
            if not bool(((ids >= 0) & (ids < V)).all()):
                raise RuntimeError(f"FlashInfer returned out-of-range token ids {ids.tolist()}")


class _TinyState:
    """The few StepState fields ``FlashInferDraw.draw`` reads, for the self-test: both rows
    with top-p; with ``top_k``, row 0 also with a top_k of 8."""

    def __init__(self, device: torch.device, top_k: bool):
        self.any_top_k = top_k
        self.any_top_p = True
        self.top_k = upload([8 if top_k else 0, 0], device, torch.int32)
        self.top_p = upload([0.9, 0.5], device, torch.float32)


@functools.lru_cache(maxsize=None)
def self_test_in_subprocess(device: str, top_k_first: bool = False) -> Optional[str]:
    """Run :meth:`FlashInferDraw.self_test` on ``device`` in a child process (this Python,
    this environment), so that a kernel that crashes or poisons its CUDA context takes only
    the child down. None when it passed, else why not (its exit status and last error line).
    Once per process and device; the child's JIT compilation is cached on disk for this
    process too."""
    code = ("import sys; from corelib_cuda.flashinfer_ops import self_test_main; "
            "sys.exit(self_test_main(sys.argv[1:]))")
    args = [sys.executable, "-c", code, device] + (["top_k_first"] if top_k_first else [])
    try:
        result = subprocess.run(args, capture_output=True, text=True, timeout=SELF_TEST_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"the self-test process did not finish within {SELF_TEST_TIMEOUT_S} s"
    if result.returncode == 0:
        return None
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    status = (f"was killed by signal {-result.returncode}" if result.returncode < 0
              else f"exited with status {result.returncode}")
    return f"the self-test process {status}" + (f": {lines[-1].strip()}" if lines else "")


def self_test_main(argv: list[str]) -> int:
    """The child of :func:`self_test_in_subprocess`: 0 when the kernels ran and returned
    token ids in range, else 1 with the error on stderr."""
    device = torch.device(argv[0])
    try:
        FlashInferDraw(device, seed=0).self_test(top_k_first="top_k_first" in argv[1:])
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0
