"""The ``cpu`` backend's sampler: the contract's stages at close to memory speed on CPUs.

What differs from the reference (``corelib.Sampler``), stage by stage:

- rows are processed in blocks of about ``BLOCK_ELEMENTS`` logits (a few MiB) held in a
  per-thread workspace, so every stage of a block runs on data still in the cache, nothing
  is allocated per step, and no temporary reaches ``B x V``;
- steps 3-8 work in place; penalties touch only the tokens a row has seen, from the running
  slots kept by :class:`~corelib_cpu.batch.CpuBatch`;
- step 9 and step 15's top-N use group maxima (``rowops``) instead of torch.argmax/topk;
- step 12 selects candidates (k-th value and ties as the reference) from group maxima;
- step 13 on candidates uses the candidates' own softmax when an error bound proves it picks
  the reference's tokens (else the reference's softmax of the masked row); on whole rows it
  finds the threshold by a radix select over the probabilities' bits
  (``select.nucleus_threshold``); masks are applied with copysign/min, never with boolean
  fills (which run ~40x slower than arithmetic on CPUs);
- step 14 draws candidate rows with noise for the candidates only (seeded rows with the
  contract's noise, so their tokens are the reference's), and whole unseeded rows with one
  uniform per row through the inverse CDF.

Every kept set equals the reference's (the conformance suite checks it), and so do seeded
tokens. Shapes: ``B`` rows, ``V`` vocabulary, ``n`` rows of a block, ``W`` candidates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from corelib import Logprobs, Sampler, SamplerOutput, SamplingBatch, StepState
from corelib.noise import row_keys
from corelib.sampler import INVALID_TOKEN, NEG_INF

from .batch import CpuBatch
from .draw import (
    draw_by_inverse_cdf,
    draw_from_weights,
    draw_seeded_candidates,
    draw_seeded_rows,
    draw_unseeded_candidates,
)
from .rowops import count_at_least, first_argmax, top_values
from .select import (
    SCRATCH,
    kth_largest,
    mask_below,
    nucleus_threshold,
    top_k_candidates,
    top_p_candidates,
    top_p_candidates_fast,
)
from .workspace import Workspace


class RowSlice:
    """The step state of rows ``r0:r1``: tensor fields sliced on first use, others as is.

    Duck-types ``StepState`` for the reference's stage methods."""

    def __init__(self, s: StepState, r0: int, r1: int):
        self._s, self._rows = s, slice(r0, r1)

    def __getattr__(self, name):
        value = getattr(self._s, name)
        if isinstance(value, torch.Tensor):
            value = value[self._rows]
        setattr(self, name, value)
        return value


@dataclass
class StepPlan:
    """Host facts of one step, computed once: per-row switches as lists (block decisions read
    them without touching tensors) and the effective per-row parameters.

    Greedy rows get neutral filter parameters (temperature 1, min_p 0, top_k 0, top_p 1), so
    the filters leave them as step 8 did, which is what their processed logits are."""

    num_rows: int
    rows_per_block: int
    greedy: list
    seeded: list
    temperature_on: list
    min_p_on: list
    top_k_on: list
    top_p_on: list
    temperature: torch.Tensor      # float32 [B]
    min_p: torch.Tensor            # float32 [B]
    top_k: torch.Tensor            # int64 [B], 0 = off, at most V
    top_p: torch.Tensor            # float32 [B]
    keys: Optional[torch.Tensor]   # int32 [B] seeded-noise row keys
    request_index: Optional[torch.Tensor]  # int64 [B] when logits have one row per request
    sparse_penalties: bool

    def blocks(self):
        step = self.rows_per_block
        for r0 in range(0, self.num_rows, step):
            yield r0, min(r0 + step, self.num_rows)


@dataclass
class Candidates:
    """Rows of a block whose kept set is a few candidate tokens (rows with top-k)."""

    rows: torch.Tensor     # int64 [nc], block-local row indices
    values: torch.Tensor   # float32 [nc, W], descending before top-p; -inf = dropped
    ids: torch.Tensor      # int64 [nc, W]


@dataclass
class Block:
    """One block of rows after steps 1-13."""

    r0: int
    r1: int
    x: torch.Tensor                      # float32 [n, V]: step 8's logits, then filtered in
                                         # place for whole rows (candidate rows: see cand)
    raw: Optional[torch.Tensor]          # float32 [n, V] raw logprobs (step 1), or None
    valid: torch.Tensor                  # bool [n]
    greedy_ids: Optional[torch.Tensor]   # int64 [n] argmax after step 8, or None
    cand: Optional[Candidates] = None
    candidate_rows: set = field(default_factory=set)
    # Whole rows whose last filter computed their probabilities: float32 [m, V], 0 where
    # dropped (the final distribution, unnormalised), keyed by block-local row.
    weights: Optional[torch.Tensor] = None
    weight_rows: dict = field(default_factory=dict)
    draw_ok: Optional[torch.Tensor] = None   # bool [n]: False where a draw saw NaN weights


class CpuSampler(Sampler):
    """The ``cpu`` backend (see the module docstring). Block-sized buffers live in
    ``self.workspace`` (one set per thread) and serve every step.

    ``block_elements``: logits per block (rows per block = block_elements // V, at least 1).
    """

    name = "cpu"
    default_device = "cpu"
    batch_class = CpuBatch
    #: Logits per block: 4 MiB of float32, so a block's few live copies stay in L2/L3.
    BLOCK_ELEMENTS = 1 << 20
    #: Extra candidate columns beyond the largest top_k, to catch ties at the k-th value
    #: without masking the whole row.
    TIE_SLACK = 8

    def __init__(self, device: torch.device | str | None = None,
                 generator: Optional[torch.Generator] = None,
                 block_elements: Optional[int] = None):
        super().__init__(device, generator)
        if self.device.type != "cpu":
            raise ValueError(f"the cpu backend runs on CPU tensors, got device {self.device}")
        self.block_elements = int(block_elements or self.BLOCK_ELEMENTS)
        if self.block_elements < 1:
            raise ValueError(f"block_elements must be >= 1, got {block_elements!r}")
        self.workspace = Workspace()

    # ------------------------------------------------------------------ public API
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample one token per row. logits ``[B, V]`` or ``[num_requests, V]``, any float
        dtype; never modified."""
        s = self.step_state(logits, batch)
        if s.num_rows == 0:
            return self.empty_output(s)
        plan = self.plan(logits, batch, s)
        token_ids = torch.empty(s.num_rows, dtype=torch.long)
        valid = torch.empty(s.num_rows, dtype=torch.bool)
        pieces = []
        for r0, r1 in plan.blocks():
            blk = self.run_block(logits, batch, s, plan, r0, r1)
            ids = self.draw_block(blk, plan)                                   # step 14
            token_ids[r0:r1] = ids
            valid[r0:r1] = blk.valid & self.drawn_is_finite_in_block(blk, ids)
            if s.num_logprobs is not None:                                     # step 15
                pieces.append(self.block_logprobs(blk, ids, s))
        logprobs = join_logprobs(pieces) if pieces else None
        token_ids = torch.where(valid, token_ids, torch.full_like(token_ids, INVALID_TOKEN))
        return SamplerOutput(token_ids, valid, logprobs)

    def processed_logits(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """float32 ``[B, V]``: the final distribution's logits (steps 2-13; greedy rows stop
        after step 8), dropped tokens -inf: the reference's result, from this backend's stages."""
        s = self.step_state(logits, batch)
        out = torch.empty((s.num_rows, s.vocab_size), dtype=torch.float32)
        if s.num_rows == 0:
            return out
        plan = self.plan(logits, batch, s)
        for r0, r1 in plan.blocks():
            out[r0:r1] = self.materialize(self.run_block(logits, batch, s, plan, r0, r1))
        return out

    # ------------------------------------------------------------------ plan
    def plan(self, logits: torch.Tensor, batch: SamplingBatch, s: StepState) -> StepPlan:
        """The step's host facts (see :class:`StepPlan`)."""
        B, V = s.num_rows, s.vocab_size
        temperature, min_p, top_p = s.temperature, s.min_p, s.top_p
        top_k = s.top_k.to(torch.long).clamp(max=V)
        if s.any_greedy:
            g = s.greedy
            temperature = torch.where(g, 1.0, temperature)
            min_p = torch.where(g, 0.0, min_p)
            top_k = torch.where(g, 0, top_k)
            top_p = torch.where(g, 1.0, top_p)
        off = [False] * B
        return StepPlan(
            num_rows=B,
            rows_per_block=max(1, self.block_elements // V),
            greedy=s.greedy.tolist() if s.any_greedy else off,
            seeded=(s.seeded & ~s.greedy).tolist() if s.any_seeded else off,
            temperature_on=(temperature != 1.0).tolist() if s.any_temperature else off,
            min_p_on=(min_p > 0.0).tolist() if s.any_min_p else off,
            top_k_on=(top_k > 0).tolist() if s.any_top_k else off,
            top_p_on=(top_p < 1.0).tolist() if s.any_top_p else off,
            temperature=temperature, min_p=min_p, top_k=top_k, top_p=top_p,
            keys=row_keys(s.seed_lo, s.seed_hi, s.child, s.position) if s.any_seeded else None,
            request_index=batch.request_index(B) if logits.shape[0] != B else None,
            sparse_penalties=s.any_penalties and isinstance(batch, CpuBatch) and batch.has_penalty_slots,
        )

    # ------------------------------------------------------------------ steps 1-13
    def run_block(self, logits: torch.Tensor, batch: SamplingBatch, s: StepState,
                  plan: StepPlan, r0: int, r1: int) -> Block:
        """Steps 1-13 for rows ``r0:r1``."""
        rs = RowSlice(s, r0, r1)
        x = self.block_copy(logits, plan, r0, r1)                               # step 2
        raw = None
        if s.num_logprobs is not None and s.logprobs_mode == "raw":             # step 1
            raw = torch.log_softmax(x, dim=-1, out=self.workspace.take("raw", tuple(x.shape)))
        valid = self.mask_block(x, s, rs)                                       # steps 3-5
        if s.any_bias:
            x.scatter_add_(1, rs.bias_ids, rs.bias_values)                      # step 6
        if s.any_penalties:
            self.penalize_block(x, batch, rs, plan, r0, r1)                     # steps 7-8
        greedy_ids = first_argmax(x) if any(plan.greedy[r0:r1]) else None     # step 9
        blk = Block(r0, r1, x, raw, valid, greedy_ids)
        if not all(plan.greedy[r0:r1]):
            self.filter_block(blk, plan)                                        # steps 10-13
        return blk

    def block_copy(self, logits: torch.Tensor, plan: StepPlan, r0: int, r1: int) -> torch.Tensor:
        """Step 2: float32 [n, V], the block's logits copied into the workspace (per-request
        logits are expanded to rows). Never aliases ``logits``."""
        x = self.workspace.take("x", (r1 - r0, logits.shape[1]))
        if plan.request_index is not None:
            return x.copy_(logits.index_select(0, plan.request_index[r0:r1]))
        return x.copy_(logits[r0:r1])

    def mask_block(self, x: torch.Tensor, s: StepState, rs: RowSlice) -> torch.Tensor:
        """Steps 3-5 in place on x float32 [n, V]; returns bool [n] valid rows (no NaN/+inf
        before masking, a token left after it). Invalid rows become zeros, as in the
        reference, so they cannot disturb later stages."""
        finite = None
        if s.any_allowed:
            # masked_fill can hide a NaN or +inf; the others below add -inf, which keeps them
            # (NaN + -inf and +inf + -inf are NaN), so one maximum after them is enough.
            top = x.amax(dim=-1)
            finite = ~(torch.isnan(top) | (top == float("inf")))
            x.masked_fill_(~rs.allowed_mask, NEG_INF)                           # step 3
        if s.any_bad_words:
            self.ban_in_place(x, rs.bad_last, self.bad_word_hits(rs))           # step 4
        if s.any_min_tokens:
            pending = (rs.position < rs.min_tokens)[:, None]
            self.ban_in_place(x, rs.stop_ids, rs.stop_valid & pending)          # step 5
        top = x.amax(dim=-1)              # NaN with a NaN, +inf with a +inf, -inf if all masked
        valid = torch.isfinite(top) if finite is None else finite & (top > NEG_INF)
        if not bool(valid.all()):
            x.masked_fill_(~valid[:, None], 0.0)
        return valid

    @staticmethod
    def bad_word_hits(rs: RowSlice) -> torch.Tensor:
        """bool [n, W]: bad words whose prefix the row's generated tokens end with (the
        reference's rule; see ``Sampler.apply_bad_words``)."""
        recent = rs.recent[:, None, :]
        matches = ((rs.bad_prefix == recent) | (rs.bad_prefix == -2)).all(dim=-1)
        return matches & rs.bad_valid

    @staticmethod
    def ban_in_place(x: torch.Tensor, ids: torch.Tensor, banned: torch.Tensor) -> None:
        """x[row, ids[row, j]] += -inf where banned[row, j] (the reference's ``_add_at``, in
        place). ids int64 [n, J], banned bool [n, J]."""
        x.scatter_add_(1, ids, torch.where(banned, NEG_INF, 0.0).to(x.dtype))

    def penalize_block(self, x: torch.Tensor, batch: SamplingBatch, rs: RowSlice,
                       plan: StepPlan, r0: int, r1: int) -> None:
        """Steps 7-8 in place on x float32 [n, V]: repetition penalty over seen tokens, then
        frequency and presence penalties over generated ones. From the batch's slots when it
        keeps them (only the seen tokens are read and written), else from its dense counts."""
        if not plan.sparse_penalties:
            x.copy_(self.apply_penalties(x, rs))
            return
        ids, counts, length = batch.penalty_slots(plan.num_rows)
        length = length[r0:r1]
        width = int(length.max())
        if width == 0:
            return
        real = torch.arange(width)[None, :] < length[:, None]                   # (n, width)
        rows, slots = real.nonzero(as_tuple=True)
        flat = rows * x.shape[1] + ids[r0:r1, :width][rows, slots]
        xf = x.view(-1)
        v = xf[flat]
        r = rs.repetition_penalty[rows]
        v = torch.where(v > 0, v / r, v * r)                                    # step 7
        c = counts[r0:r1, :width][rows, slots].to(torch.float32)
        occurred = (c > 0).to(torch.float32)
        # Same expression, in the same order, as the reference's dense step 8.
        xf[flat] = v - rs.frequency_penalty[rows] * c - rs.presence_penalty[rows] * occurred

    def filter_block(self, blk: Block, plan: StepPlan) -> None:
        """Steps 10-13 for the block's random rows (greedy rows have neutral parameters)."""
        r0, r1, x = blk.r0, blk.r1, blk.x
        if any(plan.temperature_on[r0:r1]):
            x.div_(plan.temperature[r0:r1, None])                               # step 10
        rows = lambda switch: [i for i, on in enumerate(switch[r0:r1]) if on]  # noqa: E731
        min_p_rows = rows(plan.min_p_on)
        if min_p_rows:
            self.min_p_rows(blk, min_p_rows, plan.min_p[r0:r1])                 # step 11
        top_k_rows = rows(plan.top_k_on)
        if top_k_rows:
            blk.cand = self.top_k_rows(blk, top_k_rows, plan.top_k[r0:r1])      # step 12
            if blk.cand is not None:
                blk.candidate_rows = set(blk.cand.rows.tolist())
        top_p_rows = rows(plan.top_p_on)
        if top_p_rows:                                                          # step 13
            top_p = plan.top_p[r0:r1]
            on_candidates = [i for i in top_p_rows if i in blk.candidate_rows]
            whole = [i for i in top_p_rows if i not in blk.candidate_rows]
            if on_candidates:
                self.top_p_candidate_rows(blk.cand, top_p, x.shape[1])
            if whole:
                self.top_p_whole_rows(blk, whole, top_p)

    def min_p_rows(self, blk: Block, rows: list, min_p: torch.Tensor) -> None:
        """Step 11 in place on the given rows of blk.x float32 [n, V]: drop tokens whose
        probability is < min_p * the row's largest (min_p float32 [n]; 0 keeps all)."""
        sub, index = take_rows(blk.x, rows)
        probs = torch.softmax(sub, dim=-1, out=self.workspace.take("probs", tuple(sub.shape)))
        # amax is NaN when probs hold a NaN: the row is then dropped whole (see below)
        threshold = min_p[index][:, None] * probs.amax(dim=-1, keepdim=True)
        self.drop_and_keep_weights(blk, rows, index, sub, probs, threshold)

    def drop_and_keep_weights(self, blk: Block, rows: list, index: torch.Tensor, sub: torch.Tensor,
                              probs: torch.Tensor, threshold: torch.Tensor) -> None:
        """Drop tokens whose probability is below threshold (float32 [m, 1]): sub (float32
        [m, V], the rows of blk.x) gets -inf there and is written back; probs gets 0 and
        becomes the rows' draw weights (the final distribution unless a later stage changes
        the row, which then replaces them).

        No boolean mask: masked_fill and where with an irregular mask are ~40x slower than
        vectorised arithmetic on CPUs. copysign(inf, probs - threshold) is +inf for kept
        tokens (probs >= threshold) and -inf for dropped ones, and min() with it masks both.
        Rows whose probabilities are NaN (float32 overflow upstream) drop every token, as the
        reference's comparisons do; the draw then flags them."""
        scratch = self.workspace.take(SCRATCH, tuple(probs.shape), torch.int32)
        sign = torch.sub(probs, threshold, out=scratch.view(torch.float32))
        torch.copysign(_INF, sign, out=sign)
        broken = torch.isnan(threshold[:, 0])
        if bool(broken.any()):
            sign[broken] = NEG_INF
        torch.minimum(sub, sign, out=sub)
        put_rows(blk.x, index, sub)
        blk.weights = torch.minimum(probs, sign, out=probs).clamp_(min=0.0)
        blk.weight_rows = {row: j for j, row in enumerate(rows)}

    @staticmethod
    def forget_weights(blk: Block, rows: list) -> None:
        """Rows changed after their weights were computed: draw them from blk.x instead."""
        for row in rows:
            blk.weight_rows.pop(row, None)

    def top_k_rows(self, blk: Block, rows: list, top_k: torch.Tensor) -> Optional[Candidates]:
        """Step 12 for the given rows of x float32 [n, V] (top_k int64 [n], 1..V there).

        Rows whose ties at the k-th value may run past the candidate columns are masked in
        place in x and left out of the candidates (their next stages take the whole row)."""
        x = blk.x
        sub, index = take_rows(x, rows)
        k = top_k[index]
        width = min(x.shape[1], int(k.max()) + self.TIE_SLACK)
        values, ids, complete = top_k_candidates(sub, k, width)
        if not bool(complete.all()):
            spill = (~complete).nonzero().flatten()
            self.forget_weights(blk, index[spill].tolist())
            cut = kth_largest(values[spill], k[spill])   # masking kept the top k values
            x[index[spill]] = mask_below(sub[spill], cut)
            keep = complete.nonzero().flatten()
            if keep.numel() == 0:
                return None
            values, ids, index = values[keep], ids[keep], index[keep]
        return Candidates(index, values, ids)

    def top_p_candidate_rows(self, cand: Candidates, top_p: torch.Tensor, V: int) -> None:
        """Step 13 on candidate rows (top_p float32 [n] per block row; 1 keeps all).

        From the softmax of the candidates alone when that provably picks the reference's
        tokens (``select.top_p_candidates_fast``); the other rows take the reference's
        softmax of the whole masked row."""
        p = top_p[cand.rows]
        if not bool((p < 1.0).any()):
            return
        values, settled = top_p_candidates_fast(cand.values, p)
        if not bool(settled.all()):
            rows = (~settled).nonzero().flatten()
            masked_rows = torch.full((rows.numel(), V), NEG_INF)
            masked_rows.scatter_(1, cand.ids[rows], cand.values[rows])
            probs = torch.softmax(masked_rows, dim=-1).gather(1, cand.ids[rows])
            values[rows] = top_p_candidates(cand.values[rows], probs, p[rows])
        cand.values = values

    def top_p_whole_rows(self, blk: Block, rows: list, top_p: torch.Tensor) -> None:
        """Step 13 in place on whole rows of blk.x float32 [n, V] (top_p float32 [n], < 1
        there): the threshold by histogram select, then one masking pass."""
        sub, index = take_rows(blk.x, rows)
        probs = torch.softmax(sub, dim=-1, out=self.workspace.take("probs", tuple(sub.shape)))
        threshold = nucleus_threshold(probs, top_p[index], self.workspace)[:, None]
        threshold = torch.where(torch.isnan(probs.amax(dim=-1, keepdim=True)), float("nan"), threshold)
        self.drop_and_keep_weights(blk, rows, index, sub, probs, threshold)

    # ------------------------------------------------------------------ step 14
    def draw_block(self, blk: Block, plan: StepPlan) -> torch.Tensor:
        """int64 [n]: one token per row of the block (before invalid rows are flagged)."""
        r0, r1 = blk.r0, blk.r1
        n = r1 - r0
        tokens = blk.greedy_ids if blk.greedy_ids is not None else torch.zeros(n, dtype=torch.long)
        greedy, seeded = plan.greedy[r0:r1], plan.seeded[r0:r1]
        if all(greedy):
            return tokens
        tokens = tokens.clone()
        if blk.cand is not None:
            c = blk.cand
            is_seeded = torch.tensor([seeded[i] for i in c.rows.tolist()], dtype=torch.bool)
            self.draw_into(tokens, c.rows, is_seeded,
                           lambda sel, keys: draw_seeded_candidates(c.values[sel], c.ids[sel], keys),
                           lambda sel: draw_unseeded_candidates(c.values[sel], c.ids[sel], self.generator),
                           plan.keys, r0)
        whole = [i for i in range(n) if not greedy[i] and i not in blk.candidate_rows]
        if whole:
            rows = torch.tensor(whole, dtype=torch.long)
            is_seeded = torch.tensor([seeded[i] for i in whole], dtype=torch.bool)
            self.draw_into(tokens, rows, is_seeded,
                           lambda sel, keys: draw_seeded_rows(pick_rows(blk.x, rows[sel]), keys),
                           lambda sel: self.draw_whole_unseeded(blk, rows[sel]),
                           plan.keys, r0)
        return tokens

    def draw_whole_unseeded(self, blk: Block, rows: torch.Tensor) -> torch.Tensor:
        """int64 [m]: inverse-CDF draws for whole rows (block-local int64 [m]), from the
        weights a filter left when every row has them, else from blk.x. Rows whose weights
        are NaN are marked in blk.draw_ok."""
        at = [blk.weight_rows.get(row) for row in rows.tolist()]
        if None not in at:
            weights = blk.weights if at == list(range(blk.weights.shape[0])) else blk.weights[at]
            tokens, ok = draw_from_weights(weights, self.generator)
        else:
            x = pick_rows(blk.x, rows)
            tokens, ok = draw_by_inverse_cdf(x, self.generator, self.workspace.take("weights", tuple(x.shape)))
        if not bool(ok.all()):
            if blk.draw_ok is None:
                blk.draw_ok = torch.ones(blk.x.shape[0], dtype=torch.bool)
            blk.draw_ok[rows] = ok
        return tokens

    @staticmethod
    def drawn_is_finite_in_block(blk: Block, token_ids: torch.Tensor) -> torch.Tensor:
        """bool [n]: the drawn id is in range and its final logit finite (the core's
        ``Sampler.drawn_is_finite``: rows whose float32 overflowed are flagged, not returned
        with an arbitrary id). Candidate rows read the candidates' values."""
        V = blk.x.shape[1]
        safe = token_ids.clamp(0, V - 1)
        picked = blk.x.gather(1, safe[:, None])[:, 0]
        if blk.cand is not None:
            c = blk.cand
            hit = c.ids == safe[c.rows][:, None]
            picked[c.rows] = torch.where(hit, c.values, NEG_INF).amax(dim=-1)
        ok = (token_ids >= 0) & (token_ids < V) & torch.isfinite(picked)
        return ok if blk.draw_ok is None else ok & blk.draw_ok

    @staticmethod
    def draw_into(tokens, rows, is_seeded, seeded_draw, unseeded_draw, keys, r0) -> None:
        """tokens[rows] = draws: seeded rows by ``seeded_draw(selection, keys)``, the others by
        ``unseeded_draw(selection)`` (selections index ``rows``)."""
        if bool(is_seeded.any()):
            sel = is_seeded.nonzero().flatten()
            tokens[rows[sel]] = seeded_draw(sel, keys[r0 + rows[sel]])
        if not bool(is_seeded.all()):
            sel = (~is_seeded).nonzero().flatten()
            tokens[rows[sel]] = unseeded_draw(sel)

    # ------------------------------------------------------------------ step 15
    def block_logprobs(self, blk: Block, token_ids: torch.Tensor, s: StepState) -> Logprobs:
        """Step 15 for a block: from the raw logprobs, or from the final distribution."""
        source = blk.raw if blk.raw is not None else torch.log_softmax(self.materialize(blk), dim=-1)
        return self.gather_logprobs(source, token_ids, s.num_logprobs)

    def gather_logprobs(self, logprobs: torch.Tensor, token_ids: torch.Tensor,
                        num_logprobs: int) -> Logprobs:
        """Step 15 as the reference computes it (``Sampler.gather_logprobs``), with the
        top-N by group maxima and the rank by sign arithmetic (see ``rowops``)."""
        V = logprobs.shape[-1]
        safe = token_ids.clamp(min=0)[:, None]
        sampled = logprobs.gather(1, safe)                                  # (n, 1)
        ranks = count_at_least(logprobs, sampled)
        ids, values = [safe], [sampled]
        available = min(num_logprobs, V)
        if available > 0:
            top, top_ids, _ = top_values(logprobs, available)
            ids.append(top_ids)
            values.append(top)
        if available < num_logprobs:  # a vocabulary smaller than N: pad with id -1, -inf
            missing = (logprobs.shape[0], num_logprobs - available)
            ids.append(torch.full(missing, -1, dtype=torch.long))
            values.append(torch.full(missing, NEG_INF))
        return Logprobs(torch.cat(ids, dim=1), torch.cat(values, dim=1), ranks)

    def materialize(self, blk: Block) -> torch.Tensor:
        """float32 [n, V]: the block's final logits (candidate rows written out in full, -inf
        for dropped tokens). Reuses blk.x."""
        if blk.cand is not None:
            c = blk.cand
            full = torch.full((c.values.shape[0], blk.x.shape[1]), NEG_INF)
            full.scatter_(1, c.ids, c.values)
            blk.x.index_copy_(0, c.rows, full)
            blk.cand = None
            blk.candidate_rows = set()
        return blk.x


_INF = torch.tensor(float("inf"))


def take_rows(x: torch.Tensor, rows: list) -> tuple[torch.Tensor, torch.Tensor]:
    """(x's rows as a tensor, their indices int64). All rows: x itself (a view, so in-place
    changes land in x); otherwise a copy, to be written back with :func:`put_rows`."""
    index = torch.tensor(rows, dtype=torch.long)
    if len(rows) == x.shape[0]:
        return x, index
    return x.index_select(0, index), index


def pick_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x[rows] for int64 rows [m], without a copy when rows are all of x's rows in order."""
    if rows.numel() == x.shape[0] and bool((rows == torch.arange(x.shape[0])).all()):
        return x
    return x.index_select(0, rows)


def put_rows(x: torch.Tensor, index: torch.Tensor, sub: torch.Tensor) -> None:
    """Write rows taken by :func:`take_rows` back into x (nothing to do for a view)."""
    if sub is not x:
        x.index_copy_(0, index, sub)


def join_logprobs(pieces: list) -> Logprobs:
    return Logprobs(torch.cat([p.token_ids for p in pieces]),
                    torch.cat([p.logprobs for p in pieces]),
                    torch.cat([p.ranks for p in pieces]))
