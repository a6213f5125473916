"""The reference backend passes its own conformance suite (the suite's sanity check)."""

from corelib.testing import ConformanceSuite


class TestConformance(ConformanceSuite):
    backend = "reference"
