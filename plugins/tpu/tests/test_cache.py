"""The persistent compile cache (``TpuSampler(compile_cache=...)``, ``xla.compile_cache``).

XLA:CPU serialises compiled graphs into the cache but cannot load them back (torch-xla 2.9's
CPU client answers "Deserializing serialized executable not supported"), so here the tests
check what the plugin controls: the option and the environment variable switch the cache on
in the chosen directory before the first computation, graphs are written there, and a late
call says why it cannot take effect. Loading from the cache needs a TPU (docs/tpu.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from corelib_tpu import xla

from tpu_support import needs_xla, xla_device

WARM = """
import json, sys
from corelib_tpu.sampler import TpuSampler
sampler = TpuSampler(buckets=(8,), {option})
report = sampler.warmup(64)
print(json.dumps(dict(graphs=report.graphs, dir=str(sampler.compile_cache_dir))))
"""


def _warm_in_a_new_process(option: str, **env) -> dict:
    run = subprocess.run([sys.executable, "-c", WARM.format(option=option)], capture_output=True,
                         text=True, env=dict(os.environ, PJRT_DEVICE="CPU", **env), check=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_off_unless_asked_and_never_off_xla(monkeypatch):
    monkeypatch.delenv(xla.CACHE_ENV, raising=False)
    assert xla.compile_cache(None) is None and xla.compile_cache(False) is None
    from corelib_tpu.sampler import TpuSampler
    # on a plain torch device nothing is compiled, so there is nothing to cache
    assert TpuSampler("cpu", buckets=(8,), compile_cache=True).compile_cache_dir is None


@needs_xla
@pytest.mark.parametrize("how", ["option", "environment"])
def test_graphs_are_written_to_the_chosen_directory(tmp_path, how):
    folder = tmp_path / "cache"
    if how == "option":
        got = _warm_in_a_new_process(f"compile_cache={str(folder)!r}")
    else:
        got = _warm_in_a_new_process("", **{xla.CACHE_ENV: str(folder)})
    assert got["dir"] == str(folder) and got["graphs"] > 0
    assert len(list(folder.iterdir())) >= got["graphs"] // 2, "compiled graphs were not stored"


@needs_xla
def test_default_directory_is_under_the_user_cache(tmp_path):
    got = _warm_in_a_new_process("compile_cache=True", XDG_CACHE_HOME=str(tmp_path))
    import torch_xla
    assert Path(got["dir"]) == tmp_path / "corelib" / "xla" / f"torch_xla-{torch_xla.__version__}"
    assert any(Path(got["dir"]).iterdir())


@needs_xla
def test_too_late_raises_naming_the_fix(tmp_path):
    (torch.ones(2).to(xla_device()) + 1).cpu()          # this process has run a computation
    with pytest.raises(RuntimeError, match=r"already ran XLA computations.*compile_cache="):
        xla.compile_cache(tmp_path)
