"""Helpers shared by the tpu plugin's tests (a unique module name: --import-mode=importlib puts
this folder on sys.path through conftest.py, next to other plugins' test folders)."""

from __future__ import annotations

import pytest
import torch

from corelib_tpu.probe import probe

XLA = probe()
needs_xla = pytest.mark.skipif(not XLA.available, reason=f"tpu backend unavailable: {XLA.reason}")


def xla_device() -> torch.device:
    from corelib_tpu.xla import default_device
    return default_device()


def compile_count() -> int:
    """torch-xla's count of graphs compiled in this process."""
    from corelib_tpu.xla import compile_count as count
    return count()
