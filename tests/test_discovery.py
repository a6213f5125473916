"""Discovery through real entry points: the plugin packages under tests/plugins/ are
installed by the test command (pip install -e), as a third party's would be."""

from importlib.metadata import entry_points

import pytest

import corelib
from corelib.registry import Registry
from corelib.testing import ConformanceSuite

installed = {ep.name for ep in entry_points(group="corelib.plugins")}
pytestmark = pytest.mark.skipif(
    not {"example", "broken"} <= installed,
    reason="test plugins not installed (scripts/test.sh installs tests/plugins/*)",
)


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.delenv("CORELIB_PLUGINS", raising=False)
    monkeypatch.delenv("CORELIB_DEVICE", raising=False)
    return Registry()


def test_third_party_plugin_is_found_through_its_entry_point(registry):
    status = next(s for s in registry.statuses() if s.name == "example")
    assert status.available and status.distribution == "corelib-example" and status.version == "0.0.1"
    sampler = registry.get_sampler("example")
    assert type(sampler).__module__ == "corelib_example.sampler"


def test_broken_plugin_is_reported_not_fatal(registry):
    status = next(s for s in registry.statuses() if s.name == "broken")
    assert not status.available
    assert "plugin failed to import: ImportError: libbrokenaccel.so" in status.reason
    assert registry.get_sampler().name != "broken"
    with pytest.raises(corelib.BackendUnavailableError, match="libbrokenaccel.so") as err:
        registry.get_sampler("broken")
    assert isinstance(err.value.__cause__, ImportError)


def test_allow_list_limits_which_plugins_load(monkeypatch):
    monkeypatch.setenv("CORELIB_PLUGINS", "example")
    names = {s.name for s in Registry().statuses()}
    assert names == {"reference", "example"}


def test_discovery_does_not_import_plugin_samplers(registry):
    import sys
    sys.modules.pop("corelib_example.sampler", None)
    registry.statuses()
    assert "corelib_example.sampler" not in sys.modules   # imported lazily by the factory
    registry.get_sampler("example")
    assert "corelib_example.sampler" in sys.modules


class TestExampleConformance(ConformanceSuite):
    """A third-party plugin proves itself with the shipped suite."""

    backend = "example"
    draw_calls = 5
