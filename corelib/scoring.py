"""Teacher forcing through the sampler's own pipeline (the contract's "Kept sets and
scoring"): ``score`` gives the processed log-probability of given tokens at every position of
a row, as ``sample`` would have seen them, so that a trainer reproduces the distribution a
rollout drew from. ``Sampler`` inherits it; a backend overrides its parts as it overrides
stages. Shapes: ``B`` rows, ``T`` positions, ``V`` vocabulary, ``W = ceil(V / 32)``.

Position t of a row is a virtual row with the row's state as if its first t given tokens had
been appended: the step state of ``verify`` (``batch.speculative_state``) with the tokens as
drafts, which advances penalties, DRY, min-tokens, bad words, the reasoning budget and the
selectors' state slot by slot. ``score`` itself appends nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from . import pipeline
from .batch import SamplingBatch, StepState, padded_ids_problem
from .bitmask import bitmask_width, unpack_bitmask
from .drafts import tensor_argument
from .logit_stages import NEG_INF
from .outputs import ScoreOutput


class Scoring:
    """``score`` and its parts; mixed into ``Sampler``, whose template parts (``prepare``,
    ``filter``, ``select``, ``processed_source``, ``gather_logprobs``) they call."""

    #: Whether this backend's ``score`` is differentiable with respect to the logits (its
    #: stages are plain autograd-tracked torch). A backend that is not hands a call whose
    #: logits require grad to the reference (``corelib info`` says which).
    differentiable_score = True

    def score(self, logits: torch.Tensor, batch: SamplingBatch, token_ids: torch.Tensor,
              kept: Optional[torch.Tensor] = None) -> ScoreOutput:
        """The processed log-probability of given tokens (teacher forcing).

        logits: ``[B, T, V]`` (B = the batch's rows, not requests), or ``[B, V]`` with
        token_ids ``[B]`` (one position; every output is then ``[B]``). token_ids: int64
        ``[B, T]``, -1 padding the end of a row. Position t sees the row's state as if
        ``token_ids[:, :t]`` had been appended (as ``verify``'s slots do); nothing is appended:
        the caller appends the tokens (``batch.append(token_ids)``, all T at once or step by
        step), which advances the selectors' state as after ``sample``.
        kept: None, or int32 ``[B, T, W]`` kept sets (a rollout's ``out.kept``): the
        distribution at each position is then the softmax, over exactly those tokens, of the
        logits after steps 2-10b (every stage before the truncating filters); the truncating
        filters and the selectors do not run.

        Returns a :class:`~corelib.outputs.ScoreOutput`. Bitwise on one backend: the
        processed logprob ``sample`` reports for a token it drew equals what ``score`` returns
        for it on a batch in the same state. When ``logits.requires_grad`` the result is
        differentiable with respect to them (masks, selections, the dynamic temperature and
        smoothing's maximum are constants); float64 logits that require grad are scored in
        float64 (for ``torch.autograd.gradcheck``), all others in float32 as ``sample`` does.
        Bad arguments raise ValueError (TypeError for what is not a tensor) naming them.
        """
        tensor = isinstance(logits, torch.Tensor)
        if tensor and logits.requires_grad and not self.differentiable_score:
            return self.score_reference().score(logits, batch, token_ids, kept)
        one_position = tensor and logits.dim() == 2
        logits, ids, kept = self.check_score_arguments(logits, batch, token_ids, kept)
        B, T, V = logits.shape
        s = self.score_step_state(batch, ids, differentiable=logits.requires_grad)
        if logits.requires_grad and logits.dtype == torch.float64:
            s.work_dtype = torch.float64
        if B == 0:
            out = self.empty_score_output(T, s.work_dtype)
        else:
            flat_kept = None if kept is None else kept.reshape(B * T, -1)
            out = self.score_state(logits.reshape(B * T, V), batch, s, ids.reshape(-1), flat_kept)
            batch.keep_selector_source(out.selector_source, slots=T)
            out = _each(out, lambda value: value.view(B, T))
        if one_position:
            out = _each(out, lambda value: value[:, 0])
        return out

    def score_state(self, logits: torch.Tensor, batch: SamplingBatch, s: StepState,
                    token_ids: torch.Tensor, kept: Optional[torch.Tensor]) -> ScoreOutput:
        """``score`` for a given step state (``score_step_state``: ``B T`` virtual rows),
        through the same template parts as ``sample_state``: steps 1-8b, the filter group and
        the selectors (or the replay of ``kept``), then each token's values. logits float
        ``[B T, V]``, token_ids int64 ``[B T]``, kept None or int32 ``[B T, W]``. Returns flat
        ``[B T]`` outputs, with the log-probabilities after the filter group (what ``append``
        advances the selectors' state from, as after ``sample``) when a row uses a selector."""
        x, raw, valid = self.prepare(logits, batch, s)                     # steps 1-8b
        final, source = x, None
        if kept is not None:
            final = self.replay_kept(x, s, kept)                           # steps 10-10b, kept
            valid = valid & (kept != 0).any(dim=-1)
        elif s.any_random:
            final = self.filter(x, s)                                      # steps 10-13b
            if s.any_selector:
                source = self.log_softmax(final).detach()
                final = self.select(final, s, source)                      # step 14
        out = self.score_tokens(raw, x, final, token_ids, valid, s)
        out.selector_source = source
        return out

    def score_tokens(self, raw: torch.Tensor, x: torch.Tensor, final: torch.Tensor,
                     token_ids: torch.Tensor, valid: torch.Tensor, s: StepState) -> ScoreOutput:
        """Each position's values for its token (``ScoreOutput``, flat ``[B T]``): the
        processed log-probability as step 15 computes it (``processed_source``, then
        ``gather_logprobs``), step 1's, whether the token is kept (greedy rows: it is the
        argmax of x), its rank. raw: float [B T, V] step 1's log-probabilities; x, final: after
        step 8b and after the selectors (or the replay); valid bool [B T]."""
        source = self.processed_source(x, final, s)
        V = raw.shape[-1]
        given = (token_ids >= 0) & (token_ids < V)
        safe = token_ids.clamp(0, V - 1)[:, None]
        values = self.gather_logprobs(source, safe[:, 0], 0)
        kept_token = self.final_logits(x, final, s).gather(1, safe)[:, 0] > NEG_INF
        if s.any_greedy:
            kept_token = torch.where(s.greedy, self.argmax(x) == token_ids, kept_token)
        scored = valid & given
        padding = token_ids == -1
        # padding reads 0 (a masked loss stays finite); a position without a distribution NaN
        blank = torch.where(padding, 0.0, float("nan")).to(source.dtype)
        logprobs = torch.where(scored, values.logprobs[:, 0], blank)
        raw_logprobs = torch.where(given, raw.gather(1, safe)[:, 0], blank.to(raw.dtype))
        ranks = torch.where(scored, values.ranks, 0)
        return ScoreOutput(logprobs, raw_logprobs, kept_token & scored, ranks, scored)

    def final_logits(self, x: torch.Tensor, final: torch.Tensor, s: StepState) -> torch.Tensor:
        """float [B, V]: the final distribution's logits, dense (a backend whose stages pass
        another form of x than a tensor writes it out)."""
        return self.processed_source(x, final, s, normalise=False)

    def replay_kept(self, x: torch.Tensor, s: StepState, kept: torch.Tensor) -> torch.Tensor:
        """``score``'s distribution under given kept sets: the filter group's stages that drop
        no token (``pipeline.replayed_stages``: temperature, static or dynamic, and smoothing)
        in the default order, then every token outside ``kept`` (int32 [B, W]) -> -inf. x
        float [B, V] after step 8b. Not in place."""
        for stage in pipeline.replayed_stages():
            if stage.enabled(s):
                x = self.stage_method(stage)(x, s)
        return x.masked_fill(~unpack_bitmask(kept.to(x.device), x.shape[-1]), NEG_INF)

    def score_step_state(self, batch: SamplingBatch, token_ids: torch.Tensor,
                         differentiable: bool = False) -> StepState:
        """The step state of ``score``: ``B T`` virtual rows (``batch.speculative_state`` with
        the given tokens before each position as drafts), with step 1's log-probabilities on
        and no kept sets asked for. token_ids int64 [B, T] on the device, -1 padding.
        ``differentiable``: each position gets its own copy of the ``[B, V]`` state (the
        per-row form's scatter of the earlier tokens' penalties would count a gradient once
        per duplicate index)."""
        V = batch.vocab_size
        ids = torch.where((token_ids >= 0) & (token_ids < V), token_ids, -1)
        by_row = self.dense_by_row() and not differentiable
        s = batch.speculative_state(ids[:, :-1], dense_by_row=by_row)
        return dataclasses.replace(s, num_logprobs=0, logprobs_mode="raw", any_kept=False)

    def empty_score_output(self, T: int, dtype: torch.dtype) -> ScoreOutput:
        values = torch.empty((0, T), dtype=dtype, device=self.device)
        return ScoreOutput(values, values.clone(), torch.empty((0, T), dtype=torch.bool, device=self.device),
                           torch.empty((0, T), dtype=torch.long, device=self.device),
                           torch.empty((0, T), dtype=torch.bool, device=self.device))

    def check_score_arguments(self, logits, batch: SamplingBatch, token_ids,
                              kept) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """``score``'s arguments checked and in the ``[B, T, ...]`` form: (logits, int64 ids on
        the device, kept int32 on the device or None). ValueError naming the argument for a
        wrong shape, dtype, row count or vocabulary, an id out of [-1, V) or a -1 that is not
        trailing padding (ids on the host only: on an accelerator such a position reads NaN,
        not a wait on the device); TypeError for what is not a tensor."""
        if not isinstance(logits, torch.Tensor):
            raise TypeError(f"score: logits must be a torch.Tensor, got {type(logits).__name__}")
        if self.device.type != batch.device.type:
            raise ValueError(f"batch lives on {batch.device}, but sampler {self.name!r} runs on {self.device}")
        if not logits.dtype.is_floating_point:
            raise ValueError(f"score: logits must be a float tensor, got dtype {logits.dtype}")
        if logits.dim() not in (2, 3):
            raise ValueError(f"score: logits must be [rows, T, vocab] or [rows, vocab], got "
                             f"{list(logits.shape)}")
        one = logits.dim() == 2
        if one:
            logits = logits[:, None]
        B, T, V = logits.shape
        if V != batch.vocab_size:
            raise ValueError(f"score: logits have vocab size {V} but the batch was created with "
                             f"vocab_size={batch.vocab_size}")
        if B != batch.num_rows:
            raise ValueError(f"score: logits have {B} rows; the batch has {batch.num_rows} rows "
                             f"(score takes one row per batch row, not per request)")
        if T < 1:
            raise ValueError("score: logits need at least one position ([rows, T, vocab], T >= 1)")
        ids = tensor_argument("token_ids", token_ids, "score")
        if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
            raise ValueError(f"score: token_ids must hold integer ids, got dtype {ids.dtype}")
        want = (B,) if one else (B, T)
        if tuple(ids.shape) != want:
            raise ValueError(f"score: token_ids must be {list(want)} for logits of shape "
                             f"{list(logits.shape[:1] if one else logits.shape[:2]) + [V]}, got {list(ids.shape)}")
        ids = ids.reshape(B, T)
        if ids.device.type == "cpu":
            problem = padded_ids_problem(ids, V)
            if problem is not None:
                kind, row, col = problem
                rid = batch.rows[row][0]
                if kind == "range":
                    raise ValueError(f"score: token_ids[{row}, {col}] = {int(ids[row, col])} is out "
                                     f"of range for vocab_size={V} (request {rid!r}; -1 pads a row's end)")
                raise ValueError(f"score: token_ids row {row} (request {rid!r}) has a token after -1 "
                                 f"padding; -1 may only pad the end of a row")
        ids = ids.to(self.device, torch.long)
        if kept is not None:
            kept = tensor_argument("kept", kept, "score")
            W = bitmask_width(V)
            want = (B, W) if one else (B, T, W)
            if kept.dtype != torch.int32 or tuple(kept.shape) != want:
                raise ValueError(f"score: kept must be int32 {list(want)} (packed kept sets, "
                                 f"ceil(vocab / 32) words per position), got {kept.dtype} "
                                 f"{list(kept.shape)}")
            kept = kept.reshape(B, T, W).to(self.device)
        return logits, ids, kept


def _each(out: ScoreOutput, change) -> ScoreOutput:
    """``out``'s outputs with ``change`` applied to each (views: gradients flow)."""
    return ScoreOutput(*(change(getattr(out, name)) for name in _OUTPUTS))


_OUTPUTS = ("logprobs", "raw_logprobs", "kept_token", "ranks", "valid")
