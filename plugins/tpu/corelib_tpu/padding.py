"""The graph runner's argument checks and padding: a step's tensors brought to the batch's
bucket (rows) and the graph's K (``verify``'s slots).

Each device input that does not already have the step's shapes goes through a small padding
graph of its own (one per row count, dtype and bucket), so the step graph itself only ever
sees bucket-shaped inputs; inputs that already fit are passed as they are (no copy, no graph).
``Padding`` is a mixin of ``GraphRunner`` (``corelib_tpu.graph``); ``_warm_padding`` compiles
those graphs during ``warmup`` through the very code that pads in serving.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from corelib.batch import SamplingBatch
from corelib.bitmask import bitmask_width
from corelib.params import SamplingParams
from corelib.verification import _check_draft_ids, checked_draft_ids, checked_draft_probs, verify_logits_shape

from . import xla
from .batch import XlaSamplingBatch

__all__ = ["Padding", "WARM_PARAMS"]

#: Parameters of warm-up's scratch rows (graphs depend on shapes, not parameters).
WARM_PARAMS = SamplingParams(temperature=0.0)


class Padding:
    """Checks and padding of a step's arguments (module docstring); mixed into ``GraphRunner``,
    whose ``device``, ``guard``, ``buckets``, ``speculative_k`` and ``new_batch`` it uses."""

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
            scratch.add(f"warm-{rows}", WARM_PARAMS)
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
