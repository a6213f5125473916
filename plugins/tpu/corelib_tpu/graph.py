"""The ``tpu`` backend's graph runner: how a step becomes one XLA graph and one transfer.

``GraphRunner`` holds everything of ``TpuSampler`` that is about graphs rather than stages:

- the arguments' checks, and their padding to the batch's bucket (rows) and the graph's K
  (``verify``'s slots), each through a small padding graph of its own that is skipped when
  the caller's tensors already have the step's shapes;
- ``sample``, ``verify`` and ``processed_logits``: the core's template (``Sampler.sample``,
  ``Sampler.verify_state``) run on the padded tensors, its results packed into one int32
  tensor, launched as one graph with ``xla.launch`` on exactly its outputs and read back in
  one device-to-host transfer, unpacked on the host to CPU tensors of the live rows;
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
from corelib.params import SamplingParams
from corelib.outputs import Logprobs, SamplerOutput, ScoreOutput, VerifyOutput, slot_logprobs
from corelib.sampler import Sampler
from corelib.verification import (
    VERIFY_METHODS,
    _check_draft_ids,
    checked_draft_ids,
    checked_draft_probs,
    verify_logits_shape,
)

from . import xla
from .batch import XlaSamplingBatch
from .layout import PATHS, Variant
from .buckets import Buckets
from .drafts import device_drafts
from .orders import FilterOrders

__all__ = ["GraphRunner", "WarmupReport"]

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
    score_positions: tuple[int, ...] = ()
    cache_hits: int = 0            # graphs loaded from the persistent compile cache instead
    #: graphs compiled for each ("sample", bucket), ("verify", bucket, K) and ("score",
    #: bucket, T) step
    step_graphs: dict = dataclasses.field(default_factory=dict)


class GraphRunner(Sampler):
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
        # the persistent cache must be on before the process's first XLA computation
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
            return _empty_output()
        bucket = batch.bucket(n)
        xla.launch([logits])          # a caller's pending graph is the caller's own
        mask = batch.padded_bitmask(token_bitmask, bucket)
        with self.guard.watch(f"sample (bucket {bucket}, {batch.variant()})"):
            x = self._padded(logits, batch, bucket, per_request)
            out = super().sample(x, batch, mask)       # keeps out.selector_source for append
            packed = _pack(out)
            xla.launch(_outputs(packed, out))
            host, kept = _fetch(packed, out.kept, batch)         # the one transfer of the step
        result = _unpack(host[:n], batch._asked_logprobs(), out.logprobs is not None)
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
            xla.launch(_outputs(packed, out))
            batch.keep_selector_source(out.selector_source, slots=graph_k + 1)
            host, kept = _fetch(packed, out.kept, batch)         # the one transfer of the step
        result = _unpack_verify(host[:n], K + 1, graph_k + 1, batch._asked_logprobs(),
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
            return _each_score(out, lambda t: t.cpu()[:, 0] if one else t.cpu())
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
            packed = _pack_score(out)
            xla.launch(_outputs(packed, out))
            batch.keep_selector_source(out.selector_source, slots=T)
            host = packed.cpu()                                  # the one transfer of the call
        result = _unpack_score(host[:n * T], n, T)
        return _each_score(result, lambda t: t[:, 0]) if one else result

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
                        xla.launch(_outputs(_pack(out), out))
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
                        xla.launch(_outputs(_pack_verify(out), out))
            for T in score_t:
                xs = self._zeros((bucket, T, V), torch.float32)
                ids = torch.full((bucket, T), -1, dtype=torch.long).to(self.device)
                words = torch.zeros((bucket, T, bitmask_width(V)), dtype=torch.int32).to(self.device)
                for chosen in [v for v in variants if v.random]:
                    for given in (None, words):
                        with counted("score", bucket, T), self._forcing(chosen):
                            out = self._score_padded(xs, scratch, ids, given)
                            xla.launch(_outputs(_pack_score(out), out))
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

    # ------------------------------------------------------------------ checks and padding
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

    @contextmanager
    def _forcing(self, variant: Variant):
        """Warm-up only: run the template with a given static variant."""
        self._forced = variant
        try:
            yield
        finally:
            self._forced = None


def _outputs(packed: torch.Tensor, out) -> list[torch.Tensor]:
    """What a step graph computes: the packed results, the kept sets (int32 ``[B, W]``, or
    ``[B, K + 1, W]``; zeros unless a row asks, ``TpuSampler.kept_set``: an output of every
    step graph, so that asking compiles nothing new), and the distribution after the filter
    group where rows use a stateful selector (it stays on the device for ``append``)."""
    extra = [t for t in (getattr(out, "kept", None), out.selector_source) if t is not None]
    return [packed, *extra]


def _fetch(packed: torch.Tensor, kept: Optional[torch.Tensor],
           batch: XlaSamplingBatch) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The step's results on the host in one transfer: the packed tensor, and the kept sets
    when some row asks for them (``batch.asks_kept``; otherwise they stay on the device and
    None is returned)."""
    if kept is None or not batch.asks_kept():
        return packed.cpu(), None
    host, words = xla.fetch([packed, kept])
    return host, words


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


def _pack_score(out: ScoreOutput) -> torch.Tensor:
    """int32 ``[B T, 5]``: (logprob bits, raw logprob bits, kept_token, rank, valid), one
    tensor for one transfer."""
    return torch.stack([xla.bitcast(out.logprobs.to(torch.float32), torch.int32),
                        xla.bitcast(out.raw_logprobs.to(torch.float32), torch.int32),
                        out.kept_token.to(torch.int32), out.ranks.to(torch.int32),
                        out.valid.to(torch.int32)], dim=1)


def _unpack_score(host: torch.Tensor, rows: int, T: int) -> ScoreOutput:
    """The inverse of ``_pack_score`` on the host, as ``[rows, T]`` tensors."""
    host = host.reshape(rows, T, 5)
    return ScoreOutput(host[..., 0].contiguous().view(torch.float32),
                       host[..., 1].contiguous().view(torch.float32), host[..., 2].to(torch.bool),
                       host[..., 3].to(torch.long), host[..., 4].to(torch.bool))


def _each_score(out: ScoreOutput, f) -> ScoreOutput:
    return ScoreOutput(f(out.logprobs), f(out.raw_logprobs), f(out.kept_token), f(out.ranks),
                       f(out.valid))


def _empty_output() -> SamplerOutput:
    return SamplerOutput(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.bool), None)


def _empty_verify_output(slots: int) -> VerifyOutput:
    return VerifyOutput(torch.empty((0, slots), dtype=torch.long), torch.empty(0, dtype=torch.long),
                        torch.empty(0, dtype=torch.bool), None)


def _positive_ints(name: str, values: Iterable[int]) -> tuple[int, ...]:
    """``values`` sorted without repeats (``speculative_k``, ``score_positions``); ValueError
    naming ``name`` for anything but a positive int."""
    values = tuple(values)
    for k in values:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"{name} must hold positive ints, got {k!r} in {values!r}")
    return tuple(sorted(set(values)))
