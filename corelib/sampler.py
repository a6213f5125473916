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
import math
from typing import Callable, Optional

import torch

from .batch import INVALID_TOKEN, SamplingBatch, StepState
from .bitmask import bitmask_width, pack_kept, unpack_bitmask
from . import catalog, pipeline, selectors, thinking
from .noise import STREAM_XTC, gumbel_from_uniform, row_keys, seeded_gumbel, stream_uniform
# outputs and verification are their own modules; their names stay importable from here
from .outputs import Logprobs, SamplerOutput, VerifyOutput, raise_on_flagged, slot_logprobs  # noqa: F401
from .scoring import Scoring
from .stages import StageInputs, StageSpec, run_stage
from .verification import (  # noqa: F401
    VERIFY_METHODS,
    Drafts,
    Verification,
    checked_draft_ids,
    checked_draft_probs,
    verify_logits_shape,
)

NEG_INF = float("-inf")
#: Logprobs modes whose values come from step 1 (the model's logits as given).
RAW_MODES = ("raw", "raw_logits")


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


def dynamic_divisor(entropy: torch.Tensor, kept: torch.Tensor, t: torch.Tensor,
                    s: StepState) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 10's dynamic temperature from each row's entropy (float32 [B], nats) and kept-token
    count (int [B]): (float32 [B] divisor: T' on dynamic rows with more than one kept token, 1
    on dynamic rows with one, ``t`` elsewhere; bool [B]: T' = 0, the argmax tokens alone stay).
    ``t`` float32 [B], the static temperatures (greedy rows 1). Not in place."""
    ratio = (entropy / kept.clamp(min=2).to(torch.float32).log()).clamp(min=0.0)
    d = s.dynatemp_range
    lo = (t - d).clamp(min=0.0)
    dynamic = lo + (t + d - lo) * ratio.pow(s.dynatemp_exponent)
    on = (d > 0) & ~s.greedy
    t = torch.where(on, torch.where(kept > 1, dynamic, 1.0), t)
    argmax_only = on & (kept > 1) & (dynamic == 0)
    return torch.where(argmax_only, 1.0, t), argmax_only


def tail_free_length(q: torch.Tensor, n: torch.Tensor, tfs: torch.Tensor) -> torch.Tensor:
    """Step 13c's kept length j (int64 [B, 1], >= 1): for each row's probabilities sorted in
    descending order, float64 ``q`` [B, M] (its first n kept, M >= 3 or the row's n <= M),
    the smallest j whose normalised second differences sum past ``tfs`` (float32 [B]), n - 2
    when none does. ``n`` int [B, 1] kept tokens (rows with n <= 2 keep everything: the
    caller's test). Not in place."""
    second = (q[:, :-2] - 2.0 * q[:, 1:-1] + q[:, 2:]).abs()
    inside = torch.arange(second.shape[-1], device=q.device)[None, :] < n - 2
    second = torch.where(inside, second, 0.0)
    total = second.sum(dim=-1, keepdim=True)
    weights = torch.where(total > 1e-6, second / total.clamp(min=1e-300),
                          inside.double() / (n - 2).clamp(min=1).double())
    passed_before = (torch.cumsum(weights, dim=-1) <= tfs.double()[:, None]) & inside
    return torch.minimum(passed_before.sum(dim=-1, keepdim=True) + 1, (n - 2).clamp(min=1))


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


def penalised(x: torch.Tensor, prompt_mask: torch.Tensor, counts: torch.Tensor, r: torch.Tensor,
              f: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Steps 7-8 on x float32 with the prompt mask (bool), output counts (int32) and the
    repetition, frequency and presence penalties (float32), all broadcast to x's shape. Not
    in place."""
    seen = prompt_mask | (counts > 0)
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)               # step 7
    occurred = (counts > 0).to(torch.float32)
    return x - f * counts.to(torch.float32) - p * occurred                    # step 8


class Sampler(Verification, Scoring):
    """A sampling backend. This class is the ``reference`` backend; plugins subclass it."""

    name = "reference"
    default_device = "cpu"
    batch_class = SamplingBatch
    #: dtype of block verification's weights and residual masses (``block_verify``); a
    #: backend without fast float64 (XLA on TPU) sets float32
    block_dtype = torch.float64
    #: The custom stages this sampler's batches may run (``corelib.catalog``): the registry
    #: that made it sets its own; a sampler built directly reads the process-wide registry's.
    stage_catalog: catalog.StageCatalog = staticmethod(catalog.installed_stages)

    def __init__(self, device: torch.device | str | None = None,
                 generator: Optional[torch.Generator] = None):
        self.device = torch.device(device if device is not None else self.default_device)
        self.generator = generator

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, device={str(self.device)!r})"

    # ------------------------------------------------------------------ public API
    def new_batch(self, vocab_size: int, eos_token_id: Optional[int] = None,
                  logprobs_mode: str = "raw") -> SamplingBatch:
        batch = self.batch_class(vocab_size, self.device, eos_token_id, logprobs_mode)
        batch.stage_catalog = self.stage_catalog
        return batch

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
        out = self.sample_state(logits, batch, s)
        batch.keep_selector_source(out.selector_source)
        return out

    def sample_state(self, logits: torch.Tensor, batch: SamplingBatch, s: StepState) -> SamplerOutput:
        """Steps 1-15 for a given step state: the contract's stage order, in one place
        (``prepare``, ``choose_tokens`` and ``filter`` hold the stages; ``verify_state`` runs
        the same parts at every draft slot).

        Split from ``sample`` so a backend can capture it (CUDA graphs) or trace it (XLA)."""
        x, raw, valid = self.prepare(logits, batch, s)                     # steps 1-8a
        token_ids, final, filtered = self.choose_tokens(x, s)              # steps 9-14
        valid = valid & self.drawn_is_finite(x, final, token_ids, s)
        logprobs = self.step_logprobs(raw, x, final, token_ids, s)         # step 15
        kept = self.kept_set(x, final, token_ids, valid, s) if s.any_kept else None
        token_ids = torch.where(valid, token_ids, INVALID_TOKEN)
        return SamplerOutput(token_ids, valid, logprobs, filtered, kept)

    def choose_tokens(self, x: torch.Tensor, s: StepState) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """Steps 9-14: (int64 [B] token ids, float32 [B, V] final logits, the log-probabilities
        after the filter group that the stateful selectors' state advances from, float32
        [B, V], None when no row uses one) from x float32 [B, V] after step 8a; greedy rows
        take the argmax and keep x as their final logits."""
        greedy_ids = self.argmax(x) if s.any_greedy else None              # step 9
        final, token_ids, filtered = x, greedy_ids, None
        if s.any_random:
            if s.any_selector:
                token_ids, final, filtered = self.sample_selected(x, s)    # steps 10-14
            else:
                token_ids, final = self.sample_random(x, s)                # steps 10-14
            if greedy_ids is not None:
                token_ids = torch.where(s.greedy, greedy_ids, token_ids)
        return token_ids, final, filtered

    def sample_selected(self, x: torch.Tensor, s: StepState) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Steps 10-14 when a row uses a stateful selector: the filter group, then the
        selectors (group "select" of the table) reshape the distribution the draw takes.
        Returns (int64 [B] ids, float32 [B, V] final logits, float32 [B, V] log-probabilities
        after the filter group, from which ``select`` advances verify's slot states and
        ``append`` the batch's)."""
        filtered = self.filter(x, s)
        logp = self.log_softmax(filtered)
        final = self.select(filtered, s, logp)
        return self.draw(final, s), final, logp

    def selector_slot_state(self, logp: torch.Tensor, s: StepState) -> StepState:
        """``s`` with each verify slot's selector state (``pipeline.state_fields``) advanced by
        the row's drafts before it, slot after slot, as ``append`` would advance it:
        ``logp`` float32 [B S, V] each slot's distribution after the filter group;
        ``s.verify_drafts`` int64 [B S], the draft after each slot (-1: none, the state stays)."""
        S = s.verify_slots
        rows = s.num_rows // S
        draft = s.verify_drafts.view(rows, S)
        logp = logp.view(rows, S, -1)
        changes = {}
        for stage in pipeline.stateful_stages():
            state = {f.name: getattr(s, f.name).view(rows, S).clone() for f in stage.state}
            fields = {f.name: getattr(s, f.name).view(rows, S) for f in stage.fields}
            for j in range(S - 1):
                now = {name: value[:, j] for name, value in state.items()}
                ids = draft[:, j]
                moved = getattr(selectors, stage.advance)(
                    now, {n: v[:, j] for n, v in fields.items()}, logp[:, j], ids.clamp(min=0))
                for name, value in moved.items():
                    state[name][:, j + 1] = torch.where((ids >= 0) & ~s.greedy.view(rows, S)[:, j],
                                                        value, now[name])
            changes.update({name: value.view(-1) for name, value in state.items()})
        return dataclasses.replace(s, **changes)

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

    def kept_set(self, x: torch.Tensor, final: torch.Tensor, token_ids: torch.Tensor,
                 valid: torch.Tensor, s: StepState) -> torch.Tensor:
        """The kept sets of the step (``SamplingParams.return_kept``): int32 [B, ceil(V / 32)]
        packed bits (``corelib.bitmask.pack_kept``) of the tokens with a finite logit in the
        distribution each random row drew from (``final``, after the selectors), the drawn
        token alone for greedy rows (the argmax; step 8b's forced token); zeros for flagged
        rows (``valid`` False) and rows that did not ask (``s.return_kept``). x, final:
        float32 [B, V] after step 8b and after step 14's selectors; token_ids int64 [B]. One
        pass over the final logits, no host sync. Not in place."""
        keep = self.processed_source(x, final, s, normalise=False) > NEG_INF
        if s.any_greedy:
            vocab = torch.arange(keep.shape[-1], device=keep.device)[None, :]
            keep = torch.where(s.greedy[:, None], vocab == token_ids[:, None], keep)
        return pack_kept(keep & (valid & s.return_kept)[:, None])

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
        final = x
        if s.any_random:
            final = self.filter(x, s)
            if s.any_selector:
                final = self.select(final, s)
        return self.processed_source(x, final, s, normalise=False)

    # ------------------------------------------------------------------ template parts
    def step_state(self, logits: torch.Tensor, batch: SamplingBatch) -> StepState:
        batch.check_logits(logits)
        if batch.device.type != self.device.type:
            raise ValueError(f"batch lives on {batch.device}, but sampler {self.name!r} runs on {self.device}")
        return batch.step_state()

    def with_bitmask(self, s: StepState, batch: SamplingBatch,
                     token_bitmask: Optional[torch.Tensor], slots: Optional[int] = None) -> StepState:
        """``s`` with the caller's token bitmask checked and on the device (unchanged for None).
        ``slots``: the verification slots per row (the mask is ``[B, slots, W]``)."""
        if token_bitmask is None:
            return s
        mask = batch.check_token_bitmask(token_bitmask, slots)
        return dataclasses.replace(s, token_bitmask=mask, any_bitmask=True)

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
        if s.filter_orders:
            x = self.run_orders(x, s)                                      # steps 10-13b
        else:
            x = self.run_group("filter", x, s)                             # steps 10-13b
        if s.stages:
            x = self.apply_custom_stages(x, s, "after_filters")
        return x

    def select(self, x: torch.Tensor, s: StepState, logp: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Step 14's stateful selectors (group "select"): what the draw takes from each row
        that uses one. x float32 [B, V] after ``filter``; ``logp`` its log-probabilities when
        the caller has them. In ``verify`` (``s.verify_slots`` > 1) each slot's state first
        advances by the row's earlier drafts (``selector_slot_state``); for ``score``'s
        gradients that state is a constant, as the history it stands for is."""
        if s.verify_slots > 1:
            s = self.selector_slot_state((self.log_softmax(x) if logp is None else logp).detach(), s)
        return self.run_group("select", x, s)

    def run_orders(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """The filter group when some row orders it its own way (``s.filter_orders``): the
        default order for the other rows, and each order in the batch over the whole batch,
        kept for its rows only (``s.filter_order``), so each row gets what it would alone.
        x float32 [B, V]; not in place (each order starts from a copy: a backend's stage may
        work in place)."""
        out = self.run_group("filter", x.clone(), s)
        for index, names in s.filter_orders:
            y = x.clone()
            for name in names:
                stage, switch = pipeline.named_switch(name)
                if getattr(s, switch.flag):
                    y = self.stage_method(stage)(y, self.switch_state(s, stage, switch))
            out = torch.where((s.filter_order == index)[:, None], y, out)
        return out

    def switch_state(self, s: StepState, stage: pipeline.Stage, switch: pipeline.Switch) -> StepState:
        """``s`` for running ``switch`` of ``stage`` alone (a stage with several named
        switches: top-k or top-p by itself): the fields and flags of its other switches
        neutral. ``s`` itself for a stage of one."""
        others = [w for w in stage.switches if w is not switch and w.owns]
        if not others:
            return s
        neutral = {f.name: f.neutral for f in stage.fields}
        changes = {w.flag: False for w in others}
        for w in others:
            for name in w.owns:
                changes[name] = torch.full_like(getattr(s, name), neutral[name])
        if "top_k" in changes:     # the flags derived from top-k follow it
            changes.update(max_top_k=0, all_random_top_k=False, any_top_p_without_top_k=s.any_top_p)
        elif "top_p" in changes:
            changes.update(any_top_p_without_top_k=False)
        return dataclasses.replace(s, **changes)

    def run_group(self, group: str, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """The stages of ``group`` (``corelib.pipeline``) in the contract's order, each one some
        row of ``s`` uses, through this backend's method for it. x float32 [B, V]."""
        for stage, flags in pipeline.flagged_stages_in(group):
            for flag in flags:
                if getattr(s, flag):
                    x = self.stage_method(stage)(x, s)
                    break
        return x

    def dense_by_row(self) -> bool:
        """Whether this sampler's verify states may keep the ``[B, V]`` tensors per row
        (``DENSE_ROW_STATE``, with ``slots_per_row`` and ``slot_drafts``) instead of a copy per
        slot: only where the stages that read them (``apply_penalties``, ``apply_allowed_ids``)
        are the reference's, which count each slot's drafts on top; a backend with its own
        keeps the copies."""
        cls = type(self)
        return (cls.apply_penalties is Sampler.apply_penalties
                and cls.apply_allowed_ids is Sampler.apply_allowed_ids)

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

    def row_uniforms(self, s: StepState, stream: int) -> torch.Tensor:
        """float32 ``[B]`` uniforms in (0, 1), one per row: seeded rows from ``stream`` of the
        contract's noise at (seed, child, position), others from this sampler's generator."""
        u = torch.rand(s.num_rows, generator=self.generator, device=s.position.device)
        if s.any_seeded:
            keys = row_keys(s.seed_lo, s.seed_hi, s.child, s.position)
            u = torch.where(s.seeded, stream_uniform(keys, stream), u)
        return u

    def empty_output(self, s: StepState) -> SamplerOutput:
        ids = torch.empty(0, dtype=torch.long, device=self.device)
        valid = torch.empty(0, dtype=torch.bool, device=self.device)
        logprobs = None
        if s.num_logprobs is not None:
            width = s.num_logprobs + 1
            logprobs = Logprobs(torch.empty((0, width), dtype=torch.long, device=self.device),
                                torch.empty((0, width), dtype=torch.float32, device=self.device),
                                torch.empty(0, dtype=torch.long, device=self.device))
        kept = None
        if s.any_kept:
            kept = torch.empty((0, bitmask_width(s.vocab_size)), dtype=torch.int32, device=self.device)
        return SamplerOutput(ids, valid, logprobs, kept=kept)

    # ------------------------------------------------------------------ stages
    def working_copy(self, logits: torch.Tensor, batch: SamplingBatch, s: StepState) -> torch.Tensor:
        """Step 2: a float32 ``[B, V]`` copy; one logits row per request is expanded to its
        children, and ``verify``'s flat logits to its slots (``s.logits_rows``). Never
        aliases ``logits``."""
        dtype = s.work_dtype
        if s.logits_rows is not None:
            return logits.index_select(0, s.logits_rows).to(dtype)
        if logits.shape[0] != s.num_rows:
            return logits.index_select(0, batch.request_index(s.num_rows)).to(dtype)
        return logits.to(dtype, copy=True)

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
        (all True for rows without the option; a verify state's may be per row, ``[B / S, V]``
        with ``s.slots_per_row`` S, read by every slot of the row). Not in place."""
        S = s.slots_per_row
        if S == 1:
            return x.masked_fill(~s.allowed_mask, NEG_INF)
        n, V = x.shape[0] // S, x.shape[-1]
        return x.view(n, S, V).masked_fill(~s.allowed_mask[:, None], NEG_INF).view(n * S, V)

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
        return x.scatter_add(1, s.bias_ids, s.bias_values.to(x.dtype))

    def apply_penalties(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Steps 7-8 from running counts. ``prompt_mask`` bool [B, V], ``output_counts`` int32
        [B, V]; penalties float32 [B] (1, 0, 0 disable them). A verify state's counts may be
        per row (``[B / S, V]``, ``s.slots_per_row`` S): every slot reads its row's, and the
        tokens of its earlier drafts (``s.slot_drafts`` int64 [B, K]) are penalised again with
        the drafts counted, so no ``[B, V]`` state is copied per slot. Not in place."""
        S = s.slots_per_row
        if S == 1:
            return penalised(x, s.prompt_mask, s.output_counts, s.repetition_penalty[:, None],
                             s.frequency_penalty[:, None], s.presence_penalty[:, None])
        B, V = x.shape
        n = B // S
        per_slot = lambda v: v.view(n, S, 1)                                # noqa: E731
        out = penalised(x.view(n, S, V), s.prompt_mask[:, None], s.output_counts[:, None],
                        per_slot(s.repetition_penalty), per_slot(s.frequency_penalty),
                        per_slot(s.presence_penalty)).view(B, V)
        ids = s.slot_drafts
        if ids.shape[1] == 0:
            return out
        live = ids >= 0
        safe = ids.clamp(min=0)                                            # [B, K]
        row = torch.arange(B, device=x.device)[:, None] // S
        # each id's count after the slot's drafts: the row's, plus its live drafts equal to it
        # (an entry past the drafts names token 0 with its right value too, so any order of
        # the scatter below writes the same)
        extra = ((safe[:, :, None] == safe[:, None, :]) & live[:, None, :]).sum(-1)
        counts = s.output_counts[row, safe] + extra.to(torch.int32)
        values = penalised(x.gather(1, safe), s.prompt_mask[row, safe], counts,
                           s.repetition_penalty[:, None], s.frequency_penalty[:, None],
                           s.presence_penalty[:, None])
        return out.scatter_(1, safe, values)

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
        """Step 10: ``x / temperature`` per row (greedy rows divide by 1). With
        ``dynatemp_range`` d > 0 (float32 [B], 0 = static), the row's temperature comes from
        the entropy H of its current distribution over its n kept tokens: T' = lo + (hi - lo)
        * (H / ln n) ** ``dynatemp_exponent``, lo = max(0, T - d), hi = T + d; n <= 1 leaves
        the logits as they are, T' = 0 keeps the argmax tokens only. Not in place."""
        t = torch.where(s.greedy, torch.ones_like(s.temperature), s.temperature)
        if not s.any_dynatemp:
            return x / t[:, None]
        t, argmax_only = self.dynamic_temperature(x, t, s)
        out = x / t[:, None]
        return torch.where(argmax_only[:, None] & (x < x.amax(dim=-1, keepdim=True)), NEG_INF, out)

    def dynamic_temperature(self, x: torch.Tensor, t: torch.Tensor,
                            s: StepState) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 10's temperature per row when some row is dynamic: (float32 [B] divisor, 1 where
        the logits stay as they are; bool [B]: T' = 0, only the argmax tokens stay). ``t``:
        the static temperatures (greedy rows 1). Not in place."""
        logp = torch.log_softmax(x.detach(), dim=-1)     # T' is a constant for gradients
        p = logp.exp()
        entropy = -torch.where(p > 0, p * logp, 0.0).sum(dim=-1)
        return dynamic_divisor(entropy, (x > NEG_INF).sum(dim=-1), t, s)

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

    def apply_smoothing(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 10b, quadratic smoothing: with m the row's largest kept logit, d = x - m and c =
        ``smoothing_curve`` (float32 [B]), each kept logit becomes m - (3 - c) / 2 * f * d**2
        + (c - 1) / 2 * f * d**3, f = ``smoothing_factor`` (float32 [B], 0 = off); dropped
        tokens stay -inf. Not in place."""
        f, c = s.smoothing_factor[:, None], s.smoothing_curve[:, None]
        m = x.detach().amax(dim=-1, keepdim=True)            # a constant for gradients
        d = x - m
        smoothed = m - (3.0 - c) / 2.0 * f * d * d + (c - 1.0) / 2.0 * f * d * d * d
        return torch.where((f > 0) & (x > NEG_INF), smoothed, x)

    def apply_top_a(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 11a: drop tokens with p < ``top_a`` * max(p)**2 (``top_a`` float32 [B], 0 =
        off; the most likely tokens always stay). Not in place."""
        p = torch.softmax(x, dim=-1)
        most = p.amax(dim=-1, keepdim=True)
        return x.masked_fill((p < s.top_a[:, None] * most * most) & (p < most), NEG_INF)

    def apply_epsilon(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 11b: drop tokens with p < ``epsilon_cutoff`` (float32 [B], 0 = off), never the
        most likely ones. Not in place."""
        p = torch.softmax(x, dim=-1)
        most = p.amax(dim=-1, keepdim=True)
        return x.masked_fill((p < s.epsilon_cutoff[:, None]) & (p < most), NEG_INF)

    def apply_eta(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 11c: with H = -sum p ln p, drop tokens with p < min(eta, sqrt(eta) * exp(-H))
        (``eta_cutoff`` float32 [B], 0 = off), never the most likely ones. Not in place."""
        logp = torch.log_softmax(x, dim=-1)
        p = logp.exp()
        entropy = -torch.where(p > 0, p * logp, 0.0).sum(dim=-1, keepdim=True)
        eta = s.eta_cutoff[:, None]
        cutoff = torch.minimum(eta, eta.sqrt() * torch.exp(-entropy))
        most = p.amax(dim=-1, keepdim=True)
        return x.masked_fill((p < cutoff) & (p < most), NEG_INF)

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

    def apply_tfs(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 13c, tail-free sampling (``tfs`` float32 [B], 1 = off): the kept probabilities
        sorted descending, q_1 >= ... >= q_n (n <= 2: nothing happens); the second differences
        |q_i - 2 q_(i+1) + q_(i+2)|, i = 1..n-2, normalised to sum 1 (uniform when their sum
        is <= 1e-6); keep q_1..q_j for the smallest j whose running sum passes ``tfs`` (j =
        n - 2 when none does), with every token tied with q_j. Sums in float64, by a full sort
        (the reference). Not in place."""
        if x.shape[-1] <= 2:        # every row keeps n <= 2 tokens (and XLA cannot sum 0 columns)
            return x
        p = torch.softmax(x, dim=-1)
        q = torch.sort(p, dim=-1, descending=True).values.double()
        n = (x > NEG_INF).sum(dim=-1, keepdim=True)
        threshold = q.gather(1, tail_free_length(q, n, s.tfs) - 1).to(p.dtype)
        keep = (p >= threshold) | (n <= 2) | (s.tfs >= 1.0)[:, None]
        return x.masked_fill(~keep, NEG_INF)

    def apply_p_less(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 13d, p-less: drop tokens with p < L, L = sum p**2 ("plain") or (V sum p**2 - 1)
        / (V - 1) ("norm", V the vocabulary); ``p_less`` int32 [B]: ``pipeline.P_LESS_MODES``,
        0 = off. Never the most likely tokens. Not in place."""
        p = torch.softmax(x, dim=-1)
        collision = (p * p).sum(dim=-1, keepdim=True)
        V = x.shape[-1]
        norm = (V * collision - 1.0) / max(V - 1, 1)
        mode = s.p_less[:, None]
        level = torch.where(mode == pipeline.P_LESS_MODES["norm"], norm, collision)
        most = p.amax(dim=-1, keepdim=True)
        return x.masked_fill((mode != pipeline.P_LESS_OFF) & (p < level) & (p < most), NEG_INF)

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

    def apply_mirostat(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 14, mirostat v2 (``mirostat_tau`` float32 [B], 0 = off): drop the tokens whose
        surprise -log2 p exceeds the row's ``mirostat_mu`` (float32 [B], the batch's state),
        never the most likely ones; the draw then takes the renormalised rest. Not in place."""
        dropped = selectors.mirostat_dropped(torch.log_softmax(x, dim=-1), s.mirostat_mu, s.mirostat_tau)
        return x.masked_fill(dropped, NEG_INF)

    def apply_adaptive_p(self, x: torch.Tensor, s: StepState) -> torch.Tensor:
        """Step 14, adaptive-p (``adaptive_p_target`` float32 [B], < 0 = off): each kept token's
        logit becomes 5 - 10 u**2 / (1 + u), u = |p - a| / 0.3, a = clamp(2 target - w / s, 0,
        1) from the row's state (``adaptive_p_weighted`` w, ``adaptive_p_total`` s, float32
        [B]); dropped tokens stay -inf. Not in place."""
        shaped = selectors.adaptive_logits(torch.softmax(x, dim=-1), s.adaptive_p_target,
                                           s.adaptive_p_weighted, s.adaptive_p_total)
        return torch.where((s.adaptive_p_target >= 0)[:, None] & (x > NEG_INF), shaped, x)

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
