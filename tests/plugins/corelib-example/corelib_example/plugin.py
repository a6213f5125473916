"""A third-party backend: the reference pipeline with its own temperature stage."""

import corelib


def _make(device):
    from .sampler import ExampleSampler
    return ExampleSampler(device)


@corelib.hookimpl
def corelib_backends():
    return [corelib.BackendSpec(
        name="example", device_type="cpu", priority=-10,
        probe=lambda: corelib.Availability(True),
        factory=_make, description="test plugin: in-place temperature",
    )]
