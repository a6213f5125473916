"""The ``tpu`` backend's graph runner: how a step becomes one XLA graph and one transfer.

``GraphRunner`` holds everything of ``TpuSampler`` that is about graphs rather than stages:

- ``sample``, ``verify``, ``score`` and ``processed_logits``: the arguments checked and padded
  to the batch's bucket and the graph's K (``Padding``, ``corelib_tpu.padding``), the core's
  template (``Sampler.sample``, ``Sampler.verify_state``, ``Sampler.score_state``) run on
  them, its results packed into one int32 tensor, launched as one graph with ``xla.launch``
  on exactly its outputs and read back in one device-to-host transfer, unpacked on the host
  to CPU tensors of the live rows (``corelib_tpu.transfer``);
- ``warmup``: every graph serving can need for a vocabulary, compiled on a scratch batch
  (each static ``Variant`` of the step per bucket, verify per (bucket, K), the padding graphs),
  then the compile guard armed (``xla.CompileGuard``).

The stages the template calls, and the step state they read, are ``TpuSampler``'s
(``corelib_tpu.sampler``); the runner never names one.
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
from corelib.outputs import SamplerOutput, ScoreOutput, VerifyOutput, slot_logprobs
from corelib.sampler import Sampler
from corelib.verification import VERIFY_METHODS

from . import transfer, xla
from .batch import XlaSamplingBatch
from .buckets import Buckets
from .drafts import device_drafts
from .layout import PATHS, Variant
from .orders import FilterOrders
from .padding import Padding

__all__ = ["GraphRunner", "WarmupReport"]


@dataclasses.dataclass
class WarmupReport:
    """What ``TpuSampler.warmup`` compiled."""

    graphs: int        # new XLA graphs compiled (0 off XLA)
    seconds: float
    buckets: tuple[int, ...]
    paths: tuple[str, ...]
    variants: int = 0              # static variants of the sample step per bucket
    speculative_k: tuple[int, ...] = ()
    score_positions: tuple[int, ...] = ()
    cache_hits: int = 0            # graphs loaded from the persistent compile cache instead
    #: graphs compiled for each ("sample", bucket), ("verify", bucket, K) and ("score",
    #: bucket, T) step
    step_graphs: dict = dataclasses.field(default_factory=dict)


class GraphRunner(Padding, Sampler):
    """``Sampler`` whose steps run as fixed XLA graphs per bucket (module docstring).

    device: an XLA device (None: the first one) or a plain torch device, where the same code
    runs eagerly. buckets, max_rows: the row counts graphs are compiled for (``Buckets``).
    speculative_k, strict, compile_cache: as ``TpuSampler`` documents them. Subclasses
    provide ``new_batch`` (an ``XlaSamplingBatch``) and the stages.
    """

    def __init__(self, device: torch.device | str | None, generator: Optional[torch.Generator], *,
                 buckets: Optional[Iterable[int]], max_rows: int, speculative_k: Iterable[int],
                 strict: bool, compile_cache):
        on_xla = device is None or xla.is_xla(device)
        # both must come before the runtime starts: the XLA:CPU code generation options, then
        # the persistent cache (before the process's first XLA computation)
        #: the XLA:CPU flags this sampler added to XLA_FLAGS (``xla.choose_cpu_codegen``)
        self.cpu_codegen_chosen = xla.choose_cpu_codegen() if on_xla else ()
        self.compile_cache_dir = xla.compile_cache(compile_cache) if on_xla else None
        super().__init__(device if device is not None else xla.default_device(), generator)
        self.buckets = buckets if isinstance(buckets, Buckets) else Buckets(buckets, max_rows)
        self.speculative_k = _positive_ints("speculative_k", speculative_k)
        self.guard = xla.CompileGuard(strict)
        # the filter orders every random graph traces besides the default one (its batches share it)
        self.orders = FilterOrders()
        self._forced: Optional[Variant] = None

    @property
    def strict(self) -> bool:
        return self.guard.strict

    @strict.setter
    def strict(self, value: bool) -> None:
        self.guard.strict = bool(value)

    # ------------------------------------------------------------------ steps
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
            return transfer.empty_output()
        bucket = batch.bucket(n)
        xla.launch([logits])          # a caller's pending graph is the caller's own
        mask = batch.padded_bitmask(token_bitmask, bucket)
        with self.guard.watch(f"sample (bucket {bucket}, {batch.variant()})"):
            x = self._padded(logits, batch, bucket, per_request)
            out = super().sample(x, batch, mask)       # keeps out.selector_source for append
            packed = transfer.pack(out)
            xla.launch(transfer.outputs(packed, out))
            host, kept = transfer.fetch(packed, out.kept, batch)         # the one transfer of the step
        result = transfer.unpack(host[:n], batch._asked_logprobs(), out.logprobs is not None)
        result.kept = None if kept is None else kept[:n]
        return result

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
            return transfer.empty_verify_output(S)
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
            packed = transfer.pack_verify(out)
            xla.launch(transfer.outputs(packed, out))
            batch.keep_selector_source(out.selector_source, slots=graph_k + 1)
            host, kept = transfer.fetch(packed, out.kept, batch)         # the one transfer of the step
        result = transfer.unpack_verify(host[:n], K + 1, graph_k + 1, batch._asked_logprobs(),
                                out.logprobs is not None)
        result.kept = None if kept is None else kept.view(-1, graph_k + 1, kept.shape[-1])[:n, :K + 1]
        return result

    def score(self, logits: torch.Tensor, batch: SamplingBatch, token_ids,
              kept: Optional[torch.Tensor] = None) -> ScoreOutput:
        """``Sampler.score`` (teacher forcing) as one graph per (bucket, T, ``kept`` given or
        not, stateful selectors used or not), then one transfer; returns CPU tensors of the
        live rows. ``warmup(score_positions=...)`` compiles those graphs.

        logits ``[rows, T, V]`` (or ``[rows, V]`` with token_ids ``[rows]``) on the device, any
        float dtype; token_ids int ``[rows, T]`` and kept int32 ``[rows, T, ceil(V / 32)]`` on
        the host or the device. Each may instead come padded to ``batch.bucket()`` rows (the
        layout that needs no padding graph; host ids and kept sets never need one). Position
        t is a virtual row with the row's state advanced by ``token_ids[:, :t]`` (the state
        ``verify``'s slots see), through the same stages as ``sample``.

        With logits that require grad, the core's ``score`` runs on them unpadded, with this
        backend's stages and each conditional's predicate read on the host
        (``xla.eager_branches``): differentiable, results on the device, graphs compiled per
        shape (not covered by warm-up)."""
        self._check_batch(batch)
        if isinstance(logits, torch.Tensor) and logits.requires_grad:
            with xla.eager_branches():
                return super().score(logits, batch, token_ids, kept)
        n = batch.num_rows
        padded = (isinstance(logits, torch.Tensor) and logits.dim() in (2, 3) and n > 0
                  and logits.shape[0] == batch.bucket(n) and logits.shape[0] != n)
        live = (lambda t: t[:n] if isinstance(t, torch.Tensor) else t) if padded else (lambda t: t)
        self.check_score_arguments(live(logits), batch, live(token_ids), live(kept))
        one = logits.dim() == 2
        x = logits[:, None] if one else logits
        rows, T, V = x.shape
        if n == 0:
            out = self.empty_score_output(T, torch.float32)
            return transfer.each_score(out, lambda t: t.cpu()[:, 0] if one else t.cpu())
        bucket = batch.bucket(n)
        ids = token_ids if isinstance(token_ids, torch.Tensor) else torch.as_tensor(token_ids)
        ids = ids.reshape(rows, T)
        xla.launch([x])
        x = self._padded_slots(x, batch, bucket, T)
        ids = xla.fit_block(ids, (bucket, T), -1, torch.long, self.device, self.guard,
                            f"padding score's token_ids ({rows} rows, T {T})")
        words = None
        if kept is not None:
            words = xla.fit_block(kept.reshape(rows, T, -1), (bucket, T, kept.shape[-1]), 0,
                                  torch.int32, self.device, self.guard,
                                  f"padding score's kept ({rows} rows, T {T})")
        given = ", kept" if words is not None else ""
        with self.guard.watch(f"score (bucket {bucket}, T {T}{given})"):
            out = self._score_padded(x, batch, ids, words)
            packed = transfer.pack_score(out)
            xla.launch(transfer.outputs(packed, out))
            batch.keep_selector_source(out.selector_source, slots=T)
            host = packed.cpu()                                  # the one transfer of the call
        result = transfer.unpack_score(host[:n * T], n, T)
        return transfer.each_score(result, lambda t: t[:, 0]) if one else result

    def _score_padded(self, x: torch.Tensor, batch: XlaSamplingBatch, ids: torch.Tensor,
                      kept: Optional[torch.Tensor]) -> ScoreOutput:
        """The score graph's contents: ``Scoring.score_state`` on padded inputs (x float32
        ``[B, T, V]``, ids int64 ``[B, T]`` with -1 padding, kept int32 ``[B, T, W]`` or None),
        flat ``[B T]`` outputs."""
        B, T, V = x.shape
        s = self.score_step_state(batch, ids)
        flat_kept = None if kept is None else kept.reshape(B * T, -1)
        return self.score_state(x.reshape(B * T, V), batch, s, ids.reshape(-1), flat_kept)

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
               block_verify: bool = False, selectors: bool = True,
               orders: Iterable = (), score_positions: Iterable[int] = ()) -> WarmupReport:
        """Compile every graph serving can need for this vocabulary, then arm strict mode.

        Per bucket: the step for each static variant (``variants()``: 4, 3 without
        ``selectors``), the verify step for
        each K of ``speculative_k`` and draft probabilities (given or not: its one folded
        variant serves every batch; with ``selectors``, again with the stateful selectors),
        the append graphs (one id per row, and K + 1; with ``selectors``, also those that
        advance the selectors' state), and the
        padding graphs of the logits for every row count in the bucket and each of
        ``logits_dtypes``; once: the row write and move graphs. ``per_request_logits`` adds
        padding from ``[m, V]`` per-request logits for every ``m`` up to the bucket;
        ``processed_logits`` adds the ``processed_logits`` graphs (tests and debugging);
        ``block_verify`` adds the verify graphs of ``method="block"`` (with draft
        probabilities); ``unpadded_verify`` adds the padding graphs of ``verify``'s device
        inputs (logits in each dtype, draft ids, float32 draft probabilities) for every row
        count that is not a bucket (without it, pass them padded to ``batch.bucket()``
        rows, or drafts from the host); ``device_bitmask`` the padding graphs of token
        bitmasks on the device (host masks need none). ``selectors``: the graphs of rows using
        mirostat or adaptive-p (the fourth step variant, verify's and append's). ``orders``:
        the filter orders besides the default one that requests will run (``sampler_order``
        lists, or ``"temperature_last"``): every random graph traces each in a conditional on
        its rows (``corelib_tpu.orders``); an order none of them serves compiles the graphs
        again when a request first runs it. ``score_positions``: the position counts T that
        ``score`` will be called with (a trainer's sequence lengths): per bucket and T, the
        score graphs without and with ``kept`` (and, with ``selectors``, again with the
        stateful selectors), and the append graphs of T ids per row; they take inputs padded
        to the bucket (``score``). Uses a scratch batch of the same shapes (graphs depend on
        shapes, not contents).
        """
        start, hits, t0 = xla.compile_count(), xla.persistent_cache_hits(), time.perf_counter()
        self.orders.extend(orders)
        scratch = self.new_batch(vocab_size, logprobs_mode=logprobs_mode)
        spec_k = self.speculative_k
        score_t = _positive_ints("score_positions", score_positions)
        scratch.warm_state_graphs(slots=tuple(dict.fromkeys((1, *(k + 1 for k in spec_k), *score_t))),
                                  selectors=selectors)
        V = vocab_size
        variants = [v for v in self.variants(scratch) if selectors or not v.selectors]
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
                        out = Sampler.sample(self, x, scratch)
                        xla.launch(transfer.outputs(transfer.pack(out), out))
                    if processed_logits:
                        xla.launch([Sampler.processed_logits(self, x, scratch)])
            for K in spec_k:
                xs = self._zeros((bucket, K + 1, V), torch.float32)
                ids = torch.full((bucket, K), -1, dtype=torch.long).to(self.device)
                q = self._zeros((bucket, K, V), torch.float32)
                mask = scratch.padded_bitmask(None, bucket, K + 1)
                judged = [(None, "token"), (q, "token")] + ([(q, "block")] if block_verify else [])
                for (probs, method), chosen in [(j, v) for v in variants if v.random for j in judged]:
                    with counted("verify", bucket, K), self._forcing(chosen):
                        out = self._verify_padded(xs, scratch, ids, probs, mask, method)
                        xla.launch(transfer.outputs(transfer.pack_verify(out), out))
            for T in score_t:
                xs = self._zeros((bucket, T, V), torch.float32)
                ids = torch.full((bucket, T), -1, dtype=torch.long).to(self.device)
                words = torch.zeros((bucket, T, bitmask_width(V)), dtype=torch.int32).to(self.device)
                for chosen in [v for v in variants if v.random]:
                    for given in (None, words):
                        with counted("score", bucket, T), self._forcing(chosen):
                            out = self._score_padded(xs, scratch, ids, given)
                            xla.launch(transfer.outputs(transfer.pack_score(out), out))
        self._warm_padding(vocab_size, logprobs_mode, logits_dtypes, per_request_logits,
                           unpadded_verify, device_bitmask, spec_k)
        if self.device.type == "xla":
            import torch_xla
            torch_xla._XLAC._xla_wait_device_ops(devices=[])
        self.guard.armed = True
        return WarmupReport(graphs=xla.compile_count() - start,
                            seconds=time.perf_counter() - t0, buckets=tuple(self.buckets),
                            paths=PATHS, variants=len(variants), speculative_k=spec_k,
                            score_positions=score_t,
                            cache_hits=xla.persistent_cache_hits() - hits,
                            step_graphs=step_graphs)

    def variants(self, batch: Optional[XlaSamplingBatch] = None) -> list[Variant]:
        """Every static variant a ``sample`` step of this sampler can need (``Variant``):
        greedy with and without logprobs, and the folded random one without and with the
        stateful selectors (each tracing the sampler's filter orders), tracing the custom stages
        of ``stages`` (none without it: those graphs compile when rows first use a stage)."""
        if batch is None:
            batch = self.new_batch(1)
        stages = tuple(spec.name for spec, _ in batch._stages_in_use()) if self.stages is not None else ()
        orders = self.orders.traced
        return [Variant(False, False, stages), Variant(False, True, stages),
                Variant(True, True, stages, folded=True, orders=orders),
                Variant(True, True, stages, folded=True, selectors=True, orders=orders)]

    # ------------------------------------------------------------------ verify's inputs
    def _verify_padded(self, x: torch.Tensor, batch: XlaSamplingBatch, draft_ids: torch.Tensor,
                       probs: Optional[torch.Tensor], mask: torch.Tensor,
                       method: str = "token") -> VerifyOutput:
        """The verify graph's contents: ``Sampler.verify_state`` on padded inputs (x float32
        ``[B, K+1, V]``, draft_ids int64 ``[B, K]``, probs float32 ``[B, K, V]`` or None, mask
        int32 ``[B, K+1, W]``, ``method`` as in ``verify``). The slots are flattened inside the
        graph, so the caller's tensors, padded or not, are its inputs as they are."""
        B, S, V = x.shape
        drafts = device_drafts(draft_ids, probs, V, method)
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
        kept = None if out.kept is None else out.kept[:, None]
        return VerifyOutput(emitted, out.valid.to(torch.long), out.valid, logprobs, kept=kept)

    @contextmanager
    def _forcing(self, variant: Variant):
        """Warm-up only: run the template with a given static variant."""
        self._forced = variant
        try:
            yield
        finally:
            self._forced = None


def _positive_ints(name: str, values: Iterable[int]) -> tuple[int, ...]:
    """``values`` sorted without repeats (``speculative_k``, ``score_positions``); ValueError
    naming ``name`` for anything but a positive int."""
    values = tuple(values)
    for k in values:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"{name} must hold positive ints, got {k!r} in {values!r}")
    return tuple(sorted(set(values)))
