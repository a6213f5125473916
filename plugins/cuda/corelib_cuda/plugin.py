"""The ``cuda`` plugin's hook: describes the backend without importing FlashInfer."""

from __future__ import annotations

from corelib import BackendSpec, hookimpl

#: Above the ``cpu`` backend (10), below ``tpu`` (30): platform detection prefers a GPU.
CUDA_PRIORITY = 20

DESCRIPTION = ("NVIDIA GPUs: FlashInfer sorting-free top-k/top-p kernels for unseeded rows, "
               "host-sync-free torch stages, CUDA-graph capture")


def _probe():
    from .probe import probe
    return probe()


def _factory(device):
    from .sampler import CudaSampler
    return CudaSampler(device)


@hookimpl
def corelib_backends():
    return [BackendSpec(name="cuda", device_type="cuda", priority=CUDA_PRIORITY, probe=_probe,
                        factory=_factory, description=DESCRIPTION,
                        # score's stages are autograd-safe: the in-place ones (bitmask, DRY)
                        # take the reference's form when the logits require grad
                        differentiable_score=True)]
