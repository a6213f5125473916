"""``Sampler.row_sum``, the hook every float row sum that feeds a threshold, a mask or a
constant goes through (``corelib.reductions``): a sampler whose ``row_sum`` doubles each sum
must change the outcome of every stage that has one, so a stage (or the batch's ``append``, or
``score``'s slot states) that sums by itself fails here; the reference's own sum keeps the bits
it had (torch's ``sum`` and ``logsumexp``)."""

from __future__ import annotations

import pytest
import torch

import corelib
from corelib import SamplingParams
from corelib.reductions import row_logsumexp, torch_row_sum
from corelib.sampler import Sampler

V = 64


class Doubled(Sampler):
    """The reference with every hooked row sum doubled, counting its calls."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0

    def row_sum(self, values, keepdim=False):
        self.calls += 1
        return 2.0 * torch_row_sum(values, keepdim=keepdim)


def logits_of(rows: int, seed: int) -> torch.Tensor:
    return torch.randn((rows, V), generator=torch.Generator().manual_seed(seed)) * 2.5


# each filter stage with a row sum, by itself, with settings where doubling the sum moves its
# threshold past some token of these logits
FILTERS = {
    "dynatemp": SamplingParams(dynatemp_range=0.5, temperature=1.0, seed=1),
    "top_n_sigma": SamplingParams(top_n_sigma=0.5, seed=1),
    "eta": SamplingParams(eta_cutoff=0.02, seed=1),
    "p_less": SamplingParams(p_less="plain", seed=1),
    "typical": SamplingParams(typical_p=0.5, seed=1),
    "tfs": SamplingParams(tfs=0.5, seed=1),
}


@pytest.mark.parametrize("name", sorted(FILTERS))
def test_every_filter_with_a_row_sum_takes_the_samplers(name):
    params = FILTERS[name]
    x = logits_of(4, seed=5)
    outs = []
    for sampler in (Sampler("cpu"), Doubled("cpu")):
        batch = sampler.new_batch(V)
        batch.add("r", params, prompt_token_ids=[1, 2])
        batch.add("s", params.model_copy(update={"seed": 2}), prompt_token_ids=[3])
        batch.add("t", params.model_copy(update={"seed": 3}))
        batch.add("u", params.model_copy(update={"seed": 4}))
        outs.append(sampler.processed_logits(x, batch))
    assert outs[0].shape == outs[1].shape == (4, V)
    assert not torch.equal(outs[0], outs[1]), f"{name}: the stage did not use Sampler.row_sum"


def test_mirostat_advances_with_the_samplers_row_sum_in_append_and_in_scores_slots():
    params = SamplingParams(mirostat_tau=3.0, mirostat_eta=0.5, seed=7)
    x = logits_of(1, seed=6)
    states, scores = [], []
    for sampler in (Sampler("cpu"), Doubled("cpu")):
        batch = sampler.new_batch(V)
        batch.add("r", params, prompt_token_ids=[1])
        assert batch.row_sum == sampler.row_sum          # new_batch hands it on
        out = sampler.sample(x, batch)
        batch.append(out.token_ids)                        # the batch's append sums
        states.append(batch.sampler_state("r"))
        fresh = sampler.new_batch(V)
        fresh.add("r", params, prompt_token_ids=[1])
        # position 1's state advances by position 0's token inside score (the slot states)
        ids = torch.stack([out.token_ids, out.token_ids], dim=1)
        scores.append(sampler.score(torch.stack([x, x], dim=1), fresh, ids).logprobs)
    assert states[0] != states[1], "append advanced mirostat without the batch's row_sum"
    # position 0 reads no sum (mirostat's mask before any token); position 1's state does
    assert torch.equal(scores[0][:, 0], scores[1][:, 0])
    assert not torch.equal(scores[0][:, 1], scores[1][:, 1]), "score's slot states bypassed row_sum"


def test_scores_slot_states_call_the_hook():
    params = SamplingParams(mirostat_tau=3.0, mirostat_eta=0.5, seed=7)
    sampler = Doubled("cpu")
    batch = sampler.new_batch(V)
    batch.add("r", params)
    x = logits_of(1, seed=8)
    sampler.calls = 0
    sampler.score(torch.stack([x, x, x], dim=1), batch, torch.tensor([[1, 2, 3]]))
    assert sampler.calls >= 2          # one advance per slot after the first


def test_the_references_row_sum_is_torchs_and_keeps_its_bits():
    assert Sampler("cpu").row_sum is torch_row_sum
    assert corelib.SamplingBatch.row_sum is torch_row_sum
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        x = (torch.randn((16, 1000), generator=gen) * 5).to(dtype)
        x[1, ::3] = float("-inf")
        x[2] = float("-inf")
        assert torch.equal(torch_row_sum(x, keepdim=True), x.sum(dim=-1, keepdim=True))
        assert torch.equal(row_logsumexp(x), torch.logsumexp(x, dim=-1))
        # torch's formula around another sum (here torch's own): torch's bits on CPU
        summed = row_logsumexp(x, lambda v, keepdim=False: v.sum(dim=-1, keepdim=keepdim))
        assert torch.equal(summed, torch.logsumexp(x, dim=-1))
        strided = x.view(4, 4, 1000)[:, 2]
        assert torch.equal(row_logsumexp(strided, lambda v, keepdim=False: v.sum(dim=-1, keepdim=keepdim)),
                           torch.logsumexp(strided, dim=-1))


def test_a_row_sum_hook_keeps_score_differentiable():
    params = SamplingParams(typical_p=0.9, eta_cutoff=0.01, dynatemp_range=0.3, seed=1)
    sampler = Doubled("cpu")
    batch = sampler.new_batch(V)
    batch.add("r", params)
    x = logits_of(1, seed=9)[:, None].double().requires_grad_()
    out = sampler.score(x, batch, x.detach().argmax(-1))
    out.logprobs.sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
