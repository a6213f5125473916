"""Two custom stages, as a third party would write them.

- ``ban-repeats`` (after step 8a, stateful): a token generated ``times`` times is banned from
  then on. Its state is the row's count of each generated token.
- ``floor-prob`` (after step 13b, stateless): drop tokens whose probability, renormalised over
  what the filters kept, is below ``prob`` (never the most likely token).
"""

import torch
from pydantic import BaseModel, ConfigDict

import corelib


class BanRepeatsArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    times: int = 3

    def model_post_init(self, _):
        if self.times < 1:
            raise ValueError(f"times must be >= 1, got {self.times}")


class FloorProbArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prob: float = 0.0


def count_outputs(prompt, output, args, vocab_size):
    """The state at add: how often each token was generated (the prompt does not count)."""
    return torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab_size).to(torch.int32)


def count_token(state, token_ids, live):
    """One token per row: state int32 [n, V], token_ids int64 [n], live bool [n]."""
    return state.scatter_add(1, token_ids[:, None], live[:, None].to(state.dtype))


def ban_repeats(x, inputs):
    """x float32 [B, V]; tokens seen ``times`` times or more -> -inf. Not in place."""
    seen = inputs.state["seen"] >= inputs.args["times"][:, None]
    return x.masked_fill(seen, float("-inf"))


def floor_prob(x, inputs):
    """x float32 [B, V]; tokens with probability < prob -> -inf (the best token stays)."""
    p = torch.softmax(x, dim=-1)
    low = p < torch.minimum(inputs.args["prob"][:, None], p.amax(dim=-1, keepdim=True))
    return x.masked_fill(low, float("-inf"))


@corelib.hookimpl
def corelib_stages():
    return [
        corelib.StageSpec(
            name="ban-repeats", slot="after_penalties", args=BanRepeatsArgs, apply=ban_repeats,
            state=(corelib.StageState("seen", torch.int32, lambda V: (V,), count_outputs, count_token),),
            description="test plugin: ban a token once it was generated `times` times",
        ),
        corelib.StageSpec(
            name="floor-prob", slot="after_filters", args=FloorProbArgs, apply=floor_prob,
            description="test plugin: drop tokens below a probability floor",
        ),
    ]
