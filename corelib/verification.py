"""Speculative decoding's verification (the contract's "Speculative decoding: verification"
and "Block verification"), as the part of the ``Sampler`` template that ``verify`` runs:
the argument checks, the speculative step state, the draft judgement (token rule, rejection
sampling, block verification) and the emitted tokens. ``Sampler`` inherits it; a backend
overrides its parts as it overrides stages. Shapes: ``B`` rows, ``K`` draft slots, ``S = K +
1`` slots per row, ``V`` vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .batch import INVALID_TOKEN, SamplingBatch, StepState, padded_ids_problem
from .drafts import DraftLayout, checked_flat_arguments, tensor_argument
from .noise import STREAM_ACCEPT, STREAM_BLOCK
from .outputs import Logprobs, VerifyOutput, slot_kept, slot_logprobs
from .transfer import upload

#: ``verify``'s rules for rows with draft probabilities: the token-by-token ratio test, or
#: block verification (the contract's "Block verification").
VERIFY_METHODS = ("token", "block")


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


class Verification:
    """``verify`` and its parts; mixed into ``Sampler``, whose template parts (``prepare``,
    ``choose_tokens``, ``draw``, ``row_uniforms``, ...) they call."""

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
            out = self.verify_state(logits, batch, s, drafts)
        else:
            out = self.verify_state(logits.reshape(B * S, V), batch, s, drafts)
        batch.keep_selector_source(out.selector_source, slots=S)
        return out

    def verify_state(self, logits: torch.Tensor, batch: SamplingBatch, s: StepState,
                     drafts: Drafts) -> VerifyOutput:
        """``verify`` for a given speculative step state (``batch.speculative_state``): steps
        1-14 at every slot through the same template parts as ``sample_state``, then the draft
        judgement, the emitted tokens and step 15 with a slot axis. logits float ``[B (K+1),
        V]``, slot-major per row."""
        x, raw, valid = self.prepare(logits, batch, s)                     # steps 1-8a
        token_ids, final, filtered = self.choose_tokens(x, s)              # steps 9-14
        valid = valid & self.drawn_is_finite(x, final, token_ids, s)
        accepted, tokens = self.judge_drafts(final, token_ids, s, drafts, valid)  # verification
        emitted, num_emitted = self.emit_tokens(tokens, accepted, valid, drafts)
        logprobs = self.step_logprobs(raw, x, final, emitted.flatten(), s)  # step 15
        if logprobs is not None:
            logprobs = slot_logprobs(logprobs, emitted)
        kept = None
        if s.any_kept:
            kept = slot_kept(self.kept_set(x, final, token_ids, valid, s), num_emitted)
        return VerifyOutput(emitted, num_emitted, num_emitted > 0, logprobs, filtered, kept)

    def speculative_step_state(self, batch: SamplingBatch, drafts: Drafts) -> StepState:
        """The step state of ``verify`` (``batch.speculative_state``: ``B (K+1)`` virtual rows);
        a backend that extends ``step_state`` extends this the same way. The ``[B, V]`` state
        stays per row where this class's stages that read it are the reference's
        (``dense_by_row``)."""
        return batch.speculative_state(drafts.token_ids, dense_by_row=self.dense_by_row())

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
        kept = None if out.kept is None else out.kept.view(0, slots, -1)
        return VerifyOutput(ids, out.token_ids, out.valid, lp, kept=kept)


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
