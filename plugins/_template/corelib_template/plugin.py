"""The plugin object named by the entry point: describes the backend, imports nothing heavy."""

from __future__ import annotations

import importlib.util

import corelib

BACKEND_NAME = "template"
DEVICE_TYPE = "cpu"
# Auto-detection picks the available backend with the highest priority; the reference backend
# has 0. Below it, `corelib.get_sampler()` never picks this backend: it runs only when asked
# for by name. A hardware backend uses a priority above 0 (the cuda plugin uses 20).
PRIORITY = -100
# The module whose presence means the device runtime is installed (a real plugin names its
# vendor runtime here, e.g. "torch_xla"); `torch` keeps the copied plugin runnable anywhere.
RUNTIME_MODULE = "torch"


def probe() -> corelib.Availability:
    """Cheap check that this backend can run here; say why not, never raise.

    find_spec looks the runtime up without importing it. A real plugin then checks for the
    hardware itself (a device node, a driver query), still without importing the runtime.
    """
    if importlib.util.find_spec(RUNTIME_MODULE) is None:
        return corelib.Availability(False, f"{RUNTIME_MODULE} is not installed")
    return corelib.Availability(True, "runs on the CPU (replace probe() with a hardware check)")


def make_sampler(device):
    """Factory: called once the backend is chosen, so heavy imports belong here or below."""
    from .sampler import TemplateSampler
    return TemplateSampler(device)


@corelib.hookimpl
def corelib_backends():
    return [corelib.BackendSpec(
        name=BACKEND_NAME,
        device_type=DEVICE_TYPE,
        priority=PRIORITY,
        probe=probe,
        factory=make_sampler,
        description="copyable starting point: the reference stages with a one-sort top-k/top-p",
    )]


@corelib.hookimpl
def corelib_stages():
    """The custom stages this plugin adds (any backend runs them); remove it if you add none."""
    from .stages import STAGES
    return STAGES
