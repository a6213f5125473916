"""Plugin registry and platform detection, with fake plugins registered per test."""

import pytest
import torch

import corelib
from corelib import Availability, BackendSpec, BackendUnavailableError, Sampler
from corelib.registry import Registry


class FakeSampler(Sampler):
    pass


def spec(name, priority=5, available=True, reason="", auto=True, device_type="cpu", factory=None):
    def make(device):
        sampler = FakeSampler(device)
        sampler.name = name
        return sampler
    return BackendSpec(name=name, device_type=device_type, priority=priority,
                       probe=lambda: Availability(available, reason, auto), factory=factory or make)


class Plugin:
    """A plugin object whose hook returns the given specs (or raises what it is given)."""

    def __init__(self, *specs, error=None):
        self.specs, self.error = list(specs), error

    @corelib.hookimpl
    def corelib_backends(self):
        if self.error:
            raise self.error
        return self.specs


@pytest.fixture
def registry():
    return Registry(load_entry_points=False)


def names(registry):
    return sorted(s.name for s in registry.statuses(refresh=True))


def test_reference_is_always_there(registry):
    assert names(registry) == ["reference"]
    assert registry.get_sampler().name == "reference"
    assert registry.get_sampler("reference").device == torch.device("cpu")


def test_auto_detection_picks_the_highest_priority_available(registry):
    registry.register(Plugin(spec("fastcpu", 10), spec("tpu", 30, available=False, reason="no TPU"),
                             spec("cuda", 20)), name="vendor")
    assert registry.get_sampler().name == "cuda"


def test_auto_detection_skips_backends_that_ask_not_to_be_auto_selected(registry):
    registry.register(Plugin(spec("tpu", 30, auto=False, reason="XLA on CPU: emulated"), spec("fastcpu", 10)), name="v")
    assert registry.get_sampler().name == "fastcpu"
    assert registry.get_sampler("tpu").name == "tpu"


def test_env_var_overrides_auto_detection(registry, monkeypatch):
    registry.register(Plugin(spec("fastcpu", 10)), name="v")
    monkeypatch.setenv("CORELIB_DEVICE", "reference")
    assert registry.get_sampler().name == "reference"


def test_unknown_name_lists_known_backends(registry):
    registry.register(Plugin(spec("fastcpu", 10)), name="v")
    with pytest.raises(ValueError, match=r"unknown backend 'warp'; known backends: fastcpu, reference"):
        registry.get_sampler("warp")


def test_unavailable_backend_by_name_raises_its_reason(registry):
    registry.register(Plugin(spec("cuda", 20, available=False, reason="no CUDA device")), name="v")
    with pytest.raises(BackendUnavailableError, match="no CUDA device"):
        registry.get_sampler("cuda")
    assert registry.get_sampler().name == "reference"


def test_plugin_whose_hook_raises_is_reported_and_skipped(registry):
    registry.register(Plugin(error=RuntimeError("driver exploded")), name="boom")
    statuses = {s.name: s for s in registry.statuses(refresh=True)}
    assert not statuses["boom"].available
    assert "driver exploded" in statuses["boom"].reason
    assert registry.get_sampler().name == "reference"
    with pytest.raises(BackendUnavailableError, match="driver exploded"):
        registry.get_sampler("boom")


def test_probe_that_raises_is_reported(registry):
    def bad_probe():
        raise OSError("/dev/accel0: permission denied")
    registry.register(Plugin(BackendSpec("acc", "cpu", 50, bad_probe, lambda d: Sampler(d))), name="v")
    status = next(s for s in registry.statuses(refresh=True) if s.name == "acc")
    assert not status.available and "permission denied" in status.reason
    assert registry.get_sampler().name == "reference"


@pytest.mark.parametrize("returned,fragment", [
    ("not a list", "expected a list of BackendSpec"),
    ([{"name": "x"}], "expected corelib.BackendSpec"),
    ([BackendSpec("", "cpu", 1, lambda: Availability(True), lambda d: Sampler(d))], "non-empty str"),
    ([BackendSpec("x", "cpu", "high", lambda: Availability(True), lambda d: Sampler(d))], "priority must be an int"),
])
def test_malformed_descriptions_are_reported(registry, returned, fragment):
    plugin = Plugin()
    plugin.specs = returned
    registry.register(plugin, name="weird")
    status = next(s for s in registry.statuses(refresh=True) if s.plugin == "weird")
    assert not status.available and fragment in status.reason
    assert registry.get_sampler().name == "reference"


def test_probe_returning_the_wrong_type_is_reported(registry):
    registry.register(Plugin(BackendSpec("x", "cpu", 50, lambda: True, lambda d: Sampler(d))), name="v")
    status = next(s for s in registry.statuses(refresh=True) if s.name == "x")
    assert "probe must return corelib.Availability" in status.reason


def test_two_plugins_claiming_one_name_are_an_error(registry):
    registry.register(Plugin(spec("cuda", 20)), name="vendor-a")
    registry.register(Plugin(spec("cuda", 21)), name="vendor-b")
    with pytest.raises(BackendUnavailableError, match="claimed by several plugins: 'vendor-a', 'vendor-b'"):
        registry.get_sampler("cuda")
    assert registry.get_sampler().name == "reference"


def test_factory_failure_is_a_clear_error(registry):
    def explode(device):
        raise ImportError("No module named 'torch_xla'")
    registry.register(Plugin(spec("tpu", 30, factory=explode)), name="v")
    with pytest.raises(BackendUnavailableError, match="backend 'tpu' .* failed to start: ImportError"):
        registry.get_sampler("tpu")


def test_torch_device_selects_by_device_type(registry):
    registry.register(Plugin(spec("fastcpu", 10), spec("gpu", 20, device_type="cuda", available=False,
                                                          reason="no GPU")), name="v")
    assert registry.get_sampler(torch.device("cpu")).name == "fastcpu"
    with pytest.raises(BackendUnavailableError, match="no GPU"):
        registry.get_sampler(torch.device("cuda", 0))
    with pytest.raises(ValueError, match="no backend runs on device type 'mps'"):
        registry.get_sampler(torch.device("mps"))


def test_device_index_in_a_name_reaches_the_factory(registry):
    seen = []
    def make(device):
        seen.append(device)
        return Sampler("cpu")
    registry.register(Plugin(spec("gpu", 20, device_type="cuda", factory=make)), name="v")
    registry.get_sampler("gpu:1")
    assert seen == [torch.device("cuda", 1)]
    with pytest.raises(ValueError, match="must be a non-negative int, got 'x'"):
        registry.get_sampler("gpu:x")


def test_unregister_removes_the_plugin(registry):
    registry.register(Plugin(spec("fastcpu", 10)), name="v")
    registry.unregister("v")
    assert names(registry) == ["reference"]


def test_statuses_serialise_for_json(registry):
    row = registry.statuses()[0].as_dict()
    assert row["name"] == "reference" and row["available"] is True and row["distribution"] == "corelib"
