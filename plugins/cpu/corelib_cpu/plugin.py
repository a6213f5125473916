"""The ``cpu`` plugin's hook: describes the backend; the sampler module loads only when chosen."""

from __future__ import annotations

from corelib import Availability, BackendSpec, hookimpl

#: Above the ``reference`` backend (0), below ``cuda`` (20) and ``tpu`` (30): platform
#: detection picks this backend on machines without an accelerator.
CPU_PRIORITY = 10

DESCRIPTION = ("CPUs: top-k/top-p by selection instead of full sorts, noise only for kept "
               "candidates, sparse penalties, cache-sized row blocks")


def _probe() -> Availability:
    # torch always runs on the CPU: nothing to detect.
    return Availability(True)


def _description() -> str:
    from .kernels import describe          # imports neither torch nor numba
    return f"{DESCRIPTION}; {describe()}"


def _factory(device):
    from .sampler import CpuSampler
    return CpuSampler(device)


@hookimpl
def corelib_backends():
    return [BackendSpec(name="cpu", device_type="cpu", priority=CPU_PRIORITY, probe=_probe,
                        factory=_factory, description=_description(),
                        # the stages work in place on workspace buffers: no autograd graph
                        differentiable_score=False)]
