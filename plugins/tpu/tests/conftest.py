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

from tpu_support import XLA, apply_suite_xla_settings  # noqa: E402

# read when torch-xla starts, so set before any test imports it (the benchmark keeps XLA's defaults)
apply_suite_xla_settings()


def pytest_collection_modifyitems(config, items):
    if os.environ.get("CORELIB_TPU_REQUIRE_XLA") == "1" and not XLA.available:
        raise pytest.UsageError(
            f"CORELIB_TPU_REQUIRE_XLA=1 but the tpu backend is unavailable: {XLA.reason}")
