"""Discovery: the entry point resolves, the backend is available exactly when its probe says
so, and auto-detection picks it exactly when its priority is above the reference's (the
template's -100: never)."""

from __future__ import annotations

import torch
from corelib.registry import Registry
from corelib.testing import assert_entry_point

from corelib_template import plugin
from corelib_template.sampler import TemplateSampler


def test_entry_point_resolves_to_the_plugin_module():
    assert_entry_point(plugin.BACKEND_NAME, plugin, f"corelib-{plugin.BACKEND_NAME}")


def test_backend_is_available_exactly_when_the_probe_says_so():
    registry = Registry(allow={plugin.BACKEND_NAME})
    status = next(s for s in registry.statuses() if s.name == plugin.BACKEND_NAME)
    expected = plugin.probe()
    assert status.available is expected.available, status.reason
    assert status.reason == expected.reason
    assert status.device_type == plugin.DEVICE_TYPE and status.priority == plugin.PRIORITY


def test_asked_for_by_name_it_builds_its_sampler():
    sampler = Registry(allow={plugin.BACKEND_NAME}).get_sampler(plugin.BACKEND_NAME)
    assert isinstance(sampler, TemplateSampler)
    assert sampler.name == plugin.BACKEND_NAME
    assert sampler.device == torch.device(plugin.DEVICE_TYPE)


def test_auto_detection_follows_the_priority():
    """Available, auto-detectable and above the reference's priority 0: auto-detection picks
    the backend (for no device and for its device type); otherwise it never does."""
    registry = Registry(allow={plugin.BACKEND_NAME})
    probed = plugin.probe()
    preferred = probed.available and probed.auto and plugin.PRIORITY > 0
    assert (registry.choose()[0].name == plugin.BACKEND_NAME) is preferred
    assert (registry.choose(torch.device(plugin.DEVICE_TYPE))[0].name == plugin.BACKEND_NAME) is preferred
