"""Verify's drafts as traced tensors: the ``Drafts`` of padded device inputs, and the leading
run of a boolean row counted without ``cumprod``.

Shapes: ``B`` rows, ``K`` draft slots, ``V`` vocabulary.
"""

from __future__ import annotations

from typing import Optional

import torch
from corelib.sampler import Drafts

from . import xla


def device_drafts(ids: torch.Tensor, probs: Optional[torch.Tensor], V: int,
                   method: str = "token") -> Drafts:
    """``Drafts`` of padded device inputs, as ``Sampler.check_drafts`` builds them: each row's
    real drafts (the leading ids >= 0), and whether the row is usable (ids in range, -1 only as
    a suffix, probabilities of real drafts finite and >= 0)."""
    present = ids >= 0
    count = leading_count(present)
    usable = ((ids >= -1) & (ids < V)).all(dim=1) & (present.sum(dim=1) == count)
    if probs is not None:
        real = xla.iota(ids.shape[1], torch.long, ids.device) < count[:, None]
        sane = (torch.isfinite(probs) & (probs >= 0)).all(dim=-1) | ~real
        usable = usable & sane.all(dim=1)
    return Drafts(ids, count, probs, usable, method)


def leading_count(mask: torch.Tensor) -> torch.Tensor:
    """int64 ``[B]``: how many leading entries of each row of bool ``[B, K]`` are True (the
    core's ``cumprod(...).sum()``, by a running sum: torch-xla 2.9 runs ``cumprod`` on the host,
    a transfer and a graph cut in the middle of the step)."""
    return (torch.cumsum((~mask).to(torch.int32), dim=1) == 0).sum(dim=1).to(torch.long)
