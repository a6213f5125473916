"""The sampler: a template method fixing the contract's stage order.

``Sampler`` is the ``reference`` backend: every stage is plain, readable torch and is the
oracle for all other backends. A backend subclasses it and overrides the stages it does
faster; the order of the built-in stages lives in ``corelib.pipeline``'s table, which
``prepare`` and ``filter`` below run group by group (``run_group``), and the order of the parts
of a step in ``sample_state`` and ``verify_state``. The reference stages are in
``corelib.logit_stages`` (steps 1-8b) and ``corelib.filter_stages`` (steps 9-14), verification
in ``corelib.verification`` and teacher forcing in ``corelib.scoring``: parts of this class,
mixed in; step 15 is here.

Shapes: ``B`` rows, ``V`` vocabulary. Reference stages never modify their input tensors
(they return new ones), so a backend may call them on any tensor.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from .batch import INVALID_TOKEN, SamplingBatch, StepState
from .bitmask import bitmask_width, pack_kept, token_words
from . import catalog, pipeline, selectors
from .noise import row_keys, stream_uniform
# the stages, outputs and verification are their own modules; their names stay importable
# from here, where backends have always found them
from .filter_stages import (FilterStages, dynamic_divisor, min_p_drops, nucleus_keep, tail_free_length,  # noqa: F401
                            typical_keep)
from .logit_stages import NEG_INF, LogitStages, penalised  # noqa: F401
from .outputs import Logprobs, SamplerOutput, VerifyOutput, raise_on_flagged, slot_logprobs  # noqa: F401
from .ranking import top_entries
from .reductions import torch_row_sum
from .scoring import Scoring
from .verification import (  # noqa: F401
    VERIFY_METHODS,
    Drafts,
    Verification,
    checked_draft_ids,
    checked_draft_probs,
    verify_logits_shape,
)

#: Logprobs modes whose values come from step 1 (the model's logits as given).
RAW_MODES = ("raw", "raw_logits")


class Sampler(Verification, Scoring, LogitStages, FilterStages):
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
    #: ``row_sum(values, keepdim=False)``: each row's sum over the last dimension of float
    #: ``[B, V]`` values (float32 or float64), ``[B]`` (``[B, 1]`` with ``keepdim``), for every
    #: float row sum that feeds a threshold, a mask or a constant (the entropies of dynamic
    #: temperature, eta and typical-p, top-n-sigma's mean and variance, p-less's collision,
    #: tail-free's total, mirostat's normaliser; ``corelib.reductions``). A backend overrides
    #: it where a row's sum must have bits that depend on that row's values alone, never on how
    #: many rows the tensor holds, so that ``score`` over ``B T`` rows equals ``B``-row steps
    #: bitwise; it must stay differentiable. The reference's is ``torch.sum``; its batches
    #: advance the selectors' state with the same sum (``new_batch``).
    row_sum = staticmethod(torch_row_sum)

    def __init__(self, device: torch.device | str | None = None,
                 generator: Optional[torch.Generator] = None):
        self.device = torch.device(device if device is not None else self.default_device)
        self.generator = generator

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, device={str(self.device)!r})"

    def score_reference(self):
        """The reference backend on this sampler's device, for what this backend does not do
        itself (a differentiable ``score``). It runs on this backend's batch, so the batch's
        step states must be the core's (``speculative_state`` with ``dense_by_row``, the
        ``SamplingBatch`` fields): a backend whose batch keeps another layout makes its own
        ``score`` differentiable instead (the tpu backend does)."""
        reference = Sampler(self.device, self.generator)
        reference.stage_catalog = self.stage_catalog
        return reference

    # ------------------------------------------------------------------ public API
    def new_batch(self, vocab_size: int, eos_token_id: Optional[int] = None,
                  logprobs_mode: str = "raw") -> SamplingBatch:
        batch = self.batch_class(vocab_size, self.device, eos_token_id, logprobs_mode)
        batch.stage_catalog = self.stage_catalog
        batch.row_sum = self.row_sum        # append advances the selectors with this sampler's sums
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
        valid, flagged = self.flag_invalid(valid, self.drawn_is_finite(x, final, token_ids, s),
                                           token_ids)
        logprobs = self.step_logprobs(raw, x, final, token_ids, s)         # step 15
        kept = self.kept_set(x, final, token_ids, valid, s) if s.any_kept else None
        return SamplerOutput(flagged, valid, logprobs, filtered, kept)

    def flag_invalid(self, valid: torch.Tensor, finite: torch.Tensor,
                     token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's output flags: (bool [B] valid rows, ``valid`` from steps 1-8a and
        ``drawn_is_finite`` both true; int64 [B] ``token_ids`` with ``INVALID_TOKEN`` at the
        other rows). The caller owns both: neither may be a tensor that a later step writes (a
        reused buffer, the batch's state). A backend that knows on the host that every row
        is valid may return a fresh all-true ``valid`` and ``token_ids`` as they are."""
        valid = valid & finite
        return valid, torch.where(valid, token_ids, INVALID_TOKEN)

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
            if not stage.enabled(s):
                continue
            state = {f.name: getattr(s, f.name).view(rows, S).clone() for f in stage.state}
            fields = {f.name: getattr(s, f.name).view(rows, S) for f in stage.fields}
            for j in range(S - 1):
                now = {name: value[:, j] for name, value in state.items()}
                ids = draft[:, j]
                moved = getattr(selectors, stage.advance)(
                    now, {n: v[:, j] for n, v in fields.items()}, logp[:, j], ids.clamp(min=0),
                    row_sum=self.row_sum)
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
        float32 [B, V] after step 8b and after step 14's selectors; token_ids int64 [B]. The
        finite test and the packing pass over [B, V]; greedy rows and the flags change the
        packed words only. No host sync. Not in place."""
        words = pack_kept(final > NEG_INF)      # greedy rows' words are replaced below
        if s.any_greedy:
            words = torch.where(s.greedy[:, None], token_words(token_ids, s.vocab_size), words)
        return words.masked_fill(~(valid & s.return_kept)[:, None], 0)

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
        if batch.device != self.device and batch.device.type != self.device.type:
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
        valid = self.valid_rows(finite, left)
        x = self.neutralise_rows(x, valid)
        x = self.run_group("adjust", x, s)                                 # steps 6-8a
        if s.stages:
            x = self.apply_custom_stages(x, s, "after_penalties")
        if forced is not None:
            x = self.apply_thinking_budget(x, forced)                      # step 8b
        return x, raw, valid

    def valid_rows(self, finite: torch.Tensor, left: torch.Tensor) -> torch.Tensor:
        """bool [B]: the rows ``prepare`` calls valid, ``finite`` (``finite_rows``) and
        ``left`` (``any_token_left``, forced rows counted) both true. Every reader of the
        result combines it into a new tensor, never writes it: a backend that knows on the
        host that both are all true may return one of them as it is (one operator call fewer
        per step)."""
        return finite & left

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
        """The ``n`` (<= V) best entries of float32 [B, V] log-probabilities, best first and
        among equal values the lowest id first (the contract's order: ``ranking.top_entries``):
        (float32 [B, n] values, int64 [B, n] ids). Not in place."""
        return top_entries(logprobs, n)
