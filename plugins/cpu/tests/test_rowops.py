"""rowops against the torch kernels they replace: same values, same first argmax, same
counts, on vocabularies that do and do not divide into groups, with ties and -inf."""

from __future__ import annotations

import pytest
import torch

from corelib_cpu.rowops import GROUP, count_at_least, first_argmax, top_values


def rows(V: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(7, V, generator=g)
    x[1, ::3] = float("-inf")
    x[2] = torch.round(x[2] * 2)                 # many ties
    x[3] = float("-inf")
    x[3, V - 1] = 1.0                            # the only finite token is the very last
    x[4] = 0.0                                   # all tied
    x[5, V // 2] = x[5].max() + 1                # one clear winner
    x[6, :GROUP] = float("-inf")                 # a whole group masked
    return x


@pytest.mark.parametrize("V", [7, 300, 4 * GROUP, 32000, 50257, 128256])
def test_match_torch(V):
    x = rows(V, V)
    for width in (1, 6, 58):
        if width > V:
            continue
        values, ids, floor = top_values(x, width)
        want = torch.topk(x, width, dim=-1).values
        assert torch.equal(values, want)
        assert torch.equal(x.gather(1, ids), values)
        assert bool((ids.sort(dim=-1).values.diff(dim=-1) != 0).all()), "repeated ids"
        outside_max = x.scatter(1, ids, float("-inf")).amax(dim=-1)
        assert bool((outside_max <= torch.maximum(floor, values[:, -1])).all())
    assert torch.equal(first_argmax(x), torch.argmax(x, dim=-1))
    probe = x[:, :1].clone()
    probe[3] = float("-inf")
    assert torch.equal(count_at_least(x, probe), (x >= probe).sum(dim=-1))
