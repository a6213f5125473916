"""The ``tpu`` plugin's hook: describes the backend without importing torch-xla."""

from __future__ import annotations

from corelib import BackendSpec, hookimpl

#: Above ``cuda`` (20) and ``cpu`` (10): platform detection prefers a TPU when one is present.
TPU_PRIORITY = 30

DESCRIPTION = ("TPUs through torch-xla: every stage in a fixed XLA graph per batch bucket, "
               "candidate top-k and bounded bisection instead of a vocabulary sort")


def _probe():
    from .probe import probe
    return probe()


def _factory(device):
    from .sampler import TpuSampler
    return TpuSampler(device)


@hookimpl
def corelib_backends():
    return [BackendSpec(name="tpu", device_type="xla", priority=TPU_PRIORITY, probe=_probe,
                        factory=_factory, description=DESCRIPTION,
                        # TpuSampler.differentiable_score: grads through the same stages
                        differentiable_score=True)]
