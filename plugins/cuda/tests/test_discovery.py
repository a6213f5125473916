"""Discovery: the entry point resolves, and ``cuda`` is available exactly when the probe says so;
the path report names FlashInfer problems without making the backend unavailable."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from corelib import Availability, BackendUnavailableError
from corelib.registry import Registry
from corelib.testing import assert_entry_point

from corelib_cuda import plugin
from corelib_cuda.probe import (ENV_FLASHINFER, FLASHINFER_MIN_CAPABILITY, cuda_availability,
                                flashinfer_choice, import_flashinfer, probe)


def test_entry_point_resolves_to_the_plugin_module():
    assert_entry_point("cuda", plugin, "corelib-cuda")


def test_backend_is_listed_and_available_exactly_when_the_probe_says_so():
    registry = Registry(allow={"cuda"})
    status = next(s for s in registry.statuses() if s.name == "cuda")
    gpu = cuda_availability()
    assert status.distribution == "corelib-cuda"
    assert status.device_type == "cuda" and status.priority == plugin.CUDA_PRIORITY == 20
    assert status.available is gpu.available
    assert status.reason, "the status must say why (unavailable) or which path runs (available)"
    if gpu.available:
        assert "path active" in status.reason and "; token bitmask: " in status.reason
    else:
        assert status.reason == gpu.reason
        with pytest.raises(BackendUnavailableError, match="not available"):
            registry.get_sampler("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the report of a machine without a GPU")
def test_no_gpu_is_reported_with_the_torch_build():
    availability = probe()
    assert not availability.available
    assert "torch.cuda.is_available() is False" in availability.reason
    assert torch.__version__ in availability.reason


def test_path_reasons():
    assert flashinfer_choice(None).path == "torch"
    old = flashinfer_choice((7, 0))
    assert old.path == "torch" and "7.5" in old.reason and "7.0" in old.reason
    version, error = import_flashinfer()
    new = flashinfer_choice(FLASHINFER_MIN_CAPABILITY)
    if error is None:
        assert new.flashinfer and version in new.reason
    else:
        assert new.reason.startswith("torch path active because flashinfer")


def test_env_var_forces_the_torch_path(monkeypatch):
    monkeypatch.setenv(ENV_FLASHINFER, "0")
    choice = flashinfer_choice((9, 0))
    assert choice.path == "torch" and ENV_FLASHINFER in choice.reason


def test_a_broken_flashinfer_is_a_path_reason_not_an_error(tmp_path):
    """A real package named flashinfer that fails to import, ahead of the installed one."""
    broken = tmp_path / "flashinfer"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('libcudart.so.99: cannot open shared object file')\n")
    code = textwrap.dedent("""
        from corelib_cuda.probe import flashinfer_choice
        print(flashinfer_choice((9, 0)).reason)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    env.pop(ENV_FLASHINFER, None)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ("torch path active because flashinfer cannot be used: flashinfer "
                                     "failed to import (ImportError: libcudart.so.99: cannot open "
                                     "shared object file)")


def test_hook_imports_no_flashinfer():
    code = "import sys, corelib; corelib.available_backends(); print('flashinfer' in sys.modules)"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")   # no GPU: the probe has no reason to look
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_auto_detection_picks_cuda_exactly_when_available():
    chosen = Registry(allow={"cuda"}).choose()[0].name
    assert chosen == ("cuda" if cuda_availability().available else "reference")


@pytest.mark.skipif(not cuda_availability().available, reason="needs the cuda backend available")
def test_asked_for_by_name_it_builds_a_cuda_sampler():
    from corelib_cuda import CudaSampler
    sampler = Registry(allow={"cuda"}).get_sampler("cuda")
    assert isinstance(sampler, CudaSampler) and sampler.name == "cuda"
    assert sampler.device.type == "cuda" and sampler.path in ("flashinfer", "torch")
    assert sampler.path_reason.startswith("FlashInfer path active" if sampler.path == "flashinfer"
                                          else "torch path active because")


def test_the_status_of_an_available_backend_names_the_bitmask_path(monkeypatch):
    """What ``corelib info`` shows with a GPU whose Triton launcher cannot be built: its paths,
    the bitmask's and the row sums' with the reason their first launch failed. The GPU is simulated (availability
    and capability); the launch check is the real one, on a launcher that fails."""
    from corelib_cuda import bitmask, probe as probe_module, row_sum

    def failing_launcher(x, words):
        raise RuntimeError("Failed to find C compiler")

    def failing_sum(values):
        raise RuntimeError("Failed to find C compiler")

    monkeypatch.setenv(ENV_FLASHINFER, "0")
    monkeypatch.setattr(probe_module, "cuda_availability", lambda device_index=0: Availability(True))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(bitmask, "_cuda_path",
                        lambda device: bitmask.launch_checked(torch.device("cpu"), lambda: failing_launcher))
    monkeypatch.setattr(row_sum, "_cuda_path",
                        lambda device: row_sum.launch_checked(torch.device("cpu"), failing_sum))
    status = next(s for s in Registry(allow={"cuda"}).statuses() if s.name == "cuda")
    assert status.available
    assert status.reason == (f"torch path active because {ENV_FLASHINFER}='0' disables FlashInfer; "
                             f"token bitmask: torch (the Triton kernel failed its first launch: "
                             f"RuntimeError: Failed to find C compiler); "
                             f"row sums: torch (the Triton row sum failed its first launch: "
                             f"RuntimeError: Failed to find C compiler)")
