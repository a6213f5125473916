"""A custom stage this plugin contributes: epsilon sampling (a truncation that drops every token
whose probability is below a fixed epsilon, never the most likely one).

A stage is plain torch on ``[rows, V]`` float32 logits: every backend runs it at its slot
(traced on XLA, captured in CUDA graphs), only on the rows whose request asks for it with
``SamplingParams(stage_args={"template-epsilon": {"epsilon": 3e-4}})``.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, field_validator

import corelib

NEG_INF = float("-inf")


class EpsilonArgs(BaseModel):
    """Per-request arguments; every field needs a default (rows without the stage hold it)."""

    model_config = ConfigDict(extra="forbid")
    epsilon: float = 0.0

    @field_validator("epsilon")
    @classmethod
    def _in_range(cls, value):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"epsilon must be in [0, 1), got {value}")
        return value


def epsilon_cutoff(x: torch.Tensor, inputs: corelib.StageInputs) -> torch.Tensor:
    """x float32 ``[B, V]`` after step 13b (dropped tokens -inf); ``inputs.args["epsilon"]``
    float32 ``[B]`` (0 keeps all). Tokens whose renormalised probability is below epsilon ->
    -inf, the most likely token always stays. Returns a new tensor; shapes are static and
    nothing branches on values, so it traces and captures."""
    probs = torch.softmax(x, dim=-1)
    floor = torch.minimum(inputs.args["epsilon"][:, None], probs.amax(dim=-1, keepdim=True))
    return x.masked_fill(probs < floor, NEG_INF)


STAGES = [
    corelib.StageSpec(
        name="template-epsilon",
        slot="after_filters",
        args=EpsilonArgs,
        apply=epsilon_cutoff,
        description="epsilon sampling: drop tokens below a fixed probability",
    ),
]
