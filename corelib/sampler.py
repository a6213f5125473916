"""The sampler: a template method fixing the contract's stage order, and the reference stages.

``Sampler`` is the ``reference`` backend: every stage is plain, readable torch and is the
oracle for all other backends. A backend subclasses it and overrides the stages it does
faster; the order of the built-in stages lives in ``corelib.pipeline``'s table, which
``prepare`` and ``filter`` below run group by group (``run_group``), and the order of the parts
of a step in ``sample_state`` and ``verify_state``.

Shapes: ``B`` rows, ``V`` vocabulary. Reference stages never modify their input tensors
(they return new ones), so a backend may call them on any tensor.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .batch import INVALID_TOKEN, SamplingBatch, StepState, padded_ids_problem
from .bitmask import unpack_bitmask
from . import pipeline, thinking
from .drafts import DraftLayout, checked_flat_arguments, tensor_argument
from .noise import (
    STREAM_ACCEPT,
    STREAM_BLOCK,
    STREAM_XTC,
    gumbel_from_uniform,
    row_keys,
    seeded_gumbel,
    stream_uniform,
)
from .stages import StageInputs, StageSpec, run_stage
from .transfer import upload

NEG_INF = float("-inf")
#: ``verify``'s rules for rows with draft probabilities: the token-by-token ratio test, or
#: block verification (the contract's "Block verification").
VERIFY_METHODS = ("token", "block")
#: Logprobs modes whose values come from step 1 (the model's logits as given).
RAW_MODES = ("raw", "raw_logits")


@dataclass
class Logprobs:
    """Step 15's result. Column 0 is the sampled token, columns 1..N the top-N, best first."""

    token_ids: torch.Tensor  # int64 [B, N + 1]
    logprobs: torch.Tensor   # float32 [B, N + 1]
    ranks: torch.Tensor      # int64 [B]: tokens whose logprob >= the sampled token's


@dataclass
class SamplerOutput:
    """What ``Sampler.sample`` returns.

    ``valid[row]`` is False for a row whose logits held NaN or +inf, or whose every token was
    masked by steps 3-5, or whose drawn token's logit was not finite because float32 overflowed
    in steps 6-13b (finite logits near 3e38, a subnormal temperature); such a row's token id is
    -1, which ``batch.append`` takes as "no token this step" (the row's state stays as it was).
    """

    token_ids: torch.Tensor            # int64 [B]
    valid: torch.Tensor                # bool [B]
    logprobs: Optional[Logprobs] = None

    def raise_on_invalid(self, batch: SamplingBatch) -> None:
        """Raise ValueError naming the first flagged row's request (waits on the device)."""
        raise_on_flagged(self.valid, batch, "has no token to sample: its logits are NaN/+inf, "
                         "or every token is masked by allowed_token_ids, token_bitmask, "
                         "bad_words and min_tokens, or float32 overflowed in steps 6-13b")


@dataclass
class VerifyOutput:
    """What ``Sampler.verify`` returns for ``B`` rows and ``K`` draft slots.

    ``token_ids`` int64 ``[B, K + 1]``: each row's emitted tokens first (accepted drafts, then
    the token of the slot where it stopped), -1 after; pass it to ``batch.append`` as it is.
    ``num_emitted`` int64 ``[B]``: 1 to k + 1, 0 for a flagged row. ``valid`` bool ``[B]``:
    False when slot 0 had no token (NaN/+inf logits, every token masked) or the row's drafts
    were unusable (ids out of range on an accelerator, negative or NaN draft probabilities).
    ``logprobs``: ``token_ids`` and ``logprobs`` ``[B, K + 1, N + 1]``, ``ranks`` ``[B, K + 1]``;
    column 0 is the token emitted at that slot (id -1, logprob NaN and rank 0 at slots that
    emitted nothing), columns 1..N the slot's top-N.
    """

    token_ids: torch.Tensor
    num_emitted: torch.Tensor
    valid: torch.Tensor
    logprobs: Optional[Logprobs] = None

    def raise_on_invalid(self, batch: SamplingBatch) -> None:
        """Raise ValueError naming the first flagged row's request (waits on the device)."""
        raise_on_flagged(self.valid, batch, "emitted no token: its first slot's logits are "
                         "NaN/+inf or fully masked, or its drafts are unusable (ids out of "
                         "range, negative or NaN draft probabilities)")


def raise_on_flagged(valid: torch.Tensor, batch: SamplingBatch, why: str) -> None:
    """ValueError ``row R (request 'id', child C) <why>`` for the first False of ``valid``."""
    bad = (~valid).nonzero()
    if bad.numel():
        row = int(bad[0, 0])
        rid, child = batch.rows[row]
        raise ValueError(f"row {row} (request {rid!r}, child {child}) {why}")


@dataclass
class Drafts:
    """``verify``'s draft arguments, checked and on the sampler's device (``B`` rows, ``K``
    slots)."""

    token_ids: torch.Tensor        # int64 [B, K], -1 = no draft (a suffix)
    count: torch.Tensor            # int64 [B]: k, the row's real drafts
    probs: Optional[torch.Tensor]  # float32 [B, K, V] or None
    usable: torch.Tensor           # bool [B]: ids in range, probabilities finite and >= 0
    method: str = "token"          # VERIFY_METHODS: how rows with probs are judged

    @property
    def slots(self) -> int:
        return self.token_ids.shape[1] + 1


def typical_keep(x: torch.Tensor, typical_p: torch.Tensor) -> torch.Tensor:
    """Step 13a's kept set by a full sort: bool [B, V] for logits x float32 [B, V] and
    typical_p float32 [B] (every row filtered, 1 included). Mass summed in float64. Not in
    place."""
    logp = torch.log_softmax(x, dim=-1)
    p = logp.exp()
    entropy = -torch.where(p > 0, p * logp, 0.0).sum(dim=-1, keepdim=True)
    score = torch.where(p > 0, (-logp - entropy).abs(), float("inf"))
    order = torch.argsort(score, dim=-1, stable=True)
    ordered_p = p.gather(1, order).double()
    mass_before = ordered_p.cumsum(dim=-1) - ordered_p
    inside = mass_before < typical_p.double()[:, None]
    last = inside.sum(dim=-1, keepdim=True).clamp(min=1) - 1
    threshold = score.gather(1, order.gather(1, last))
    return score <= threshold


def nucleus_keep(probs: torch.Tensor, ordered: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Step 13's kept set: bool [B, V], True for tokens in the nucleus (ties at its edge kept).

    probs: float32 [B, V] renormalised over what steps 11-12 left; ordered: float32 [B, K], the
    row's K largest probs in descending order (K = V, or any K that holds the whole nucleus);
    top_p: float32 [B] (1 keeps every token). Mass is summed in float64. Not in place.
    """
    ordered64 = ordered.double()
    mass_before = ordered64.cumsum(dim=-1) - ordered64
    # Token j (by rank) is in the nucleus when the mass strictly before it is < top_p.
    in_nucleus = mass_before < top_p.double()[:, None]
    last = in_nucleus.sum(dim=-1, keepdim=True).clamp(min=1) - 1           # (B, 1)
    threshold = ordered.gather(1, last)
    return (probs >= threshold) | (top_p >= 1.0)[:, None]


class Sampler:
    """A sampling backend. This class is the ``reference`` backend; plugins subclass it."""

    name = "reference"
    default_device = "cpu"
    batch_class = SamplingBatch
    #: dtype of block verification's weights and residual masses (``block_verify``); a
    #: backend without fast float64 (XLA on TPU) sets float32
    block_dtype = torch.float64

    def __init__(self, device: torch.device | str | None = None,
                 generator: Optional[torch.Generator] = None):
        self.device = torch.device(device if device is not None else self.default_device)
        self.generator = generator

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, device={str(self.device)!r})"

    # ------------------------------------------------------------------ public API
    def new_batch(self, vocab_size: int, eos_token_id: Optional[int] = None,
                  logprobs_mode: str = "raw") -> SamplingBatch:
        return self.batch_class(vocab_size, self.device, eos_token_id, logprobs_mode)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch,
               token_bitmask: Optional[torch.Tensor] = None) -> SamplerOutput:
        """Sample one token per row. logits: ``[B, V]`` or ``[num_requests, V]``, any float dtype.

        ``token_bitmask``: None, or int32 ``[B, ceil(V / 32)]`` on the host or the sampler's
        device (structured output, part of step 3; ``corelib.bitmask``). The caller's tensors
        are never modified.
        """
        s = self.with_bitmask(self.step_state(logits, batch), batch, token_bitmask)
        if s.num_rows == 0:
            return self.empty_output(s)
        return self.sample_state(logits, batch, s)

    def sample_state(self, logits: torch.Tensor, batch: SamplingBatch, s: StepState) -> SamplerOutput:
        """Steps 1-15 for a given step state: the contract's stage order, in one place
        (``prepare``, ``choose_tokens`` and ``filter`` hold the stages; ``verify_state`` runs
        the same parts at every draft slot).

        Split from ``sample`` so a backend can capture it (CUDA graphs) or trace it (XLA)."""
        x, raw, valid = self.prepare(logits, batch, s)                     # steps 1-8a
        token_ids, final = self.choose_tokens(x, s)                        # steps 9-14
        valid = valid & self.drawn_is_finite(x, final, token_ids, s)
        logprobs = self.step_logprobs(raw, x, final, token_ids, s)         # step 15
        token_ids = torch.where(valid, token_ids, INVALID_TOKEN)
        return SamplerOutput(token_ids, valid, logprobs)

    def verify(self, logits: torch.Tensor, batch: SamplingBatch, draft_token_ids: torch.Tensor,
               draft_probs: Optional[torch.Tensor] = None,
               token_bitmask: Optional[torch.Tensor] = None, method: str = "token",
               num_drafts=None) -> VerifyOutput:
        """Verify speculative drafts (the contract's "Speculative decoding: verification").

        logits: the target model's ``[B, K + 1, V]`` (slot j scores the token after the row's
        tokens plus its first j drafts), any float dtype. draft_token_ids: int64 ``[B, K]``, -1
        padding a row's tail. draft_probs: None, or float32 ``[B, K, V]``, the distributions
        the drafts were drawn from (then random rows use rejection sampling). token_bitmask:
        None, or int32 ``[B, K + 1, ceil(V / 32)]``. method: "token" (each draft by its own
        ratio test) or "block" (rows with draft probabilities are verified as a block,
        ``block_verify``; other rows keep the token rule). With K = 0 this equals ``sample``.

        num_drafts: None, or the flat form (``corelib.drafts``): each row's draft count k
        (ints >= 0, K their largest), with logits ``[sum(k) + B, V]`` (row r's k + 1 slots
        one after the other, rows in order), draft_token_ids ``[sum(k)]`` (a -1 ends its row's
        drafts), draft_probs ``[sum(k), V]``, token_bitmask ``[sum(k) + B, ceil(V / 32)]``.
        The logits are read where they are (``StepState.logits_rows``), never padded.

        Returns a :class:`VerifyOutput`; ``batch.append(out.token_ids)`` records it. Nothing
        waits on the host when the tensors are on an accelerator; the caller's tensors are
        never modified.
        """
        layout = None
        if num_drafts is not None:
            layout = DraftLayout.of(num_drafts, self.device)
            logits, draft_token_ids, draft_probs, token_bitmask = checked_flat_arguments(
                layout, logits, batch, draft_token_ids, draft_probs, token_bitmask)
            token_bitmask = layout.bitmask(token_bitmask)
        drafts = self.check_drafts(logits, batch, draft_token_ids, draft_probs, method, layout)
        B, S, V = drafts.token_ids.shape[0], drafts.slots, logits.shape[-1]
        s = self.with_bitmask(self.speculative_step_state(batch, drafts), batch, token_bitmask, slots=S)
        if B == 0:
            return self.empty_verify_output(s, S)
        if layout is not None and not layout.uniform:
            s.logits_rows = layout.slot_rows.reshape(-1)
            return self.verify_state(logits, batch, s, drafts)
        return self.verify_state(logits.reshape(B * S, V), batch, s, drafts)

    def verify_state(self, logits: torch.Tensor, batch: SamplingBatch, s: StepState,
                     drafts: Drafts) -> VerifyOutput:
        """``verify`` for a given speculative step state (``batch.speculative_state``): steps
        1-14 at every slot through the same template parts as ``sample_state``, then the draft
        judgement, the emitted tokens and step 15 with a slot axis. logits float ``[B (K+1),
        V]``, slot-major per row."""
        x, raw, valid = self.prepare(logits, batch, s)                     # steps 1-8a
        token_ids, final = self.choose_tokens(x, s)                        # steps 9-14
        valid = valid & self.drawn_is_finite(x, final, token_ids, s)
        accepted, tokens = self.judge_drafts(final, token_ids, s, drafts, valid)  # verification
        emitted, num_emitted = self.emit_tokens(tokens, accepted, valid, drafts)
        logprobs = self.step_logprobs(raw, x, final, emitted.flatten(), s)  # step 15
        if logprobs is not None:
            logprobs = slot_logprobs(logprobs, emitted)
        return VerifyOutput(emitted, num_emitted, num_emitted > 0, logprobs)

    def choose_tokens(self, x: torch.Tensor, s: StepState) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 9-14: (int64 [B] token ids, float32 [B, V] final logits) from x float32 [B, V]
        after step 8a; greedy rows take the argmax and keep x as their final logits."""
        greedy_ids = self.argmax(x) if s.any_greedy else None              # step 9
        final, token_ids = x, greedy_ids
        if s.any_random:
            token_ids, final = self.sample_random(x, s)                    # steps 10-14
            if greedy_ids is not None:
                token_ids = torch.where(s.greedy, greedy_ids, token_ids)
        return token_ids, final

    def step_logprobs(self, raw: Optional[torch.Tensor], x: torch.Tensor, final: torch.Tensor,
                      token_ids: torch.Tensor, s: StepState) -> Optional[Logprobs]:
        """Step 15 (None when no row asks): from the raw logprobs of step 1 or from the final
        distribution (``processed_source``)."""
        if s.num_logprobs is None:
            return None
        if s.logprobs_mode in RAW_MODES:
            source = raw
        else:
            source = self.processed_source(x, final, s, normalise=s.logprobs_mode == "processed")
        return self.gather_logprobs(source, token_ids, s.num_logprobs)

    def sample_random(self, x: torch.Tensor, s: StepState) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 10-14 for every row (greedy rows' results are replaced by the caller).

        x: float32 [B, V] after step 8. Returns (int64 [B] drawn ids, float32 [B, V] final
        logits, dropped tokens -inf). A backend whose kernel fuses filtering and drawing
        overrides this; the final logits are read for processed logprobs and overflow checks.
        """
        final = self.filter(x, s)                                          # steps 10-13
        return self.draw(final, s), final                                  # step 14

    def step(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """``sample`` then ``batch.append`` of the sampled tokens."""
        out = self.sample(logits, batch)
        batch.append(out.token_ids)
        return out

    def processed_logits(self, logits: torch.Tensor, batch: SamplingBatch,
                         token_bitmask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """float32 ``[B, V]``: the final distribution's logits (steps 2-13b; greedy rows stop
        after step 8a); dropped tokens are -inf. Its log_softmax is the processed logprobs."""
        s = self.with_bitmask(self.step_state(logits, batch), batch, token_bitmask)
        return self.processed_state(logits, batch, s)

    def processed_state(self, logits: torch.Tensor, batch: SamplingBatch, s: StepState) -> torch.Tensor:
        """``processed_logits`` for a given step state (split from it as ``sample_state`` is
        from ``sample``, so a backend can run it per block of rows)."""
        x, _, _ = self.prepare(logits, batch, s)
        final = self.filter(x, s) if s.any_random else x
        return self.processed_source(x, final, s, normalise=False)

    # ------------------------------------------------------------------ template parts
    def step_state(self, logits: torch.Tensor, batch: SamplingBatch) -> StepState:
        batch.check_logits(logits)
        if batch.device.type != self.device.type:
            raise ValueError(f"batch lives on {batch.device}, but sampler {self.name!r} runs on {self.device}")
        return batch.step_state()

    def speculative_step_state(self, batch: SamplingBatch, drafts: Drafts) -> StepState:
        """The step state of ``verify`` (``batch.speculative_state``: ``B (K+1)`` virtual rows);
        a backend that extends ``step_state`` extends this the same way."""
        return batch.speculative_state(drafts.token_ids)

    def with_bitmask(self, s: StepState, batch: SamplingBatch,
                     token_bitmask: Optional[torch.Tensor], slots: Optional[int] = None) -> StepState:
        """``s`` with the caller's token bitmask checked and on the device (unchanged for None).
        ``slots``: the verification slots per row (the mask is ``[B, slots, W]``)."""
        if token_bitmask is None:
            return s
        mask = batch.check_token_bitmask(token_bitmask, slots)
        return dataclasses.replace(s, token_bitmask=mask, any_bitmask=True)

    def check_drafts(self, logits: torch.Tensor, batch: SamplingBatch,
                     draft_token_ids: torch.Tensor, draft_probs: Optional[torch.Tensor],
                     method: str = "token", layout: Optional[DraftLayout] = None) -> Drafts:
        """``verify``'s argument checks. Shapes, dtypes, K mismatches and an unknown ``method``
        raise ValueError naming the argument; draft ids out of range (or -1 padding that is not
        a suffix) raise when the ids are on the host, and flag the row on an accelerator
        (checking would wait on it); negative or NaN draft probabilities flag the row.
        ``layout``: the flat form's (``verify``'s num_drafts), whose arguments
        ``checked_flat_arguments`` has checked; they are padded here, the logits excepted."""
        if method not in VERIFY_METHODS:
            raise ValueError(f"verify: method must be one of {VERIFY_METHODS}, got {method!r}")
        if self.device.type != batch.device.type:
            raise ValueError(f"batch lives on {batch.device}, but sampler {self.name!r} runs on {self.device}")
        if layout is None:
            B, S, V = verify_logits_shape(logits)
            if B != batch.num_rows:
                raise ValueError(f"verify: logits have {B} rows; the batch has {batch.num_rows} rows "
                                 f"(verify takes one row per batch row, not per request)")
            batch.check_logits(logits[:, 0])
            ids = checked_draft_ids(draft_token_ids, B, S - 1)
            if ids.device.type == "cpu" and B and S > 1:
                _check_draft_ids(ids, V, batch)
        else:
            B, S, V = layout.num_rows, layout.max_drafts + 1, logits.shape[-1]
            ids = layout.draft_token_ids(draft_token_ids)
            draft_probs = layout.draft_probs(draft_probs)
        K = S - 1
        ids = upload(ids, self.device, torch.long)
        present = ids >= 0
        count = torch.cumprod(present.to(torch.int32), dim=1).sum(dim=1).to(torch.long)
        usable = ((ids >= -1) & (ids < V)).all(dim=1) & (present.sum(dim=1) == count)
        probs = None
        if draft_probs is not None:
            # contiguous: kernels that read it (FlashInfer's) take dense [B, K, V] only
            probs = upload(checked_draft_probs(draft_probs, B, K, V), self.device,
                           torch.float32).contiguous()
            real = torch.arange(K, device=self.device)[None, :] < count[:, None]
            sane = self.draft_probs_sane(probs) | ~real
            usable = usable & sane.all(dim=1)
        return Drafts(ids, count, probs, usable, method)

    def draft_probs_sane(self, probs: torch.Tensor) -> torch.Tensor:
        """bool ``[B, K]``: the draft distribution of each slot (float32 ``[B, K, V]``) is free
        of NaN, +-inf and negative values (``check_drafts`` flags the rows where it is not).
        Not in place; a backend may compute it in fewer passes over ``probs``."""
        return (torch.isfinite(probs) & (probs >= 0)).all(dim=-1)

    def prepare(self, logits: torch.Tensor, batch: SamplingBatch, s: StepState):
        """Steps 1-8a and the custom stages after them. Returns (float32 [B, V] logits, raw
        logprobs or None, bool [B] valid rows). Invalid rows are replaced by zeros so they
        cannot poison shared reductions; their results are flagged, not used."""
        x = self.working_copy(logits, batch, s)                            # step 2
        raw = None
        if s.num_logprobs is not None and s.logprobs_mode in RAW_MODES:   # step 1
            raw = self.raw_logprobs(x, s)
        finite = self.finite_rows(x)
        forced = self.thinking_forced_tokens(s) if s.any_thinking else None
        x = self.run_group("mask", x, s)                                   # steps 3-5
        left = self.any_token_left(x)
        if forced is not None:      # step 8b forces its token even where steps 3-5 masked it
            left = left | (forced >= 0)
        valid = finite & left
        x = self.neutralise_rows(x, valid)
        x = self.run_group("adjust", x, s)                                 # steps 6-8a
        if s.stages:
            x = self.apply_custom_stages(x, s, "after_penalties")
        if forced is not None:
            x = self.apply_thinking_budget(x, forced)                      # step 8b
        return x, raw, valid

    def filter(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Steps 10-13b and the custom stages after them, for every row (greedy rows' results
        are ignored by the caller)."""
        x = self.run_group("filter", x, s)                                 # steps 10-13b
        if s.stages:
            x = self.apply_custom_stages(x, s, "after_filters")
        return x

    def run_group(self, group: str, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """The stages of ``group`` (``corelib.pipeline``) in the contract's order, each one some
        row of ``s`` uses, through this backend's method for it. x float32 [B, V]."""
        for stage in pipeline.stages_in(group):
            if stage.enabled(s):
                x = self.stage_method(stage)(x, s)
        return x

    def stage_method(self, stage: pipeline.Stage) -> Callable[[torch.Tensor, StepState], torch.Tensor]:
        """What runs ``stage`` on this backend: its method (``stage.method``). A backend whose
        stages take another form of x than a tensor (the cpu backend's blocks) returns, for a
        stage it does not override, the reference method wrapped to run on a dense view, so a
        new stage runs there the day it joins the table."""
        return getattr(self, stage.method)

    def processed_source(self, x: torch.Tensor, final: torch.Tensor, s: StepState,
                         normalise: bool = True) -> torch.Tensor:
        """The logits of the final distribution: ``final`` for random rows, ``x`` for greedy."""
        chosen = torch.where(s.greedy[:, None], x, final) if s.any_greedy else final
        return self.log_softmax(chosen) if normalise else chosen

    def drawn_is_finite(self, x: torch.Tensor, final: torch.Tensor, token_ids: torch.Tensor,
                        s: StepState) -> torch.Tensor:
        """bool [B]: the drawn id is in [0, V) and its logit is finite in the distribution it
        came from (``x`` [B, V] for greedy rows, ``final`` [B, V] for the others). False where
        float32 overflowed after step 5 (huge finite logits divided by a small temperature or
        a repetition penalty < 1, a subnormal temperature): the stages then see +inf/NaN and
        may drop every token, so the row is flagged instead of returning an arbitrary id.
        O(B): gathers one value per row. Not in place."""
        V = x.shape[-1]
        in_range = (token_ids >= 0) & (token_ids < V)
        safe = token_ids.clamp(0, V - 1)[:, None]
        picked = final.gather(1, safe)
        if s.any_greedy and final is not x:
            picked = torch.where(s.greedy[:, None], x.gather(1, safe), picked)
        return in_range & torch.isfinite(picked[:, 0])

    def judge_drafts(self, final: torch.Tensor, token_ids: torch.Tensor, s: StepState,
                     drafts: Drafts, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Which drafts the target accepts, and the token each slot emits when the row stops
        there. final float32 ``[B S, V]``, token_ids int64 ``[B S]`` (steps 9-14 at every
        slot), valid bool ``[B S]`` (the slot has a token). Returns (bool ``[B, K]`` accepted,
        int64 ``[B, S]`` tokens).

        Greedy rows, and random rows without draft probabilities, accept a draft when it
        equals the slot's token (argmax, or the draw that ``sample`` would make there). Random
        rows with draft probabilities take the ratio test and, at a rejection, the residual
        draw (``rejection_sample``), or with ``method="block"`` are verified as a block
        (``block_verify``)."""
        B, K = drafts.token_ids.shape
        tokens = token_ids.view(B, K + 1)
        accepted = drafts.token_ids == tokens[:, :K]
        if drafts.probs is not None and s.any_random and K:
            if drafts.method == "block":
                passed, recovered = self.block_verify(final, s, drafts, valid)
            else:
                passed, recovered = self.rejection_sample(final, s, drafts)
            random = ~s.greedy.view(B, K + 1)[:, :K]
            accepted = torch.where(random, passed, accepted)
            # Slot k of a row with k < K drafts has no draft: after k acceptances the row emits
            # that slot's own draw, never a residual against padding probabilities.
            real = torch.arange(K, device=tokens.device)[None, :] < drafts.count[:, None]
            recovered = torch.where(random & real, recovered, tokens[:, :K])
            tokens = torch.cat([recovered, tokens[:, K:]], dim=1)
        return accepted, tokens

    def rejection_sample(self, final: torch.Tensor, s: StepState,
                         drafts: Drafts) -> tuple[torch.Tensor, torch.Tensor]:
        """Lossless speculative sampling at the draft slots. final float32 ``[B S, V]`` (the
        target's final logits, p = their softmax), drafts with probs q float32 ``[B, K, V]``.

        Draft d at slot j passes when ``u * q(d) < p(d)`` (probability min(1, p/q); u from
        ``acceptance_uniforms``). The recovered token is drawn from max(p - q, 0) renormalised
        (p itself if that is all zero) with step 14's own noise at the slot, so seeded rows
        stay reproducible. Returns (bool ``[B, K]`` passed, int64 ``[B, K]`` recovered).
        Not in place."""
        B, K = drafts.token_ids.shape
        S, V = K + 1, final.shape[-1]
        p = torch.softmax(final, dim=-1).view(B, S, V)
        q = drafts.probs
        d = drafts.token_ids.clamp(min=0)[..., None]
        u = self.acceptance_uniforms(s).view(B, S)[:, :K]
        passed = u * q.gather(2, d)[..., 0] < p[:, :K].gather(2, d)[..., 0]
        residual = (p[:, :K] - q).clamp(min=0.0)
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p[:, :K])
        residual_logits = torch.cat([residual.log(), final.view(B, S, V)[:, K:]], dim=1)
        recovered = self.draw(residual_logits.view(B * S, V), s).view(B, S)[:, :K]
        return passed, recovered

    def block_verify(self, final: torch.Tensor, s: StepState, drafts: Drafts,
                     valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Block verification (Sun et al., ICLR 2025) at the draft slots. final float32
        ``[B S, V]`` (p_j = softmax of slot j), drafts with probs q float32 ``[B, K, V]``,
        valid bool ``[B S]``. Returns (bool ``[B, K]`` accepted: the first tau drafts; int64
        ``[B, K]`` the token each slot j < k emits when the row stops there).

        With w_0 = 1 and w_i = min(w_(i-1) p_(i-1)(d_i) / q_(i-1)(d_i), 1), the block keeps
        its first i drafts when ``u_i <= h_i``, h_i = R_i / (R_i + 1 - w_i) with
        R_i = sum_x max(w_i p_i(x) - q_i(x), 0) for i < k, and h_k = w_k; tau is the largest
        such i (0 if none; u_i from ``row_uniforms`` on the block stream at slot i - 1). The
        row then emits, at slot tau < k, a draw from max(w_tau p_tau - q_tau, 0) renormalised
        (p_tau itself where that is all zero) with step 14's noise at the slot; at tau = k,
        slot k's own draw. A draft at or after a slot without a token is never kept. Sums
        in ``block_dtype`` (float64 here). Not in place."""
        B, K = drafts.token_ids.shape
        S, V = K + 1, final.shape[-1]
        p = torch.softmax(final, dim=-1).view(B, S, V)
        q = drafts.probs
        d = drafts.token_ids.clamp(min=0)[..., None]
        dtype = self.block_dtype
        tiny = torch.finfo(dtype).tiny
        p_d = p[:, :K].gather(2, d)[..., 0].to(dtype)
        q_d = q.gather(2, d)[..., 0].to(dtype)
        real = torch.arange(K, device=q.device)[None, :] < drafts.count[:, None]
        # the leading run of usable slots, by a running sum (no cumprod: XLA runs it on the host)
        usable = torch.cumsum((~(real & valid.view(B, S)[:, :K])).to(torch.int32), dim=1) == 0
        ratio = torch.where(q_d > 0, p_d / q_d.clamp(min=tiny), torch.where(p_d > 0, float("inf"), 0.0))
        weights = [torch.ones(B, dtype=dtype, device=q.device)]              # w_0 .. w_K
        for j in range(K):
            grown = torch.where(weights[-1] > 0, weights[-1] * ratio[:, j], 0.0).clamp(max=1.0)
            weights.append(torch.where(usable[:, j], grown, 0.0))
        w = torch.stack(weights, dim=1)                                          # (B, S)
        # residual_j = max(w_j p_j - q_j, 0) at the slots j < K (what a stop at slot j draws)
        residual = (w[:, :K, None] * p[:, :K].to(dtype) - q.to(dtype)).clamp(min=0.0)
        mass = residual.sum(dim=-1)                                              # (B, K): R_j
        k_usable = usable.sum(dim=1)                                             # (B,)
        i = torch.arange(1, K + 1, device=q.device)[None, :]                      # prefix sizes
        next_mass = torch.cat([mass[:, 1:], torch.zeros_like(mass[:, :1])], dim=1)   # R_i
        denominator = next_mass + 1.0 - w[:, 1:]
        h = torch.where(denominator > 0, next_mass / denominator.clamp(min=tiny), 1.0)
        h = torch.where(i == k_usable[:, None], w[:, 1:], h)
        u = self.row_uniforms(s, STREAM_BLOCK).view(B, S)[:, :K].to(dtype)
        stands = (u <= h) & usable
        tau = torch.where(stands, i, 0).amax(dim=1)                               # (B,)
        accepted = torch.arange(K, device=q.device)[None, :] < tau[:, None]
        residual = torch.where(mass[..., None] > 0, residual, p[:, :K].to(dtype)).float()
        residual_logits = torch.cat([residual.log(), final.view(B, S, V)[:, K:]], dim=1)
        recovered = self.draw(residual_logits.view(B * S, V), s).view(B, S)[:, :K]
        return accepted, recovered

    def acceptance_uniforms(self, s: StepState) -> torch.Tensor:
        """float32 ``[B]`` uniforms in (0, 1) of the ratio test: seeded rows from the contract's
        noise on the acceptance stream (``corelib.noise.STREAM_ACCEPT`` at the slot's
        position), others from this sampler's generator."""
        return self.row_uniforms(s, STREAM_ACCEPT)

    def row_uniforms(self, s: StepState, stream: int) -> torch.Tensor:
        """float32 ``[B]`` uniforms in (0, 1), one per row: seeded rows from ``stream`` of the
        contract's noise at (seed, child, position), others from this sampler's generator."""
        u = torch.rand(s.num_rows, generator=self.generator, device=s.position.device)
        if s.any_seeded:
            keys = row_keys(s.seed_lo, s.seed_hi, s.child, s.position)
            u = torch.where(s.seeded, stream_uniform(keys, stream), u)
        return u

    def emit_tokens(self, tokens: torch.Tensor, accepted: torch.Tensor, valid: torch.Tensor,
                    drafts: Drafts) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's emitted tokens: its leading accepted drafts, then the token of the slot
        where it stopped, unless that slot has no token (the row then stops before it).
        tokens int64 ``[B, S]``, accepted bool ``[B, K]``, valid bool ``[B S]`` (a token at the
        slot). Returns (int64 ``[B, S]`` emitted, -1 after; int64 ``[B]`` their count, 0 for
        a flagged row)."""
        B, S = tokens.shape
        K = S - 1
        valid = valid.view(B, S)
        real = torch.arange(K, device=tokens.device)[None, :] < drafts.count[:, None]
        ok = (accepted & real & valid[:, :K]).to(torch.int32)
        taken = torch.cumprod(ok, dim=1).sum(dim=1).to(torch.long)              # (B,)
        stops_with_token = valid.gather(1, taken[:, None])[:, 0]
        num_emitted = torch.where(drafts.usable, taken + stops_with_token.to(torch.long), 0)
        last = tokens.gather(1, taken[:, None])                                  # (B, 1)
        padded = torch.cat([drafts.token_ids, torch.full_like(last, INVALID_TOKEN)], dim=1)
        column = torch.arange(S, device=tokens.device)[None, :]
        emitted = torch.where(column < taken[:, None], padded, last)
        emitted = torch.where(column < num_emitted[:, None], emitted, INVALID_TOKEN)
        return emitted, num_emitted

    def empty_verify_output(self, s: StepState, slots: int) -> VerifyOutput:
        out = self.empty_output(s)
        lp = out.logprobs
        if lp is not None:
            lp = Logprobs(lp.token_ids.view(0, slots, -1), lp.logprobs.view(0, slots, -1),
                          lp.ranks.view(0, slots))
        ids = torch.empty((0, slots), dtype=torch.long, device=self.device)
        return VerifyOutput(ids, out.token_ids, out.valid, lp)

    def empty_output(self, s: StepState) -> SamplerOutput:
        ids = torch.empty(0, dtype=torch.long, device=self.device)
        valid = torch.empty(0, dtype=torch.bool, device=self.device)
        logprobs = None
        if s.num_logprobs is not None:
            width = s.num_logprobs + 1
            logprobs = Logprobs(torch.empty((0, width), dtype=torch.long, device=self.device),
                                torch.empty((0, width), dtype=torch.float32, device=self.device),
                                torch.empty(0, dtype=torch.long, device=self.device))
        return SamplerOutput(ids, valid, logprobs)

    # ------------------------------------------------------------------ stages
    def working_copy(self, logits: torch.Tensor, batch: SamplingBatch, s: StepState) -> torch.Tensor:
        """Step 2: a float32 ``[B, V]`` copy; one logits row per request is expanded to its
        children, and ``verify``'s flat logits to its slots (``s.logits_rows``). Never
        aliases ``logits``."""
        if s.logits_rows is not None:
            return logits.index_select(0, s.logits_rows).to(torch.float32)
        if logits.shape[0] != s.num_rows:
            return logits.index_select(0, batch.request_index(s.num_rows)).to(torch.float32)
        return logits.to(torch.float32, copy=True)

    def raw_logprobs(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 1 (rows asking for logprobs in a raw mode): float32 ``[B, V]`` from the working
        logits before any stage, ``log_softmax`` for ``"raw"``, a copy for ``"raw_logits"``;
        step 15 reads it. Not in place."""
        return self.log_softmax(x) if s.logprobs_mode == "raw" else self.copy_logits(x)

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        """float32 ``[B, V]`` -> float32 ``[B, V]`` log-probabilities; not in place."""
        return torch.log_softmax(x, dim=-1)

    def copy_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Step 1 of ``logprobs_mode="raw_logits"``: float32 ``[B, V]``, a copy of the working
        logits before any stage (later stages may work on ``x`` in place)."""
        return x.clone()

    def finite_rows(self, x: torch.Tensor) -> torch.Tensor:
        """bool ``[B]``: rows free of NaN and +inf (-inf is a legitimate mask)."""
        return ~(torch.isnan(x) | (x == float("inf"))).any(dim=-1)

    def any_token_left(self, x: torch.Tensor) -> torch.Tensor:
        """bool ``[B]``: rows with at least one token not masked to -inf."""
        return (x > NEG_INF).any(dim=-1)

    def neutralise_rows(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Replace invalid rows by zeros (uniform); returns a new tensor."""
        return torch.where(valid[:, None], x, torch.zeros((), dtype=x.dtype, device=x.device))

    def apply_allowed_ids(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 3: tokens outside a row's allowed set -> -inf. ``s.allowed_mask`` bool [B, V]
        (all True for rows without the option). Not in place."""
        return x.masked_fill(~s.allowed_mask, NEG_INF)

    def apply_token_bitmask(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 3, structured output: tokens whose bit is 0 in ``s.token_bitmask`` (int32
        [B, ceil(V / 32)], bit j % 32 of word j // 32; a row of -1 words is unconstrained)
        -> -inf. Not in place (the reference unpacks a bool [B, V] mask)."""
        return x.masked_fill(~unpack_bitmask(s.token_bitmask, x.shape[-1]), NEG_INF)

    def apply_bad_words(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 4: ban each bad word's last token when the row's generated tokens end with the
        rest of the word. ``bad_prefix`` int64 [B, W, P] (right-aligned, -2 matches anything),
        ``recent`` int64 [B, P] (last P generated, -1 before any), ``bad_last`` [B, W],
        ``bad_valid`` bool [B, W] (False for padding words). Not in place."""
        recent = s.recent[:, None, :]                                      # (B, 1, P)
        prefix_matches = ((s.bad_prefix == recent) | (s.bad_prefix == -2)).all(dim=-1)
        banned = prefix_matches & s.bad_valid                              # (B, W)
        return self._add_at(x, s.bad_last, banned)

    def apply_min_tokens(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 5: while ``position < min_tokens``, stop ids and eos -> -inf. ``stop_ids``
        int64 [B, S] with ``stop_valid`` bool [B, S]. Not in place."""
        pending = (s.position < s.min_tokens)[:, None]                     # (B, 1)
        return self._add_at(x, s.stop_ids, s.stop_valid & pending)

    def apply_logit_bias(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 6: ``x[row, bias_ids] += bias_values`` (padding adds 0 to token 0). Not in place."""
        return x.scatter_add(1, s.bias_ids, s.bias_values)

    def apply_penalties(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Steps 7-8 from running counts. ``prompt_mask`` bool [B, V], ``output_counts`` int32
        [B, V]; penalties float32 [B] (1, 0, 0 disable them). Not in place."""
        counts = s.output_counts
        seen = s.prompt_mask | (counts > 0)
        r = s.repetition_penalty[:, None]
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)           # step 7
        occurred = (counts > 0).to(torch.float32)
        return (x - s.frequency_penalty[:, None] * counts.to(torch.float32)
                - s.presence_penalty[:, None] * occurred)                    # step 8

    def thinking_forced_tokens(self, s: StepState) -> torch.Tensor:
        """Step 8b's forced token per row (``corelib.thinking.forced_tokens``): int64 [B], -1
        for rows that are not forced. From ``thinking_markers`` int64 [B, 3, L],
        ``thinking_match`` bool [B, 3, L], ``thinking_count`` and ``thinking_budget`` int32
        [B] (-1 = no budget). Not in place."""
        return thinking.forced_tokens(s.thinking_markers, s.thinking_match, s.thinking_count,
                                      s.thinking_budget)

    def apply_thinking_budget(self, x: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
        """Step 8b: a forced row (``forced`` int64 [B], -1 = not forced) keeps only its forced
        token, with logit 0 (so its processed logprob is 0); every other token -> -inf. Rows
        that are not forced keep ``x`` (float32 [B, V]). Not in place."""
        vocab = torch.arange(x.shape[-1], device=x.device)[None, :]
        only = torch.where(vocab == forced[:, None], 0.0, NEG_INF).to(x.dtype)
        return torch.where((forced >= 0)[:, None], only, x)

    def apply_dry(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 8a, DRY: a token that would extend a repeat of length L >= dry_allowed_length
        gets ``logit -= dry_multiplier * dry_base ** min(L - dry_allowed_length, 30)``.

        From the batch's history (``corelib.history``): ``dry_history`` int64 [B, H],
        ``dry_match`` int32 [B, H] (repeat length before each token), ``dry_length`` and
        ``dry_since_breaker`` int32 [B], ``dry_breakers`` int64 [B, NB]; per-row
        ``dry_multiplier`` (0 = off), ``dry_base``, ``dry_allowed_length``, ``dry_range`` (0 =
        whole history). Costs O(B H): only tokens of the history can be penalised, so the
        penalty is scattered onto them, never computed over the vocabulary. Not in place."""
        tokens, penalty = self.dry_penalties(s)
        # x[t] - (the largest penalty on t): an amin over the history's entries for t.
        return x.scatter_reduce(1, tokens, x.gather(1, tokens) - penalty, reduce="amin")

    @staticmethod
    def dry_penalties(s: StepState) -> tuple[torch.Tensor, torch.Tensor]:
        """DRY's penalty for each history entry: (int64 [B, H] token ids, float32 [B, H]
        penalties, 0 where the entry extends no repeat of allowed length or lies outside the
        row's window). A token's penalty is the largest over its entries. Not in place."""
        history, H = s.dry_history, s.dry_history.shape[1]
        column = torch.arange(H, device=history.device)[None, :]
        length = s.dry_length.to(torch.long)[:, None]
        window = s.dry_range.to(torch.long)[:, None]
        start = torch.where(window > 0, (length - window).clamp(min=0), 0)            # (B, 1)
        in_window = (column >= start) & (column < length)
        breaker = (history[:, :, None] == s.dry_breakers[:, None, :]).any(dim=-1)     # (B, H)
        repeat = torch.minimum(s.dry_match.to(torch.long), column - start)
        repeat = torch.minimum(repeat, s.dry_since_breaker.to(torch.long)[:, None])
        allowed = s.dry_allowed_length.to(torch.long)[:, None]
        penalised = in_window & ~breaker & (repeat >= allowed) & (s.dry_multiplier > 0)[:, None]
        exponent = (repeat - allowed).clamp(min=0, max=30).to(torch.float32)
        penalty = s.dry_multiplier[:, None] * torch.pow(s.dry_base[:, None], exponent)
        return torch.where(in_window, history, 0), torch.where(penalised, penalty, 0.0)

    def apply_custom_stages(self, x: torch.Tensor, s: StepState, slot: str) -> torch.Tensor:
        """The plugins' stages at ``slot`` ("after_penalties" after step 8a, "after_filters"
        after step 13b), in registration order; rows that do not use a stage keep their
        logits. x float32 [B, V]; not in place. A failing stage raises ``StageError``."""
        for spec, inputs, plugin in s.stages_at(slot):
            x = run_stage(spec, self.stage_implementation(spec), x, inputs, plugin)
        return x

    def stage_implementation(self, spec: StageSpec) -> Callable[[torch.Tensor, StageInputs], torch.Tensor]:
        """The function this backend runs for a custom stage: its own faster one when the
        stage's plugin registered one under this backend's name, else the plain-torch one."""
        return spec.implementations.get(self.name, spec.apply)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Step 9: int64 [B], the lowest id among the row's maxima."""
        return torch.argmax(x, dim=-1)

    def apply_temperature(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 10: ``x / temperature`` per row (greedy rows divide by 1). Not in place."""
        t = torch.where(s.greedy, torch.ones_like(s.temperature), s.temperature)
        return x / t[:, None]

    def apply_top_n_sigma(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 10a: over each row's finite logits, drop those below max - n * sigma (sigma their
        population standard deviation). ``top_n_sigma`` float32 [B], 0 = off. Not in place."""
        finite = torch.isfinite(x)
        count = finite.sum(dim=-1, keepdim=True).clamp(min=1).to(torch.float32)
        mean = torch.where(finite, x, 0.0).sum(dim=-1, keepdim=True) / count
        variance = torch.where(finite, (x - mean) ** 2, 0.0).sum(dim=-1, keepdim=True) / count
        threshold = x.amax(dim=-1, keepdim=True) - s.top_n_sigma[:, None] * variance.sqrt()
        keep = (x >= threshold) | (s.top_n_sigma <= 0.0)[:, None]
        return x.masked_fill(~keep, NEG_INF)

    def apply_min_p(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 11: drop tokens with prob < min_p * max prob (min_p 0 keeps all). Not in place."""
        probs = torch.softmax(x, dim=-1)
        threshold = s.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        return x.masked_fill(probs < threshold, NEG_INF)

    def apply_top_k_top_p(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Steps 12-13 by a full sort (the reference; fast backends avoid the sort).

        top_k int32 [B] (0 = off): keep logits >= the k-th largest. top_p float32 [B] (1 = off):
        keep the smallest most-likely set whose mass >= top_p of what is left, ties at the
        boundary kept, never fewer than one token. Not in place."""
        if s.any_top_k:
            x = self.apply_top_k(x, s)
        if s.any_top_p:
            x = self.apply_top_p(x, s)
        return x

    def apply_top_k(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 12 alone; see ``apply_top_k_top_p``."""
        V = x.shape[-1]
        k = s.top_k.to(torch.long).clamp(max=V)
        ordered = torch.sort(x, dim=-1, descending=True).values
        kth = ordered.gather(1, (k - 1).clamp(min=0)[:, None])            # (B, 1)
        keep = (x >= kth) | (k == 0)[:, None]
        return x.masked_fill(~keep, NEG_INF)

    def apply_top_p(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 13 alone; see ``apply_top_k_top_p``. Mass is summed in float64."""
        probs = torch.softmax(x, dim=-1)
        ordered = torch.sort(probs, dim=-1, descending=True).values
        return x.masked_fill(~nucleus_keep(probs, ordered, s.top_p), NEG_INF)

    def apply_typical_p(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 13a: over the probabilities left, H = -sum p log p and score = |-log p - H|;
        keep the smallest set of lowest-score tokens whose mass >= typical_p (ties at the
        boundary kept, never fewer than one token). ``typical_p`` float32 [B], 1 = off. Mass
        summed in float64, by a full sort (the reference). Not in place."""
        keep = typical_keep(x, s.typical_p) | (s.typical_p >= 1.0)[:, None]
        return x.masked_fill(~keep, NEG_INF)

    def apply_xtc(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 13b, XTC: with probability ``xtc_probability`` (float32 [B], 0 = off; the coin
        from ``row_uniforms`` on the XTC stream), when two or more kept tokens have probability
        >= ``xtc_threshold``, drop all of them but those with the smallest such probability.
        Not in place."""
        p = torch.softmax(x, dim=-1)
        above = (x > NEG_INF) & (p >= s.xtc_threshold[:, None])
        smallest = torch.where(above, p, float("inf")).amin(dim=-1, keepdim=True)
        coin = self.row_uniforms(s, STREAM_XTC) < s.xtc_probability
        act = (above.sum(dim=-1) >= 2) & coin
        return x.masked_fill(above & (p > smallest) & act[:, None], NEG_INF)

    def draw(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 14: int64 [B] by the Gumbel-max race ``argmax(x + gumbel)`` over kept tokens
        (x float32 [B, V], dropped tokens -inf). Seeded rows use the contract's noise
        function; others this sampler's generator. Never waits on the host."""
        B, V = x.shape
        noise = torch.zeros_like(x)
        if s.any_unseeded:
            u = torch.rand(x.shape, generator=self.generator, device=x.device)
            noise = gumbel_from_uniform(u)
        if s.any_seeded:
            keys = row_keys(s.seed_lo, s.seed_hi, s.child, s.position)[:, None]
            vocab = torch.arange(V, dtype=torch.int32, device=x.device)[None, :]
            noise = torch.where(s.seeded[:, None], seeded_gumbel(keys, vocab), noise)
        return torch.argmax(x + noise, dim=-1)

    def gather_logprobs(self, logprobs: torch.Tensor, token_ids: torch.Tensor,
                        num_logprobs: int) -> Logprobs:
        """Step 15 from float32 [B, V] log-probabilities and int64 [B] sampled ids."""
        safe = token_ids.clamp(min=0)[:, None]
        sampled = logprobs.gather(1, safe)                                  # (B, 1)
        ranks = (logprobs >= sampled).sum(dim=-1)
        ids, values = [safe], [sampled]
        available = min(num_logprobs, logprobs.shape[-1])
        if available > 0:
            top_values, top_ids = self.top_logprobs(logprobs, available)
            ids.append(top_ids)
            values.append(top_values)
        if available < num_logprobs:  # a vocabulary smaller than N: pad with id -1, -inf
            missing = (logprobs.shape[0], num_logprobs - available)
            ids.append(torch.full(missing, -1, dtype=torch.long, device=logprobs.device))
            values.append(torch.full(missing, NEG_INF, device=logprobs.device))
        return Logprobs(torch.cat(ids, dim=1), torch.cat(values, dim=1), ranks)

    def top_logprobs(self, logprobs: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``n`` (<= V) best entries of float32 [B, V] log-probabilities, best first:
        (float32 [B, n] values, int64 [B, n] ids). Not in place."""
        top = torch.topk(logprobs, n, dim=-1)
        return top.values, top.indices

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _add_at(x: torch.Tensor, ids: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
        """Set ``x[row, ids[row, j]]`` to -inf where ``banned[row, j]``; returns a new tensor."""
        penalty = torch.where(banned, NEG_INF, 0.0).to(x.dtype)
        return x.scatter_add(1, ids, penalty)


def slot_logprobs(logprobs: Logprobs, emitted: torch.Tensor) -> Logprobs:
    """Step 15 of ``verify``: flat ``[B S, ...]`` logprobs given a slot axis; column 0 at
    slots that emitted nothing becomes id -1, logprob NaN, rank 0."""
    B, S = emitted.shape
    width = logprobs.token_ids.shape[-1]
    ids = logprobs.token_ids.view(B, S, width).clone()
    values = logprobs.logprobs.view(B, S, width).clone()
    ranks = logprobs.ranks.view(B, S).clone()
    none = emitted < 0
    ids[..., 0] = torch.where(none, INVALID_TOKEN, ids[..., 0])
    values[..., 0] = torch.where(none, float("nan"), values[..., 0])
    ranks = torch.where(none, 0, ranks)
    return Logprobs(ids, values, ranks)


def verify_logits_shape(logits) -> tuple[int, int, int]:
    """(rows, K + 1, V) of ``verify``'s logits after the checks of their kind and rank (a
    tensor ``[rows, K + 1, V]`` with at least one slot); ``ValueError`` otherwise."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        shape = list(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"verify: logits must be [rows, K + 1, vocab], got {shape}")
    rows, S, V = logits.shape
    if S < 1:
        raise ValueError("verify: logits need at least one slot ([rows, K + 1, vocab] with K >= 0)")
    return rows, S, V


def checked_draft_ids(draft_token_ids, rows: int, K: int) -> torch.Tensor:
    """``verify``'s draft_token_ids argument as a tensor, after the checks of its dtype
    (integer) and shape (``[rows, K]``); ``ValueError`` naming the argument otherwise. The
    ids' range is checked on the host only (``_check_draft_ids``)."""
    ids = tensor_argument("draft_token_ids", draft_token_ids)
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        raise ValueError(f"verify: draft_token_ids must hold integer ids, got dtype {ids.dtype}")
    if ids.dim() != 2 or tuple(ids.shape) != (rows, K):
        raise ValueError(f"verify: draft_token_ids must be [rows, K] = [{rows}, {K}] for logits "
                         f"with K = {K}, got {list(ids.shape)}")
    return ids


def checked_draft_probs(draft_probs, rows: int, K: int, V: int) -> torch.Tensor:
    """``verify``'s draft_probs argument as a tensor, after the checks of its kind and shape
    (float ``[rows, K, V]``); ``ValueError`` naming the argument otherwise. Values are
    checked per slot later (``Sampler.draft_probs_sane``)."""
    probs = tensor_argument("draft_probs", draft_probs)
    if not probs.dtype.is_floating_point:
        raise ValueError(f"verify: draft_probs must be a float tensor, got dtype {probs.dtype}")
    if tuple(probs.shape) != (rows, K, V):
        raise ValueError(f"verify: draft_probs must be [rows, K, vocab] = [{rows}, {K}, {V}], "
                         f"got {list(probs.shape)}")
    return probs


def _check_draft_ids(ids: torch.Tensor, vocab_size: int, batch: SamplingBatch) -> None:
    """Host draft ids: in [0, V), with -1 only as a row's trailing padding."""
    problem = padded_ids_problem(ids, vocab_size)
    if problem is None:
        return
    kind, row, col = problem
    if kind == "range":
        raise ValueError(f"verify: draft_token_ids[{row}, {col}] = {int(ids[row, col])} is out of "
                         f"range for vocab_size={vocab_size} (request {batch.rows[row][0]!r}; "
                         f"-1 pads a row's tail)")
    raise ValueError(f"verify: draft_token_ids row {row} (request {batch.rows[row][0]!r}) has "
                     f"a draft after -1 padding: {ids[row].tolist()}; -1 may only pad the end")
