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
  it draws what row (request, i) of corelib's own n-completion request draws;
- ``thinking_token_budget`` is corelib's ``thinking_budget``, with the markers of the engine's
  reasoning config (``ThinkingMarkers``): its start ids open a thinking section, its natural
  end ids close one, its forced end ids (which may begin with a transition phrase) are what
  the budget forces;
- ``logprobs`` keeps its value, -1 (every token) included.

corelib's own samplers that vLLM has no field for come through ``extra_args``, under one key
of corelib's: ``extra_args["corelib"]`` is a dict of ``corelib.SamplingParams`` fields absent
from vLLM's ``SamplingParams`` (validated by corelib; any other key in it is an error naming
it), or that dict as a JSON string: the OpenAI-compatible server's ``vllm_xargs`` (which
becomes ``extra_args``) takes only strings, numbers and lists as values, so a request to
``vllm serve`` sends ``"vllm_xargs": {"corelib": '{"mirostat_tau": 5.0}'}``. Every other key
of ``extra_args`` belongs to other code (vLLM itself, custom logits processors, plugins, the
user) and passes through untouched, except two spellings corelib reads at the top level:
``child_offset``, the child index a request draws as (``SamplingBatch.add``'s argument), and,
for requests written before the ``"corelib"`` key, the name of a field that ``"corelib"``
takes (``extra_args={"dry_multiplier": 0.8}``), validated as there; there
``temperature_last`` may be 1 or 0, since the server's ``vllm_xargs`` turns JSON booleans into
those. A field set both ways is an error.
A vLLM feature that would change sampling and that corelib does not implement is refused.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from typing import Any, Optional

import pydantic

from ...params import SamplingParams

# vLLM's Sampler treats a temperature below this as greedy.
GREEDY_TEMPERATURE = 1e-5
# extra_args keys that vLLM's own engine reads (disaggregated prefill and encoder transfer).
VLLM_EXTRA_ARGS = frozenset({"kv_transfer_params", "ec_transfer_params", "kv_cache_report_mode"})
# The extra_args key of the child index a request draws as (parallel sampling).
CHILD_OFFSET = "child_offset"
# The extra_args key whose dict holds corelib's own fields (other keys belong to other code).
CORELIB_KEY = "corelib"
# corelib fields that vLLM sets otherwise: the budget is vLLM's thinking_token_budget, the
# markers are the engine's reasoning config (one set per engine, as vLLM has it).
THINKING_FIELDS = frozenset({"thinking_budget", "thinking_start_token_ids",
                             "thinking_end_token_ids", "thinking_forced_token_ids"})
# corelib fields whose output vLLM's V1 runner has no channel for: the kept sets of
# return_kept would be computed and dropped (a trainer next to vLLM calls score instead).
NO_CHANNEL_FIELDS = frozenset({"return_kept"})
_INT32_MAX = 2**31 - 1
# corelib's boolean fields that extra_args may set.
_BOOL_FIELDS = frozenset({"temperature_last"})


class UnsupportedParameterError(ValueError):
    """A vLLM request asks for something corelib cannot sample exactly."""


@dataclass(frozen=True)
class ThinkingMarkers:
    """The token ids of an engine's reasoning markers, as corelib's step 8b reads them."""

    start: tuple[int, ...]       # opens a thinking section (thinking_start_token_ids)
    end: tuple[int, ...]         # closes one when the model writes it (thinking_end_token_ids)
    forced: tuple[int, ...]      # forced once the budget is spent (thinking_forced_token_ids)


def thinking_markers(reasoning_config: Any,
                     vocab_size: Optional[int] = None) -> Optional[ThinkingMarkers]:
    """The markers of vLLM's ``ReasoningConfig``; None without one, or when vLLM found no
    marker strings to tokenise. Its ``reasoning_start_token_ids`` open a section, its
    ``natural_reasoning_end_token_ids`` (the parser's end marker) close one, and its
    ``reasoning_end_token_ids`` (``reasoning_end_str``: a transition phrase, then the end
    marker) are forced. Raises ValueError naming the setting when corelib's contract cannot
    express them: forced ids that do not end with the natural end ids, or ids outside
    ``vocab_size``."""
    if reasoning_config is None or not reasoning_config.enabled:
        return None
    markers = ThinkingMarkers(tuple(reasoning_config.reasoning_start_token_ids or ()),
                              tuple(reasoning_config.natural_reasoning_end_token_ids or ()),
                              tuple(reasoning_config.reasoning_end_token_ids or ()))
    if not (markers.start and markers.end and markers.forced):
        return None
    if markers.forced[len(markers.forced) - len(markers.end):] != markers.end:
        raise ValueError(
            f"the reasoning config's forced end {list(markers.forced)} (reasoning_end_str "
            f"{reasoning_config.reasoning_end_str!r}) does not end with its natural end "
            f"{list(markers.end)} (the reasoning parser's end marker): corelib forces a "
            f"transition phrase followed by the end marker; make reasoning_end_str end with it")
    for name, ids in (("reasoning_start_token_ids", markers.start),
                      ("natural_reasoning_end_token_ids", markers.end),
                      ("reasoning_end_token_ids", markers.forced)):
        if vocab_size is not None and max(ids) >= vocab_size:
            raise ValueError(f"the reasoning config's {name} {list(ids)} hold token id "
                             f"{max(ids)}, out of range for the model's vocabulary of {vocab_size}")
    return markers


@functools.lru_cache(maxsize=None)       # one entry per vLLM params class: made once per process
def extra_args_fields(vllm_params_type: type) -> frozenset[str]:
    """The ``corelib.SamplingParams`` fields ``extra_args`` may set: those that
    ``vllm_params_type`` (vLLM's ``SamplingParams``, a msgspec struct) does not have, except
    the reasoning budget's (``THINKING_FIELDS``), which vLLM sets its own way, and those whose
    output vLLM cannot carry (``NO_CHANNEL_FIELDS``)."""
    return (frozenset(SamplingParams.model_fields) - frozenset(vllm_params_type.__struct_fields__)
            - THINKING_FIELDS - NO_CHANNEL_FIELDS)


def corelib_params(params: Any, vocab_size: Optional[int] = None,
                   thinking: Optional[ThinkingMarkers] = None) -> SamplingParams:
    """The ``corelib.SamplingParams`` that sample what ``params`` (a vLLM ``SamplingParams``)
    asks for. Raises ``ValueError`` naming the parameter when corelib cannot honour it or a
    value is out of corelib's range, and for token ids (and a number of logprobs) beyond
    ``vocab_size`` when given. ``extra_args`` keys that are not corelib's are left alone.
    ``thinking``: the engine's reasoning markers (``thinking_markers``), which a
    ``thinking_token_budget`` needs."""
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
    fields.update(_thinking_fields(params, thinking))
    fields.update(_extra_fields(params))
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
    if vocab_size is not None and result.logprobs is not None and result.logprobs > vocab_size:
        raise ValueError(f"logprobs={result.logprobs} exceeds the model's vocabulary of "
                         f"{vocab_size} (-1 asks for every token)")
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
    if params.logprob_token_ids is not None:
        raise UnsupportedParameterError(
            f"logprob_token_ids is not supported by corelib's sampler, got {params.logprob_token_ids}")


def _thinking_fields(params: Any, thinking: Optional[ThinkingMarkers]) -> dict[str, Any]:
    budget = params.thinking_token_budget
    if budget is None:
        return {}
    if thinking is None:
        raise ValueError(
            f"thinking_token_budget={budget} needs the engine's reasoning markers: start the "
            f"engine with a reasoning parser (reasoning_parser) or a reasoning config "
            f"(reasoning_config with reasoning_start_str and reasoning_end_str)")
    return {"thinking_budget": budget, "thinking_start_token_ids": list(thinking.start),
            "thinking_end_token_ids": list(thinking.end),
            "thinking_forced_token_ids": list(thinking.forced)}


def _extra_fields(params: Any) -> dict[str, Any]:
    """corelib's fields in ``params.extra_args``: the dict under ``"corelib"`` (every key in it
    must be one), and the names of those fields at the top level (the spelling from before that
    key). Other top-level keys belong to other code and are not read."""
    extra = params.extra_args
    if not extra:
        return {}
    nested = _corelib_dict(extra.get(CORELIB_KEY, {}))
    allowed = extra_args_fields(type(params))
    fields = {}
    for key, value in nested.items():
        where = f"extra_args[{CORELIB_KEY!r}][{key!r}]"
        _check_corelib_key(key, where, allowed)
        fields[key] = value
    for key in allowed.intersection(extra):
        if key in fields:
            raise ValueError(f"extra_args[{key!r}]: {key} is also set in "
                             f"extra_args[{CORELIB_KEY!r}]; set it once")
        fields[key] = _top_level_value(key, extra[key])
    return fields


def _corelib_dict(value: Any) -> dict:
    """The dict of corelib fields under ``extra_args["corelib"]``: the dict itself, or the
    JSON object a string holds (the server's ``vllm_xargs`` cannot carry a dict)."""
    where = f"extra_args[{CORELIB_KEY!r}]"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"{where}: a string must hold a JSON object of corelib sampling "
                             f"parameters, got {value!r} ({exc})") from None
        if not isinstance(value, dict):
            raise ValueError(f"{where}: a string must hold a JSON object of corelib sampling "
                             f"parameters, got JSON {type(value).__name__} {value!r}")
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a dict of corelib sampling parameters (or that dict "
                         f"as a JSON string), got {type(value).__name__} {value!r}")
    return value


def _top_level_value(key: str, value: Any) -> Any:
    # vLLM's server turns JSON booleans in vllm_xargs into 1 and 0; an int (not a bool) of
    # exactly those values is the boolean the request sent.
    if key in _BOOL_FIELDS and type(value) is int and value in (0, 1):
        return bool(value)
    return value


def _check_corelib_key(key: Any, where: str, allowed: frozenset[str]) -> None:
    """Raise ValueError, naming ``where``, when ``key`` is not a field corelib takes from
    ``extra_args`` (``allowed``)."""
    if key in allowed:
        return
    if key in THINKING_FIELDS:
        raise ValueError(f"{where}: the reasoning budget is vLLM's thinking_token_budget, its "
                         f"markers the engine's reasoning config")
    if key in NO_CHANNEL_FIELDS:
        raise ValueError(f"{where}: vLLM's V1 runner has no output for kept sets; a trainer "
                         f"next to vLLM recomputes the rollout's distribution with corelib's "
                         f"Sampler.score (docs/vllm.md)")
    if key in SamplingParams.model_fields:
        raise ValueError(f"{where}: {key} is a field of vLLM's SamplingParams; set it there")
    raise ValueError(f"{where} is not a corelib sampling parameter (corelib reads "
                     f"{sorted(allowed) or 'none'} from extra_args[{CORELIB_KEY!r}])")


def _describe(exc: pydantic.ValidationError) -> str:
    """One line per error, naming the field: pydantic's own text is several lines per error."""
    parts = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "parameters"
        message = str(error["msg"]).removeprefix("Value error, ")
        parts.append(f"{where}: {message}")
    return "; ".join(parts)
