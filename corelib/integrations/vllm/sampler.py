"""The sampler vLLM's V1 model runner calls, and the corelib batch that mirrors its rows.

vLLM keeps a persistent ``InputBatch``: one row per running request, rows filled by new
requests (lowest free row first), emptied by finished or preempted ones, closed up by
``condense`` (the last row moves into the lowest hole) and reordered by ``swap_states``.
``BatchMirror.sync`` brings a ``corelib.SamplingBatch`` to the same rows before each step
without rebuilding it:

- a request whose history no longer matches vLLM's (its sampled token was discarded after a
  partial prefill, or vLLM changed it) is removed and added again from vLLM's own state;
- a request that joined is ``add``ed with vLLM's prompt and output tokens, so a preempted and
  resumed request continues its penalties, min-tokens and seeded positions;
- a request that leaves unfinished (preempted, or not scheduled this step: vLLM keeps its
  ``CachedRequestState``) and uses a stateful selector (mirostat, adaptive-p) leaves its
  selector state behind (``batch.sampler_state``), keyed by its number of generated tokens;
  when it joins again with that many output tokens it resumes from it, so it samples what it
  would have sampled without the preemption. A token vLLM discarded (a chunk of a resumed
  prefill) is undone the same way: the state kept for vLLM's count is taken again;
- the requests that left vLLM's batch are ``remove``d together, after the joins: corelib's
  ``remove`` moves the last row into each hole, and the joins and removals go in the order
  that makes this vLLM's placing of new requests into the lowest freed rows and its
  ``condense``, so a step that only adds and loses requests needs one move of rows in all;
- where the rows then differ from vLLM's order, ``swap_rows`` exchanges them.

After sampling (or verifying drafts), the mirror appends the emitted tokens, which vLLM keeps
in the common case; the next ``sync`` compares lengths with vLLM's request state to catch the
other cases.

A row corelib flags (no token left to sample: a finished grammar whose end is held back by
min_tokens, allowed ids all banned by a multi-token bad word, NaN logits) emits no token.
The sampler records why, per request (``take_failures``); the hooks in ``patches`` hand that
to vLLM's scheduler, which finishes the request as a per-request error while the engine goes
on. Under asynchronous scheduling (where that hand-over is not wired) the step raises instead.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections import deque
from typing import Any, Optional

import torch
from vllm.v1.outputs import LogprobsTensors, SamplerOutput
from vllm.v1.sample.sampler import Sampler as VllmSampler

from ... import get_sampler
from ...batch import SamplingBatch
from ...drafts import DraftLayout, padded_arguments
from ...params import SamplingParams
from ...sampler import Logprobs, Sampler, VerifyOutput
from . import AUTO, ENV_VAR
from .params import ThinkingMarkers, child_offset, corelib_params, thinking_markers
from .processors import ProcessorStages, custom_processors, processor_name
from .speculative import CorelibRejectionSampler, SpeculationStats, verify_method

logger = logging.getLogger(__name__)

# vLLM's logprobs modes and their corelib names.
LOGPROBS_MODES = {"raw_logprobs": "raw", "processed_logprobs": "processed",
                  "raw_logits": "raw_logits", "processed_logits": "processed_logits"}
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


def traces_its_steps(sampler: Any) -> bool:
    """Whether a corelib sampler runs its steps as traced (XLA) or captured (CUDA graphs)
    programs, where arbitrary Python such as a vLLM logits processor cannot run."""
    return (sampler.device.type == "xla" or sampler.name == "tpu"
            or type(sampler).__name__ == "GraphedSampler")


def accepts_token_bitmask(sampler: Sampler) -> bool:
    """Whether ``sampler.sample`` takes a ``token_bitmask`` argument (a backend written before
    it does not: vLLM masks the logits in place for it instead)."""
    return "token_bitmask" in inspect.signature(sampler.sample).parameters


class BatchMirror:
    """A ``SamplingBatch`` kept in the row order of a vLLM ``InputBatch`` (module docstring)."""

    def __init__(self, sampler: Sampler, vocab_size: int, logprobs_mode: str,
                 processors: Optional[ProcessorStages] = None,
                 thinking: Optional[ThinkingMarkers] = None):
        self.vocab_size = vocab_size
        self.batch: SamplingBatch = sampler.new_batch(vocab_size, logprobs_mode=logprobs_mode)
        self.processors = processors
        self.thinking = thinking
        for spec in processors.specs() if processors else ():
            self.batch.use_stage(spec, "vllm")
        # request id -> (vLLM SamplingParams object, prompt length) it was added with
        self._added: dict[str, tuple[Any, int]] = {}
        self._synced_order: list[str] = []     # vLLM's row order after the last sync (a copy)
        self.moves = {"added": 0, "removed": 0, "swapped": 0}   # for tests and benchmarks
        # Unfinished requests that use a stateful selector: request id -> {number of generated
        # tokens: its sampler_state then}, what it resumes from when it joins again.
        self._selector_states: dict[str, dict[int, list]] = {}
        self.resumed = 0        # joins that took a kept selector state (for tests)
        # A backend's batch written before add's sampler_state argument cannot resume a state:
        # its preempted selector requests start afresh (with a warning) rather than fail the step.
        self._resumes = "sampler_state" in inspect.signature(self.batch.add).parameters

    def sync(self, input_batch: Any, requests: dict[str, Any]) -> SamplingBatch:
        """Bring the batch to ``input_batch``'s rows (``requests``: the runner's
        ``CachedRequestState`` per request id). Returns the batch."""
        order = input_batch.req_ids
        outputs = input_batch.req_output_token_ids
        if self._unchanged(order, outputs, requests):
            return self.batch
        order, self._synced_order = list(order), []     # no steady state until this sync ends
        left, changed = self._stale(input_batch.req_id_to_index, outputs, requests)
        if self._selector_states:           # requests that finished while out of the batch
            for request_id in [r for r in self._selector_states if r not in requests]:
                del self._selector_states[request_id]
        if changed:                         # added again below, from vLLM's state
            self._drop(changed, requests)
            # where the leaving requests are now: last rows moved into the changed ones' holes
            left = deque(sorted((self.batch.rows_of(request_id)[0], request_id)
                                for _, request_id in left))
        joining = [(row, request_id) for row, request_id in enumerate(order)
                   if request_id not in self._added]
        # vLLM put its first new requests into the lowest rows the leaving ones freed and
        # appended the others. Added in this order, the ones that fill holes are the last rows,
        # lowest first, when ``_drop`` moves the last row into each lowest hole: the rows then
        # match vLLM's with one move for all of them and no swap.
        filling = min(len(left), len(joining))
        into_holes = joining[:filling][::-1]
        for row, request_id in joining[filling:] + into_holes:
            self._add(request_id, requests[request_id], outputs[row])
        self._drop(left, requests)
        self._follow(order)
        self._synced_order = order
        return self.batch

    def _unchanged(self, order: list[str], outputs: list, requests: dict[str, Any]) -> bool:
        """The steady state, checked without building anything per row: the same requests in
        the same rows as after the last sync, each with the state it was added with and as
        many generated tokens as vLLM holds (``_matches`` for every row)."""
        if order != self._synced_order:
            return False
        if self.batch.generated_counts() != [len(ids) for ids in outputs[:len(order)]]:
            return False
        added = self._added
        for request_id in order:
            state = requests[request_id]
            params, prompt_length = added[request_id]
            if state.sampling_params is not params or state.num_prompt_tokens != prompt_length:
                return False
        return True

    def _stale(self, rows_now: dict[str, int], outputs: list,
               requests: dict[str, Any]) -> tuple[deque, deque]:
        """The requests that left vLLM's batch, and those whose state differs from vLLM's
        (their sampled token was discarded, or vLLM changed them): ``(row, request id)`` each,
        rows ascending."""
        counts = self.batch.generated_counts()
        left, changed = deque(), deque()
        for row, (request_id, _) in enumerate(self.batch.rows):
            vllm_row = rows_now.get(request_id)
            if vllm_row is None:
                left.append((row, request_id))
                continue
            if not self._matches(request_id, requests[request_id], counts[row], outputs[vllm_row]):
                changed.append((row, request_id))
        return left, changed

    def _matches(self, request_id: str, state: Any, generated: int, output_ids: list[int]) -> bool:
        params, prompt_length = self._added[request_id]
        return (state.sampling_params is params and state.num_prompt_tokens == prompt_length
                and generated == len(output_ids))

    def _drop(self, stale: deque, requests: dict[str, Any]) -> None:
        """Remove ``stale`` (``(row, request id)``, rows ascending) in the order that closes
        the holes as vLLM's ``condense`` does: a stale last row is dropped, otherwise the
        lowest stale row is removed and the last row moves into it (vLLM moves its last
        remaining request into its lowest hole). The moved row is never stale (else it would
        have been dropped first), so the other stale rows stay where they are: the order is
        found on row numbers alone, and one ``remove`` takes them all. The selector state of
        a request still in ``requests`` (unfinished) is kept first (``_keep_selector_state``)."""
        order, last_row = [], self.batch.num_rows - 1
        while stale:
            _, victim = stale.pop() if stale[-1][0] == last_row else stale.popleft()
            order.append(victim)
            last_row -= 1
        for victim in order:
            if victim in requests:
                self._keep_selector_state(victim)
            else:
                self._selector_states.pop(victim, None)
        self.batch.remove(*order)
        for victim in order:
            del self._added[victim]
            if self.processors:
                self.processors.forget(victim)
        self.moves["removed"] += len(order)

    def _keep_selector_state(self, request_id: str) -> None:
        """Keep the selector state of a request about to leave unfinished, under its number
        of generated tokens (a device read, only for requests that use a selector)."""
        params = self.batch.params_of(request_id)
        if not (params.uses_mirostat or params.uses_adaptive_p):
            return
        if not self._resumes:
            logger.warning("corelib sampler (%s): request %r leaves unfinished, and backend %r "
                           "cannot resume its mirostat/adaptive-p state (its batch's add takes "
                           "no sampler_state): it starts afresh when it returns", ENV_VAR,
                           request_id, type(self.batch).__name__)
            return
        generated = self.batch.generated_counts()[self.batch.rows_of(request_id)[0]]
        kept = self._selector_states.setdefault(request_id, {})
        kept[generated] = self.batch.sampler_state(request_id)

    def _resume_state(self, request_id: str, params: SamplingParams,
                      generated: int) -> Optional[list]:
        """The selector state a request joining with ``generated`` output tokens resumes
        from: the one kept at that count, None (a fresh start) for a request that uses no
        selector or has generated nothing. States kept at later counts are forgotten: their
        tokens are not vLLM's."""
        kept = self._selector_states.get(request_id)
        if kept is None or not (params.uses_mirostat or params.uses_adaptive_p):
            return None
        state = kept.get(generated)
        for count in [c for c in kept if c > generated]:
            del kept[count]
        if state is None and generated:
            logger.warning("corelib sampler (%s): request %r rejoins with %d output tokens, but "
                           "its selector state was kept at %s tokens; mirostat/adaptive-p "
                           "start afresh", ENV_VAR, request_id, generated, sorted(kept))
        if state is not None:
            self.resumed += 1
        return state

    def _add(self, request_id: str, state: Any, output_ids: list[int]) -> None:
        if PLACEHOLDER_TOKEN in output_ids:
            raise RuntimeError(
                f"request {request_id!r} joins the batch with unresolved output tokens "
                f"(async scheduling placeholders); corelib's vLLM sampler needs their values")
        if state.prompt_token_ids is None and state.sampling_params.repetition_penalty != 1.0:
            raise ValueError(f"request {request_id!r}: repetition_penalty needs the prompt's "
                             f"token ids, but the prompt was given as embeddings")
        params = corelib_params(state.sampling_params, self.vocab_size, thinking=self.thinking)
        if self.processors:
            self.processors.admit(request_id)
        resume = self._resume_state(request_id, params, len(output_ids))
        # Only a resumed selector passes sampler_state: a backend's batch written before that
        # argument serves every other request.
        more = {} if resume is None else {"sampler_state": resume}
        self.batch.add(request_id, params, prompt_token_ids=state.prompt_token_ids or (),
                       output_token_ids=list(output_ids),
                       child_offset=child_offset(state.sampling_params), **more)
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
    """vLLM's ``Sampler`` interface, sampled by corelib; also verifies speculative drafts
    (``verify_drafts``, called through ``rejection_sampler``) and takes the grammar bitmask
    (``receive_grammar_bitmask``, called instead of vLLM's ``apply_grammar_bitmask``).

    Subclasses vLLM's sampler so that what the runner uses besides ``forward`` (prompt
    logprobs: ``compute_logprobs``, ``gather_logprobs``) stays vLLM's: prompt logprobs are the
    model's raw log-softmax, no sampling involved.
    """

    def __init__(self, runner: Any, choice: str):
        """Raises ValueError naming the engine setting corelib cannot honour: a logprobs mode,
        reasoning markers (``params.thinking_markers``), a rejection-sampling method
        (``speculative.verify_method``), custom logits processors on a traced backend."""
        model_config = runner.model_config
        mode = model_config.logprobs_mode
        if mode not in LOGPROBS_MODES:
            raise ValueError(f"{ENV_VAR}: logprobs_mode={mode!r} is not supported; corelib "
                             f"returns {sorted(LOGPROBS_MODES)}")
        vocab_size = runner.input_batch.vocab_size
        thinking = _engine_setting(thinking_markers, runner.vllm_config.reasoning_config, vocab_size)
        super().__init__(logprobs_mode=mode,
                         use_fp64_gumbel=getattr(model_config, "use_fp64_gumbel", False))
        self.runner = runner
        self.corelib = make_sampler(choice, torch.device(runner.device), model_config.seed)
        self.verify_method = _engine_setting(verify_method, runner.speculative_config, self.corelib)
        self.processors = self._processor_stages(custom_processors(runner.input_batch.logitsprocs))
        self.mirror = BatchMirror(self.corelib, vocab_size, LOGPROBS_MODES[mode], self.processors,
                                  thinking)
        self.rejection_sampler = CorelibRejectionSampler(self)
        # A backend written before corelib's token_bitmask argument gets vLLM's own in-place
        # masking of the logits instead (``grammar``).
        self.takes_token_bitmask = accepts_token_bitmask(self.corelib)
        self.takes_flat_drafts = "num_drafts" in inspect.signature(self.corelib.verify).parameters
        self.speculation = SpeculationStats(self.corelib.device)
        self._grammar_bitmask: Optional[torch.Tensor] = None
        self._failures: dict[str, str] = {}
        _SAMPLERS.add(self)

    def _processor_stages(self, processors: list) -> Optional[ProcessorStages]:
        """vLLM's custom logits processors as stages of the mirror's batch (``processors``),
        or None without any. A backend that traces or captures its steps cannot run their
        Python: ValueError naming them."""
        if not processors:
            return None
        if traces_its_steps(self.corelib):
            raise ValueError(
                f"{ENV_VAR}: vLLM logits processors {[processor_name(p) for p in processors]} "
                f"cannot run on corelib backend {self.corelib.name!r}: it traces or captures "
                f"its steps; use a backend that runs eager torch (reference, cpu, cuda)")

        def rows_of(request_ids: list[str]) -> tuple[list[int], int]:
            batch = self.mirror.batch
            return [batch.rows_of(r)[0] for r in request_ids], batch.num_rows

        return ProcessorStages(processors, rows_of,
                               lambda request_id: self.mirror.batch.params_of(request_id).is_greedy)

    def describe(self) -> dict[str, Any]:
        """What this sampler changed in its runner, for the start-up log line of its worker."""
        patched = ["sampler"]
        if self.takes_token_bitmask:
            patched.append("grammar bitmask -> token_bitmask")
        if self.runner.speculative_config is not None:
            patched.append(f"rejection_sampler -> corelib verify (method={self.verify_method!r})")
        if self.mirror.thinking is not None:
            patched.append("thinking budget -> corelib step 8b")
        if self.processors:
            patched.append(f"logits processors as corelib stages: {self.processors.names}")
        return {"backend": self.corelib.name, "device": str(self.corelib.device), "patched": patched}

    # ------------------------------------------------------------------ one token per row
    def forward(self, logits: torch.Tensor, sampling_metadata: Any,
                predict_bonus_token: bool = False,
                logprobs_mode_override: Optional[str] = None) -> SamplerOutput:
        """logits: ``[num_reqs, V]``, one row per row of the runner's input batch. Returns
        vLLM's ``SamplerOutput``: int32 ``[num_reqs, 1]`` token ids (-1 for a flagged row, see
        the module docstring) and, when a request asks for logprobs, ``LogprobsTensors`` (int32
        ids and float32 logprobs ``[num_reqs, N + 1]``, column 0 the sampled token; int64 ranks
        ``[num_reqs]``)."""
        if predict_bonus_token or logprobs_mode_override is not None:
            raise NotImplementedError("corelib's vLLM sampler does not run inside vLLM's "
                                      "rejection sampler: corelib verifies drafts itself")
        mask = self._take_grammar_bitmask(logits.shape[0])
        # The runner's own steps pass its input batch's metadata; warm-up and profiling pass
        # dummy metadata for rows that are no requests.
        if sampling_metadata is not self.runner.input_batch.sampling_metadata:
            return self._profile(logits)
        batch = self.mirror.sync(self.runner.input_batch, self.runner.requests)
        if self.processors:
            self.processors.start_step()
        if mask is None:
            out = self.corelib.sample(logits, batch)
        else:
            out = self.corelib.sample(logits, batch, token_bitmask=mask)
        if self._any_flagged(out.valid, batch, out.raise_on_invalid):
            batch.append(out.token_ids[:, None])     # -1: the flagged rows get no token
        else:
            batch.append(out.token_ids)
        return _vllm_output(out.token_ids[:, None], out.logprobs)

    def _profile(self, logits: torch.Tensor) -> SamplerOutput:
        """vLLM's warm-up and memory-profiling call (dummy metadata, no requests): the same
        work on a throwaway batch of as many random rows, so the profile measures corelib."""
        out = self.corelib.sample(logits, self._profile_batch(logits.shape[0], logits.shape[1]))
        return _vllm_output(out.token_ids[:, None], out.logprobs)

    def _profile_batch(self, rows: int, vocab_size: int) -> SamplingBatch:
        batch = self.corelib.new_batch(vocab_size)
        params = SamplingParams(temperature=0.5, top_p=0.9, top_k=vocab_size - 1)
        for row in range(rows):
            batch.add(f"profile-{row}", params)
        return batch

    # ------------------------------------------------------------------ speculative decoding
    def verify_drafts(self, metadata: Any, draft_probs: Optional[torch.Tensor],
                      logits: torch.Tensor, sampling_metadata: Any) -> SamplerOutput:
        """vLLM's rejection-sampler call, verified by corelib.

        metadata: vLLM's ``SpecDecodeMetadata`` (drafts per row, flat int32 draft ids);
        draft_probs: None or float ``[sum(drafts), V]``; logits: ``[sum(1 + drafts), V]``, each
        row's slots consecutive. Returns int32 ``[num_reqs, K + 1]`` emitted tokens, -1 after
        them (all -1 for a flagged row), and logprobs with one row per (row, slot)
        (``[num_reqs * (K + 1), N + 1]``; vLLM drops the rows of -1 slots). The corelib batch
        advances by each row's emitted tokens. A step where no row has drafts is ``forward``'s
        plain sample."""
        num_drafts = list(metadata.num_draft_tokens)
        if max(num_drafts, default=0) == 0:
            return self.forward(logits, sampling_metadata)
        mask = self._take_grammar_bitmask(logits.shape[0])
        flat = (logits, metadata.draft_token_ids, draft_probs, mask)
        if sampling_metadata is not self.runner.input_batch.sampling_metadata:
            batch = self._profile_batch(len(num_drafts), logits.shape[1])
            out = self._verify(batch, flat, num_drafts)
            return _vllm_output(out.token_ids, out.logprobs)
        batch = self.mirror.sync(self.runner.input_batch, self.runner.requests)
        out = self._verify(batch, flat, num_drafts)
        self._any_flagged(out.valid, batch, out.raise_on_invalid)
        batch.append(out.token_ids)
        self.speculation.record(num_drafts, out.num_emitted)
        return _vllm_output(out.token_ids, out.logprobs)

    def _verify(self, batch: SamplingBatch, flat: tuple, num_drafts: list[int]) -> VerifyOutput:
        """corelib's verify of vLLM's flat tensors (logits, draft ids, draft probabilities,
        bitmask) with the engine's method. A backend written before verify's flat form (its
        ``num_drafts`` argument) gets them padded; one written before its ``method`` argument
        is called without it (it verifies by the token rule)."""
        method = {} if self.verify_method == "token" else {"method": self.verify_method}
        logits, ids, probs, mask = flat
        if self.takes_flat_drafts:
            return self.corelib.verify(logits, batch, ids, probs, mask, num_drafts=num_drafts, **method)
        layout = DraftLayout.of(num_drafts, self.corelib.device)
        logits, ids, probs, mask = padded_arguments(layout, logits, batch, ids, probs, mask)
        return self.corelib.verify(logits, batch, ids, probs, mask, **method)

    # ------------------------------------------------------------------ structured outputs
    def receive_grammar_bitmask(self, mask: torch.Tensor) -> None:
        """The step's grammar bitmask, int32 ``[logits rows, W]`` (``grammar``); the next
        sampling call passes it to corelib."""
        self._grammar_bitmask = mask

    def _take_grammar_bitmask(self, rows: int) -> Optional[torch.Tensor]:
        mask, self._grammar_bitmask = self._grammar_bitmask, None
        if mask is not None and mask.shape[0] != rows:
            raise RuntimeError(f"the grammar bitmask has {mask.shape[0]} rows for {rows} rows "
                               f"of logits")
        return mask

    # ------------------------------------------------------------------ flagged rows
    def _any_flagged(self, valid: torch.Tensor, batch: SamplingBatch, raise_on_invalid) -> bool:
        """Whether a row is flagged, recording why for each (``take_failures``). The check
        waits on the device: free on the CPU, where vLLM copies the tokens to the host right
        after. Under asynchronous scheduling ``raise_on_invalid`` raises instead."""
        if bool(valid.all()):
            return False
        if getattr(self.runner, "use_async_scheduling", False):
            raise_on_invalid(batch)
        counts = batch.generated_counts()
        processor_failures = self.processors.failures if self.processors else {}
        for row in (~valid).nonzero()[:, 0].tolist():
            request_id = batch.rows[row][0]
            why = processor_failures.get(request_id) or (
                f"its grammar, allowed_token_ids, bad_words and min_tokens (which holds back the "
                f"stop and eos ids) exclude every token, or its logits are NaN/+inf")
            self._failures[request_id] = (
                f"corelib sampler ({ENV_VAR}): request {request_id!r} has no token to sample "
                f"after {counts[row]} generated tokens: {why}")
            logger.error("%s; vLLM finishes the request with an error", self._failures[request_id])
        return True

    def take_failures(self) -> dict[str, str]:
        """The flagged requests since the last call: request id -> why."""
        failures, self._failures = self._failures, {}
        return failures


# Every CorelibSampler of this process, to find the one of a runner's input batch.
_SAMPLERS: "weakref.WeakSet[CorelibSampler]" = weakref.WeakSet()


def sampler_for(input_batch: Any) -> Optional[CorelibSampler]:
    """The CorelibSampler whose runner's input batch is ``input_batch``, or None (a runner
    built without ``CORELIB_VLLM`` keeps vLLM's sampler)."""
    for sampler in list(_SAMPLERS):
        if sampler.runner.input_batch is input_batch:
            return sampler
    return None


def _engine_setting(read, *args):
    """``read(*args)``, a ValueError it raises prefixed with the variable that chose corelib
    (the engine fails to start with it)."""
    try:
        return read(*args)
    except ValueError as exc:
        raise ValueError(f"{ENV_VAR}: {exc}") from None


def _vllm_output(token_ids: torch.Tensor, logprobs: Optional[Logprobs]) -> SamplerOutput:
    """vLLM's SamplerOutput from corelib's ``[rows, slots]`` token ids and logprobs (one
    logprobs row per row and slot, as vLLM's rejection sampler lays them out)."""
    tensors = None
    if logprobs is not None:
        width = logprobs.token_ids.shape[-1]
        tensors = LogprobsTensors(logprobs.token_ids.reshape(-1, width).to(torch.int32),
                                  logprobs.logprobs.reshape(-1, width),
                                  logprobs.ranks.reshape(-1))
    return SamplerOutput(sampled_token_ids=token_ids.to(torch.int32), logprobs_tensors=tensors)
