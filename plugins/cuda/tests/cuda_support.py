"""Helpers shared by the cuda plugin's tests (a unique module name: ``conftest.py`` puts this
folder on sys.path, next to other plugins' test folders)."""

from __future__ import annotations

from corelib_cuda.probe import cuda_availability

GPU = cuda_availability()
