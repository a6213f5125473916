"""The shared conformance kit against this backend: every contract rule, compared with the
reference backend. Failures name the contract rule, the row and its parameters."""

from corelib.testing import ConformanceSuite


class TestConformance(ConformanceSuite):
    backend = "template"
