"""The step state: what one ``sample`` call reads, and the per-row tensors a batch keeps for it.

``StepState``'s stage scalars and switches come from the stage table (``corelib.pipeline``);
the fields that are not one stage's (the seeded draw's, the histories', optional stage
tensors, flags spanning several stages) are declared here, with the neutral values that
padding rows and rows not using a stage hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass
from typing import Optional

import torch

from . import pipeline, thinking
from .stages import StageInputs, StageSpec


@dataclass(kw_only=True)
class _StepStateFields:
    """The fields of ``StepState`` that are not a stage table entry's (``corelib.pipeline``):
    the step's shape, the seeded draw's and the history's per-row state, the optional stage
    tensors, and the flags derived from several stages."""

    num_rows: int
    vocab_size: int
    logprobs_mode: str
    # int32 [B]
    seed_lo: torch.Tensor
    seed_hi: torch.Tensor
    child: torch.Tensor
    position: torch.Tensor       # tokens generated so far by the row
    # bool [B]
    seeded: torch.Tensor
    greedy: torch.Tensor
    return_kept: torch.Tensor    # the row asks for its kept set (``out.kept``)
    # int32 [B]: the row's order of the filter group, 0 = the default one, k > 0 the order
    # ``filter_orders`` gives for k (the batch numbers the orders its requests ask for)
    filter_order: torch.Tensor
    # optional stage state
    prompt_mask: Optional[torch.Tensor] = None     # bool [B, V]
    output_counts: Optional[torch.Tensor] = None   # int32 [B, V]
    allowed_mask: Optional[torch.Tensor] = None    # bool [B, V]
    bias_ids: Optional[torch.Tensor] = None        # int64 [B, L], padding id 0 value 0
    bias_values: Optional[torch.Tensor] = None     # float32 [B, L]
    stop_ids: Optional[torch.Tensor] = None        # int64 [B, S], padding id 0
    stop_valid: Optional[torch.Tensor] = None      # bool [B, S]
    bad_prefix: Optional[torch.Tensor] = None      # int64 [B, W, P] right-aligned, -2 = any
    bad_last: Optional[torch.Tensor] = None        # int64 [B, W], padding 0
    bad_valid: Optional[torch.Tensor] = None       # bool [B, W]
    recent: Optional[torch.Tensor] = None          # int64 [B, P] last P generated, -1 = none
    # reasoning budget (stage 8b, corelib.thinking): per-row budget and think count, always
    # present; markers and their match bits present when a row uses a budget
    thinking_budget: Optional[torch.Tensor] = None   # int32 [B], -1 = off
    thinking_count: Optional[torch.Tensor] = None    # int32 [B]: tokens after the start marker, -1 = not thinking
    thinking_markers: Optional[torch.Tensor] = None  # int64 [B, 3, L]: start, end, forced; -1 padding
    thinking_match: Optional[torch.Tensor] = None    # bool [B, 3, L]: the history ends with marker[:k + 1]
    # DRY's history (corelib.history): present when a row uses DRY
    dry_length: Optional[torch.Tensor] = None      # int32 [B]: history tokens (prompt + output)
    dry_since_breaker: Optional[torch.Tensor] = None  # int32 [B]: trailing non-breaker tokens
    dry_history: Optional[torch.Tensor] = None     # int64 [B, H], -1 past dry_length
    dry_match: Optional[torch.Tensor] = None       # int32 [B, H]: repeat length before each token
    dry_breakers: Optional[torch.Tensor] = None    # int64 [B, NB], -1 = none
    # structured output (part of step 3): the caller's mask for this call
    token_bitmask: Optional[torch.Tensor] = None   # int32 [B, ceil(V / 32)], -1 = unconstrained
    # custom stages some row uses: (spec, inputs, plugin name), in registration order
    stages: tuple = ()
    # verify's flat form (corelib.drafts): the logits row each row reads; None = row i reads
    # row i (or its request's row, for one logits row per request)
    logits_rows: Optional[torch.Tensor] = None     # int64 [B]
    # verify's state with the dense [rows, V] tensors kept per row (DENSE_ROW_STATE:
    # prompt_mask, output_counts, allowed_mask; speculative_state(dense_by_row=True)): virtual
    # row r * S + j reads row r's, and its drafts before slot j count on top (slot_drafts)
    slots_per_row: int = 1
    slot_drafts: Optional[torch.Tensor] = None     # int64 [B, K]: drafts before the slot, -1 = none
    # verify's slots per row (1 outside verify), and the draft after each virtual row's slot
    # (-1: none), which advances the stateful selectors' state to the next slot
    verify_slots: int = 1
    verify_drafts: Optional[torch.Tensor] = None   # int64 [B]
    # host flags beyond the stage table's switches
    any_greedy: bool = False
    all_greedy: bool = False
    any_random: bool = True
    any_seeded: bool = False
    any_unseeded: bool = True
    any_thinking: bool = False         # some row has a thinking_budget
    max_top_k: int = 0                 # largest top_k among random rows (0: none uses it)
    any_top_p_without_top_k: bool = False  # a random row with top_p < 1 and top_k off
    all_random_top_k: bool = False     # there are random rows and every one has a top_k
    num_logprobs: Optional[int] = None  # N = largest `logprobs` asked for (V for -1), None if none asks
    # the non-default filter orders some row runs: (k, names in order), k as in filter_order
    filter_orders: tuple = ()
    any_selector: bool = False         # some random row uses a stateful selector (group "select")
    any_kept: bool = False             # some row asks for its kept set (return_kept)
    # the float dtype the step works in (step 2's copy): float32, except ``score`` on float64
    # logits that require grad (so that gradients can be checked in float64)
    work_dtype: torch.dtype = torch.float32

    def stages_at(self, slot: str) -> list[tuple[StageSpec, StageInputs, Optional[str]]]:
        """The custom stages some row uses at ``slot`` (``corelib.stages.SLOTS``)."""
        return [entry for entry in self.stages if entry[0].slot == slot]


StepState = make_dataclass(
    "StepState",
    [(f.name, torch.Tensor) for f in pipeline.stage_fields() + pipeline.state_fields()]
    + [(switch.flag, bool, field(default=False)) for _, switch in pipeline.switches()],
    bases=(_StepStateFields,), kw_only=True,
    namespace={"__module__": __name__, "__doc__": """What one ``sample`` call reads: per-row
    tensors (first dimension = rows) and host flags.

    Each stage of the table (``corelib.pipeline.STAGES``) contributes its per-row scalars
    (``[B]`` tensors of the field's dtype, always present, neutral for rows that do not use
    the stage), the per-row state the batch keeps for it (``Stage.state``, same form) and its
    switches (host flags: some row uses the stage); the other fields are
    declared in ``_StepStateFields``. The flags say which optional stages any row uses; a
    backend that prefers a fixed graph (TPU) may ignore them, since every tensor holds neutral
    values for rows that do not use a stage. Optional stage tensors are None until some row of
    the batch has used their stage; once allocated they stay, holding neutral values for rows
    that do not use it. So a backend tests the flags, never ``is None``, to know whether a
    stage runs. Construct it with keywords."""})


# Per-row scalar tensors: name -> (dtype, neutral value used for padding rows): the stage
# table's fields, then the state of the seeded draw, DRY's history and the reasoning budget.
SCALARS: dict[str, tuple[torch.dtype, float]] = {
    **{f.name: (f.dtype, f.neutral) for f in pipeline.stage_fields() + pipeline.state_fields()},
    "filter_order": (torch.int32, 0),
    "seed_lo": (torch.int32, 0),
    "seed_hi": (torch.int32, 0),
    "child": (torch.int32, 0),
    "position": (torch.int32, 0),
    "seeded": (torch.bool, False),
    "greedy": (torch.bool, False),
    "return_kept": (torch.bool, False),
    "dry_length": (torch.int32, 0),
    "dry_since_breaker": (torch.int32, 0),
    "thinking_budget": (torch.int32, thinking.NO_BUDGET),
    "thinking_count": (torch.int32, thinking.NOT_THINKING),
}


# Neutral (padding) values of the optional tensors: inert for every stage.
OPTIONAL_NEUTRAL = {
    "prompt_mask": False,
    "output_counts": 0,
    "allowed_mask": True,
    "bias_ids": 0,
    "bias_values": 0.0,
    "stop_ids": 0,
    "stop_valid": False,
    "bad_prefix": -2,   # wildcard: a shorter word's prefix is padded on the left with it
    "bad_last": 0,
    "bad_valid": False,
    "recent": -1,
    "dry_history": -1,
    "dry_match": 0,
    "dry_breakers": -1,
    "thinking_markers": -1,
    "thinking_match": False,
}
#: Every per-row tensor name that is a ``StepState`` field.
STATE_FIELDS = set(SCALARS) | set(OPTIONAL_NEUTRAL)
#: The ``[rows, V]`` tensors a verify state may keep per row instead of per slot.
DENSE_ROW_STATE = ("prompt_mask", "output_counts", "allowed_mask")
