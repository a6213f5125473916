"""pytest plugin shipped with corelib (entry point ``pytest11``): ``--corelib-backend``.

``pytest --pyargs corelib.testing.suite --corelib-backend NAME`` runs the conformance suite
against any installed backend without writing a test file; ``--corelib-device cuda:1`` runs
it on another device than the backend's default. Tests marked ``slow`` (a minute or more)
run first in any suite where corelib is installed.
"""

from __future__ import annotations


def pytest_addoption(parser):
    group = parser.getgroup("corelib")
    group.addoption("--corelib-backend", default=None, metavar="NAME",
                    help="backend name for corelib's conformance suite (corelib.testing.suite)")
    group.addoption("--corelib-device", default=None, metavar="DEVICE",
                    help="torch device for --corelib-backend (default: the backend's own)")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: a test that runs for a minute or more; collected first, so that "
                   "parallel test workers (pytest -n) start the long ones side by side instead "
                   "of one of them ending the run alone")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` first, in their order; the rest keep theirs."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
