"""Fixtures of the tpu plugin's tests.

Tests that need an XLA device are gated on the plugin's own probe (``tpu_support.needs_xla``),
so tests and runtime agree; the project's test script runs them with ``PJRT_DEVICE=CPU`` and
torch-xla installed, where they must run: ``CORELIB_TPU_REQUIRE_XLA=1`` turns that skip into an
error.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tpu_support import XLA  # noqa: E402

# The suite spends its time compiling graphs, not running them (small vocabularies): compiled
# without LLVM's optimisations they are the same HLO, built 4-5 times faster. Read when
# torch-xla starts, so it must be set before any test imports it; the benchmark keeps XLA's
# defaults.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
# XLA:CPU maps a few hundred memory regions per compiled graph and releases them only when
# torch-xla drops the graph from its cache; past the kernel's limit (vm.max_map_count, 65530
# by default) compiling fails. The suite compiles several hundred graphs in one process, so
# the cache keeps the 96 most recent (each test module needs fewer at a time): at 128 the
# conformance module reached the limit (about 65000 regions, measured) once the random
# graphs held the draw's route branch, about 5% more regions per graph.
os.environ.setdefault("XLA_COMPILATION_CACHE_SIZE", "96")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("CORELIB_TPU_REQUIRE_XLA") == "1" and not XLA.available:
        raise pytest.UsageError(
            f"CORELIB_TPU_REQUIRE_XLA=1 but the tpu backend is unavailable: {XLA.reason}")
