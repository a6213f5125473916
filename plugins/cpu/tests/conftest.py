"""One torch thread for the tests: results do not depend on it (every stage is row-wise and
each row is computed by one thread), and on a shared 2-core machine OpenMP's barriers make
two-thread runs up to 20x slower whenever another process holds a core. ``kernel_path`` runs a
test on both paths of ``corelib_cpu.kernels``."""

import importlib.util

import pytest
import torch

from corelib_cpu import kernels

torch.set_num_threads(1)


@pytest.fixture(params=["compiled", "torch"])
def kernel_path(request, monkeypatch):
    """Runs a test on each path of the compiled kernels: numba's (skipped where numba is not
    installed) and the pure-torch fallback."""
    if request.param == "compiled":
        if importlib.util.find_spec("numba") is None:
            pytest.skip("numba is not installed (the kernels extra)")
        monkeypatch.delenv(kernels.KERNELS_ENV, raising=False)
    else:
        monkeypatch.setenv(kernels.KERNELS_ENV, "torch")
    kernels.reset()
    yield request.param
    kernels.reset()
