"""Validated per-request sampling parameters (the contract's SamplingParams table)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)

from . import pipeline

TokenId = Annotated[StrictInt, Field(ge=0)]
# Floats accept ints too (temperature=1 is natural) but never bools or strings.
Float = Annotated[float, Field(strict=False, allow_inf_nan=False)]

#: Top-N logprobs of a request are limited only by the vocabulary (checked at ``batch.add``);
#: this is the default cap of backends with fixed shapes (XLA), which may raise it.
MAX_LOGPROBS = 20
#: ``logprobs=ALL_LOGPROBS`` asks for every token (columns 1..V in descending order).
ALL_LOGPROBS = -1
MAX_SEED = 2**63


# Field -> (test, rule): a value failing the test raises "<field> <rule>, got <value>".
_RANGES = {
    "n": (lambda v: v >= 1, "must be >= 1"),
    "temperature": (lambda v: v >= 0, "must be >= 0"),
    "top_k": (lambda v: v >= -1, "must be >= -1 (0 or -1 disable it)"),
    "top_p": (lambda v: 0.0 < v <= 1.0, "must be in (0, 1]"),
    "min_p": (lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]"),
    "presence_penalty": (lambda v: -2.0 <= v <= 2.0, "must be in [-2, 2]"),
    "frequency_penalty": (lambda v: -2.0 <= v <= 2.0, "must be in [-2, 2]"),
    "repetition_penalty": (lambda v: v > 0.0, "must be > 0"),
    "min_tokens": (lambda v: v >= 0, "must be >= 0"),
    "seed": (lambda v: 0 <= v < MAX_SEED, "must be in [0, 2**63)"),
    "logprobs": (lambda v: v >= ALL_LOGPROBS, "must be >= -1 (-1 = every token)"),
    "thinking_budget": (lambda v: v >= 0, "must be >= 0"),
    "dry_multiplier": (lambda v: 0.0 <= v <= 100.0, "must be in [0, 100]"),
    "dry_base": (lambda v: 1.0 < v <= 10.0, "must be in (1, 10]"),
    "dry_allowed_length": (lambda v: v >= 1, "must be >= 1"),
    "dry_range": (lambda v: v >= 0, "must be >= 0 (0 = the whole history)"),
    "top_n_sigma": (lambda v: v >= 0.0, "must be >= 0 (0 disables it)"),
    "typical_p": (lambda v: 0.0 < v <= 1.0, "must be in (0, 1]"),
    "xtc_threshold": (lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]"),
    "xtc_probability": (lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]"),
    "dynatemp_range": (lambda v: v >= 0.0, "must be >= 0 (0 disables it)"),
    "dynatemp_exponent": (lambda v: v > 0.0, "must be > 0"),
    "smoothing_factor": (lambda v: v >= 0.0, "must be >= 0 (0 disables it)"),
    "smoothing_curve": (lambda v: 1.0 <= v <= 3.0, "must be in [1, 3]"),
    "top_a": (lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]"),
    "epsilon_cutoff": (lambda v: 0.0 <= v < 1.0, "must be in [0, 1)"),
    "eta_cutoff": (lambda v: 0.0 <= v < 1.0, "must be in [0, 1)"),
    "tfs": (lambda v: 0.0 < v <= 1.0, "must be in (0, 1]"),
    "mirostat_tau": (lambda v: v >= 0.0, "must be >= 0 (0 disables it)"),
    "mirostat_eta": (lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]"),
    "adaptive_p_target": (lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]"),
    "adaptive_p_decay": (lambda v: 0.0 <= v <= 0.99, "must be in [0, 0.99]"),
}
_FLOAT_FIELDS = (
    "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "dry_multiplier", "dry_base", "top_n_sigma", "typical_p",
    "xtc_threshold", "xtc_probability", "dynatemp_range", "dynatemp_exponent",
    "smoothing_factor", "smoothing_curve", "top_a", "epsilon_cutoff", "eta_cutoff", "tfs",
    "mirostat_tau", "mirostat_eta", "adaptive_p_target", "adaptive_p_decay",
)


def _ensure_not_bool(value, field):
    # ValueError, so pydantic reports it as a ValidationError like every other bad value
    if isinstance(value, bool):
        raise ValueError(f"{field} must be a number, got bool {value!r}")
    if isinstance(value, str):
        raise ValueError(f"{field} must be a number, got str {value!r}")
    return value


class SamplingParams(BaseModel):
    """What one request asks of the sampler; every field's disabled value is its default.

    Invalid values raise ``pydantic.ValidationError`` (a ``ValueError``) naming the field and
    the value. Token ids are checked against the vocabulary when the request is added to a
    batch, since the vocabulary size is not known here.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    n: StrictInt = 1
    temperature: Float = 1.0
    top_k: StrictInt = 0
    top_p: Float = 1.0
    min_p: Float = 0.0
    presence_penalty: Float = 0.0
    frequency_penalty: Float = 0.0
    repetition_penalty: Float = 1.0
    logit_bias: dict[TokenId, Float] = Field(default_factory=dict)
    min_tokens: StrictInt = 0
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    allowed_token_ids: Optional[list[TokenId]] = None
    bad_words: list[list[TokenId]] = Field(default_factory=list)
    seed: Optional[StrictInt] = None
    logprobs: Optional[StrictInt] = None
    # The kept set of every step (``out.kept``: the tokens the row drew from), for training.
    return_kept: StrictBool = False
    # More samplers (contract stages 8a, 10a, 13a, 13b); every default disables its stage.
    dry_multiplier: Float = 0.0
    dry_base: Float = 1.75
    dry_allowed_length: StrictInt = 2
    dry_range: StrictInt = 0
    dry_sequence_breakers: list[TokenId] = Field(default_factory=list)
    top_n_sigma: Float = 0.0
    typical_p: Float = 1.0
    xtc_threshold: Float = 0.1
    xtc_probability: Float = 0.0
    # Fourth release: the local engines' filters (steps 10, 10b, 11a-11c, 13c, 13d), the
    # order of the filter group, and the stateful selectors of step 14.
    dynatemp_range: Float = 0.0
    dynatemp_exponent: Float = 1.0
    smoothing_factor: Float = 0.0
    smoothing_curve: Float = 1.0
    top_a: Float = 0.0
    epsilon_cutoff: Float = 0.0
    eta_cutoff: Float = 0.0
    tfs: Float = 1.0
    p_less: Optional[Literal["plain", "norm"]] = None
    sampler_order: Optional[list[str]] = None
    temperature_last: StrictBool = False
    mirostat_tau: Float = 0.0
    mirostat_eta: Float = 0.1
    adaptive_p_target: Optional[Float] = None
    adaptive_p_decay: Float = 0.9
    # Reasoning budget (contract step 8b): off unless thinking_budget is set.
    thinking_budget: Optional[StrictInt] = None
    thinking_start_token_ids: list[TokenId] = Field(default_factory=list)
    thinking_end_token_ids: list[TokenId] = Field(default_factory=list)
    thinking_forced_token_ids: Optional[list[TokenId]] = None
    # Custom stages from plugins: stage name -> its arguments (checked at ``batch.add``).
    stage_args: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @field_validator(*_FLOAT_FIELDS, mode="before")
    @classmethod
    def _floats_reject_bools(cls, value, info):
        _ensure_not_bool(value, info.field_name)
        if isinstance(value, int):
            return float(value)
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_values_reject_bools(cls, value):
        if isinstance(value, dict):
            out = {}
            for token, bias in value.items():
                _ensure_not_bool(bias, f"logit_bias[{token!r}]")
                out[token] = float(bias) if isinstance(bias, int) else bias
            return out
        return value

    @field_validator(*_RANGES)
    @classmethod
    def _check_range(cls, v, info):
        in_range, rule = _RANGES[info.field_name]
        if v is not None and not in_range(v):
            raise ValueError(f"{info.field_name} {rule}, got {v}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v):
        for token, bias in v.items():
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias[{token}] must be in [-100, 100], got {bias}")
        return v

    @field_validator("stage_args", mode="before")
    @classmethod
    def _check_stage_names(cls, value):
        if isinstance(value, dict):
            for name, args in value.items():
                if not isinstance(name, str) or not name:
                    raise ValueError(f"stage_args keys must be stage names (non-empty str), got {name!r}")
                if not isinstance(args, dict):
                    raise ValueError(f"stage_args[{name!r}] must be a dict of the stage's "
                                     f"arguments, got {type(args).__name__}")
        return value

    @field_validator("allowed_token_ids")
    @classmethod
    def _check_allowed(cls, v):
        if v is not None and len(v) == 0:
            raise ValueError("allowed_token_ids must not be empty (use None to allow every token)")
        return v

    @field_validator("bad_words")
    @classmethod
    def _check_bad_words(cls, v):
        for i, word in enumerate(v):
            if len(word) == 0:
                raise ValueError(f"bad_words[{i}] must be a non-empty token sequence, got []")
        return v

    @model_validator(mode="after")
    def _check_thinking_markers(self):
        if self.thinking_budget is None:
            return self
        for name in ("thinking_start_token_ids", "thinking_end_token_ids"):
            if not getattr(self, name):
                raise ValueError(f"thinking_budget={self.thinking_budget} needs {name}: the "
                                 f"marker that {'opens' if 'start' in name else 'ends'} a "
                                 f"thinking section (non-empty token ids), got []")
        forced, end = self.thinking_forced_token_ids, self.thinking_end_token_ids
        if forced is not None and (len(forced) < len(end) or forced[len(forced) - len(end):] != end):
            raise ValueError(f"thinking_forced_token_ids must end with thinking_end_token_ids "
                             f"{end} (a transition phrase, then the end marker), got {forced}")
        return self

    @model_validator(mode="after")
    def _check_filter_order(self):
        if self.sampler_order is None:
            return self
        if self.temperature_last:
            raise ValueError("temperature_last cannot be combined with sampler_order (list "
                             "temperature where it should run instead)")
        names = pipeline.order_names()
        seen = set()
        for name in self.sampler_order:
            if name not in names:
                raise ValueError(f"sampler_order: unknown filter {name!r} (known: {', '.join(names)})")
            if name in seen:
                raise ValueError(f"sampler_order: {name!r} is listed twice")
            seen.add(name)
        for name in pipeline.filters_on(self):
            if name not in seen:
                raise ValueError(f"sampler_order must list every filter the request turns on: "
                                 f"{name!r} is on but not listed")
        return self

    @model_validator(mode="after")
    def _check_one_selector(self):
        if self.mirostat_tau > 0.0 and self.adaptive_p_target is not None:
            raise ValueError(f"mirostat_tau={self.mirostat_tau} and adaptive_p_target="
                             f"{self.adaptive_p_target} both replace the draw: ask for one")
        return self

    @model_validator(mode="after")
    def _check_greedy_n(self):
        if self.n > 1 and self.temperature == 0.0:
            raise ValueError(
                f"n > 1 needs temperature > 0 (greedy completions would be identical), "
                f"got n={self.n}, temperature=0.0"
            )
        return self

    # Derived, for the batch state.
    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def effective_top_k(self) -> int:
        """top_k with both disabled spellings (0, -1) normalised to 0."""
        return max(self.top_k, 0)

    @property
    def uses_dry(self) -> bool:
        return self.dry_multiplier > 0.0

    @property
    def uses_xtc(self) -> bool:
        return self.xtc_probability > 0.0

    @property
    def uses_dynatemp(self) -> bool:
        return self.dynatemp_range > 0.0 and self.temperature > 0.0

    @property
    def uses_mirostat(self) -> bool:
        return self.mirostat_tau > 0.0

    @property
    def uses_adaptive_p(self) -> bool:
        return self.adaptive_p_target is not None

    @property
    def filter_order(self) -> Optional[tuple[str, ...]]:
        """The filters this request turns on, in the order it runs them, when that differs
        from the default order (``sampler_order`` or ``temperature_last``); None otherwise.
        Listed filters that are off do nothing, so they are left out."""
        if self.sampler_order is None and not self.temperature_last:
            return None
        on = set(pipeline.filters_on(self))
        if self.sampler_order is not None:
            order = tuple(name for name in self.sampler_order if name in on)
        else:
            last = ("temperature", "smoothing")
            order = tuple(n for n in pipeline.order_names() if n in on and n not in last)
            order += tuple(n for n in last if n in on)
        default = tuple(n for n in pipeline.order_names() if n in on)
        return None if order == default else order

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    @property
    def uses_thinking_budget(self) -> bool:
        return self.thinking_budget is not None

    @property
    def forced_thinking_ids(self) -> list[int]:
        """What step 8b forces once the budget is spent: ``thinking_forced_token_ids``, or the
        end marker when that is None."""
        forced = self.thinking_forced_token_ids
        return list(self.thinking_end_token_ids if forced is None else forced)

    def max_token_id(self) -> Optional[int]:
        """The largest token id named anywhere in the parameters, or None."""
        ids = list(self.logit_bias) + list(self.stop_token_ids) + list(self.allowed_token_ids or [])
        ids += [t for word in self.bad_words for t in word] + list(self.dry_sequence_breakers)
        ids += list(self.thinking_start_token_ids) + list(self.thinking_end_token_ids)
        ids += list(self.thinking_forced_token_ids or [])
        return max(ids) if ids else None
