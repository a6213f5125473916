"""What a plugin returns to describe a backend: its spec and what its probe says.

Plain data, below the registry (which collects them) and the plugins (which make them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch

if TYPE_CHECKING:
    from .sampler import Sampler


@dataclass(frozen=True)
class Availability:
    """What a backend's probe says: usable now or not (and why), and whether auto-detection
    may pick it (False, for example, for an emulated device such as XLA on the CPU)."""

    available: bool
    reason: str = ""
    auto: bool = True


@dataclass(frozen=True)
class BackendSpec:
    """A plugin's description of one backend.

    ``probe()`` returns an :class:`Availability` (cheap: no heavy imports unless they are the
    only way to know). ``factory(device)`` imports the heavy runtime and returns a
    :class:`Sampler`; ``device`` is None for the backend's default device.
    """

    name: str
    device_type: str
    priority: int
    probe: Callable[[], Availability]
    factory: Callable[[Optional[torch.device]], "Sampler"]
    description: str = ""
    #: Whether the backend's own ``score`` is differentiable (its sampler's
    #: ``differentiable_score``); False: a ``score`` whose logits require grad runs on the
    #: reference backend. ``corelib info`` shows it; the conformance suite checks it.
    differentiable_score: bool = True
