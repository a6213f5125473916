"""The shared conformance suite against the cuda backend: its torch path on CPU tensors (CI),
the graph runner's buffer logic on CPU, and the real backend on a GPU (skipped without one)."""

from __future__ import annotations

import pytest
from corelib.testing import ConformanceSuite

from corelib_cuda import CudaSampler, GraphedSampler
from cuda_support import GPU

needs_gpu = pytest.mark.skipif(not GPU.available, reason=f"cuda backend unavailable: {GPU.reason}")


class TestTorchPathOnCpu(ConformanceSuite):
    """The device-agnostic torch path, run on CPU tensors."""

    backend = "cuda"

    def make_sampler(self):
        return CudaSampler("cpu", use_flashinfer=False)


class GraphReplays:
    """Row counts that fit the largest graph size (512), so the chi-square tests replay graphs
    instead of falling back to the eager sampler, and checks that they did."""

    draw_rows, draw_calls = 512, 40          # 20480 draws, as 1000 x 20 elsewhere
    verify_rows = 512

    @pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded"])
    def test_draws_follow_the_reference_distribution(self, sampler, reference, seeded):
        before = sampler.stats
        super().test_draws_follow_the_reference_distribution(sampler, reference, seeded)
        assert_replayed(before, sampler.stats, self.draw_calls)

    @pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded"])
    def test_verify_rejection_sampling_keeps_the_target_distribution(self, sampler, seeded):
        before = sampler.stats
        super().test_verify_rejection_sampling_keeps_the_target_distribution(sampler, seeded)
        assert_replayed(before, sampler.stats, 1)


def assert_replayed(before: dict, after: dict, calls: int) -> None:
    assert after["replays"] - before["replays"] == calls, "the draws did not replay graphs"
    assert after["eager_steps"] == before["eager_steps"], "some draws ran eagerly"


class TestGraphRunnerOnCpu(GraphReplays, ConformanceSuite):
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
class TestGraphsOnCuda(GraphReplays, ConformanceSuite):
    backend = "cuda"

    def make_sampler(self):
        return GraphedSampler(CudaSampler("cuda"))
