"""vLLM ``SamplingParams`` -> ``corelib.SamplingParams``.

Every vLLM field that corelib has keeps its meaning (vLLM validates the same ranges). Where
vLLM's field is derived, the mapping takes vLLM's derived value:

- ``temperature`` below vLLM's greedy threshold (1e-5) is greedy (corelib's 0);
- ``stop_token_ids`` are vLLM's ``all_stop_token_ids``: the request's stop ids and the
  model's eos ids, which vLLM's min-tokens stage masks (corelib's step 5);
- ``bad_words`` are vLLM's tokenised bad words (``bad_words_token_ids``);
- ``n`` is 1 inside the engine: vLLM runs a request with n > 1 as n requests. vLLM seeds
  child i with ``seed + i``; with ``CORELIB_VLLM`` set, child i of a seeded request keeps the
  parent's seed and carries its index in ``extra_args["child_offset"]`` (``child_params``), so
  it draws what row (request, i) of corelib's own n-completion request draws.

corelib's own samplers that vLLM has no field for come through ``extra_args``: a key that
is a ``corelib.SamplingParams`` field absent from vLLM's ``SamplingParams`` is passed on
(validated by corelib); a key vLLM itself reads is left to vLLM; ``child_offset`` is the
child index a request draws as (``SamplingBatch.add``'s argument); any other key is an error,
unless the engine runs custom logits processors, which read their settings from
``extra_args`` too (then other keys are theirs).
So is a vLLM feature that would change sampling and that corelib does not implement.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import pydantic

from ...params import SamplingParams

# vLLM's Sampler treats a temperature below this as greedy.
GREEDY_TEMPERATURE = 1e-5
# extra_args keys that vLLM's own engine reads (disaggregated prefill and encoder transfer).
VLLM_EXTRA_ARGS = frozenset({"kv_transfer_params", "ec_transfer_params", "kv_cache_report_mode"})
# The extra_args key of the child index a request draws as (parallel sampling).
CHILD_OFFSET = "child_offset"
_INT32_MAX = 2**31 - 1


class UnsupportedParameterError(ValueError):
    """A vLLM request asks for something corelib cannot sample exactly."""


def extra_args_fields(vllm_params_type: type) -> frozenset[str]:
    """The ``corelib.SamplingParams`` fields ``extra_args`` may set: those that
    ``vllm_params_type`` (vLLM's ``SamplingParams``, a msgspec struct) does not have."""
    return frozenset(SamplingParams.model_fields) - frozenset(vllm_params_type.__struct_fields__)


def corelib_params(params: Any, vocab_size: Optional[int] = None,
                   custom_processors: bool = False) -> SamplingParams:
    """The ``corelib.SamplingParams`` that sample what ``params`` (a vLLM ``SamplingParams``)
    asks for. Raises ``ValueError`` naming the parameter when corelib cannot honour it or a
    value is out of corelib's range, and for token ids outside ``vocab_size`` when given.
    ``custom_processors``: the engine runs custom logits processors, so an ``extra_args`` key
    that is neither corelib's nor vLLM's is left to them."""
    _reject_unsupported(params)
    fields = {
        "n": params.n,
        "temperature": 0.0 if params.temperature < GREEDY_TEMPERATURE else params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "min_p": params.min_p,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "logit_bias": dict(params.logit_bias or {}),
        "min_tokens": params.min_tokens,
        "stop_token_ids": sorted(params.all_stop_token_ids),
        "allowed_token_ids": list(params.allowed_token_ids) if params.allowed_token_ids else None,
        "bad_words": [list(word) for word in (params.bad_words_token_ids or [])],
        "seed": params.seed,
        "logprobs": params.logprobs,
    }
    fields.update(_extra_fields(params, custom_processors))
    offset = child_offset(params)
    if offset + params.n - 1 > _INT32_MAX:
        raise ValueError(f"extra_args[{CHILD_OFFSET!r}]: {offset} + n - 1 exceeds 2**31 - 1")
    try:
        result = SamplingParams(**fields)
    except pydantic.ValidationError as exc:
        raise ValueError(_describe(exc)) from None
    top = result.max_token_id()
    if vocab_size is not None and top is not None and top >= vocab_size:
        raise ValueError(f"token id {top} in the sampling parameters is out of range for the "
                         f"model's vocabulary of {vocab_size}")
    _check_first_token_possible(result)
    return result


def child_offset(params: Any) -> int:
    """The child index the vLLM request ``params`` draws as: ``extra_args["child_offset"]``,
    0 when absent. Raises ValueError naming the key for anything but an int >= 0."""
    value = (params.extra_args or {}).get(CHILD_OFFSET, 0)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _INT32_MAX:
        raise ValueError(f"extra_args[{CHILD_OFFSET!r}] must be an int in [0, 2**31), got {value!r}")
    return value


def child_params(parent: Any, index: int) -> Any:
    """vLLM ``SamplingParams`` for child ``index`` of the seeded request ``parent`` (n > 1):
    n = 1, the parent's seed, and the child's index (after the parent's own ``child_offset``)
    in ``extra_args``, so the child draws what row (parent, index) of the unsplit request
    draws. A new object; the parent and its ``extra_args`` are not changed."""
    child = copy.copy(parent)
    child.n = 1
    child.extra_args = {**(parent.extra_args or {}), CHILD_OFFSET: child_offset(parent) + index}
    return child


def _check_first_token_possible(params: SamplingParams) -> None:
    """Refuse a request whose first step has no token left (allowed ids all excluded by
    one-token bad words or, under min_tokens, by stop ids): corelib would flag the row, and
    the engine could not go on with it."""
    if params.allowed_token_ids is None:
        return
    left = set(params.allowed_token_ids) - {w[0] for w in params.bad_words if len(w) == 1}
    if params.min_tokens > 0:
        left -= set(params.stop_token_ids)
    if not left:
        raise ValueError(
            f"allowed_token_ids {sorted(set(params.allowed_token_ids))} are all excluded by "
            f"bad_words or, until min_tokens={params.min_tokens}, by the stop ids "
            f"{params.stop_token_ids}: no first token could be sampled")


def _reject_unsupported(params: Any) -> None:
    if params.logprobs == -1:
        raise UnsupportedParameterError(
            "logprobs=-1 (the whole vocabulary) is not supported by corelib's sampler: ask for "
            "at most 20")
    if params.logprob_token_ids is not None:
        raise UnsupportedParameterError(
            f"logprob_token_ids is not supported by corelib's sampler, got {params.logprob_token_ids}")
    if params.thinking_token_budget is not None:
        raise UnsupportedParameterError(
            f"thinking_token_budget is not supported by corelib's sampler, got "
            f"{params.thinking_token_budget}")


def _extra_fields(params: Any, custom_processors: bool) -> dict[str, Any]:
    extra = params.extra_args or {}
    allowed = extra_args_fields(type(params))
    fields = {}
    for key, value in extra.items():
        if key in VLLM_EXTRA_ARGS or key == CHILD_OFFSET:
            continue
        if key in allowed:
            fields[key] = value
        elif key in SamplingParams.model_fields:
            raise ValueError(f"extra_args[{key!r}]: {key} is a field of vLLM's SamplingParams; "
                             f"set it there")
        elif not custom_processors:
            raise ValueError(
                f"extra_args[{key!r}] is not a corelib sampling parameter (corelib reads "
                f"{sorted(allowed | {CHILD_OFFSET}) or 'none'} from extra_args; vLLM reads "
                f"{sorted(VLLM_EXTRA_ARGS)})")
    return fields


def _describe(exc: pydantic.ValidationError) -> str:
    """One line per error, naming the field: pydantic's own text is several lines per error."""
    parts = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "parameters"
        message = str(error["msg"]).removeprefix("Value error, ")
        parts.append(f"{where}: {message}")
    return "; ".join(parts)
