"""``TpuSampler``: the core's template with every stage traced into a fixed XLA graph.

One step is at most two graphs, both compiled once: a small one that pads the caller's logits
to the batch's bucket (skipped when they arrive padded as float32), and the step itself, chosen
by (bucket, ``Variant``: greedy or random, logprobs or not); ``verify`` adds K + 1 slots per
row, picks K from a configured set and has one variant. The graphs, padding, transfer and
warm-up are the runner's (``corelib_tpu.graph``); this module holds the stages. A random graph
holds every path of steps 11-13 and every filter inside XLA conditionals (``xla.cond``), so a
step runs only what its rows use. ``docs/tpu.md`` counts the graphs. The stage order is the
core's: ``Sampler.sample`` and ``Sampler.verify_state`` run unchanged, on the padded logits,
with the stages below overridden where the reference is not traced-friendly (a sort,
per-token scatters, ``argmax`` that XLA:CPU does not vectorise, ``torch.rand``) or where the
layout differs (dense additive row, dense stop mask, DRY's window).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Optional, Sequence

import torch
from corelib.batch import SamplingBatch
from corelib.params import MAX_LOGPROBS
from corelib.sampler import INVALID_TOKEN, NEG_INF, RAW_MODES, Drafts, Logprobs, Sampler

from corelib import noise

from . import bitmask, dry, thresholds, xla
from .batch import XlaSamplingBatch
from .layout import ROUTES, Variant, XlaStepState, flags_for
from .drafts import leading_count
from .filter_stages import FilterStages, RouteRecord, _unchanged
from .graph import GraphRunner, WarmupReport
from .xla import RecompilationError

__all__ = ["TpuSampler", "RecompilationError", "WarmupReport"]


class TpuSampler(FilterStages, GraphRunner):
    """The ``tpu`` backend (module docstring). ``device`` defaults to the first XLA device.

    buckets: row counts to compile for (default 8, 16, ..., ``max_rows``); a batch holds at
    most the largest. top_k_candidates: the static K of the candidate path. max_bad_words,
    max_bad_word_length: size of the bad-word tables (words of two or more tokens).
    speculative_k: the draft counts K ``verify`` is compiled for by ``warmup`` (another K runs
    in the next larger one; above the largest raises); empty (the default): each K gets its
    own graphs when first used, none at warm-up. dry_window: tokens of history DRY sees per row;
    max_dry_breakers: sequence breakers per request. max_logprobs: the most top logprobs a
    request may ask for (every logprobs graph computes that many; -1, every token, needs at
    least the vocabulary); above it ``add`` raises ValueError. max_thinking_marker_length: the
    longest reasoning-budget marker (start, end or forced sequence, step 8b) a request may
    use. stages: None traces the custom stages the
    rows use, or a tuple of stage names traced in every step (fixed graphs: requests may
    switch them on and off without compiling). strict: after ``warmup()``, raise
    ``RecompilationError`` if any operation compiles a graph. generator: a CPU
    ``torch.Generator`` for unseeded rows' noise keys. compile_cache: torch-xla's persistent
    compile cache (``xla.compile_cache``): a directory, True for the default one under the
    user's cache, None (the default) for the ``CORELIB_TPU_COMPILE_CACHE`` environment
    variable (unset: off), False for off; it must be switched on before the process's first
    XLA computation. ``compile_cache_dir`` says which directory is in use (None: none).
    """

    name = "tpu"
    batch_class = XlaSamplingBatch
    # ``score`` with logits that require grad runs these stages with each conditional's
    # predicate read on the host (``xla.eager_branches``), as plain autograd-tracked ops
    differentiable_score = True
    # TPUs have no fast float64; block verification's sums over the vocabulary hold in float32
    # to well within the suite's statistical tolerance
    block_dtype = torch.float32

    def __init__(self, device: torch.device | str | None = None,
                 generator: Optional[torch.Generator] = None, *,
                 buckets: Optional[Iterable[int]] = None, max_rows: int = 256,
                 top_k_candidates: int = 64, max_bad_words: int = 8,
                 max_bad_word_length: int = 8,
                 speculative_k: Iterable[int] = (), dry_window: int = 1024,
                 max_dry_breakers: int = 64, max_logprobs: int = MAX_LOGPROBS,
                 max_thinking_marker_length: int = 8, stages: Optional[Sequence[str]] = None,
                 strict: bool = False, compile_cache=None):
        if generator is not None and generator.device.type != "cpu":
            raise TypeError(f"generator must be a CPU torch.Generator (it draws the noise keys on "
                            f"the host), got one on {generator.device}")
        super().__init__(device, generator, buckets=buckets, max_rows=max_rows,
                         speculative_k=speculative_k, strict=strict, compile_cache=compile_cache)
        self.top_k_candidates = top_k_candidates
        self.max_bad_words = max_bad_words
        self.max_bad_word_length = max_bad_word_length
        self.dry_window = dry_window
        self.max_dry_breakers = max_dry_breakers
        self.max_logprobs = max_logprobs
        self.max_thinking_marker_length = max_thinking_marker_length
        self.stages = None if stages is None else tuple(stages)
        self._host_generator = generator if generator is not None else _entropy_generator()
        self._finite_pending: Optional[torch.Tensor] = None

    # ------------------------------------------------------------------ public API
    def new_batch(self, vocab_size: int, eos_token_id: Optional[int] = None,
                  logprobs_mode: str = "raw") -> XlaSamplingBatch:
        return self.batch_class(
            vocab_size, self.device, eos_token_id, logprobs_mode, buckets=self.buckets,
            top_k_candidates=self.top_k_candidates, max_bad_words=self.max_bad_words,
            max_bad_word_length=self.max_bad_word_length, dry_window=self.dry_window,
            max_dry_breakers=self.max_dry_breakers, stages=self.stages,
            num_logprobs=self.max_logprobs,
            max_thinking_marker_length=self.max_thinking_marker_length, guard=self.guard,
            orders=self.orders)

    # ------------------------------------------------------------------ template parts
    def step_state(self, logits: torch.Tensor, batch: SamplingBatch) -> XlaStepState:
        """The bucket's state, with fresh noise keys for unseeded rows from this sampler's
        generator: ``logits`` arrive padded, so their row count is the bucket."""
        B = logits.shape[0]
        return self._with_variant(batch.step_state(B, random_keys=self._random_keys(B)), batch,
                                  self._forced)

    def speculative_step_state(self, batch: SamplingBatch, drafts: Drafts) -> XlaStepState:
        """``batch.speculative_state`` for the drafts' (padded) rows, with fresh noise keys for
        every slot of the unseeded rows, in verify's one folded variant (``Variant.folded``)."""
        B, K = drafts.token_ids.shape
        keys = self._random_keys(B * (K + 1))
        s = batch.speculative_state(drafts.token_ids, B, random_keys=keys)
        selectors = self._forced.selectors if self._forced is not None else batch.uses_selectors()
        return self._with_variant(s, batch, Variant(random=True, logprobs=True, stages=s.variant.stages,
                                                    folded=True, greedy_batches=True,
                                                    selectors=selectors, orders=batch.orders.traced))

    def score_step_state(self, batch: SamplingBatch, token_ids: torch.Tensor,
                         differentiable: bool = False) -> XlaStepState:
        """``score``'s state (``Scoring.score_step_state``): ``B T`` virtual rows from the
        batch's ``speculative_state`` with the given tokens before each position as drafts
        (token_ids int64 ``[B, T]`` on the device, -1 padding; B the live rows, or the bucket
        when the graph runner pads), traced as one variant whatever the rows (random, the
        stateful selectors when a random row uses one, the sampler's filter orders, not
        folded: step 1's log-probabilities are computed, step 15 is not traced), with the
        greedy rows' argmax (``any_greedy``). ``differentiable`` changes nothing here: the
        per-slot dense state is a broadcast of the row's, never a scatter of duplicates."""
        V = batch.vocab_size
        ids = torch.where((token_ids >= 0) & (token_ids < V), token_ids, -1)
        s = batch.speculative_state(ids[:, :-1], token_ids.shape[0])
        selectors = self._forced.selectors if self._forced is not None else batch.uses_selectors()
        variant = Variant(random=True, logprobs=True, stages=s.variant.stages, selectors=selectors,
                          orders=batch.orders.traced)
        s = self._with_variant(s, batch, variant)
        B, T = token_ids.shape
        mask = batch.padded_bitmask(None, B, T).reshape(B * T, -1)          # all -1: no mask
        return dataclasses.replace(s, num_logprobs=0, logprobs_mode="raw", any_kept=False,
                                   any_greedy=True, token_bitmask=mask)

    def with_bitmask(self, s: XlaStepState, batch: SamplingBatch,
                     token_bitmask: Optional[torch.Tensor], slots: Optional[int] = None) -> XlaStepState:
        """``s`` with the token bitmask padded to its rows (all -1 words without one: the mask
        is always an input of the step graph, so passing one or not compiles nothing new)."""
        bucket = s.num_rows // (slots or 1)
        mask = batch.padded_bitmask(token_bitmask, bucket, slots)
        return dataclasses.replace(s, token_bitmask=mask.reshape(s.num_rows, -1), any_bitmask=True)

    def row_uniforms(self, s: XlaStepState, stream: int) -> torch.Tensor:
        """float32 ``[B]`` uniforms of ``stream`` (``corelib.noise``): seeded rows keyed by
        (seed, child, position) as in the core, unseeded rows by this step's host-drawn key,
        so no ``torch.rand`` runs in the graph."""
        return noise.stream_uniform(self._noise_keys(s), stream)

    # ------------------------------------------------------------------ stages
    def working_copy(self, logits: torch.Tensor, batch: SamplingBatch, s: XlaStepState) -> torch.Tensor:
        """Step 2: ``logits`` are already a float32 ``[B, V]`` tensor that ``sample`` made (or,
        on XLA, whose graphs never write into their inputs, the caller's padded float32
        logits): returned as they are."""
        return logits

    def finite_rows(self, x: torch.Tensor) -> torch.Tensor:
        """bool ``[B]``: rows free of NaN and +inf, answered by ``any_token_left``'s reduction,
        which runs after steps 3-5 (they only add 0 or -inf, so NaN and +inf survive them; +inf
        under a -inf mask becomes NaN): the tensor returned here is written there, before the
        template reads it. Kept apart from the rows left because step 8b counts a forced row
        as having a token left, never as finite."""
        self._finite_pending = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
        return self._finite_pending

    def any_token_left(self, x: torch.Tensor) -> torch.Tensor:
        """bool ``[B]``: rows with no NaN or +inf and at least one token above -inf, from one
        int8 max over a per-token code (2 = NaN/+inf, 1 = live, 0 = -inf): XLA's float max
        neither propagates NaN nor returns -inf for an all -inf row. Also writes
        ``finite_rows``'s answer (code max below 2)."""
        bad = torch.isnan(x) | (x == float("inf"))
        code = torch.where(bad, 2, (x > NEG_INF).to(torch.int8)).to(torch.int8)
        top = code.max(dim=-1).values
        if self._finite_pending is not None:
            self._finite_pending.copy_(top != 2)
            self._finite_pending = None
        return top == 1          # 2: NaN/+inf, 0: all -inf

    def apply_allowed_ids(self, x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """Steps 3, 4 (one-token bad words) and 6 as one add: ``x + static_add`` with
        ``static_add`` float32 ``[B, V]`` holding -inf for disallowed and banned tokens and the
        logit bias elsewhere (0 = no option). The bias is finite, so adding it before steps
        4-5 changes neither their masks nor the valid-row check. Not in place."""
        return x + s.static_add

    def apply_token_bitmask(self, x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """Step 3, structured output (``bitmask.apply_words``): ``token_bitmask`` int32
        ``[B, ceil(V / 32)]`` unpacked inside the fused elementwise pass, -inf added where a
        bit is 0 (all -1 words = off). Not in place."""
        return bitmask.apply_words(x, s.token_bitmask)

    def apply_bad_words(self, x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """Step 4 for words of two or more tokens: when the row's last generated tokens equal a
        word's prefix, its last token -> -inf. ``bad_prefix`` int64 ``[B, W, P]``
        (right-aligned, -2 = any), ``recent`` int64 ``[B, P]``, ``bad_last`` int64 ``[B, W]``,
        ``bad_valid`` bool ``[B, W]`` (False = no word). One scatter-add of the ``B W`` bans
        (-inf, or 0 at token 0 for a word that does not apply) into x, an intermediate XLA
        scatters into in place; -inf is added, so NaN and +inf stay visible to the valid-row
        check. Not in place for the caller."""
        matches = ((s.bad_prefix == s.recent[:, None, :]) | (s.bad_prefix == -2)).all(dim=-1)
        banned = matches & s.bad_valid                                        # (B, W)
        return x.scatter_add(1, torch.where(banned, s.bad_last, 0), torch.where(banned, NEG_INF, 0.0))

    def apply_min_tokens(self, x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """Step 5: while ``position < min_tokens``, tokens in ``stop_mask`` (bool ``[B, V]``:
        stop ids and eos; all False = off) -> -inf, by adding -inf (see ``any_token_left``).
        Not in place."""
        pending = (s.position < s.min_tokens)[:, None]                     # (B, 1)
        return x + torch.where(s.stop_mask & pending, NEG_INF, 0.0)

    def apply_dry(self, x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """Step 8a, DRY, over each row's window of the last ``dry_window`` tokens (``dry``):
        penalties from the window's repeat lengths (O(B H)), then one scatter-min of the
        ``B H`` penalised logits into x (``dry.apply``). dry_multiplier float32 ``[B]``, 0 =
        off. The penalties are computed in a conditional on "some row uses DRY" that returns
        them (int64 and float32 ``[B, H]``; ids 0 and penalties 0 when none does, which the
        scatter-min leaves as they are), and the scatter runs outside it: a conditional that
        took and returned x would have XLA:CPU copy ``[B, V]`` into its result at every step.
        (XLA:CPU may make this conditional a select of its two cheap branches: O(B H) work.)
        Under autograd (``score``'s gradients) the scatter runs only when a row uses DRY:
        amin's backward splits a gradient among equal values. Not in place."""
        def run(history, match, since, multiplier, base, allowed_length, window):
            return dry.penalties(history, match, since, multiplier, base, allowed_length, window)

        def none(history, *rest):
            return (torch.zeros(history.shape, dtype=torch.int64, device=history.device),
                    torch.zeros(history.shape, dtype=torch.float32, device=history.device))

        used = (s.dry_multiplier > 0).any()
        operands = [s.dry_history, s.dry_match, s.dry_since_breaker, s.dry_multiplier,
                    s.dry_base, s.dry_allowed_length, s.dry_range]
        if x.requires_grad:
            return xla.cond(used, lambda x, *rest: dry.apply(x, *run(*rest)), _unchanged,
                            [x, *operands], "dry")
        tokens, penalty = xla.cond(used, run, none, operands, "dry penalties")
        return dry.apply(x, tokens, penalty)

    def apply_thinking_budget(self, x: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
        """Step 8b as in the core (a forced row, ``forced`` int64 ``[B]`` >= 0, keeps only its
        forced token, with logit 0; -1 = not forced: x float32 ``[B, V]`` as it is), against
        the cached vocabulary iota (``xla.iota``: no upload per step). Not in place."""
        vocab = xla.iota(x.shape[-1], torch.int64, x.device)
        only = torch.where(vocab == forced[:, None], 0.0, NEG_INF)
        return torch.where((forced >= 0)[:, None], only, x)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Step 9: int64 ``[B]``, the lowest id among each row's maxima."""
        return thresholds.first_argmax(x)

    def sample_random(self, x: torch.Tensor, s: XlaStepState) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 10-14 as in the core (``Sampler.sample_random``), with what steps 11-13's
        candidate route found (``RouteRecord``) handed to the draw, which races over its
        candidates where they hold every kept token instead of finding each row's largest
        logits again. x float32 ``[B, V]`` after step 8b; returns (int64 ``[B]`` ids, float32
        ``[B, V]`` final logits). Only the default filter order without custom stages records
        it (other orders run in conditionals that trace the route on placeholders; a custom
        stage may change the logits after the route)."""
        self._route = RouteRecord() if not (s.filter_orders or s.stages) else None
        try:
            final = self.filter(x, s)                                      # steps 10-13
            record = self._route
        finally:
            self._route = None
        usable = record is not None and len(record.candidates) == 1 and not record.unknown
        return self.draw(final, s, record if usable else None), final      # step 14

    def draw(self, x: torch.Tensor, s: XlaStepState, route=None) -> torch.Tensor:
        """Step 14 (and step 9 for greedy rows): int64 ``[B]``, ``argmax(x + gumbel)`` over the
        whole vocabulary (x float32 ``[B, V]``, dropped tokens -inf), the lowest id among
        ties. Seeded rows key the contract's noise by (seed, child, position); unseeded rows
        by a fresh host-drawn key (``random_key``), so one hash serves both and nothing waits
        on the host.

        When every random row keeps at most ``top_k_candidates`` tokens and no row holds NaN
        or +inf (``thresholds.narrow_rows``), the race runs over each row's largest
        ``top_k_candidates`` logits (``thresholds.top_entries``), which then hold every kept
        token, with the noise hashed at their ids: the same noise values, the same sums and
        the same winner as over the vocabulary, without a hash and two logarithms at each of
        its tokens. Otherwise (an ``xla.cond`` on the rows) the noise covers the vocabulary.

        route: None, or the ``RouteRecord`` of this step's filter group (``sample_random``).
        Where the batch took the candidate route, no other filter's conditional ran (the
        route's output is ``x``), and every row's candidates hold its kept tokens (a random
        row's K-th largest logit lies below its threshold, a greedy row's below its largest)
        with a finite largest, the race runs over the route's candidates (``_race``: the same
        winner), with no pass over ``x``; else as above, in a conditional."""
        # Greedy rows carry neutral filter parameters, so ``x`` is still their step-8a logits:
        # without noise, this argmax is step 9 (the template skips its own, see flags_for).
        K = min(self.top_k_candidates, x.shape[-1])
        keys = self._noise_keys(s)
        if route is None:
            narrow = thresholds.narrow_rows(x, K, s.greedy).all()
            return xla.cond(narrow, _draw_over_candidates(K), _draw_over_vocabulary,
                            [x, keys, s.greedy], ("draw", K))
        ids, edges = route.candidates[0]
        last, top, threshold = edges[:, 0], edges[:, 1], edges[:, 2]
        # A token outside the candidates is at most the K-th largest: below the threshold,
        # none is kept. A greedy row's filters are neutral (its x is what the route read), so
        # its first maximum is among the candidates unless all K tie. +inf (an overflow of
        # the penalties or the temperature) would be the largest; NaN, which the search's
        # pass would see anywhere, needs a filter that ran (they are ruled out below) or DRY
        # subtracting +inf from +inf (rows using DRY are too).
        inside = torch.where(s.greedy, (last < top) | (K == x.shape[-1]), last < threshold)
        reuse = ((s.route[0] == ROUTES.index("candidates")) & ~(s.dry_multiplier > 0).any()
                 & (inside & (top < float("inf"))).all())
        for ran in route.ran:
            reuse = reuse & ~ran
        return xla.cond(reuse, _race, _draw_by_search(K), [x, keys, s.greedy, ids],
                        ("draw", K, "route"))

    def kept_set(self, x: torch.Tensor, final: torch.Tensor, token_ids: torch.Tensor,
                 valid: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """The step's kept sets as the core defines them (``Sampler.kept_set``): int32 ``[B,
        ceil(V / 32)]`` packed bits (``bitmask.pack_words``) of the tokens with a finite logit
        in ``final`` (float32 ``[B, V]``, after the selectors) for random rows, the drawn token
        (int64 ``[B]``) for greedy rows (every graph, the folded random one included, where
        ``any_greedy`` is False); zeros for flagged rows (``valid`` False), rows that did not
        ask and padding rows (``s.return_kept`` False). Traced into every step graph
        (``flags_for`` sets ``any_kept``) inside a conditional on "some row asks": a step
        without such a row pays the predicate and a zero ``[B, W]`` output, and asking
        compiles nothing. Not in place."""
        def kept(final, token_ids, valid, asks, greedy):
            vocab = xla.iota(final.shape[-1], torch.int64, final.device)
            # An identity gather (rows by a cached iota, which XLA cannot fold): a branch of
            # elementwise ops only is turned into a select by XLA's conditional simplifier,
            # which then packs the kept bits at every step, asked for or not.
            rows = xla.iota(final.shape[0], torch.int64, final.device)[0]
            token_ids = token_ids.index_select(0, rows)
            keep = torch.where(greedy[:, None], vocab == token_ids[:, None], final > NEG_INF)
            return bitmask.pack_words(keep & (valid & asks)[:, None])

        def none(final, token_ids, valid, asks, greedy):
            return torch.zeros((final.shape[0], -(-final.shape[-1] // 32)), dtype=torch.int32,
                               device=final.device)

        return xla.cond(s.return_kept.any(), kept, none,
                        [final, token_ids, valid, s.return_kept, s.greedy], "kept")

    def rejection_sample(self, final: torch.Tensor, s: XlaStepState,
                         drafts: Drafts) -> tuple[torch.Tensor, torch.Tensor]:
        """The core's ``rejection_sample``: draft d passes when ``u * q(d) < p(d)``; the
        recovered token is drawn from ``max(p - q, 0)`` renormalised (p itself where that is all
        zero) with the slot's own step-14 noise. final float32 ``[B (K+1), V]`` (p = its
        softmax), draft probabilities float32 ``[B, K, V]``. Returns (bool ``[B, K]`` passed,
        int64 ``[B, K]`` recovered: each row's residual draw at its first rejected slot, the
        one slot whose entry is read, repeated along the row).

        Shaped for few passes over the vocabulary: only the K draft slots (the core also builds
        slot K's row to keep one draw over every slot); p = ``exp(x - logsumexp(x))`` is
        recomputed where it is read instead of being stored; the residual's noise is hashed at
        the B rows drawn from (the values the slot's own draw over the vocabulary would use).
        Rounding differs from the core's ``softmax`` in the last bits."""
        B, K = drafts.token_ids.shape
        S, V = K + 1, final.shape[-1]
        x = final.view(B, S, V)[:, :K]                                          # (B, K, V)
        top = x.max(dim=-1, keepdim=True).values
        log_total = top + torch.exp(x - top).sum(dim=-1, keepdim=True).log()   # logsumexp
        q = drafts.probs
        d = drafts.token_ids.clamp(min=0)[..., None]
        u = self.acceptance_uniforms(s).view(B, S)[:, :K]
        passed = u * q.gather(2, d)[..., 0] < torch.exp(x.gather(2, d) - log_total)[..., 0]
        # A row emits the residual draw of its first rejected slot only (emit_tokens reads no
        # other), so the residual is built at that slot alone: B rows of V, not B K.
        device = final.device
        real = xla.iota(K, torch.long, device) < drafts.count[:, None]
        stop = leading_count(passed & real).clamp(max=K - 1)                    # (B,)
        row = xla.iota(B, torch.long, device)[0]
        at_stop = row * S + stop                                                # rows of final
        x_stop = final.index_select(0, at_stop)                                 # (B, V)
        log_total_stop = log_total[..., 0].gather(1, stop[:, None])             # (B, 1)
        q_stop = q.reshape(B * K, V).index_select(0, row * K + stop)
        residual = (torch.exp(x_stop - log_total_stop) - q_stop).clamp(min=0.0)
        has_mass = (residual > 0).any(dim=-1, keepdim=True)
        target = torch.where(has_mass, residual.log(), x_stop - log_total_stop)  # log p: fallback
        recovered = _draw_over_vocabulary(target, self._noise_keys(s).index_select(0, at_stop),
                                          s.greedy.index_select(0, at_stop))   # (B,)
        return passed, recovered[:, None].expand(B, K)

    def raw_logprobs(self, x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """Step 1 as in the core; in a folded graph (``Variant.folded``) the raw logits alone,
        which step 15's conditional normalises when some row asks (XLA does not move the
        ``log_softmax`` into the branch by itself: it would run, two passes over ``[B, V]``,
        at every step). There ``x`` itself, not a copy: it is the step's input (from
        ``working_copy``), which every stage reads without writing into it, so the
        conditional takes the input's buffer as it is instead of a ``[B, V]`` copy made at
        every step."""
        if s.variant.folded:
            return x
        return super().raw_logprobs(x, s)

    def step_logprobs(self, raw: Optional[torch.Tensor], x: torch.Tensor, final: torch.Tensor,
                      token_ids: torch.Tensor, s: XlaStepState) -> Optional[Logprobs]:
        """Step 15 as in the core; in a folded graph (``Variant.folded``) inside a conditional
        on the step's ``logprobs_on``, so a batch that asks for none skips it (the results
        are then zeros, which the host does not read). There ``raw`` holds the raw logits
        (``raw_logprobs``), normalised in the branch."""
        if s.num_logprobs is None or not s.variant.folded:
            return super().step_logprobs(raw, x, final, token_ids, s)
        n, mode = s.num_logprobs, s.logprobs_mode
        plain = dataclasses.replace(s, variant=dataclasses.replace(s.variant, folded=False))

        def gathered(source, ids):
            if mode == "raw":
                source = self.log_softmax(source)
            # the core's step 15, with the source as its raw and as its final logits
            lp = Sampler.step_logprobs(self, source, source, source, ids, plain)
            return lp.token_ids, lp.logprobs, lp.ranks

        def skipped(source, ids):
            B = ids.shape[0]
            return (torch.zeros((B, n + 1), dtype=torch.long, device=ids.device),
                    torch.zeros((B, n + 1), dtype=torch.float32, device=ids.device),
                    torch.zeros((B,), dtype=torch.long, device=ids.device))

        source = raw if mode in RAW_MODES else final
        return Logprobs(*xla.cond(s.logprobs_on[0], gathered, skipped, [source, token_ids],
                                  ("logprobs", n, mode)))

    def top_logprobs(self, logprobs: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 15's top-N from ``thresholds.top_entries`` (float32 [B, n] values, int64 [B, n]
        ids): torch-xla lowers a ``topk`` over the vocabulary to a sort."""
        return thresholds.top_entries(logprobs, n)

    def emit_tokens(self, tokens: torch.Tensor, accepted: torch.Tensor, valid: torch.Tensor,
                    drafts: Drafts) -> tuple[torch.Tensor, torch.Tensor]:
        """The core's ``emit_tokens`` (each row's leading accepted drafts, then the token of
        the slot where it stopped, unless that slot has no token), with the leading run
        counted by ``leading_count``. tokens int64 ``[B, S]``, accepted bool ``[B, K]``, valid
        bool ``[B S]``. Returns (int64 ``[B, S]`` emitted, -1 after; int64 ``[B]`` their
        count, 0 for a flagged row)."""
        B, S = tokens.shape
        K = S - 1
        valid = valid.view(B, S)
        real = xla.iota(K, torch.long, tokens.device) < drafts.count[:, None]
        taken = leading_count(accepted & real & valid[:, :K])                   # (B,)
        stops_with_token = valid.gather(1, taken[:, None])[:, 0]
        num_emitted = torch.where(drafts.usable, taken + stops_with_token.to(torch.long), 0)
        last = tokens.gather(1, taken[:, None])                                  # (B, 1)
        padded = torch.cat([drafts.token_ids, torch.full_like(last, INVALID_TOKEN)], dim=1)
        column = xla.iota(S, torch.long, tokens.device)
        emitted = torch.where(column < taken[:, None], padded, last)
        emitted = torch.where(column < num_emitted[:, None], emitted, INVALID_TOKEN)
        return emitted, num_emitted

    # ------------------------------------------------------------------ noise and variants
    def _random_keys(self, rows: int) -> torch.Tensor:
        return torch.randint(-(2**31), 2**31, (rows,), dtype=torch.int32, generator=self._host_generator)

    @staticmethod
    def _noise_keys(s: XlaStepState) -> torch.Tensor:
        """int32 ``[B]`` noise keys: the contract's row keys for seeded rows, this step's
        host-drawn keys for the others."""
        return torch.where(s.seeded, noise.row_keys(s.seed_lo, s.seed_hi, s.child, s.position),
                           s.random_key)

    def _with_variant(self, s: XlaStepState, batch: XlaSamplingBatch,
                      variant: Optional[Variant]) -> XlaStepState:
        """``s`` traced as ``variant`` (None: as it is): warm-up forces each variant on its
        scratch batch, and verify runs every batch in its folded one."""
        if variant is None or variant == s.variant:
            return s
        if variant.stages != tuple(spec.name for spec, _, _ in s.stages):
            raise RuntimeError(f"{variant} forced on a batch tracing stages "
                               f"{[spec.name for spec, _, _ in s.stages]}")
        padded = batch.padded_logprobs if variant.logprobs else None
        # folded: the batch's own N, so step 15 runs in the graph only when it asks
        asked = s.logprobs_asked if variant.folded else padded
        return dataclasses.replace(s, variant=variant, logprobs_asked=asked,
                                   **flags_for(variant, padded, batch.padded_logprobs))


def _draw_over_vocabulary(x: torch.Tensor, keys: torch.Tensor, greedy: torch.Tensor,
                          *unused: torch.Tensor) -> torch.Tensor:
    """int64 ``[B]``: ``first_argmax(x + gumbel)`` with each row's noise (int32 ``[B]`` keys)
    hashed at every token of the vocabulary, none in greedy rows (bool ``[B]``); x float32
    ``[B, V]``.

    The noise's two logarithms are taken only where a token can win. One pass computes
    each token's upper bound (``_score_bound``: the hash and the uniform, no logarithm) and
    its maxima down ``[B, 32, V / 32]`` (a reduction that keeps the minor dimension, which
    XLA:CPU vectorises with the expression fused in); the ``_BOUND_COLUMNS`` columns of 32
    tokens with the largest bounds get their exact scores (the same noise at the same ids,
    the same sums), and where every token left outside has a bound below the best exact
    score, the best's first id is the race's winner, as over the whole vocabulary. Else
    (a tie at the bound, NaN or +inf, more contenders) every row takes ``first_argmax``
    over the exact scores, in a conditional."""
    B, V = x.shape
    W = V // _STRIDE
    if V % _STRIDE or W < _BOUND_COLUMNS:
        return _first_argmax_of_race(x, keys, greedy)
    vocab = xla.iota(V, torch.int32, keys.device)
    bound = _score_bound(x, noise.uniform_noise(keys[:, None], vocab), greedy)
    columns = bound.reshape(B, _STRIDE, W).max(dim=1).values       # (B, W)
    step = xla.iota(_STRIDE, torch.int64, x.device) * W            # (1, 32)
    best = torch.full_like(columns[:, :1], NEG_INF)
    token = torch.full_like(best, V, dtype=torch.int64)
    nan = torch.zeros_like(best, dtype=torch.bool)
    for _ in range(_BOUND_COLUMNS):
        top = columns.max(dim=-1, keepdim=True).values
        column = thresholds._first_index(columns == top).clamp(max=W - 1)    # (B, 1)
        ids = column + step                                                 # (B, 32) ascending
        gumbel = noise.seeded_gumbel(keys[:, None], ids.to(torch.int32))
        scores = x.gather(1, ids) + torch.where(greedy[:, None], 0.0, gumbel)
        here = scores.max(dim=-1, keepdim=True).values
        nan = nan | torch.isnan(scores).any(dim=-1, keepdim=True)
        first = torch.where(scores == here, ids, V).min(dim=-1, keepdim=True).values
        token = torch.where((here > best) | ((here == best) & (first < token)), first, token)
        best = torch.maximum(best, here)
        columns = columns.scatter(1, column, NEG_INF)
    rest = columns.max(dim=-1, keepdim=True).values
    settled = ((rest < best) & (best < float("inf")) & ~nan).all()
    return xla.cond(settled, _given_tokens, _first_argmax_of_race,
                    [x, keys, greedy, token[:, 0]], "draw over vocabulary")


#: ``_draw_over_vocabulary``'s columns: tokens t, t + V / _STRIDE, ... share one.
_STRIDE = 32
#: Columns ``_draw_over_vocabulary`` scores exactly before it falls back (measured: at
#: most 3 columns held a token whose bound reached the row's winner, in 36 batches of 32
#: rows at V = 128256, flat to peaked).
_BOUND_COLUMNS = 4
_LN2 = math.log(2.0)


def _score_bound(x: torch.Tensor, u: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """float32 ``[B, V]`` expression: at least the race's score ``x + (-log(-log(u)))`` in
    float32 at every token (x float32 ``[B, V]``, u the contract's uniforms, greedy bool
    ``[B]``: x itself there), without a logarithm. With d = 1 - u (exact: u has 24 bits),
    -log(u) = d + d**2 / 2 + d**3 / 3 + ... >= y = the first three terms, so the noise is at
    most -log(y) = -(e + log2(m)) ln 2 for y = m 2**e, m in [1, 2), and log2(m) >= m - 1:
    y's bit pattern read as a number, over 2**23, less 127, is e + m - 1 (within 0.09 of
    log2(y)). A margin of 2**-10 of the bound, 2**-10 on top and 2**-16 of the sum covers
    the float32 logarithms and roundings (``test_noise``'s exhaustive check of all 2**23
    uniforms)."""
    d = 1.0 - u
    bits = xla.bitcast(d + d * d * (0.5 + d * (1.0 / 3.0)), torch.int32).to(torch.float32)
    noise_bound = (-_LN2 * (1.0 + 2.0 ** -10)) * (bits * 2.0 ** -23 - 127.0) + 2.0 ** -10
    raw = x + torch.where(greedy[:, None], 0.0, noise_bound)
    raw = torch.where(raw > 0, raw * (1.0 + 2.0 ** -16), raw * (1.0 - 2.0 ** -16))
    # NaN: +inf, so that its column is examined (or the race falls back), never skipped
    return torch.where(torch.isnan(x), float("inf"), raw)


def _race_scores(x: torch.Tensor, keys: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """float32 ``[B, V]`` expression: x plus each row's seeded noise at every token (none in
    greedy rows)."""
    vocab = xla.iota(x.shape[-1], torch.int32, keys.device)
    gumbel = noise.seeded_gumbel(keys[:, None], vocab)
    return x + torch.where(greedy[:, None], 0.0, gumbel)


def _first_argmax_of_race(x: torch.Tensor, keys: torch.Tensor, greedy: torch.Tensor,
                          *unused: torch.Tensor) -> torch.Tensor:
    """``_draw_over_vocabulary`` by ``thresholds.first_argmax`` (any row)."""
    return thresholds.first_argmax(_race_scores(x, keys, greedy))


def _draw_over_candidates(K: int):
    """``_draw_over_vocabulary`` for rows whose kept tokens (x > -inf) are among their K
    largest logits, and greedy rows, free of NaN and +inf (``thresholds.narrow_rows``): the
    race over ``top_entries(x, K)`` only, the noise hashed at those ids (the same values as
    at those positions of the vocabulary-wide noise), ties to the lowest id. A greedy row
    whose K largest logits all tie has maxima outside them, which only the vocabulary-wide
    argmax sees: then every row takes that one (a conditional)."""
    def draw(x: torch.Tensor, keys: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
        values, ids = thresholds.top_entries(x, K)                             # (B, K)
        gumbel = noise.seeded_gumbel(keys[:, None], ids.to(torch.int32))
        scores = values + torch.where(greedy[:, None], 0.0, gumbel)
        best = scores.max(dim=-1, keepdim=True).values
        tokens = torch.where(scores == best, ids, x.shape[-1]).min(dim=-1).values
        # the K-th largest below the largest: fewer than K ties at the max, all candidates
        maxima_inside = ~greedy | (values[:, K - 1] < values[:, 0]) | (K == x.shape[-1])
        return xla.cond(maxima_inside.all(), _given_tokens, _draw_over_vocabulary,
                        [x, keys, greedy, tokens], ("draw over candidates", K))
    return draw


def _race(x: torch.Tensor, keys: torch.Tensor, greedy: torch.Tensor,
          ids: torch.Tensor) -> torch.Tensor:
    """int64 ``[B]``: the draw of ``_draw_over_candidates`` for rows whose kept tokens (for
    a greedy row, bool ``greedy``: its first maximum) all lie among ``ids`` (int64 ``[B, K]``,
    distinct): their logits gathered from x float32 ``[B, V]``, the same noise at the same
    ids, the same sums, the same winner (the lowest id among the best), with no pass over
    ``x``."""
    values = x.gather(1, ids)                                                  # (B, K)
    gumbel = noise.seeded_gumbel(keys[:, None], ids.to(torch.int32))
    scores = values + torch.where(greedy[:, None], 0.0, gumbel)
    best = scores.max(dim=-1, keepdim=True).values
    return torch.where(scores == best, ids, x.shape[-1]).min(dim=-1).values


def _draw_by_search(K: int):
    """The draw where the route's candidates do not serve (``TpuSampler.draw``): over each
    row's K largest logits where every row is narrow (``thresholds.narrow_rows``), else over
    the vocabulary."""
    def draw(x, keys, greedy, ids):
        narrow = thresholds.narrow_rows(x, K, greedy).all()
        return xla.cond(narrow, _draw_over_candidates(K), _draw_over_vocabulary,
                        [x, keys, greedy], ("draw", K))
    return draw


def _given_tokens(x: torch.Tensor, keys: torch.Tensor, greedy: torch.Tensor,
                  tokens: torch.Tensor) -> torch.Tensor:
    """The branch of a draw whose tokens are already known: ``tokens`` as they are."""
    return tokens


def _entropy_generator() -> torch.Generator:
    generator = torch.Generator()
    generator.seed()
    return generator
