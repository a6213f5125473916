"""The shared conformance suite against the cuda backend: its torch path on CPU tensors (CI),
the graph runner's buffer logic on CPU, and the real backend on a GPU (skipped without one)."""

from __future__ import annotations

import pytest
from corelib.testing import ConformanceSuite

from corelib_cuda import CudaSampler, GraphedSampler
from corelib_cuda.probe import cuda_availability

GPU = cuda_availability()
needs_gpu = pytest.mark.skipif(not GPU.available, reason=f"cuda backend unavailable: {GPU.reason}")


class TestTorchPathOnCpu(ConformanceSuite):
    """The device-agnostic torch path, run on CPU tensors."""

    backend = "cuda"

    def make_sampler(self):
        return CudaSampler("cpu", use_flashinfer=False)


class TestGraphRunnerOnCpu(ConformanceSuite):
    """The graph runner's padded, persistent-buffer step, replayed eagerly on CPU."""

    backend = "cuda"

    def make_sampler(self):
        return GraphedSampler(CudaSampler("cpu", use_flashinfer=False), use_graphs=False)


@needs_gpu
class TestConformanceOnCuda(ConformanceSuite):
    """The backend as corelib.get_sampler("cuda") builds it (FlashInfer path where it runs)."""

    backend = "cuda"


@needs_gpu
class TestTorchPathOnCuda(ConformanceSuite):
    backend = "cuda"

    def make_sampler(self):
        return CudaSampler("cuda", use_flashinfer=False)


@needs_gpu
class TestGraphsOnCuda(ConformanceSuite):
    backend = "cuda"

    def make_sampler(self):
        return GraphedSampler(CudaSampler("cuda"))
