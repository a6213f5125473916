"""``Sampler.valid_rows``: the rows ``prepare`` calls valid, and a backend's freedom to return
a flag tensor it keeps (its readers in sample, verify and score never write it)."""

import torch

from corelib import Sampler, SamplingParams

V = 64


class KeptValid(Sampler):
    """Returns the same tensor from every ``valid_rows`` call, as a backend returning a shared
    flag does; records what each call's answer was."""

    def __init__(self):
        super().__init__("cpu")
        self.kept = None
        self.answers = []

    def valid_rows(self, finite, left):
        answer = Sampler.valid_rows(self, finite, left)
        if self.kept is None or self.kept.shape != answer.shape:
            self.kept = answer.clone()
        else:
            self.kept.copy_(answer)
        self.answers.append(answer.clone())
        return self.kept


def logits_with_bad_rows(rows):
    """Row 1 holds a NaN, row 2 every token masked by its allowed ids (no token left)."""
    x = torch.randn(rows, V, generator=torch.Generator().manual_seed(5))
    x[1, 7] = float("nan")
    return x


def batch_of(sampler, rows):
    batch = sampler.new_batch(V)
    for i in range(rows):
        params = dict(seed=10 + i, top_k=8, top_p=0.9, logprobs=2)
        if i == 2:
            params["allowed_token_ids"] = [3]
        if i == 3:
            params["temperature"] = 0.0
        batch.add(f"r{i}", SamplingParams(**params))
    return batch


def test_default_is_finite_and_left():
    finite = torch.tensor([True, False, True, True])
    left = torch.tensor([True, True, False, True])
    assert Sampler("cpu").valid_rows(finite, left).tolist() == [True, False, False, True]


def test_a_kept_valid_tensor_is_never_written_and_never_returned():
    x = logits_with_bad_rows(4)
    x[2, 3] = float("-inf")                        # the one allowed token masked too
    ref, kept = Sampler("cpu"), KeptValid()
    a, b = ref.sample(x, batch_of(ref, 4)), kept.sample(x, batch_of(kept, 4))
    assert kept.answers[-1].tolist() == [True, False, False, True]
    assert torch.equal(kept.kept, kept.answers[-1])                 # not written
    assert b.valid is not kept.kept and b.valid.data_ptr() != kept.kept.data_ptr()
    assert torch.equal(a.valid, b.valid) and torch.equal(a.token_ids, b.token_ids)
    assert torch.equal(a.logprobs.token_ids, b.logprobs.token_ids)


def test_verify_and_score_leave_a_kept_valid_tensor_as_it_was():
    ref, kept = Sampler("cpu"), KeptValid()
    x = logits_with_bad_rows(4)
    drafts = torch.tensor([[1], [2], [3], [4]])
    slots = torch.stack([x, x.flip(0)], dim=1)                      # [B, K + 1, V]
    a = ref.verify(slots, batch_of(ref, 4), drafts)
    b = kept.verify(slots, batch_of(kept, 4), drafts)
    assert torch.equal(kept.kept, kept.answers[-1])
    assert not bool(kept.kept.all())                               # the bad rows were seen
    assert torch.equal(a.valid, b.valid) and torch.equal(a.token_ids, b.token_ids)
    tokens = torch.tensor([[1, 2], [2, 2], [3, -1], [4, 5]])
    a = ref.score(slots, batch_of(ref, 4), tokens)
    b = kept.score(slots, batch_of(kept, 4), tokens)
    assert torch.equal(kept.kept, kept.answers[-1])
    assert b.valid.data_ptr() != kept.kept.data_ptr()
    assert torch.equal(a.valid, b.valid)
    assert torch.equal(a.logprobs.isnan(), b.logprobs.isnan())
    assert torch.allclose(a.logprobs.nan_to_num(), b.logprobs.nan_to_num())
