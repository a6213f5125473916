"""Row sums: the float reductions over a row's vocabulary whose results feed a threshold, a
mask or a constant (an entropy, a mean and variance, a collision probability, tail-free's
total, mirostat's normaliser). ``Sampler.row_sum`` is the hook a backend overrides so that a
row's sum has bits that depend on that row alone, never on how many rows the tensor holds
(what makes ``score`` over ``B T`` virtual rows bitwise equal to ``B``-row steps on a device
whose library sums choose their thread layout from the row count). The module functions that
take a sum (``filter_stages.typical_keep``, ``tail_free_length``, ``selectors.advance_*``)
take it as an argument whose default is :func:`torch_row_sum`. Imports no other part of
corelib.
"""

from __future__ import annotations

from typing import Callable

import torch

#: ``row_sum(values, keepdim=False)``: float ``[..., V]`` (float32 or float64) -> the sum over
#: the last dimension, ``[...]`` or ``[..., 1]`` with ``keepdim``, same dtype.
RowSum = Callable[..., torch.Tensor]


def torch_row_sum(values: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """The reference's row sum: ``values.sum(dim=-1)``, torch's own reduction (on CPU its bits
    depend on the row alone). float ``[..., V]`` -> ``[...]`` (``[..., 1]`` with ``keepdim``).
    Differentiable."""
    return values.sum(dim=-1, keepdim=keepdim)


def row_logsumexp(x: torch.Tensor, row_sum: RowSum = torch_row_sum) -> torch.Tensor:
    """float ``[..., V]`` -> ``[...]``: log(sum(exp(x))) over the last dimension. With the
    default sum, ``torch.logsumexp`` itself; with another, torch's own formula (m + log(sum(
    exp(x - m))), m the row's maximum, 0 where it is infinite) around that sum, which with
    ``torch_row_sum`` gives torch's bits on CPU. Not in place."""
    if row_sum is torch_row_sum:
        return torch.logsumexp(x, dim=-1)
    m = x.amax(dim=-1, keepdim=True)
    m = m.masked_fill(m.abs() == float("inf"), 0.0)
    return row_sum(torch.exp(x - m)).log() + m.squeeze(-1)
