"""The core's own plugin: the pure-torch ``reference`` backend."""

from __future__ import annotations

from .hookspecs import hookimpl
from .backends import Availability, BackendSpec

REFERENCE_PRIORITY = 0


def _make_reference(device):
    from .sampler import Sampler
    return Sampler(device)


@hookimpl
def corelib_backends():
    return [BackendSpec(
        name="reference",
        device_type="cpu",
        priority=REFERENCE_PRIORITY,
        probe=lambda: Availability(True),
        factory=_make_reference,
        description="pure-torch oracle of the contract (any torch device)",
    )]
