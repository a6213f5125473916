"""Discovery: the entry point resolves, the probe is cheap and honest, auto-detection never
prefers XLA on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import corelib
from corelib.registry import Registry
from corelib.testing import assert_entry_point
from corelib_tpu import plugin, probe as probe_module

from tpu_support import XLA, needs_xla


def test_entry_point_resolves_to_the_plugin_module():
    assert_entry_point("tpu", plugin, "corelib-tpu")


def test_backend_is_listed_exactly_as_the_probe_says():
    status = {s.name: s for s in Registry().statuses()}["tpu"]
    assert status.available == XLA.available, status.reason
    assert status.device_type == "xla" and status.priority == plugin.TPU_PRIORITY
    assert status.distribution == "corelib-tpu"


def test_discovery_does_not_import_torch_xla():
    code = ("import sys, json, corelib; s = {b.name: b.available for b in corelib.available_backends()};"
            "print(json.dumps([s.get('tpu'), 'torch_xla' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    listed, imported = json.loads(out.stdout.strip().splitlines()[-1])
    assert listed is not None, "the tpu backend was not discovered"
    assert imported is False, "discovery imported torch_xla"


@pytest.mark.parametrize("pjrt, available, auto", [("CPU", True, False), ("cpu", True, False),
                                                   ("CUDA", False, None)])
def test_pjrt_device_decides_availability(monkeypatch, pjrt, available, auto):
    monkeypatch.setattr(probe_module.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(probe_module, "torch_version_mismatch", lambda: "")
    monkeypatch.setenv("PJRT_DEVICE", pjrt)
    result = probe_module.probe()
    assert result.available == available, result
    if available:
        assert result.auto == auto, result
    assert result.reason


def test_tpu_needs_a_device_file(monkeypatch):
    monkeypatch.setattr(probe_module.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(probe_module, "torch_version_mismatch", lambda: "")
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    monkeypatch.setattr(probe_module, "tpu_device_files", lambda: [])
    assert not probe_module.probe().available
    monkeypatch.setattr(probe_module, "tpu_device_files", lambda: ["/dev/accel0"])
    result = probe_module.probe()
    assert result.available and result.auto, result


def test_missing_or_mismatched_torch_xla_is_explained(monkeypatch):
    monkeypatch.setattr(probe_module.importlib.util, "find_spec", lambda name: None)
    result = probe_module.probe()
    assert not result.available and "torch_xla is not installed" in result.reason
    monkeypatch.setattr(probe_module.importlib.util, "find_spec", lambda name: object())
    versions = {"torch-xla": "2.9.0", "torch": "2.13.0+cpu"}
    monkeypatch.setattr(probe_module.metadata, "version", lambda name: versions[name])
    result = probe_module.probe()
    assert not result.available and "torch 2.9" in result.reason and "2.13.0" in result.reason


@needs_xla
def test_auto_detection_prefers_another_backend_on_xla_cpu(monkeypatch):
    monkeypatch.delenv("CORELIB_DEVICE", raising=False)
    if XLA.auto:
        pytest.skip("a real TPU is present: auto-detection is expected to pick it")
    status, _ = Registry().choose(None)
    assert status.name != "tpu"


@needs_xla
def test_get_sampler_by_name_and_by_device_type():
    sampler = corelib.get_sampler("tpu")
    assert sampler.name == "tpu" and sampler.device.type == "xla"
    import torch
    assert corelib.get_sampler(torch.device("xla")).name == "tpu"
