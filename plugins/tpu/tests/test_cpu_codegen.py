"""On XLA:CPU the plugin chooses the kernel emitter that maps fewer memory regions per graph
(``xla.choose_cpu_codegen``), before the runtime starts, unless the caller chose one.

Each case runs in a fresh process: XLA reads ``XLA_FLAGS`` once, when its runtime starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from corelib_tpu import xla

from tpu_support import SUITE_XLA_SETTINGS, needs_xla

RANDOM_GRAPH = """
import json, os, sys
import torch
first = sys.argv[1]
if first == "caller-starts-xla":
    import torch_xla
    torch_xla.device()
from corelib.sampler import Sampler
from corelib_tpu import xla
from corelib_tpu.sampler import TpuSampler
from corelib_tpu.transfer import outputs, pack

def maps():
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)

sampler = TpuSampler(buckets=(8,))
if first == "caller-starts-xla":          # the flags are settled: no graph needed
    print(json.dumps(dict(chosen=sampler.cpu_codegen_chosen, flags=os.environ.get("XLA_FLAGS", ""))))
    sys.exit()
batch = sampler.new_batch(256)
x = torch.zeros((8, 256)).to(sampler.device)
xla.launch([x])
before = maps()
with sampler._forcing(sampler.variants(batch)[2]):              # the folded random graph
    out = Sampler.sample(sampler, x, batch)
    xla.launch(outputs(pack(out), out))
print(json.dumps(dict(maps=maps() - before, chosen=sampler.cpu_codegen_chosen,
                      flags=os.environ.get("XLA_FLAGS", ""), token=out.token_ids.cpu().tolist())))
"""


def _random_graph_in_a_new_process(first: str = "sampler", flags: str = "") -> dict:
    # the suite's options only (this process's XLA_FLAGS may hold the plugin's choice already)
    env = dict(os.environ, PJRT_DEVICE="CPU",
               XLA_FLAGS=f"{SUITE_XLA_SETTINGS['XLA_FLAGS']} {flags}".strip())
    run = subprocess.run([sys.executable, "-c", RANDOM_GRAPH, first], capture_output=True,
                         text=True, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@needs_xla
def test_the_plugin_chooses_the_emitter_that_maps_fewer_regions():
    chosen = _random_graph_in_a_new_process()
    assert chosen["chosen"] and xla.CPU_CODEGEN_FLAG in chosen["flags"].split()
    callers = _random_graph_in_a_new_process(flags="--xla_cpu_use_fusion_emitters=true")
    assert not callers["chosen"], "the caller's own choice was overridden"
    assert xla.CPU_CODEGEN_FLAG not in callers["flags"].split()
    # measured 710 against 1,140 maps: a quarter fewer at least
    assert chosen["maps"] < 0.75 * callers["maps"], (chosen["maps"], callers["maps"])
    assert chosen["token"] == callers["token"]


@needs_xla
def test_nothing_changes_once_the_caller_started_xla():
    got = _random_graph_in_a_new_process("caller-starts-xla")
    assert not got["chosen"] and xla.CPU_CODEGEN_FLAG not in got["flags"]


def test_only_on_xla_cpu(monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert not xla.choose_cpu_codegen() and "XLA_FLAGS" not in os.environ
