"""CUDA-graph capture of the cuda backend's step over persistent buffers.

A graph replays fixed kernels on fixed addresses, so a step is captured per padded batch size
``P`` (the smallest of ``sizes`` holding the batch) over:

- a static logits buffer ``[P, V]`` that each call copies the new logits into;
- the batch's own per-row tensors, sliced to ``P`` rows (``batch.step_state(P)``): the core
  keeps them at fixed addresses while its capacity holds, writes new requests' parameter values
  into them in place and gives rows past ``len(batch)`` neutral values, so a replay reads the
  current parameters and the padding rows are inert;
- FlashInfer's seed and offset tensors and torch's generator state, advanced on the device.

What the graph cannot see is host state: the stage flags, the filter bounds, and the addresses
of the batch's tensors. They form the capture key; when a request changes one of them (the
first request with penalties, a larger top_k, a capacity growth) the step is captured again.
Flags that change during a request's life are turned on whenever their tensors exist (the
min-tokens mask depends on each row's position, which the device tracks), so the key changes
only when requests join or leave.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from corelib import SamplerOutput, SamplingBatch, StepState
from corelib.sampler import Logprobs

from .batch import FilterBounds
from .sampler import CudaSampler, CudaStepState, with_bounds

GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_KEY_FLAGS = ("any_greedy", "any_random", "any_seeded", "any_unseeded", "any_top_k",
              "any_top_p", "any_min_p", "any_temperature", "any_penalties", "any_allowed",
              "any_bias", "any_min_tokens", "any_bad_words", "num_logprobs", "logprobs_mode")


@dataclass
class _Capture:
    key: tuple
    state: StepState
    logits: torch.Tensor                  # static [P, V]
    out: Optional[SamplerOutput] = None   # static outputs [P] (graph mode)
    graph: Optional["torch.cuda.CUDAGraph"] = None


class GraphedSampler:
    """Runs ``CudaSampler`` steps as CUDA-graph replays: ``sample`` / ``step`` as on the sampler.

    ``use_graphs`` None = on for CUDA devices; False replays the same captured step state
    eagerly (the CPU tests use this to check the buffer logic). Batches larger than the
    largest size run the eager sampler. Outputs are copies, valid after the next call.
    """

    def __init__(self, sampler: CudaSampler, sizes: Sequence[int] = GRAPH_SIZES,
                 use_graphs: Optional[bool] = None, warmup: int = 2):
        if not isinstance(sampler, CudaSampler):
            raise TypeError(f"GraphedSampler needs a CudaSampler, got {type(sampler).__name__}")
        if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
            raise ValueError(f"sizes must be positive ints, got {sizes!r}")
        self.sampler = sampler
        self.sizes = tuple(sorted(set(sizes)))
        self.use_graphs = sampler.device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and sampler.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the sampler runs on {sampler.device}")
        self.warmup = warmup
        self.captures = 0          # how many times a step was captured (for tests and logs)
        self._by_size: dict[int, _Capture] = {}

    @property
    def name(self) -> str:
        return self.sampler.name

    @property
    def device(self) -> torch.device:
        return self.sampler.device

    def new_batch(self, *args, **kwargs) -> SamplingBatch:
        return self.sampler.new_batch(*args, **kwargs)

    def processed_logits(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The sampler's (eager): a debugging view, not a step."""
        return self.sampler.processed_logits(logits, batch)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """As ``CudaSampler.sample``, replaying a captured step. logits ``[B, V]`` or
        ``[num_requests, V]``; never modified."""
        batch.check_logits(logits)
        n = batch.num_rows
        size = self.padded_size(n)
        if n == 0 or size is None:
            return self.sampler.sample(logits, batch)
        if logits.shape[0] != n:   # one row per request: expand here, outside the graph
            logits = logits.index_select(0, batch.request_index(n))
        state = self.graph_state(batch, size)
        key = self.capture_key(state, logits.dtype)
        capture = self._by_size.get(size)
        if capture is None or capture.key != key:
            capture = self._capture(key, state, logits, batch)
            self._by_size[size] = capture
        capture.logits[:n].copy_(logits)
        if capture.graph is not None:
            capture.graph.replay()
            out = capture.out
        else:
            out = self.sampler.sample_state(capture.logits, batch, capture.state)
        return _first_rows(out, n)

    def step(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """``sample`` then ``batch.append`` of the sampled tokens."""
        out = self.sample(logits, batch)
        batch.append(out.token_ids)
        return out

    # ------------------------------------------------------------------ capture
    def padded_size(self, rows: int) -> Optional[int]:
        """The smallest capture size holding ``rows`` rows, or None when none does."""
        return next((size for size in self.sizes if size >= rows), None)

    def graph_state(self, batch: SamplingBatch, size: int) -> CudaStepState:
        """The step state of ``size`` rows as the graph sees it: min-tokens on whenever its
        tensors exist, and the filter bounds rounded up to a power of two (fewer captures;
        a larger candidate count keeps the same sets)."""
        s = with_bounds(batch.step_state(size), batch)
        bounds = s.bounds
        if bounds is not None:
            bounds = FilterBounds(_round_up(bounds.candidates, batch.vocab_size),
                                  _round_up(bounds.max_top_k, batch.vocab_size),
                                  bounds.every_row_top_k)
        return dataclasses.replace(s, any_min_tokens=s.stop_ids is not None, bounds=bounds)

    @staticmethod
    def capture_key(s: CudaStepState, dtype: torch.dtype) -> tuple:
        """Everything host-side a captured step depends on."""
        tensors = tuple(
            (f.name, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
            for f in dataclasses.fields(s)
            if isinstance(t := getattr(s, f.name), torch.Tensor)
        )
        flags = tuple(getattr(s, name) for name in _KEY_FLAGS)
        return (s.num_rows, s.vocab_size, dtype, s.bounds, flags, tensors)

    def _capture(self, key: tuple, state: CudaStepState, logits: torch.Tensor,
                 batch: SamplingBatch) -> _Capture:
        size, V = state.num_rows, state.vocab_size
        static = torch.zeros((size, V), dtype=logits.dtype, device=self.device)
        static[: logits.shape[0]].copy_(logits)
        capture = _Capture(key, state, static)
        self.captures += 1
        if not self.use_graphs:
            return capture
        sampler = self.sampler
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):          # warm-up: lazy inits, FlashInfer workspaces
            for _ in range(self.warmup):
                sampler.sample_state(static, batch, state)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if sampler.generator is not None:
            graph.register_generator_state(sampler.generator)
        with torch.cuda.graph(graph):
            capture.out = sampler.sample_state(static, batch, state)
        capture.graph = graph
        return capture


def _round_up(count: int, vocab_size: int) -> int:
    """The next power of two >= count, at most vocab_size (0 stays 0)."""
    if count <= 0:
        return 0
    return min(vocab_size, 1 << (count - 1).bit_length())


def _first_rows(out: SamplerOutput, n: int) -> SamplerOutput:
    logprobs = None
    if out.logprobs is not None:
        lp = out.logprobs
        logprobs = Logprobs(lp.token_ids[:n].clone(), lp.logprobs[:n].clone(), lp.ranks[:n].clone())
    return SamplerOutput(out.token_ids[:n].clone(), out.valid[:n].clone(), logprobs)
