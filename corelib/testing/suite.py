"""The conformance suite as a runnable test module, for ``--corelib-backend NAME``.

``pytest --pyargs corelib.testing.suite --corelib-backend NAME [--corelib-device DEVICE]``
"""

from __future__ import annotations

import pytest

from corelib.testing.conformance import ConformanceSuite


class TestConformance(ConformanceSuite):
    @pytest.fixture(scope="class")
    @classmethod
    def sampler(cls, request):
        suite = cls()
        suite.backend = request.config.getoption("--corelib-backend")
        suite.device = request.config.getoption("--corelib-device")
        if suite.backend is None:
            pytest.skip("pass --corelib-backend NAME to run the conformance suite")
        return suite.make_sampler()
