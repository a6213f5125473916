"""``TpuSampler``: the core's template with every stage traced into a fixed XLA graph.

One step is at most two graphs, both compiled once: a small one that pads the caller's logits
to the batch's bucket (skipped when they arrive padded as float32), and the step itself, chosen
by (bucket, path, logprobs on/off); ``docs/tpu.md`` counts them. The stage order is the
core's: ``Sampler.sample`` runs here unchanged, on the padded logits, with the stages below
overridden where the reference is not traced-friendly (a sort, per-token scatters, ``argmax``
that XLA:CPU does not vectorise) or where the layout differs (dense additive row, dense stop
mask). The results come back in one device-to-host transfer, as CPU tensors.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager
from typing import Iterable, Optional, Sequence

import torch
from corelib.batch import SamplingBatch
from corelib.params import MAX_LOGPROBS
from corelib.sampler import NEG_INF, Logprobs, Sampler, SamplerOutput

from corelib import noise

from . import thresholds, xla
from .batch import PATHS, XlaSamplingBatch, XlaStepState, flags_for
from .buckets import Buckets
from .xla import RecompilationError

__all__ = ["TpuSampler", "RecompilationError", "WarmupReport"]


@dataclasses.dataclass
class WarmupReport:
    """What ``TpuSampler.warmup`` compiled."""

    graphs: int        # new XLA graphs compiled (0 off XLA)
    seconds: float
    buckets: tuple[int, ...]
    paths: tuple[str, ...]


class TpuSampler(Sampler):
    """The ``tpu`` backend (module docstring). ``device`` defaults to the first XLA device.

    buckets: row counts to compile for (default 8, 16, ..., ``max_rows``); a batch holds at
    most the largest. top_k_candidates: the static K of the candidate path. max_bad_words,
    max_bad_word_length: size of the bad-word tables (words of two or more tokens). strict:
    after ``warmup()``, raise ``RecompilationError`` if any operation compiles a graph.
    generator: a CPU ``torch.Generator`` for unseeded rows' noise keys.
    """

    name = "tpu"
    batch_class = XlaSamplingBatch

    def __init__(self, device: torch.device | str | None = None,
                 generator: Optional[torch.Generator] = None, *,
                 buckets: Optional[Iterable[int]] = None, max_rows: int = 256,
                 top_k_candidates: int = 64, max_bad_words: int = 8,
                 max_bad_word_length: int = 8, strict: bool = False):
        if generator is not None and generator.device.type != "cpu":
            raise TypeError(f"generator must be a CPU torch.Generator (it draws the noise keys on "
                            f"the host), got one on {generator.device}")
        super().__init__(device if device is not None else xla.default_device(), generator)
        self.buckets = buckets if isinstance(buckets, Buckets) else Buckets(buckets, max_rows)
        self.top_k_candidates = top_k_candidates
        self.max_bad_words = max_bad_words
        self.max_bad_word_length = max_bad_word_length
        self.guard = xla.CompileGuard(strict)
        self._host_generator = generator if generator is not None else _entropy_generator()
        self._forced: Optional[tuple[str, bool]] = None

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
            max_bad_word_length=self.max_bad_word_length, num_logprobs=MAX_LOGPROBS,
            guard=self.guard)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """``Sampler.sample`` on the logits padded to the batch's bucket, then one transfer.

        logits: ``[rows, V]``, ``[num_requests, V]``, or already padded to the bucket
        (``[batch.bucket(), V]``, rows past the live ones ignored: the layout that needs no
        padding graph), any float dtype, on ``sampler.device``. Returns CPU tensors of the
        live rows. Overridden only to pad before and fetch after: the stage order is the core's.
        """
        per_request = self._check(logits, batch)
        n = batch.num_rows
        if n == 0:
            return _empty_output()
        bucket = batch.bucket(n)
        xla.launch([logits])          # a caller's pending graph is the caller's own
        with self.guard.watch(f"sample (bucket {bucket}, path {batch.path()!r})"):
            x = self._padded(logits, batch, bucket, per_request)
            out = super().sample(x, batch)
            packed = _pack(out)
            xla.launch([packed])
            host = packed.cpu()                                  # the one transfer of the step
        return _unpack(host[:n], batch._asked_logprobs(), out.logprobs is not None)

    def processed_logits(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """``Sampler.processed_logits`` of the live rows, as a CPU float32 ``[rows, V]``."""
        per_request = self._check(logits, batch)
        n = batch.num_rows
        if n == 0:
            return torch.empty((0, batch.vocab_size), dtype=torch.float32)
        bucket = batch.bucket(n)
        xla.launch([logits])
        with self.guard.watch(f"processed_logits (bucket {bucket})"):
            x = self._padded(logits, batch, bucket, per_request)
            final = super().processed_logits(x, batch)
            xla.launch([final])
            return final.cpu()[:n]

    def warmup(self, vocab_size: int, logprobs_mode: str = "raw",
               logits_dtypes: Sequence[torch.dtype] = (torch.float32,),
               per_request_logits: bool = False, processed_logits: bool = False) -> WarmupReport:
        """Compile every graph serving can need for this vocabulary, then arm strict mode.

        Per bucket: the step for each path (``PATHS``) with and without logprobs, the append
        graph, and the padding graphs for every row count in the bucket and each of
        ``logits_dtypes``; once: the row write and move graphs. ``per_request_logits`` adds
        padding from ``[m, V]`` per-request logits for every ``m`` up to the bucket;
        ``processed_logits`` adds the ``processed_logits`` graphs (tests and debugging). Uses a
        scratch batch of the same shapes (graphs depend on shapes, not contents).
        """
        start, t0 = xla.compile_count(), time.perf_counter()
        scratch = self.new_batch(vocab_size, logprobs_mode=logprobs_mode)
        scratch.warm_state_graphs()
        V = vocab_size
        for bucket in self.buckets:
            x = torch.zeros((bucket, V), dtype=torch.float32).to(self.device)
            for path in PATHS:
                for logprobs in (False, True):
                    with self._forcing(path, logprobs):
                        xla.launch([_pack(Sampler.sample(self, x, scratch))])
                        if processed_logits:
                            xla.launch([Sampler.processed_logits(self, x, scratch)])
            smallest = max((b for b in self.buckets if b < bucket), default=0) + 1
            for dtype in logits_dtypes:
                counts = range(1, bucket + 1) if per_request_logits else range(smallest, bucket + 1)
                for rows in counts:
                    if rows == bucket and dtype == torch.float32:
                        continue
                    logits = torch.zeros((rows, V), dtype=dtype).to(self.device)
                    sources = torch.zeros(bucket, dtype=torch.long)
                    xla.launch([self._pad(logits, sources)])
        if self.device.type == "xla":
            import torch_xla
            torch_xla._XLAC._xla_wait_device_ops(devices=[])
        self.guard.armed = True
        return WarmupReport(graphs=xla.compile_count() - start,
                            seconds=time.perf_counter() - t0,
                            buckets=tuple(self.buckets), paths=PATHS)

    # ------------------------------------------------------------------ template parts
    def step_state(self, logits: torch.Tensor, batch: SamplingBatch) -> XlaStepState:
        """The bucket's state, with fresh noise keys for unseeded rows from this sampler's
        generator: ``logits`` arrive padded, so their row count is the bucket."""
        B = logits.shape[0]
        keys = torch.randint(-(2**31), 2**31, (B,), dtype=torch.int32, generator=self._host_generator)
        s = batch.step_state(B, random_keys=keys)
        if self._forced is not None:
            path, logprobs = self._forced
            asked = MAX_LOGPROBS if logprobs else None
            s = dataclasses.replace(s, path=path, logprobs_asked=asked,
                                    **flags_for(path, asked, MAX_LOGPROBS))
        return s

    # ------------------------------------------------------------------ stages
    def working_copy(self, logits: torch.Tensor, batch: SamplingBatch, s: XlaStepState) -> torch.Tensor:
        """Step 2: ``logits`` are already a float32 ``[B, V]`` tensor that ``sample`` made (or,
        on XLA, whose graphs never write into their inputs, the caller's padded float32
        logits): returned as they are."""
        return logits

    def finite_rows(self, x: torch.Tensor) -> torch.Tensor:
        """All True: the NaN/+inf check is folded into ``any_token_left``, which runs after
        steps 3-5. Those steps only add (0 or -inf), so NaN and +inf survive them (+inf
        under a -inf mask becomes NaN) and one reduction answers both questions."""
        return torch.ones(x.shape[0], dtype=torch.bool, device=x.device)

    def any_token_left(self, x: torch.Tensor) -> torch.Tensor:
        """bool ``[B]``: rows with no NaN or +inf and at least one token above -inf, from one
        int8 max over a per-token code (2 = NaN/+inf, 1 = live, 0 = -inf): XLA's float max
        neither propagates NaN nor returns -inf for an all -inf row."""
        bad = torch.isnan(x) | (x == float("inf"))
        code = torch.where(bad, 2, (x > NEG_INF).to(torch.int8)).to(torch.int8)
        return code.max(dim=-1).values == 1          # 2: NaN/+inf, 0: all -inf

    def apply_allowed_ids(self, x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """Steps 3, 4 (one-token bad words) and 6 as one add: ``x + static_add`` with
        ``static_add`` float32 ``[B, V]`` holding -inf for disallowed and banned tokens and the
        logit bias elsewhere (0 = no option). The bias is finite, so adding it before steps
        4-5 changes neither their masks nor the valid-row check. Not in place."""
        return x + s.static_add

    def apply_bad_words(self, x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """Step 4 for words of two or more tokens: when the row's last generated tokens equal a
        word's prefix, its last token -> -inf. ``bad_prefix`` int64 ``[B, W, P]``
        (right-aligned, -2 = any), ``recent`` int64 ``[B, P]``, ``bad_last`` int64 ``[B, W]``,
        ``bad_valid`` bool ``[B, W]`` (False = no word). W compares per token instead of a
        scatter (XLA copies a whole ``[B, V]`` operand to scatter into it). Not in place."""
        matches = ((s.bad_prefix == s.recent[:, None, :]) | (s.bad_prefix == -2)).all(dim=-1)
        banned = torch.where(matches & s.bad_valid, s.bad_last, -1)         # (B, W), -1 = none
        vocab = xla.iota(x.shape[-1], torch.int64, x.device)
        hit = torch.zeros_like(x, dtype=torch.bool)
        for w in range(banned.shape[1]):
            hit = hit | (vocab == banned[:, w:w + 1])
        return x + torch.where(hit, NEG_INF, 0.0)

    def apply_min_tokens(self, x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """Step 5: while ``position < min_tokens``, tokens in ``stop_mask`` (bool ``[B, V]``:
        stop ids and eos; all False = off) -> -inf, by adding -inf (see ``finite_rows``).
        Not in place."""
        pending = (s.position < s.min_tokens)[:, None]                     # (B, 1)
        return x + torch.where(s.stop_mask & pending, NEG_INF, 0.0)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Step 9: int64 ``[B]``, the lowest id among each row's maxima."""
        return thresholds.first_argmax(x)

    def apply_min_p(self, x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """Step 11 (``thresholds.min_p_filter``): min_p float32 ``[B]``, 0 = off. The
        candidate path runs it inside ``apply_top_k_top_p`` instead, from the row max its
        topk already has (``flags_for`` turns this call off there). Not in place."""
        return thresholds.min_p_filter(x, s.min_p)

    def apply_top_k_top_p(self, x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """Steps 12-13 without a sort, by path (``PATHS``): from the candidate set alone
        (which also runs step 11 there), top-k from the candidates and top-p by bisection, or
        both by bisection (``thresholds``). top_k int32 ``[B]`` (0 = off), top_p float32
        ``[B]`` (1 = off). Not in place."""
        if s.path == "candidates":
            return thresholds.top_k_top_p_candidates(x, s.top_k, s.top_p, s.min_p,
                                                     self.top_k_candidates)
        if s.path == "nucleus":
            x = thresholds.top_k_by_candidates(x, s.top_k, self.top_k_candidates)
        else:
            x = thresholds.top_k_by_bisection(x, s.top_k)
        return thresholds.top_p_by_bisection(x, s.top_p)

    def draw(self, x: torch.Tensor, s: XlaStepState) -> torch.Tensor:
        """Step 14 (and step 9 for greedy rows): int64 ``[B]``, ``argmax(x + gumbel)`` over the
        whole vocabulary (x float32 ``[B, V]``, dropped tokens -inf). Seeded rows key the
        contract's noise by (seed, child, position); unseeded rows by a fresh host-drawn key
        (``random_key``), so one hash serves both and nothing waits on the host."""
        keys = torch.where(s.seeded, noise.row_keys(s.seed_lo, s.seed_hi, s.child, s.position),
                           s.random_key)
        vocab = xla.iota(x.shape[-1], torch.int32, x.device)
        gumbel = noise.seeded_gumbel(keys[:, None], vocab)
        # Greedy rows carry neutral filter parameters, so ``x`` is still their step-8 logits:
        # without noise, this argmax is step 9 (the template skips its own, see flags_for).
        return thresholds.first_argmax(x + torch.where(s.greedy[:, None], 0.0, gumbel))

    def top_logprobs(self, logprobs: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 15's top-N from ``thresholds.top_entries`` (float32 [B, n] values, int64 [B, n]
        ids): torch-xla lowers a ``topk`` over the vocabulary to a sort."""
        return thresholds.top_entries(logprobs, n)

    # ------------------------------------------------------------------ internals
    def _check(self, logits: torch.Tensor, batch: SamplingBatch) -> bool:
        """Validate; True when ``logits`` hold one row per request (to expand to rows)."""
        if batch.device.type != self.device.type:
            raise ValueError(f"batch lives on {batch.device}, but sampler {self.name!r} runs on {self.device}")
        if not isinstance(batch, XlaSamplingBatch):
            raise TypeError(f"sampler {self.name!r} needs a batch from its new_batch(), got "
                            f"{type(batch).__name__}")
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

    @contextmanager
    def _forcing(self, path: str, logprobs: bool):
        """Warm-up only: run the template with a given static variant."""
        self._forced = (path, logprobs)
        try:
            yield
        finally:
            self._forced = None


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


def _empty_output() -> SamplerOutput:
    return SamplerOutput(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.bool), None)


def _entropy_generator() -> torch.Generator:
    generator = torch.Generator()
    generator.seed()
    return generator
