"""The shared conformance suite against the tpu backend: on the XLA device as
``corelib.get_sampler("tpu")`` builds it, and the same traced code run eagerly on CPU tensors."""

from __future__ import annotations

from corelib.testing import ConformanceSuite

from corelib_tpu.sampler import TpuSampler

from tpu_support import needs_xla


@needs_xla
class TestConformanceOnXla(ConformanceSuite):
    backend = "tpu"
    # 250 rows x 40 calls = 10,000 draws per chi-square test, in the 256-row bucket.
    draw_rows = 250
    draw_calls = 40


class TestTracedCodeOnCpu(ConformanceSuite):
    """The same stages run eagerly on CPU tensors: runs without torch-xla (any venv)."""

    backend = "tpu"
    draw_rows = 250
    draw_calls = 20

    def make_sampler(self):
        return TpuSampler("cpu")
