"""The reference backend's steps 1-8b (the table's "mask" and "adjust" groups, step 8b and
the custom stages after them): plain, readable torch, the oracle every backend is checked
against. Mixed into ``Sampler`` (``corelib.sampler``), whose template calls them; a backend
overrides the stages it does faster. Shapes: ``B`` rows, ``V`` vocabulary. These stages never
modify their input tensors (they return new ones), so a backend may call them on any tensor.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import thinking
from .batch import SamplingBatch, StepState
from .bitmask import unpack_bitmask
from .stages import StageInputs, StageSpec, run_stage

NEG_INF = float("-inf")


def penalised(x: torch.Tensor, prompt_mask: torch.Tensor, counts: torch.Tensor, r: torch.Tensor,
              f: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Steps 7-8 on x float32 with the prompt mask (bool), output counts (int32) and the
    repetition, frequency and presence penalties (float32), all broadcast to x's shape. Not
    in place."""
    seen = prompt_mask | (counts > 0)
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)               # step 7
    occurred = (counts > 0).to(torch.float32)
    return x - f * counts.to(torch.float32) - p * occurred                    # step 8


def earlier_equal_drafts(slot_drafts: torch.Tensor, S: int) -> torch.Tensor:
    """int64 [n S, K]: for each virtual row's entry of ``slot_drafts`` (int64 [n S, K], the
    row's drafts before the slot, -1 for none), how many of those drafts equal it; an entry of
    -1 counts the drafts equal to token 0 (the id it is read as). By prefix sums over each
    row's K drafts, O(n K^2), not per slot (O(n S K^2): at K = 511, ``score``'s 512 positions,
    that was most of the step)."""
    n, K = slot_drafts.shape[0] // S, slot_drafts.shape[1]
    drafts = slot_drafts.view(n, S, K)[:, -1]          # the last slot sees every draft
    live = drafts >= 0
    zeros = torch.zeros((n, K, 1), dtype=torch.long, device=drafts.device)
    equal = (drafts[:, :, None] == drafts[:, None, :]) & live[:, None, :]         # [n, K, K]
    before = torch.cat([zeros, equal.long().cumsum(-1)], dim=-1)                  # [n, K, S]
    zero = torch.cat([zeros[:, 0], ((drafts == 0) & live).long().cumsum(-1)], dim=-1)   # [n, S]
    per_slot = before.transpose(1, 2)                                             # [n, S, K]
    entry_live = slot_drafts.view(n, S, K) >= 0
    return torch.where(entry_live, per_slot, zero[:, :, None]).view(n * S, K)


class LogitStages:
    """Steps 1-8b of the reference backend (mixed into ``Sampler``)."""

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
        safe = ids.clamp(min=0)                                            # [B, K]
        row = torch.arange(B, device=x.device)[:, None] // S
        # each id's count after the slot's drafts: the row's, plus its live drafts equal to it
        # (an entry past the drafts names token 0 with its right value too, so any order of
        # the scatter below writes the same)
        counts = s.output_counts[row, safe] + earlier_equal_drafts(ids, S).to(torch.int32)
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

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _add_at(x: torch.Tensor, ids: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
        """Set ``x[row, ids[row, j]]`` to -inf where ``banned[row, j]``; returns a new tensor."""
        penalty = torch.where(banned, NEG_INF, 0.0).to(x.dtype)
        return x.scatter_add(1, ids, penalty)
