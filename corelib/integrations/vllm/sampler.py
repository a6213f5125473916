"""The sampler vLLM's V1 model runner calls, and the corelib batch that mirrors its rows.

vLLM keeps a persistent ``InputBatch``: one row per running request, rows filled by new
requests (lowest free row first), emptied by finished or preempted ones, closed up by
``condense`` (the last row moves into the lowest hole) and reordered by ``swap_states``.
``BatchMirror.sync`` brings a ``corelib.SamplingBatch`` to the same rows before each step
without rebuilding it:

- a request that left vLLM's batch is ``remove``d; corelib's ``remove`` moves the last row
  into the hole, and the removals go in the order that makes this vLLM's ``condense``, so a
  step that only loses requests needs no further move;
- a request whose history no longer matches vLLM's (its sampled token was discarded after a
  partial prefill, or vLLM changed it) is removed and added again from vLLM's own state;
- a request that joined is ``add``ed with vLLM's prompt and output tokens, so a preempted and
  resumed request continues its penalties, min-tokens and seeded positions;
- where the rows then differ from vLLM's order, ``swap_rows`` exchanges them.

After sampling, the mirror appends the sampled tokens, which vLLM keeps in the common case;
the next ``sync`` compares lengths with vLLM's request state to catch the other cases.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from vllm.v1.outputs import LogprobsTensors, SamplerOutput
from vllm.v1.sample.sampler import Sampler as VllmSampler

from ... import get_sampler
from ...batch import SamplingBatch
from ...params import SamplingParams
from ...sampler import Sampler
from . import AUTO, ENV_VAR
from .params import corelib_params

# vLLM's logprobs modes corelib computes, and their corelib names.
LOGPROBS_MODES = {"raw_logprobs": "raw", "processed_logprobs": "processed"}
# Placeholder vLLM writes for a token whose value is not on the host yet (async scheduling).
PLACEHOLDER_TOKEN = -1


def make_sampler(choice: str, device: torch.device, seed: Optional[int]) -> Sampler:
    """The corelib sampler ``CORELIB_VLLM=choice`` names, on the worker's ``device``.

    Unseeded rows draw from a generator seeded with vLLM's engine seed, so every
    tensor-parallel rank (same seed, same logits) draws the same tokens."""
    if choice == AUTO:
        sampler = get_sampler(device)
    elif ":" not in choice and device.index is not None:
        sampler = get_sampler(f"{choice}:{device.index}")
    else:
        sampler = get_sampler(choice)
    if sampler.device.type != device.type:
        raise ValueError(f"{ENV_VAR}={choice!r} selects corelib backend {sampler.name!r} on "
                         f"{sampler.device}, but this vLLM worker's logits are on {device}")
    generator = torch.Generator(device=sampler.device)
    generator.manual_seed(0 if seed is None else seed)
    sampler.generator = generator
    return sampler


class BatchMirror:
    """A ``SamplingBatch`` kept in the row order of a vLLM ``InputBatch`` (module docstring)."""

    def __init__(self, sampler: Sampler, vocab_size: int, logprobs_mode: str):
        self.vocab_size = vocab_size
        self.batch: SamplingBatch = sampler.new_batch(vocab_size, logprobs_mode=logprobs_mode)
        # request id -> (vLLM SamplingParams object, prompt length) it was added with
        self._added: dict[str, tuple[Any, int]] = {}
        self.moves = {"added": 0, "removed": 0, "swapped": 0}   # for tests and benchmarks

    def sync(self, input_batch: Any, requests: dict[str, Any]) -> SamplingBatch:
        """Bring the batch to ``input_batch``'s rows (``requests``: the runner's
        ``CachedRequestState`` per request id). Returns the batch."""
        order = list(input_batch.req_ids)
        outputs = input_batch.req_output_token_ids
        self._drop_stale(input_batch.req_id_to_index, outputs, requests)
        for row, request_id in enumerate(order):
            if request_id not in self._added:
                self._add(request_id, requests[request_id], outputs[row])
        self._follow(order)
        return self.batch

    def _drop_stale(self, rows_now: dict[str, int], outputs: list, requests: dict[str, Any]) -> None:
        """Remove the requests that left vLLM's batch or whose state differs from vLLM's, in
        the order that closes the holes as vLLM's ``condense`` does: a stale last row is
        dropped, otherwise the lowest stale row is removed and the last row moves into it
        (vLLM moves its last remaining request into its lowest hole)."""
        counts = self.batch.generated_counts()
        stale = set()
        for row, (request_id, _) in enumerate(self.batch.rows):
            vllm_row = rows_now.get(request_id)
            if vllm_row is None or not self._matches(request_id, requests[request_id],
                                                     counts[row], outputs[vllm_row]):
                stale.add(request_id)
        while stale:
            row_of = {request_id: self.batch.rows_of(request_id)[0] for request_id in stale}
            last = max(stale, key=row_of.__getitem__)
            victim = last if row_of[last] == self.batch.num_rows - 1 else min(stale, key=row_of.__getitem__)
            self.batch.remove(victim)
            stale.discard(victim)
            del self._added[victim]
            self.moves["removed"] += 1

    def _matches(self, request_id: str, state: Any, generated: int, output_ids: list[int]) -> bool:
        params, prompt_length = self._added[request_id]
        return (state.sampling_params is params and state.num_prompt_tokens == prompt_length
                and generated == len(output_ids))

    def _add(self, request_id: str, state: Any, output_ids: list[int]) -> None:
        if PLACEHOLDER_TOKEN in output_ids:
            raise RuntimeError(
                f"request {request_id!r} joins the batch with unresolved output tokens "
                f"(async scheduling placeholders); corelib's vLLM sampler needs their values")
        if state.prompt_token_ids is None and state.sampling_params.repetition_penalty != 1.0:
            raise ValueError(f"request {request_id!r}: repetition_penalty needs the prompt's "
                             f"token ids, but the prompt was given as embeddings")
        params = corelib_params(state.sampling_params, self.vocab_size)
        self.batch.add(request_id, params, prompt_token_ids=state.prompt_token_ids or (),
                       output_token_ids=list(output_ids))
        self._added[request_id] = (state.sampling_params, state.num_prompt_tokens)
        self.moves["added"] += 1

    def _follow(self, order: list[str]) -> None:
        """Swap rows until row i holds ``order[i]`` (at most one swap per misplaced row)."""
        current = [request_id for request_id, _ in self.batch.rows]
        where = {request_id: row for row, request_id in enumerate(current)}
        for row, request_id in enumerate(order):
            other_row = where[request_id]
            if other_row == row:
                continue
            self.batch.swap_rows(row, other_row)
            displaced = current[row]
            current[row], current[other_row] = request_id, displaced
            where[request_id], where[displaced] = row, other_row
            self.moves["swapped"] += 1


class CorelibSampler(VllmSampler):
    """vLLM's ``Sampler`` interface, sampled by corelib.

    Subclasses vLLM's sampler so that what the runner uses besides ``forward`` (prompt
    logprobs: ``compute_logprobs``, ``gather_logprobs``) stays vLLM's: prompt logprobs are the
    model's raw log-softmax, no sampling involved.
    """

    def __init__(self, runner: Any, choice: str):
        model_config = runner.model_config
        super().__init__(logprobs_mode=model_config.logprobs_mode,
                         use_fp64_gumbel=getattr(model_config, "use_fp64_gumbel", False))
        self.runner = runner
        self.corelib = make_sampler(choice, torch.device(runner.device), model_config.seed)
        self.mirror = BatchMirror(self.corelib, runner.input_batch.vocab_size,
                                  LOGPROBS_MODES[model_config.logprobs_mode])

    def forward(self, logits: torch.Tensor, sampling_metadata: Any,
                predict_bonus_token: bool = False,
                logprobs_mode_override: Optional[str] = None) -> SamplerOutput:
        """logits: ``[num_reqs, V]``, one row per row of the runner's input batch. Returns
        vLLM's ``SamplerOutput``: int32 ``[num_reqs, 1]`` token ids and, when a request asks
        for logprobs, ``LogprobsTensors`` (int32 ids and float32 logprobs ``[num_reqs, N + 1]``,
        column 0 the sampled token; int64 ranks ``[num_reqs]``)."""
        if predict_bonus_token or logprobs_mode_override is not None:
            raise NotImplementedError("corelib's vLLM sampler does not run inside vLLM's "
                                      "rejection sampler (speculative decoding)")
        input_batch = self.runner.input_batch
        # The runner's own steps pass its input batch's metadata; warm-up and profiling pass
        # dummy metadata for rows that are no requests.
        if sampling_metadata is not input_batch.sampling_metadata:
            return self._profile(logits)
        batch = self.mirror.sync(input_batch, self.runner.requests)
        out = self.corelib.sample(logits, batch)
        # A flagged row must not reach vLLM as token -1. The check waits on the device: free on
        # the CPU, where vLLM copies the tokens to the host right after; with asynchronous
        # scheduling on a GPU it gives up that step's overlap.
        if not bool(out.valid.all()):
            out.raise_on_invalid(batch)
        batch.append(out.token_ids)
        return _vllm_output(out)

    def _profile(self, logits: torch.Tensor) -> SamplerOutput:
        """vLLM's warm-up and memory-profiling call (dummy metadata, no requests): the same
        work on a throwaway batch of as many random rows, so the profile measures corelib."""
        batch = self.corelib.new_batch(logits.shape[1])
        params = SamplingParams(temperature=0.5, top_p=0.9, top_k=logits.shape[1] - 1)
        for row in range(logits.shape[0]):
            batch.add(f"profile-{row}", params)
        return _vllm_output(self.corelib.sample(logits, batch))


def _vllm_output(out) -> SamplerOutput:
    tensors = None
    if out.logprobs is not None:
        lp = out.logprobs
        tensors = LogprobsTensors(lp.token_ids.to(torch.int32), lp.logprobs, lp.ranks)
    return SamplerOutput(sampled_token_ids=out.token_ids.to(torch.int32).unsqueeze(-1),
                         logprobs_tensors=tensors)
