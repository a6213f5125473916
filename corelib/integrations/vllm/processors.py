"""vLLM's custom logits processors (``LLM(logits_processors=[...])``, ``--logits-processors``,
the ``vllm.logits_processors`` entry points) run inside corelib's pipeline.

A V1 ``LogitsProcessor`` keeps per-row state, fed by vLLM's ``InputBatch`` before every step
(``update_state(BatchUpdate)``: the rows added, removed and moved, with each added request's
live output-token list), and changes the logits of the whole batch (``apply(logits)``, rows
in vLLM's batch order). The runner keeps feeding it exactly as it does for vLLM's sampler; the
corelib batch follows the same rows (``sampler.BatchMirror``), so only ``apply`` moves:

- a processor that is not argmax-invariant runs in corelib's ``after_penalties`` slot (after
  step 8a, every row), where vLLM runs it before its penalties;
- an argmax-invariant one runs in the ``after_filters`` slot (after step 13b, random rows),
  where vLLM runs it after temperature and min-p, before top-k and top-p.

Each becomes a ``corelib.StageSpec`` that the batch runs on every row
(``SamplingBatch.use_stage``), in vLLM's order within its slot. vLLM's built-in processors
(min-tokens, logit bias, min-p) are corelib stages of their own and are left out.

A backend may run its stages per block of rows (the ``cpu`` backend does, for large batches):
every row carries a key of its request (stage state), so a block's rows are put at their batch
rows of a ``[rows, V]`` tensor before ``apply`` and taken back after it.

A processor whose ``apply`` raises (or returns something other than ``[rows, V]`` logits)
leaves no token to the rows it ran on: every row in the ``after_penalties`` slot, the random
rows in ``after_filters``. corelib flags them (their logits become -inf), the sampler reports
the processor's error for their requests, and vLLM finishes them as per-request errors; the
other rows and the engine go on.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from pydantic import BaseModel

from ...stages import StageInputs, StageSpec, StageState

AFTER_PENALTIES, AFTER_FILTERS = "after_penalties", "after_filters"
KEY_STATE = "request"
NEG_INF = float("-inf")


class NoArguments(BaseModel):
    """A vLLM processor reads its per-request settings from vLLM's SamplingParams, not from
    corelib's stage_args."""


def processor_name(processor: Any) -> str:
    """``module.Class`` of a vLLM logits processor, as errors and logs name it."""
    kind = type(processor)
    return f"{kind.__module__}.{kind.__qualname__}"


def custom_processors(logitsprocs: Any) -> list[Any]:
    """The processors of a runner's ``LogitsProcessors`` that are not vLLM's built-ins, in
    vLLM's order (argmax-invariant ones, then the others, each in construction order)."""
    from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS
    builtin = tuple(BUILTIN_LOGITS_PROCESSORS)
    return [p for p in logitsprocs.all if type(p) not in builtin]


class ProcessorStages:
    """The custom processors of one runner as stages of its corelib batch.

    ``rows_of(request_ids)`` gives the current batch row of each request and the batch's row
    count (the mirror's batch, which is in vLLM's row order when the sampler runs);
    ``is_greedy(request_id)`` whether a request samples greedily. ``admit(request_id)`` is called right
    before a request is added to the batch (its rows' key state is made then);
    ``forget(request_id)`` after it left. ``failures`` holds, for the current step, request
    id -> why, for the rows a failing processor left without a token; ``start_step`` clears it.
    """

    def __init__(self, processors: Iterable[Any], rows_of, is_greedy):
        self.processors = list(processors)
        self._rows_of = rows_of
        self._is_greedy = is_greedy
        self._request_of_key: dict[int, str] = {}
        self._key_of_request: dict[str, int] = {}
        self._next_key = 0
        self._admitting: Optional[str] = None
        self.failures: dict[str, str] = {}

    @property
    def names(self) -> list[str]:
        return [processor_name(p) for p in self.processors]

    def specs(self) -> list[StageSpec]:
        """One StageSpec per processor (for ``SamplingBatch.use_stage``)."""
        key = StageState(KEY_STATE, torch.int64, lambda vocab_size: (), self._new_key, _unchanged)
        specs, names = [], []
        for p in self.processors:
            names.append(processor_name(p))
            repeat = names.count(names[-1])      # vLLM builds a class named twice twice
            specs.append(StageSpec(
                name=f"vllm:{names[-1]}" + (f"#{repeat}" if repeat > 1 else ""),
                slot=AFTER_FILTERS if p.is_argmax_invariant() else AFTER_PENALTIES,
                args=NoArguments, apply=self._apply_with(p), state=(key,),
                description="a vLLM logits processor"))
        return specs

    # ------------------------------------------------------------------ request keys
    def admit(self, request_id: str) -> None:
        self._admitting = request_id
        self.forget(request_id)       # a request added again (from vLLM's state) gets a new key

    def forget(self, request_id: str) -> None:
        key = self._key_of_request.pop(request_id, None)
        if key is not None:
            del self._request_of_key[key]

    def _new_key(self, prompt, output, args, vocab_size) -> torch.Tensor:
        """The key state of a row being added: one key per request (all its stages share it)."""
        request_id = self._admitting
        if request_id is None:
            raise RuntimeError("a row joined the batch without its request id")
        key = self._key_of_request.get(request_id)
        if key is None:
            key = self._next_key
            self._next_key += 1
            self._key_of_request[request_id] = key
            self._request_of_key[key] = request_id
        return torch.tensor(key, dtype=torch.int64)

    # ------------------------------------------------------------------ the stage
    def start_step(self) -> None:
        self.failures = {}

    def _apply_with(self, processor: Any):
        name = processor_name(processor)
        slot = AFTER_FILTERS if processor.is_argmax_invariant() else AFTER_PENALTIES

        def apply(x: torch.Tensor, inputs: StageInputs) -> torch.Tensor:
            """x float32 ``[b, V]``, the rows of one block (or the whole batch); returns a new
            tensor: the processor's logits for those rows, or -inf rows where it failed."""
            request_ids = [self._request_of_key[k] for k in inputs.state[KEY_STATE].tolist()]
            rows, num_rows = self._rows_of(request_ids)
            whole = rows == list(range(num_rows))
            logits = x.clone() if whole else _at_rows(x, rows, num_rows)
            try:
                out = processor.apply(logits)
                if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(logits.shape):
                    got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                    raise TypeError(f"apply returned {got}, expected {list(logits.shape)} logits")
            except Exception as exc:
                self._record_failure(name, slot, request_ids, exc)
                return torch.full_like(x, NEG_INF)
            out = out.to(x.dtype)
            return out if whole else out[torch.tensor(rows, device=x.device)]
        return apply

    def _record_failure(self, name: str, slot: str, request_ids: list[str], exc: Exception) -> None:
        why = (f"vLLM logits processor {name} raised {type(exc).__name__}: {exc}; the requests "
               f"it ran on in this step have no token")
        for request_id in request_ids:
            if slot == AFTER_FILTERS and self._is_greedy(request_id):
                continue        # a greedy row's token never reads that slot
            self.failures.setdefault(request_id, why)


def _at_rows(x: torch.Tensor, rows: list[int], num_rows: int) -> torch.Tensor:
    """x ``[b, V]`` placed at ``rows`` of a zero ``[num_rows, V]`` tensor: the batch indices
    a vLLM processor reads its per-row state by (rows of other blocks are zeros, and their
    results are dropped)."""
    full = x.new_zeros((num_rows, x.shape[1]))
    full[torch.tensor(rows, device=x.device)] = x
    return full


def _unchanged(state: torch.Tensor, token_ids: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    return state
