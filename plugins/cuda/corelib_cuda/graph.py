"""CUDA-graph capture of the cuda backend's sample and verify steps over persistent buffers.

A graph replays fixed kernels on fixed addresses, so a step is captured per padded batch size
``P`` (the smallest of ``sizes`` holding the batch), and a verify step per ``(P, K)``, over:

- static input buffers that each call copies into: logits ``[P, V]`` (verify: ``[P, K + 1, V]``),
  the token bitmask ``[P (K + 1), ceil(V / 32)]`` when one is used, and for verify the draft ids,
  draft counts, usability flags and draft probabilities (``[P, K, V]``) as ``check_drafts``
  returns them for the real rows;
- the batch's own per-row tensors, sliced to ``P`` rows (``batch.step_state(P)``,
  ``batch.speculative_state(drafts, num_rows=P)``, which a verify graph computes inside the
  capture): the core keeps them at fixed addresses while its capacity holds, writes new
  requests' parameter values into them in place and gives rows past ``len(batch)`` neutral
  values, so a replay reads the current parameters and the padding rows are inert;
- FlashInfer's seed and offset tensors and torch's generator state, advanced on the device.

The stateful selectors (mirostat, adaptive-p) need nothing more: their per-row state is one
of the batch's per-row tensors, which ``append`` advances in place between replays, and the
filtered log-probabilities it advances from (``selector_source``) are an output of the
captured step, copied out of the graphs' pool with the tokens and handed to the batch
(``keep_selector_source``), as the eager sampler does. The number of each row's filter order
is a per-row tensor too; the orders a batch holds are a host flag of the capture key.
Kept sets (``return_kept``) likewise: which rows ask is a per-row tensor, whether any row asks
(``any_kept``) a host flag of the key, and the packed bits an output of the captured step,
copied out with the tokens. ``score`` is not captured: it runs the eager sampler's.

What the graph cannot see is host state: the stage flags, the filter bounds, the custom stages
in use and the addresses of the batch's tensors. They form the capture key; when a request
changes one of them (the first request with penalties, a larger top_k, DRY's history growing
past its width, a capacity growth) the step is captured again. Flags that change during a
request's life are turned on whenever their tensors exist (the min-tokens mask depends on each
row's position, which the device tracks), so the key changes only when requests join or leave.
A bitmask, once passed for a (kind, size, K), stays on for it: calls without one fill the
buffer with -1 (every token allowed), so engines that pass masks on some steps only do not
capture again each time.

Capture cost (:class:`CudaGraphs`): every graph of a runner is captured into one shared memory
pool (``torch.cuda.graph_pool_handle()``), on one capture stream of the sampler's device, by
``CUDAGraph.capture_begin`` / ``capture_end`` directly: ``torch.cuda.graph`` would synchronise
the device and empty the process's whole allocator cache (device and pinned host) on every
capture. Sharing a pool is safe because replays run one at a time on the caller's stream and
each replay's outputs are copied right after it, before another graph can reuse the pool's
memory. At most ``max_graphs`` graphs are held (one per (kind, size, K) in use); a step that
would need another runs eagerly. ``GraphedSampler.stats`` reports captures, graphs held,
replays, eager steps and the memory the captures took. Every capture, warm-up and replay runs
with the sampler's device as the current device (``torch.cuda.device``), so a sampler on
``cuda:1`` captures there whatever device is current.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from corelib import SamplerOutput, SamplingBatch, ScoreOutput, StepState
from corelib.bitmask import bitmask_width
from corelib.drafts import DraftLayout, padded_arguments
from corelib.sampler import Drafts, Logprobs, VerifyOutput, checked_draft_probs, verify_logits_shape

from .batch import FilterBounds
from .device import device_guard
from .sampler import CudaSampler, CudaStepState, with_bounds

GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
#: Graphs a runner holds at most (one per (kind, size, K) in use); further steps run eagerly.
MAX_GRAPHS = 32


@dataclass
class _Capture:
    key: tuple
    inputs: dict[str, torch.Tensor]           # static buffers the caller's tensors go into
    run: Callable[[], object]                 # the step over those buffers (eager form)
    out: object = None                        # static outputs (graph mode)
    graph: Optional["torch.cuda.CUDAGraph"] = None


class CudaGraphs:
    """Captures and replays the CUDA graphs of one runner on ``device``: one capture stream
    and one memory pool shared by all of them, every call under ``torch.cuda.device``. Counts
    what it did (``captures``, ``replays``, ``capture_bytes``: growth of the device's reserved
    memory across captures, ``capture_s``: host seconds of warm-ups and captures)."""

    def __init__(self, device: torch.device, warmup: int = 2):
        self.device = device
        self.warmup = warmup
        self.captures = 0
        self.replays = 0
        self.capture_bytes = 0
        self.capture_s = 0.0
        self._pool = None
        self._stream: Optional["torch.cuda.Stream"] = None

    @property
    def pool(self):
        """The memory pool every graph of this runner is captured into (created on first use)."""
        if self._pool is None:
            with device_guard(self.device):
                self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def capture(self, run: Callable[[], object],
                generator: Optional[torch.Generator] = None) -> tuple["torch.cuda.CUDAGraph", object]:
        """(graph, static outputs) of ``run`` after ``warmup`` eager runs (lazy inits, Triton
        and FlashInfer compilation happen outside the capture). ``generator``: a CUDA
        generator ``run`` draws from besides the device's default one (registered so replays
        advance it). Never synchronises the device, never empties the allocator's cache."""
        start = time.perf_counter()
        with device_guard(self.device):
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            current = torch.cuda.current_stream(self.device)
            self._stream.wait_stream(current)
            with torch.cuda.stream(self._stream):
                for _ in range(self.warmup):
                    run()
            reserved = torch.cuda.memory_reserved(self.device)
            graph = torch.cuda.CUDAGraph()
            if generator is not None:
                graph.register_generator_state(generator)
            with torch.cuda.stream(self._stream):
                graph.capture_begin(pool=self.pool)
                try:
                    out = run()
                except BaseException:
                    with contextlib.suppress(Exception):   # the capture is invalid anyway
                        graph.capture_end()
                    raise
                graph.capture_end()
            current.wait_stream(self._stream)
            self.capture_bytes += torch.cuda.memory_reserved(self.device) - reserved
        self.captures += 1
        self.capture_s += time.perf_counter() - start
        return graph, out

    def replay(self, graph: "torch.cuda.CUDAGraph") -> None:
        """Replay ``graph`` on the current stream of this device."""
        with device_guard(self.device):
            graph.replay()
        self.replays += 1


@dataclass
class _Slot:
    """The capture of one (kind, size, K) and whether it applies a bitmask."""

    capture: Optional[_Capture] = None
    masked: bool = False


class GraphedSampler:
    """Runs ``CudaSampler`` steps as CUDA-graph replays: ``sample`` / ``step`` / ``verify`` as
    on the sampler (``batch.append(out.token_ids)`` after ``verify`` records it, as usual).

    ``use_graphs`` None = on for CUDA devices; False replays the same captured step state
    eagerly (the CPU tests use this to check the buffer logic). Batches larger than the
    largest size, and steps that would need more than ``max_graphs`` graphs, run the eager
    sampler. Outputs are copies, valid after the next call. A verify graph holds ``P (K + 1)``
    rows of every ``[rows, V]`` temporary, and its draft probability buffer ``[P, K, V]``
    (all graphs share one memory pool, so the temporaries of the largest one dominate):
    choose ``sizes`` with the memory in mind; ``stats`` says what the captures took.
    """

    def __init__(self, sampler: CudaSampler, sizes: Sequence[int] = GRAPH_SIZES,
                 use_graphs: Optional[bool] = None, warmup: int = 2, max_graphs: int = MAX_GRAPHS):
        if not isinstance(sampler, CudaSampler):
            raise TypeError(f"GraphedSampler needs a CudaSampler, got {type(sampler).__name__}")
        if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
            raise ValueError(f"sizes must be positive ints, got {sizes!r}")
        self.sampler = sampler
        self.sizes = tuple(sorted(set(sizes)))
        self.use_graphs = sampler.device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and sampler.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the sampler runs on {sampler.device}")
        if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
            raise ValueError(f"max_graphs must be a positive int, got {max_graphs!r}")
        self.max_graphs = max_graphs
        self.graphs = CudaGraphs(sampler.device, warmup)
        self.eager_steps = 0       # steps run eagerly: too many rows, or max_graphs reached
        self._slots: dict[tuple, _Slot] = {}

    @property
    def captures(self) -> int:
        """How many times a step was captured (a new key, or its first call)."""
        return self.graphs.captures

    @property
    def stats(self) -> dict:
        """``captures``, ``graphs`` (held now), ``max_graphs``, ``replays``, ``eager_steps``,
        ``capture_bytes`` (device memory the captures reserved; 0 without CUDA graphs) and
        ``capture_s`` (host seconds spent capturing, warm-ups included)."""
        return dict(captures=self.graphs.captures, graphs=self._held(), max_graphs=self.max_graphs,
                    replays=self.graphs.replays, eager_steps=self.eager_steps,
                    capture_bytes=self.graphs.capture_bytes, capture_s=self.graphs.capture_s)

    def _held(self) -> int:
        return sum(slot.capture is not None for slot in self._slots.values())

    @property
    def name(self) -> str:
        return self.sampler.name

    @property
    def device(self) -> torch.device:
        return self.sampler.device

    def new_batch(self, *args, **kwargs) -> SamplingBatch:
        return self.sampler.new_batch(*args, **kwargs)

    def processed_logits(self, logits: torch.Tensor, batch: SamplingBatch,
                         token_bitmask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The sampler's (eager): a debugging view, not a step."""
        return self.sampler.processed_logits(logits, batch, token_bitmask)

    # ------------------------------------------------------------------ sample
    def sample(self, logits: torch.Tensor, batch: SamplingBatch,
               token_bitmask: Optional[torch.Tensor] = None) -> SamplerOutput:
        """As ``CudaSampler.sample``, replaying a captured step. logits ``[B, V]`` or
        ``[num_requests, V]``; token_bitmask None or int32 ``[B, ceil(V / 32)]`` (host or
        device). The caller's tensors are never modified."""
        batch.check_logits(logits)
        n = batch.num_rows
        size = self.padded_size(n)
        if n == 0 or not self._graphable(("sample", size)):
            return self._eager(self.sampler.sample, logits, batch, token_bitmask)
        mask = None if token_bitmask is None else batch.check_token_bitmask(token_bitmask)
        if logits.shape[0] != n:   # one row per request: expand here, outside the graph
            logits = logits.index_select(0, batch.request_index(n))
        state, host_key = self._state_and_key(batch, size)
        slot = self._slot(("sample", size), mask is not None)
        key = ("sample", logits.dtype, slot.masked, host_key)
        if slot.capture is None or slot.capture.key != key:
            slot.capture = self._capture(key, self._sample_buffers(state, logits.dtype, slot.masked),
                                         lambda inputs: self._sample_body(inputs, batch, state))
        inputs = slot.capture.inputs
        inputs["logits"][:n].copy_(logits)
        if slot.masked:
            _copy_mask(inputs["bitmask"], mask, n)
        out = _first_rows(self._replay(slot.capture), n)
        batch.keep_selector_source(out.selector_source)
        return out

    def step(self, logits: torch.Tensor, batch: SamplingBatch,
             token_bitmask: Optional[torch.Tensor] = None) -> SamplerOutput:
        """``sample`` then ``batch.append`` of the sampled tokens."""
        out = self.sample(logits, batch, token_bitmask)
        batch.append(out.token_ids)
        return out

    def _sample_buffers(self, s: CudaStepState, dtype: torch.dtype, masked: bool) -> dict:
        P, V = s.num_rows, s.vocab_size
        inputs = {"logits": torch.zeros((P, V), dtype=dtype, device=self.device)}
        if masked:
            inputs["bitmask"] = torch.full((P, bitmask_width(V)), -1, dtype=torch.int32, device=self.device)
        return inputs

    def _sample_body(self, inputs: dict, batch: SamplingBatch, s: CudaStepState) -> SamplerOutput:
        if "bitmask" in inputs:
            s = dataclasses.replace(s, token_bitmask=inputs["bitmask"], any_bitmask=True)
        return self.sampler.sample_state(inputs["logits"], batch, s)

    # ------------------------------------------------------------------ score
    #: ``score`` runs the eager sampler's, so its gradients are the sampler's.
    differentiable_score = CudaSampler.differentiable_score

    def score(self, logits: torch.Tensor, batch: SamplingBatch, token_ids: torch.Tensor,
              kept: Optional[torch.Tensor] = None) -> ScoreOutput:
        """The sampler's ``score`` (``corelib.scoring``), eager: scoring is a trainer's call
        over ``[B, T, V]`` logits whose T varies from call to call, not a decode step, so no
        graph captures it. Counts as an eager step."""
        return self._eager(self.sampler.score, logits, batch, token_ids, kept)

    # ------------------------------------------------------------------ verify
    def verify(self, logits: torch.Tensor, batch: SamplingBatch, draft_token_ids: torch.Tensor,
               draft_probs: Optional[torch.Tensor] = None,
               token_bitmask: Optional[torch.Tensor] = None, method: str = "token",
               num_drafts=None) -> VerifyOutput:
        """As ``CudaSampler.verify``, replaying a verify step captured per (padded rows, K, method):
        logits ``[B, K + 1, V]``, draft_token_ids int64 ``[B, K]`` (-1 padding a row's tail),
        draft_probs None or float32 ``[B, K, V]``, token_bitmask None or int32
        ``[B, K + 1, ceil(V / 32)]``. Arguments are checked (and draft ids on the host
        validated) eagerly before the replay, exactly as the sampler checks them. With
        ``num_drafts`` (the flat form, ``corelib.drafts``) they are checked and padded on the
        device first: the graph's buffers have one shape per (rows, K)."""
        if num_drafts is not None:
            layout = DraftLayout.of(num_drafts, self.device)
            logits, draft_token_ids, draft_probs, token_bitmask = padded_arguments(
                layout, logits, batch, draft_token_ids, draft_probs, token_bitmask)
        B, S, V = verify_logits_shape(logits)
        size = self.padded_size(B)
        with_probs = draft_probs is not None
        where = ("verify", size, S, with_probs)
        if B == 0 or not self._graphable(where):
            return self._eager(self.sampler.verify, logits, batch, draft_token_ids, draft_probs,
                               token_bitmask, method)
        # The draft probabilities are read once before the replay: copied into the graph's
        # buffer, and checked there (the check of the sampler's own verify would make them
        # contiguous and read them, and the copy read them again).
        drafts = self.sampler.check_drafts(logits, batch, draft_token_ids, None, method)
        probs = None if draft_probs is None else checked_draft_probs(draft_probs, B, S - 1, V)
        mask = None if token_bitmask is None else batch.check_token_bitmask(token_bitmask, S)
        state, host_key = self._state_and_key(batch, size)
        slot = self._slot(where, mask is not None)
        key = ("verify", S, with_probs, method, logits.dtype, slot.masked, host_key)
        if slot.capture is None or slot.capture.key != key:
            inputs = self._verify_buffers(state, S, logits.dtype, with_probs, slot.masked)
            slot.capture = self._capture(key, inputs, lambda inputs: self._verify_body(inputs, batch, state, method))
        inputs = slot.capture.inputs
        usable = drafts.usable
        if probs is not None:
            copied = inputs["draft_probs"][:B]
            copied.copy_(probs)
            real = torch.arange(S - 1, device=self.device)[None, :] < drafts.count[:, None]
            usable = usable & (self.sampler.draft_probs_sane(copied) | ~real).all(dim=1)
        inputs["logits"][:B].copy_(logits)
        inputs["draft_ids"][:B].copy_(drafts.token_ids)
        inputs["draft_ids"][B:].fill_(-1)          # padding rows propose nothing
        inputs["draft_count"][:B].copy_(drafts.count)
        inputs["draft_usable"][:B].copy_(usable)
        if slot.masked:
            _copy_mask(inputs["bitmask"], mask, B * S)
        out = _first_verify_rows(self._replay(slot.capture), B, S)
        batch.keep_selector_source(out.selector_source, slots=S)
        return out

    def _verify_buffers(self, s: CudaStepState, S: int, dtype: torch.dtype, with_probs: bool,
                        masked: bool) -> dict:
        P, V, dev = s.num_rows, s.vocab_size, self.device
        K = S - 1
        inputs = {
            "logits": torch.zeros((P, S, V), dtype=dtype, device=dev),
            "draft_ids": torch.full((P, K), -1, dtype=torch.long, device=dev),
            "draft_count": torch.zeros(P, dtype=torch.long, device=dev),
            "draft_usable": torch.ones(P, dtype=torch.bool, device=dev),
        }
        if with_probs:
            inputs["draft_probs"] = torch.full((P, K, V), 1.0 / V, dtype=torch.float32, device=dev)
        if masked:
            inputs["bitmask"] = torch.full((P * S, bitmask_width(V)), -1, dtype=torch.int32, device=dev)
        return inputs

    def _verify_body(self, inputs: dict, batch: SamplingBatch, graph_state: CudaStepState,
                     method: str) -> VerifyOutput:
        """``verify_state`` over the static buffers: the speculative state of ``P`` rows is
        computed inside the graph from the batch's tensors and the draft buffer."""
        P, S, V = inputs["logits"].shape
        drafts = Drafts(inputs["draft_ids"], inputs["draft_count"], inputs.get("draft_probs"),
                        inputs["draft_usable"], method)
        s = self.sampler.speculative_step_state(batch, drafts, num_rows=P)
        s = dataclasses.replace(s, any_min_tokens=graph_state.any_min_tokens, bounds=graph_state.bounds)
        if "bitmask" in inputs:
            s = dataclasses.replace(s, token_bitmask=inputs["bitmask"], any_bitmask=True)
        return self.sampler.verify_state(inputs["logits"].view(P * S, V), batch, s, drafts)

    # ------------------------------------------------------------------ capture
    def padded_size(self, rows: int) -> Optional[int]:
        """The smallest capture size holding ``rows`` rows, or None when none does."""
        return next((size for size in self.sizes if size >= rows), None)

    def _state_and_key(self, batch: SamplingBatch, size: int) -> tuple[CudaStepState, tuple]:
        """(``graph_state``, its ``capture_key``), built once per step state the batch keeps
        (a ``CudaBatch`` keeps one until requests join, leave or move, or a tensor is
        replaced, and its ``graph_memo`` travels with it): the key walks every field and
        tensor, about 0.2 ms of host time a step at 32 rows, which steady steps need not pay.
        Other batches build both every step."""
        template = batch.step_state(size)
        memo = getattr(template, "graph_memo", None)
        if memo is not None and "key" in memo:
            state = object.__new__(type(memo["state"]))          # a new object each step, as
            state.__dict__.update(memo["state"].__dict__)        # step_state gives
            return state, memo["key"]
        state = self.graph_state(batch, size, template)
        key = self.capture_key(state)
        if memo is not None:
            memo.update(state=state, key=key)
        return state, key

    def graph_state(self, batch: SamplingBatch, size: int,
                    template: Optional[StepState] = None) -> CudaStepState:
        """The step state of ``size`` rows as the graph sees it: min-tokens on whenever its
        tensors exist, and the filter bounds rounded up to a power of two (fewer captures;
        a larger candidate count keeps the same sets)."""
        s = with_bounds(batch.step_state(size) if template is None else template, batch)
        bounds = s.bounds
        if bounds is not None:
            bounds = FilterBounds(_round_up(bounds.candidates, batch.vocab_size),
                                  _round_up(bounds.max_top_k, batch.vocab_size),
                                  bounds.every_row_top_k, bounds.exact_top_p)
        max_top_k = _round_up(s.max_top_k, batch.vocab_size)
        return dataclasses.replace(s, any_min_tokens=s.stop_ids is not None, bounds=bounds,
                                   max_top_k=max_top_k)

    @staticmethod
    def capture_key(s: StepState) -> tuple:
        """Everything host-side a captured step depends on: every flag and bound of the step
        state, the custom stages in use, and the address, shape and strides of every tensor."""
        parts = []
        for f in dataclasses.fields(s):
            if f.name == "graph_memo":
                continue
            value = getattr(s, f.name)
            if isinstance(value, torch.Tensor):
                parts.append((f.name, _tensor_key(value)))
            elif f.name == "stages":
                parts.append((f.name, tuple(_stage_key(entry) for entry in value)))
            else:
                parts.append((f.name, value))
        return tuple(parts)

    def _graphable(self, where: tuple) -> bool:
        """Whether the step of slot ``where`` replays a graph: its size exists, and it has a
        graph already or fewer than ``max_graphs`` are held."""
        if where[1] is None:
            return False
        slot = self._slots.get(where)
        return (slot is not None and slot.capture is not None) or self._held() < self.max_graphs

    def _eager(self, step: Callable, *args):
        self.eager_steps += 1
        return step(*args)

    def _slot(self, where: tuple, masked_now: bool) -> _Slot:
        slot = self._slots.setdefault(where, _Slot())
        slot.masked = slot.masked or masked_now
        return slot

    def _capture(self, key: tuple, inputs: dict, body: Callable[[dict], object]) -> _Capture:
        capture = _Capture(key, inputs, lambda: body(inputs))
        if not self.use_graphs:
            self.graphs.captures += 1
            return capture
        capture.graph, capture.out = self.graphs.capture(capture.run, self.sampler.generator)
        return capture

    def _replay(self, capture: _Capture):
        if capture.graph is None:
            self.graphs.replays += 1
            return capture.run()
        self.graphs.replay(capture.graph)
        return capture.out


def _tensor_key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _stage_key(entry) -> tuple:
    spec, inputs, plugin = entry
    tensors = [("active", inputs.active), ("position", inputs.position)]
    tensors += [(f"arg:{k}", v) for k, v in sorted(inputs.args.items())]
    tensors += [(f"state:{k}", v) for k, v in sorted(inputs.state.items())]
    return (spec.name, id(spec), plugin, tuple((name, _tensor_key(t)) for name, t in tensors))


def _copy_mask(buffer: torch.Tensor, mask: Optional[torch.Tensor], rows: int) -> None:
    """The caller's checked mask ``[rows, W]`` into the static buffer; -1 (all allowed) when
    this call has none."""
    if mask is None:
        buffer[:rows].fill_(-1)
    else:
        buffer[:rows].copy_(mask)


def _round_up(count: int, vocab_size: int) -> int:
    """The next power of two >= count, at most vocab_size (0 stays 0)."""
    if count <= 0:
        return 0
    return min(vocab_size, 1 << (count - 1).bit_length())


def _clone_logprobs(lp: Optional[Logprobs], n: int) -> Optional[Logprobs]:
    if lp is None:
        return None
    return Logprobs(lp.token_ids[:n].clone(), lp.logprobs[:n].clone(), lp.ranks[:n].clone())


def _clone_rows(t: Optional[torch.Tensor], rows: int) -> Optional[torch.Tensor]:
    return None if t is None else t[:rows].clone()


def _first_rows(out: SamplerOutput, n: int) -> SamplerOutput:
    # The selector source is copied too: ``batch.append`` reads it after this call returns,
    # when another graph's replay may have reused the pool memory it lives in.
    return SamplerOutput(out.token_ids[:n].clone(), out.valid[:n].clone(), _clone_logprobs(out.logprobs, n),
                         _clone_rows(out.selector_source, n), _clone_rows(out.kept, n))


def _first_verify_rows(out: VerifyOutput, n: int, slots: int) -> VerifyOutput:
    return VerifyOutput(out.token_ids[:n].clone(), out.num_emitted[:n].clone(), out.valid[:n].clone(),
                        _clone_logprobs(out.logprobs, n), _clone_rows(out.selector_source, n * slots),
                        _clone_rows(out.kept, n))
