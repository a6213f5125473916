"""Fixtures of the hostile-input suite (issue 7)."""

import sys
from pathlib import Path

import pytest
import torch

# --import-mode=importlib puts no test folder on sys.path; the suite's helpers live next to
# this file under a name no other tests/ folder uses.
sys.path.insert(0, str(Path(__file__).parent))

from hostile_support import BACKEND_NAMES, load_sampler  # noqa: E402


@pytest.fixture(scope="module", params=BACKEND_NAMES)
def sampler(request):
    """Each backend of BACKEND_NAMES that runs here (the others are skipped, saying why)."""
    return load_sampler(request.param)


@pytest.fixture(scope="module")
def reference():
    return load_sampler("reference")


@pytest.fixture(autouse=True)
def single_thread_torch():
    """Run each test with one intra-op thread, restored after. The suite's tensors are tiny;
    with OpenMP's two threads on a loaded 2-core machine a [64, 256] torch.log took 24 ms
    instead of 0.08 ms (threads waiting at barriers), which made the long runs crawl."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
