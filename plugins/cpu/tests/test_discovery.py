"""Discovery: the entry point resolves through importlib.metadata, the backend is listed and
available exactly when its probe says so, and it builds a CpuSampler by name and by device."""

from __future__ import annotations


import torch
from corelib.registry import Registry
from corelib.testing import assert_entry_point

from corelib_cpu import plugin
from corelib_cpu.sampler import CpuSampler


def test_entry_point_resolves_to_the_plugin_module():
    assert_entry_point("cpu", plugin, "corelib-cpu")


def test_backend_is_listed_and_available_exactly_when_the_probe_says_so():
    registry = Registry(allow={"cpu"})
    status = next(s for s in registry.statuses() if s.name == "cpu")
    expected = plugin._probe()
    assert status.distribution == "corelib-cpu"
    assert status.available is expected.available is True
    assert status.device_type == "cpu" and status.priority == plugin.CPU_PRIORITY == 10
    assert status.auto


def test_built_by_name_and_chosen_for_cpu_devices_over_the_reference():
    registry = Registry(allow={"cpu"})
    sampler = registry.get_sampler("cpu")
    assert isinstance(sampler, CpuSampler)
    assert sampler.name == "cpu" and sampler.device == torch.device("cpu")
    assert registry.choose(torch.device("cpu"))[0].name == "cpu"
    assert registry.choose()[0].name == "cpu"     # no accelerator plugin allowed here


def test_discovery_does_not_import_the_sampler():
    import subprocess
    import sys
    code = ("import sys, corelib; corelib.available_backends(); "
            "print('corelib_cpu.sampler' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
