"""The shared conformance suite against the cpu backend: as built by name, with blocks of a
few rows (several blocks per call, rows of one request split across blocks), and on a larger
vocabulary (where the histogram select and the candidate paths do real work)."""

from __future__ import annotations

from corelib.testing import ConformanceSuite

from corelib_cpu.sampler import CpuSampler


class TestConformance(ConformanceSuite):
    backend = "cpu"


class TestConformanceSmallBlocks(ConformanceSuite):
    backend = "cpu"
    draw_rows = 200          # 4000 draws of ~60 kept tokens: the chi-square still bites

    def make_sampler(self):
        return CpuSampler("cpu", block_elements=3 * self.vocab_size)   # 3 rows per block


class TestConformanceLargeVocabulary(ConformanceSuite):
    backend = "cpu"
    vocab_size = 8192
    draw_rows = 200

    def make_sampler(self):
        return CpuSampler("cpu", block_elements=5 * self.vocab_size)
