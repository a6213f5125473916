"""pytest plugin shipped with corelib (entry point ``pytest11``): ``--corelib-backend``.

``pytest --pyargs corelib.testing.suite --corelib-backend NAME`` runs the conformance suite
against any installed backend without writing a test file; ``--corelib-device cuda:1`` runs
it on another device than the backend's default.
"""

from __future__ import annotations


def pytest_addoption(parser):
    group = parser.getgroup("corelib")
    group.addoption("--corelib-backend", default=None, metavar="NAME",
                    help="backend name for corelib's conformance suite (corelib.testing.suite)")
    group.addoption("--corelib-device", default=None, metavar="DEVICE",
                    help="torch device for --corelib-backend (default: the backend's own)")
