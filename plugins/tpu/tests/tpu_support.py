"""Helpers shared by the tpu plugin's tests (a unique module name: --import-mode=importlib puts
this folder on sys.path through conftest.py, next to other plugins' test folders)."""

from __future__ import annotations

import os

import pytest
import torch

from corelib_tpu.probe import probe

#: XLA settings the suite runs under where the caller sets none (conftest.py applies them before
#: torch-xla starts). The suite spends its time compiling graphs, not running them (small
#: vocabularies): without LLVM's optimisations the same HLO compiles 4-5 times faster. XLA:CPU
#: keeps each compiled graph's code in memory maps of the process until torch-xla drops the
#: graph from its cache; the suite compiles several hundred graphs in one process, so the cache
#: keeps the 80 most recent (each test module needs fewer at a time), under the kernel's
#: default vm.max_map_count (65530): with 96, the conformance suite on XLA peaked at 60,000 maps.
SUITE_XLA_SETTINGS = {"XLA_FLAGS": "--xla_backend_optimization_level=0",
                      "XLA_COMPILATION_CACHE_SIZE": "80"}
_ADDED: set[str] = set()          # the names the suite set


def apply_suite_xla_settings() -> None:
    """Set each of ``SUITE_XLA_SETTINGS`` the caller's environment leaves unset."""
    for name, value in SUITE_XLA_SETTINGS.items():
        if name not in os.environ:
            os.environ[name] = value
            _ADDED.add(name)


def user_environment() -> dict[str, str]:
    """The environment as the caller gave it: without the variables the suite added (whatever
    torch-xla or the plugin appended to them since), so that a subprocess measures what a
    user's process does (the default XLA options and cache)."""
    return {k: v for k, v in os.environ.items() if k not in _ADDED}


XLA = probe()
needs_xla = pytest.mark.skipif(not XLA.available, reason=f"tpu backend unavailable: {XLA.reason}")


def xla_device() -> torch.device:
    from corelib_tpu.xla import default_device
    return default_device()


def compile_count() -> int:
    """torch-xla's count of graphs compiled in this process."""
    from corelib_tpu.xla import compile_count as count
    return count()
