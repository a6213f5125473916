"""``TpuSampler``: the core's template with every stage traced into a fixed XLA graph.

One step is at most two graphs, both compiled once: a small one that pads the caller's logits
to the batch's bucket (skipped when they arrive padded as float32), and the step itself, chosen
by (bucket, ``Variant``: greedy or random, logprobs or not); ``verify`` adds K + 1 slots per
row, picks K from a configured set and has one variant. A random graph holds every path of
steps 11-13 and every filter inside XLA conditionals (``xla.cond``), so a step runs only what
its rows use. ``docs/tpu.md`` counts the graphs. The stage order is the core's: ``Sampler.sample`` and
``Sampler.verify_state`` run here unchanged, on the padded logits, with the stages below
overridden where the reference is not traced-friendly (a sort, per-token scatters, ``argmax``
that XLA:CPU does not vectorise, ``torch.rand``) or where the layout differs (dense additive
row, dense stop mask, DRY's window). The results come back in one device-to-host transfer, as
CPU tensors.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager
from typing import Iterable, Optional, Sequence

import torch
from corelib.batch import SamplingBatch
from corelib.bitmask import bitmask_width
from corelib.drafts import DraftLayout, padded_arguments
from corelib.params import MAX_LOGPROBS, SamplingParams
from corelib.sampler import (
    INVALID_TOKEN,
    NEG_INF,
    RAW_MODES,
    VERIFY_METHODS,
    Drafts,
    Logprobs,
    Sampler,
    SamplerOutput,
    VerifyOutput,
    _check_draft_ids,
    checked_draft_ids,
    checked_draft_probs,
    slot_logprobs,
    verify_logits_shape,
)

from corelib import noise

from . import bitmask, dry, filters, thresholds, xla
from .batch import PATHS, ROUTES, Variant, XlaSamplingBatch, XlaStepState, flags_for
from .buckets import Buckets
from .xla import RecompilationError

__all__ = ["TpuSampler", "RecompilationError", "WarmupReport"]

#: Parameters of warm-up's scratch rows (graphs depend on shapes, not parameters).
_WARM_PARAMS = SamplingParams(temperature=0.0)



@dataclasses.dataclass
class WarmupReport:
    """What ``TpuSampler.warmup`` compiled."""

    graphs: int        # new XLA graphs compiled (0 off XLA)
    seconds: float
    buckets: tuple[int, ...]
    paths: tuple[str, ...]
    variants: int = 0              # static variants of the sample step per bucket
    speculative_k: tuple[int, ...] = ()
    cache_hits: int = 0            # graphs loaded from the persistent compile cache instead
    #: graphs compiled for each ("sample", bucket) and ("verify", bucket, K) step
    step_graphs: dict = dataclasses.field(default_factory=dict)


class TpuSampler(Sampler):
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
        on_xla = device is None or xla.is_xla(device)
        self.compile_cache_dir = xla.compile_cache(compile_cache) if on_xla else None
        super().__init__(device if device is not None else xla.default_device(), generator)
        self.buckets = buckets if isinstance(buckets, Buckets) else Buckets(buckets, max_rows)
        self.top_k_candidates = top_k_candidates
        self.max_bad_words = max_bad_words
        self.max_bad_word_length = max_bad_word_length
        self.speculative_k = _speculative_k(speculative_k)
        self.dry_window = dry_window
        self.max_dry_breakers = max_dry_breakers
        self.max_logprobs = max_logprobs
        self.max_thinking_marker_length = max_thinking_marker_length
        self.stages = None if stages is None else tuple(stages)
        self.guard = xla.CompileGuard(strict)
        self._host_generator = generator if generator is not None else _entropy_generator()
        self._forced: Optional[Variant] = None
        self._noise_cache: Optional[tuple] = None
        self._finite_pending: Optional[torch.Tensor] = None

    @property
    def strict(self) -> bool:
        return self.guard.strict

    @strict.setter
    def strict(self, value: bool) -> None:
        self.guard.strict = bool(value)

    # ------------------------------------------------------------------ public API
    def new_batch(self, vocab_size: int, eos_token_id: Optional[int] = None,
                  logprobs_mode: str = "raw") -> XlaSamplingBatch:
        return self.batch_class(
            vocab_size, self.device, eos_token_id, logprobs_mode, buckets=self.buckets,
            top_k_candidates=self.top_k_candidates, max_bad_words=self.max_bad_words,
            max_bad_word_length=self.max_bad_word_length, dry_window=self.dry_window,
            max_dry_breakers=self.max_dry_breakers, stages=self.stages,
            num_logprobs=self.max_logprobs,
            max_thinking_marker_length=self.max_thinking_marker_length, guard=self.guard)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch,
               token_bitmask: Optional[torch.Tensor] = None) -> SamplerOutput:
        """``Sampler.sample`` on the logits padded to the batch's bucket, then one transfer.

        logits: ``[rows, V]``, ``[num_requests, V]``, or already padded to the bucket
        (``[batch.bucket(), V]``, rows past the live ones ignored: the layout that needs no
        padding graph), any float dtype, on ``sampler.device``. token_bitmask: None or int32
        ``[rows, ceil(V / 32)]`` (or padded to the bucket) on the host or the device. Returns
        CPU tensors of the live rows. Overridden only to pad before and fetch after: the
        stage order is the core's.
        """
        per_request = self._check(logits, batch)
        n = batch.num_rows
        if n == 0:
            if token_bitmask is not None:
                batch.check_token_bitmask(token_bitmask)
            return _empty_output()
        bucket = batch.bucket(n)
        xla.launch([logits])          # a caller's pending graph is the caller's own
        mask = batch.padded_bitmask(token_bitmask, bucket)
        with self.guard.watch(f"sample (bucket {bucket}, {batch.variant()})"):
            x = self._padded(logits, batch, bucket, per_request)
            out = super().sample(x, batch, mask)
            packed = _pack(out)
            xla.launch([packed])
            host = packed.cpu()                                  # the one transfer of the step
        return _unpack(host[:n], batch._asked_logprobs(), out.logprobs is not None)

    def verify(self, logits: torch.Tensor, batch: SamplingBatch, draft_token_ids: torch.Tensor,
               draft_probs: Optional[torch.Tensor] = None,
               token_bitmask: Optional[torch.Tensor] = None, method: str = "token",
               num_drafts=None) -> VerifyOutput:
        """``Sampler.verify`` with K + 1 slots per row in one graph per (bucket, K, draft
        probabilities given or not, and with them ``method``), then one transfer;
        returns CPU tensors.

        logits ``[rows, K + 1, V]`` on the device (any float dtype); draft_token_ids int
        ``[rows, K]``, draft_probs float ``[rows, K, V]`` and token_bitmask int32
        ``[rows, K + 1, ceil(V / 32)]`` on the host or the device. Every argument may instead
        come padded to ``batch.bucket()`` rows (the layout that needs no padding graph). With
        ``speculative_k`` configured, K must not exceed its largest; a K between them runs in
        the next configured one (its extra slots hold no draft and are cut from the result).
        K = 0 is ``sample``. Draft ids on the device are not read back: out-of-range ones flag their
        row, as in the core. method: "token" or "block" (``Sampler.verify``).

        num_drafts: the flat form (``corelib.drafts``), padded to ``[rows, K + 1, ...]`` first.
        Its gather depends on the flat row count ``sum(k) + rows``, so it compiles a graph per
        count, which warm-up does not cover (docs/tpu.md): engines on TPU pass the padded form.
        """
        if method not in VERIFY_METHODS:
            raise ValueError(f"verify: method must be one of {VERIFY_METHODS}, got {method!r}")
        self._check_batch(batch)
        if num_drafts is not None:
            layout = DraftLayout.of(num_drafts)
            with self.guard.watch(f"verify's flat form ({layout.num_slots} logits rows, "
                                  f"K {layout.max_drafts})"):
                logits, draft_token_ids, draft_probs, token_bitmask = padded_arguments(
                    layout, logits, batch, draft_token_ids, draft_probs, token_bitmask)
                xla.launch([t for t in (logits, draft_token_ids, draft_probs, token_bitmask)
                            if t is not None])
        n, S, V = self._check_verify_logits(logits, batch)
        K = S - 1
        rows = logits.shape[0]
        ids, probs = self._check_drafts_arguments(rows, K, V, batch, draft_token_ids, draft_probs)
        if n == 0:
            if token_bitmask is not None:
                batch.check_token_bitmask(token_bitmask, S)
            return _empty_verify_output(S)
        if K == 0:
            return self._verify_without_drafts(logits, batch, token_bitmask)
        graph_k = self._graph_k(K)
        bucket = batch.bucket(n)
        xla.launch([logits])
        x, draft_ids, q, mask = self._padded_verify_inputs(logits, batch, ids, probs, token_bitmask,
                                                           bucket, graph_k)
        given = f"given, method {method}" if q is not None else "none"
        with self.guard.watch(f"verify (bucket {bucket}, K {graph_k}, "
                              f"draft_probs {given})"):
            out = self._verify_padded(x, batch, draft_ids, q, mask, method)
            packed = _pack_verify(out)
            xla.launch([packed])
            host = packed.cpu()                                  # the one transfer of the step
        return _unpack_verify(host[:n], K + 1, graph_k + 1, batch._asked_logprobs(),
                              out.logprobs is not None)

    def processed_logits(self, logits: torch.Tensor, batch: SamplingBatch,
                         token_bitmask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``Sampler.processed_logits`` of the live rows, as a CPU float32 ``[rows, V]``."""
        per_request = self._check(logits, batch)
        n = batch.num_rows
        if n == 0:
            return torch.empty((0, batch.vocab_size), dtype=torch.float32)
        bucket = batch.bucket(n)
        xla.launch([logits])
        mask = batch.padded_bitmask(token_bitmask, bucket)
        with self.guard.watch(f"processed_logits (bucket {bucket})"):
            x = self._padded(logits, batch, bucket, per_request)
            final = super().processed_logits(x, batch, mask)
            xla.launch([final])
            return final.cpu()[:n]

    def warmup(self, vocab_size: int, logprobs_mode: str = "raw",
               logits_dtypes: Sequence[torch.dtype] = (torch.float32,),
               per_request_logits: bool = False, processed_logits: bool = False,
               unpadded_verify: bool = False, device_bitmask: bool = False,
               block_verify: bool = False) -> WarmupReport:
        """Compile every graph serving can need for this vocabulary, then arm strict mode.

        Per bucket: the step for each static variant (``variants()``: 3), the verify step for
        each K of ``speculative_k`` and draft probabilities (given or not: its one folded
        variant serves every batch), the append graphs (one id per row, and K + 1), and the
        padding graphs of the logits for every row count in the bucket and each of
        ``logits_dtypes``; once: the row write and move graphs. ``per_request_logits`` adds
        padding from ``[m, V]`` per-request logits for every ``m`` up to the bucket;
        ``processed_logits`` adds the ``processed_logits`` graphs (tests and debugging);
        ``block_verify`` adds the verify graphs of ``method="block"`` (with draft
        probabilities); ``unpadded_verify`` adds the padding graphs of ``verify``'s device
        inputs (logits in each dtype, draft ids, float32 draft probabilities) for every row
        count that is not a bucket (without it, pass them padded to ``batch.bucket()``
        rows, or drafts from the host); ``device_bitmask`` the padding graphs of token
        bitmasks on the device (host masks need none). Uses a scratch batch of the same shapes
        (graphs depend on shapes, not contents).
        """
        start, hits, t0 = xla.compile_count(), xla.persistent_cache_hits(), time.perf_counter()
        scratch = self.new_batch(vocab_size, logprobs_mode=logprobs_mode)
        spec_k = self.speculative_k
        scratch.warm_state_graphs(slots=(1, *(k + 1 for k in spec_k)))
        V = vocab_size
        variants = self.variants(scratch)
        step_graphs: dict = {}

        @contextmanager
        def counted(*graph):
            before = xla.compile_count()
            yield
            step_graphs[graph] = step_graphs.get(graph, 0) + xla.compile_count() - before

        for bucket in self.buckets:
            x = self._zeros((bucket, V), torch.float32)
            for variant in variants:
                with self._forcing(variant):
                    with counted("sample", bucket):
                        xla.launch([_pack(Sampler.sample(self, x, scratch))])
                    if processed_logits:
                        xla.launch([Sampler.processed_logits(self, x, scratch)])
            for K in spec_k:
                xs = self._zeros((bucket, K + 1, V), torch.float32)
                ids = torch.full((bucket, K), -1, dtype=torch.long).to(self.device)
                q = self._zeros((bucket, K, V), torch.float32)
                mask = scratch.padded_bitmask(None, bucket, K + 1)
                judged = [(None, "token"), (q, "token")] + ([(q, "block")] if block_verify else [])
                for probs, method in judged:
                    with counted("verify", bucket, K):
                        out = self._verify_padded(xs, scratch, ids, probs, mask, method)
                        xla.launch([_pack_verify(out)])
        self._warm_padding(vocab_size, logprobs_mode, logits_dtypes, per_request_logits,
                           unpadded_verify, device_bitmask, spec_k)
        if self.device.type == "xla":
            import torch_xla
            torch_xla._XLAC._xla_wait_device_ops(devices=[])
        self.guard.armed = True
        return WarmupReport(graphs=xla.compile_count() - start,
                            seconds=time.perf_counter() - t0, buckets=tuple(self.buckets),
                            paths=PATHS, variants=len(variants), speculative_k=spec_k,
                            cache_hits=xla.persistent_cache_hits() - hits,
                            step_graphs=step_graphs)

    def variants(self, batch: Optional[XlaSamplingBatch] = None) -> list[Variant]:
        """Every static variant a ``sample`` step of this sampler can need (``Variant``):
        greedy with and without logprobs, and the folded random one, tracing the custom stages
        of ``stages`` (none without it: those graphs compile when rows first use a stage)."""
        if batch is None:
            batch = self.new_batch(1)
        stages = tuple(spec.name for spec, _ in batch._stages_in_use()) if self.stages is not None else ()
        return [Variant(False, False, stages), Variant(False, True, stages),
                Variant(True, True, stages, folded=True)]

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
        return self._with_variant(s, batch, Variant(random=True, logprobs=True, stages=s.variant.stages,
                                                    folded=True, greedy_batches=True))

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
        off; runs only when some row uses it (``xla.cond``). Not in place."""
        def run(x, history, match, since, multiplier, base, allowed_length, window):
            tokens, penalty = dry.penalties(history, match, since, multiplier, base,
                                            allowed_length, window)
            return dry.apply(x, tokens, penalty)
        return xla.cond((s.dry_multiplier > 0).any(), run, _unchanged,
                        [x, s.dry_history, s.dry_match, s.dry_since_breaker, s.dry_multiplier,
                         s.dry_base, s.dry_allowed_length, s.dry_range], "dry")

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

    def apply_top_n_sigma(self, x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """Step 10a (``filters.top_n_sigma_filter``): top_n_sigma float32 ``[B]``, 0 = off;
        runs only when some row uses it. Not in place."""
        return xla.cond((s.top_n_sigma > 0).any(), filters.top_n_sigma_filter, _unchanged,
                        [x, s.top_n_sigma], "top_n_sigma")

    def apply_min_p(self, x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """Step 11 (``thresholds.min_p_filter``): min_p float32 ``[B]``, 0 = off; runs only
        when some row uses it and the route is not the candidate path, which runs it inside
        ``apply_top_k_top_p`` from the row max its topk already has. Not in place."""
        needed = (s.min_p > 0).any() & (s.route[0] != ROUTES.index("candidates"))
        return xla.cond(needed, thresholds.min_p_filter, _unchanged, [x, s.min_p], "min_p")

    def apply_top_k_top_p(self, x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """Steps 12-13 without a sort, by the step's route (``ROUTES``, one branch of an
        ``xla.switch``): none (plain), from the candidate set alone (which also runs step 11
        there), top-k from the candidates and top-p by bisection, or both by bisection
        (``thresholds``). top_k int32 ``[B]`` (0 = off), top_p float32 ``[B]`` (1 = off),
        route int32 ``[B]`` (the batch's, in every row). Not in place."""
        candidates = self.top_k_candidates

        def from_candidates(x, top_k, top_p, min_p):
            return thresholds.top_k_top_p_candidates(x, top_k, top_p, min_p, candidates)

        def nucleus(x, top_k, top_p, min_p):
            x = thresholds.top_k_by_candidates(x, top_k, candidates)
            return thresholds.top_p_by_bisection(x, top_p)

        def exhaustive(x, top_k, top_p, min_p):
            return thresholds.top_p_by_bisection(thresholds.top_k_by_bisection(x, top_k), top_p)

        routes = {"plain": _unchanged, "candidates": from_candidates, "nucleus": nucleus,
                  "exhaustive": exhaustive}
        return xla.switch(s.route[0], [routes[name] for name in ROUTES],
                          [x, s.top_k, s.top_p, s.min_p], ("top_k_top_p", candidates))

    def apply_typical_p(self, x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """Step 13a by bisection over the scores, no sort (``filters.typical_p_by_bisection``):
        typical_p float32 ``[B]``, 1 = off; runs only when some row uses it. Not in place."""
        return xla.cond((s.typical_p < 1).any(), filters.typical_p_by_bisection, _unchanged,
                        [x, s.typical_p], "typical_p")

    def apply_xtc(self, x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """Step 13b (``filters.xtc_filter``), the coin from the XTC stream of ``row_uniforms``:
        xtc_probability float32 ``[B]`` (0 = off), xtc_threshold float32 ``[B]``; runs only
        when some row's coin came up. Not in place."""
        coin = self.row_uniforms(s, noise.STREAM_XTC) < s.xtc_probability
        return xla.cond(coin.any(), filters.xtc_filter, _unchanged,
                        [x, s.xtc_threshold, coin], "xtc")

    def draw(self, x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """Step 14 (and step 9 for greedy rows): int64 ``[B]``, ``argmax(x + gumbel)`` over the
        whole vocabulary (x float32 ``[B, V]``, dropped tokens -inf). Seeded rows key the
        contract's noise by (seed, child, position); unseeded rows by a fresh host-drawn key
        (``random_key``), so one hash serves both and nothing waits on the host."""
        # Greedy rows carry neutral filter parameters, so ``x`` is still their step-8a logits:
        # without noise, this argmax is step 9 (the template skips its own, see flags_for).
        return thresholds.first_argmax(x + self._row_noise(s, x.shape[-1]))

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
        recomputed where it is read instead of being stored; the draw reuses the noise tensor
        of the slots' own draws (one hash per step, not two). Rounding differs from the
        core's ``softmax`` in the last bits."""
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
        noise_at_stop = self._row_noise(s, V).index_select(0, at_stop)
        recovered = thresholds.first_argmax(target + noise_at_stop)             # (B,)
        return passed, recovered[:, None].expand(B, K)

    def raw_logprobs(self, x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """Step 1 as in the core; in a folded graph (``Variant.folded``) the raw logits alone,
        which step 15's conditional normalises when some row asks (XLA does not move the
        ``log_softmax`` into the branch by itself: it would run, two passes over ``[B, V]``,
        at every step). Not in place."""
        if s.variant.folded:
            return self.copy_logits(x)
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

    # ------------------------------------------------------------------ internals: verify
    def _verify_padded(self, x: torch.Tensor, batch: XlaSamplingBatch, draft_ids: torch.Tensor,
                       probs: Optional[torch.Tensor], mask: torch.Tensor,
                       method: str = "token") -> VerifyOutput:
        """The verify graph's contents: ``Sampler.verify_state`` on padded inputs (x float32
        ``[B, K+1, V]``, draft_ids int64 ``[B, K]``, probs float32 ``[B, K, V]`` or None, mask
        int32 ``[B, K+1, W]``, ``method`` as in ``verify``). The slots are flattened inside the
        graph, so the caller's tensors, padded or not, are its inputs as they are."""
        B, S, V = x.shape
        drafts = _device_drafts(draft_ids, probs, V, method)
        s = self.speculative_step_state(batch, drafts)
        s = dataclasses.replace(s, token_bitmask=mask.reshape(B * S, -1), any_bitmask=True)
        return self.verify_state(x.reshape(B * S, V), batch, s, drafts)

    def _verify_without_drafts(self, logits: torch.Tensor, batch: XlaSamplingBatch,
                               token_bitmask: Optional[torch.Tensor]) -> VerifyOutput:
        """K = 0: ``sample`` on slot 0, given a slot axis."""
        mask = None if token_bitmask is None else token_bitmask[:, 0]
        out = self.sample(logits[:, 0], batch, mask)
        emitted = out.token_ids[:, None]
        logprobs = None if out.logprobs is None else slot_logprobs(out.logprobs, emitted)
        return VerifyOutput(emitted, out.valid.to(torch.long), out.valid, logprobs)

    def _padded_verify_inputs(self, logits, batch: XlaSamplingBatch, ids: torch.Tensor,
                              probs: Optional[torch.Tensor], token_bitmask, bucket: int,
                              graph_k: int) -> tuple:
        """verify's arguments with ``bucket`` rows and ``graph_k`` drafts on the device: logits
        float32 ``[bucket (K+1), V]``, draft ids int64 ``[bucket, K]``, draft probabilities
        float32 ``[bucket, K, V]`` (or None), token bitmask int32 ``[bucket (K+1), W]``. Each
        device input that does not fit already goes through its own one-op padding graph."""
        rows, S, V = logits.shape
        what = f"({rows} rows, K {S - 1})"
        x = self._padded_slots(logits, batch, bucket, graph_k + 1)
        draft_ids = xla.fit_block(ids, (bucket, graph_k), -1, torch.long, self.device, self.guard,
                                  f"padding draft_token_ids {what}")
        q = None
        if probs is not None:
            q = xla.fit_block(probs, (bucket, graph_k, V), 0.0, torch.float32, self.device,
                              self.guard, f"padding draft_probs {what}")
        mask = batch.padded_bitmask(token_bitmask, bucket, S, graph_slots=graph_k + 1)
        return x, draft_ids, q, mask

    def _graph_k(self, K: int) -> int:
        """The configured K whose graph serves K drafts per row (the smallest >= K; K itself
        when none is configured)."""
        if not self.speculative_k:
            return K
        for k in self.speculative_k:
            if k >= K:
                return k
        raise ValueError(f"verify: K={K} draft slots, but this sampler compiles verification "
                         f"for speculative_k={self.speculative_k}; create it with "
                         f"TpuSampler(speculative_k=(..., {K}))")

    def _check_verify_logits(self, logits: torch.Tensor, batch: XlaSamplingBatch) -> tuple[int, int, int]:
        """The core's logits checks for ``verify``, also accepting rows padded to the bucket.
        Returns (live rows, K + 1, V)."""
        rows, S, V = verify_logits_shape(logits)
        n = batch.num_rows
        if rows != n and not (n and rows == batch.bucket(n)):
            raise ValueError(f"verify: logits have {rows} rows; the batch has {n} rows "
                             f"(verify takes one row per batch row, not per request, or rows "
                             f"padded to batch.bucket())")
        batch.check_logits(logits[:n, 0])
        return n, S, V

    def _check_drafts_arguments(self, rows: int, K: int, V: int, batch: XlaSamplingBatch,
                                draft_token_ids, draft_probs) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The core's checks of the draft arguments (``Sampler.check_drafts``) without moving
        anything to the device. Returns (ids, probs) as tensors."""
        ids = checked_draft_ids(draft_token_ids, rows, K)
        if ids.device.type == "cpu" and batch.num_rows and K:
            _check_draft_ids(ids[:batch.num_rows], V, batch)
        probs = None if draft_probs is None else checked_draft_probs(draft_probs, rows, K, V)
        return ids, probs

    def _padded_slots(self, logits: torch.Tensor, batch: XlaSamplingBatch, bucket: int,
                      slots: int) -> torch.Tensor:
        """float32 ``[bucket, slots, V]``: verify's logits with their rows padded to the bucket
        and their slots to ``slots`` (the graph's K + 1; extra slots repeat the last, and
        nothing reads them); the caller's tensor itself when it already is that."""
        rows, S, V = logits.shape
        if rows == bucket and S == slots and logits.dtype == torch.float32:
            return logits if xla.is_xla(logits.device) else logits.clone()
        sources = batch.row_sources(bucket, per_request=False).tolist()
        index = torch.tensor([r * S + min(j, S - 1) for r in sources for j in range(slots)],
                             dtype=torch.long)
        with self.guard.watch(f"padding verify logits ({rows} rows, {S} slots, {logits.dtype})"):
            x = self._pad(logits.reshape(rows * S, V), index).reshape(bucket, slots, V)
            xla.launch([x])
        return x

    # ------------------------------------------------------------------ internals
    def _check_batch(self, batch: SamplingBatch) -> None:
        if batch.device.type != self.device.type:
            raise ValueError(f"batch lives on {batch.device}, but sampler {self.name!r} runs on "
                             f"{self.device}")
        if not isinstance(batch, XlaSamplingBatch):
            raise TypeError(f"sampler {self.name!r} needs a batch from its new_batch(), got "
                            f"{type(batch).__name__}")

    def _check(self, logits: torch.Tensor, batch: SamplingBatch) -> bool:
        """Validate; True when ``logits`` hold one row per request (to expand to rows)."""
        self._check_batch(batch)
        n = batch.num_rows
        padded = (isinstance(logits, torch.Tensor) and logits.dim() == 2 and n > 0
                  and logits.shape[0] == batch.bucket(n) and logits.shape[0] not in (n, batch.num_requests))
        batch.check_logits(logits[:n] if padded else logits)
        return not padded and logits.shape[0] != n

    def _padded(self, logits: torch.Tensor, batch: XlaSamplingBatch, bucket: int,
                per_request: bool) -> torch.Tensor:
        """float32 ``[bucket, V]``: the caller's logits as they are when already padded float32
        rows (XLA: no copy, no graph), else through the padding graph."""
        if logits.shape[0] == bucket and not per_request and logits.dtype == torch.float32:
            return logits if xla.is_xla(logits.device) else logits.clone()
        x = self._pad(logits, batch.row_sources(bucket, per_request))
        xla.launch([x])
        return x

    def _pad(self, logits: torch.Tensor, sources: torch.Tensor) -> torch.Tensor:
        """Rows ``sources`` (int64 host ``[bucket]``) of ``logits`` as float32: the padding
        graph, one per (logits rows, dtype, bucket)."""
        return logits.index_select(0, sources.to(logits.device)).to(torch.float32)

    def _warm_padding(self, V: int, logprobs_mode: str, logits_dtypes: Sequence[torch.dtype],
                      per_request_logits: bool, unpadded_verify: bool, device_bitmask: bool,
                      spec_k: Sequence[int]) -> None:
        """The padding graphs of ``warmup``, through the very code that pads in serving, on a
        scratch batch that grows one row at a time (graphs depend on the row count only)."""
        scratch = self.new_batch(V, logprobs_mode=logprobs_mode)
        W = bitmask_width(V)
        for rows in range(1, self.buckets.largest + 1):
            scratch.add(f"warm-{rows}", _WARM_PARAMS)
            bucket = scratch.bucket(rows)
            for dtype in logits_dtypes:
                if rows != bucket or dtype != torch.float32:
                    self._padded(self._zeros((rows, V), dtype), scratch, bucket, per_request=False)
                if per_request_logits and rows == bucket:     # fewer requests than rows
                    smallest = max((b for b in self.buckets if b < bucket), default=0) + 1
                    for requests in range(1, smallest):
                        xla.launch([self._pad(self._zeros((requests, V), dtype),
                                              torch.zeros(bucket, dtype=torch.long))])
            if rows == bucket:
                continue
            if device_bitmask:
                scratch.padded_bitmask(self._device_words((rows, W)), bucket)
            for K in spec_k if (unpadded_verify or device_bitmask) else ():
                S = K + 1
                if device_bitmask:
                    scratch.padded_bitmask(self._device_words((rows, S, W)), bucket, S)
                if not unpadded_verify:
                    continue
                for dtype in logits_dtypes:
                    self._padded_slots(self._zeros((rows, S, V), dtype), scratch, bucket, S)
                ids = torch.full((rows, K), -1, dtype=torch.long).to(self.device)
                q = self._zeros((rows, K, V), torch.float32)
                self._padded_verify_inputs(self._zeros((rows, S, V), torch.float32), scratch, ids,
                                           q, None, bucket, K)

    def _device_words(self, shape) -> torch.Tensor:
        return torch.full(shape, -1, dtype=torch.int32).to(self.device)

    def _zeros(self, shape, dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype).to(self.device)

    def _random_keys(self, rows: int) -> torch.Tensor:
        return torch.randint(-(2**31), 2**31, (rows,), dtype=torch.int32, generator=self._host_generator)

    def _row_noise(self, s: XlaStepState, V: int) -> torch.Tensor:
        """float32 ``[B, V]``: each row's Gumbel noise (0 for greedy rows), made once per step
        state and reused by every draw of that step (``draw``, ``rejection_sample``). In a
        graph that also serves all-greedy batches (``Variant.greedy_batches``: verify's) it is
        made only when some row is random."""
        cached = self._noise_cache
        if cached is None or cached[0] is not s.random_key or cached[1] is not s.greedy:
            def row_noise(keys, greedy):
                vocab = xla.iota(V, torch.int32, keys.device)
                return torch.where(greedy[:, None], 0.0, noise.seeded_gumbel(keys[:, None], vocab))

            def silent(keys, greedy):
                return torch.zeros((keys.shape[0], V), dtype=torch.float32, device=keys.device)

            operands = [self._noise_keys(s), s.greedy]
            made = (xla.cond((~s.greedy).any(), row_noise, silent, operands, ("noise", V))
                    if s.variant.greedy_batches else row_noise(*operands))
            self._noise_cache = cached = (s.random_key, s.greedy, made)
        return cached[2]

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

    @contextmanager
    def _forcing(self, variant: Variant):
        """Warm-up only: run the template with a given static variant."""
        self._forced = variant
        try:
            yield
        finally:
            self._forced = None


def _unchanged(x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
    """The branch of a conditional stage that no row uses: its logits as they are."""
    return x


def _device_drafts(ids: torch.Tensor, probs: Optional[torch.Tensor], V: int,
                   method: str = "token") -> Drafts:
    """``Drafts`` of padded device inputs, as ``Sampler.check_drafts`` builds them: each row's
    real drafts (the leading ids >= 0), and whether the row is usable (ids in range, -1 only as
    a suffix, probabilities of real drafts finite and >= 0)."""
    present = ids >= 0
    count = leading_count(present)
    usable = ((ids >= -1) & (ids < V)).all(dim=1) & (present.sum(dim=1) == count)
    if probs is not None:
        real = xla.iota(ids.shape[1], torch.long, ids.device) < count[:, None]
        sane = (torch.isfinite(probs) & (probs >= 0)).all(dim=-1) | ~real
        usable = usable & sane.all(dim=1)
    return Drafts(ids, count, probs, usable, method)


def leading_count(mask: torch.Tensor) -> torch.Tensor:
    """int64 ``[B]``: how many leading entries of each row of bool ``[B, K]`` are True (the
    core's ``cumprod(...).sum()``, by a running sum: torch-xla 2.9 runs ``cumprod`` on the host,
    a transfer and a graph cut in the middle of the step)."""
    return (torch.cumsum((~mask).to(torch.int32), dim=1) == 0).sum(dim=1).to(torch.long)


def _pack(out: SamplerOutput) -> torch.Tensor:
    """int32 ``[B, 2]`` (token, valid), or ``[B, 3 + 2 (N+1)]`` with (rank, logprob ids,
    logprob values as their float32 bits): everything the host needs in one tensor."""
    cols = [out.token_ids[:, None].to(torch.int32), out.valid[:, None].to(torch.int32)]
    if out.logprobs is not None:
        lp = out.logprobs
        cols += [lp.ranks[:, None].to(torch.int32), lp.token_ids.to(torch.int32),
                 xla.bitcast(lp.logprobs, torch.int32)]
    return torch.cat(cols, dim=1)


def _unpack(host: torch.Tensor, asked: Optional[int], has_logprobs: bool) -> SamplerOutput:
    """The inverse of ``_pack`` on the host, keeping the batch's real N + 1 logprob columns."""
    token_ids, valid = host[:, 0].to(torch.long), host[:, 1].to(torch.bool)
    logprobs = None
    if has_logprobs and asked is not None:
        width = (host.shape[1] - 3) // 2
        take = asked + 1
        ids = host[:, 3:3 + take].to(torch.long)
        values = host[:, 3 + width:3 + width + take].contiguous().view(torch.float32)
        logprobs = Logprobs(ids, values, host[:, 2].to(torch.long))
    return SamplerOutput(token_ids, valid, logprobs)


def _pack_verify(out: VerifyOutput) -> torch.Tensor:
    """int32 ``[B, S + 2]`` (emitted tokens, their count, valid), or ``[B, 2 S + 2 + 2 S (N+1)]``
    with the slots' ranks, logprob ids and logprob bits: one tensor, one transfer."""
    B, S = out.token_ids.shape
    cols = [out.token_ids.to(torch.int32), out.num_emitted[:, None].to(torch.int32),
            out.valid[:, None].to(torch.int32)]
    if out.logprobs is not None:
        lp = out.logprobs
        cols += [lp.ranks.to(torch.int32), lp.token_ids.reshape(B, -1).to(torch.int32),
                 xla.bitcast(lp.logprobs.reshape(B, -1), torch.int32)]
    return torch.cat(cols, dim=1)


def _unpack_verify(host: torch.Tensor, slots: int, graph_slots: int, asked: Optional[int],
                   has_logprobs: bool) -> VerifyOutput:
    """The inverse of ``_pack_verify`` on the host, cut to the caller's ``slots`` and the
    batch's real N + 1 logprob columns."""
    S = graph_slots
    emitted = host[:, :slots].to(torch.long)
    num_emitted, valid = host[:, S].to(torch.long), host[:, S + 1].to(torch.bool)
    logprobs = None
    if has_logprobs and asked is not None:
        n = host.shape[0]
        width = (host.shape[1] - 2 - 2 * S) // (2 * S)
        take = asked + 1
        ranks = host[:, S + 2:2 * S + 2]
        ids = host[:, 2 * S + 2:2 * S + 2 + S * width].reshape(n, S, width)
        bits = host[:, 2 * S + 2 + S * width:].reshape(n, S, width)
        logprobs = Logprobs(ids[:, :slots, :take].to(torch.long),
                            bits[:, :slots, :take].contiguous().view(torch.float32),
                            ranks[:, :slots].to(torch.long))
    return VerifyOutput(emitted, num_emitted, valid, logprobs)


def _empty_output() -> SamplerOutput:
    return SamplerOutput(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.bool), None)


def _empty_verify_output(slots: int) -> VerifyOutput:
    return VerifyOutput(torch.empty((0, slots), dtype=torch.long), torch.empty(0, dtype=torch.long),
                        torch.empty(0, dtype=torch.bool), None)


def _speculative_k(values: Iterable[int]) -> tuple[int, ...]:
    values = tuple(values)
    for k in values:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"speculative_k must hold positive ints, got {k!r} in {values!r}")
    return tuple(sorted(set(values)))


def _entropy_generator() -> torch.Generator:
    generator = torch.Generator()
    generator.seed()
    return generator
