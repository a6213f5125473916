"""pytest plugin shipped with corelib (entry point ``pytest11``): ``--corelib-backend``.

``pytest --pyargs corelib.testing.suite --corelib-backend NAME`` runs the conformance suite
against any installed backend without writing a test file.
"""

from __future__ import annotations


def pytest_addoption(parser):
    group = parser.getgroup("corelib")
    group.addoption("--corelib-backend", default=None,
                    help="backend name for corelib's conformance suite (corelib.testing.suite)")
