"""The conformance suite as a runnable test module, for ``--corelib-backend NAME``."""

from __future__ import annotations

import pytest

from corelib.testing.conformance import ConformanceSuite


class TestConformance(ConformanceSuite):
    @pytest.fixture(scope="class")
    @classmethod
    def sampler(cls, request):
        from corelib import get_sampler
        name = request.config.getoption("--corelib-backend")
        if name is None:
            pytest.skip("pass --corelib-backend NAME to run the conformance suite")
        return get_sampler(name)
