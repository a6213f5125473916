"""The documented warm-up fits a default-configured machine.

Warming the default buckets with ``speculative_k=(4,)`` once compiled 18 sample and 36 verify
graphs per bucket; XLA:CPU keeps each compiled graph's code in its own memory maps, and the
process passed the kernel's default ``vm.max_map_count`` (65530) and died with "LLVM
compilation error: Cannot allocate memory". The same buckets and K at V = 256 died the same
way, so this test warms them at V = 256 in a fresh process and counts its memory maps after.
A graph mapped more at a large vocabulary while XLA:CPU built each row reduction as a tree of
reduce-window kernels (the V = 128256 warm-up then passed the limit); the plugin now turns
that off, and ``test_cpu_codegen.py`` checks that a random graph maps at most a quarter more
at V = 128256 than at V = 256, which carries this test's budget to a real vocabulary.

The warm-up runs in a subprocess started when this module is collected: the suite compiles on
one core, so the second core does this warm-up meanwhile and the test only collects its result.
It runs in the caller's environment without the suite's own XLA settings (``tpu_support``): a
cache of 96 graphs would drop most of the 325 this warm-up compiles, and with them their maps,
so the count would not be what a user's process holds."""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys

from corelib_tpu.buckets import Buckets

from tpu_support import XLA, needs_xla, user_environment

DEFAULT_MAX_MAP_COUNT = 65530
# a quarter of the limit left free: other libraries in an engine's process map memory too
MAP_BUDGET = DEFAULT_MAX_MAP_COUNT * 3 // 4

WARM = """
import json
from corelib_tpu.sampler import TpuSampler
sampler = TpuSampler(speculative_k=(4,))
report = sampler.warmup(256)
with open("/proc/self/maps") as maps:
    count = sum(1 for _ in maps)
print(json.dumps(dict(maps=count, buckets=list(report.buckets), graphs=report.graphs,
                      step_graphs=[[list(key), n] for key, n in report.step_graphs.items()])))
"""


def _start_warmup():
    run = subprocess.Popen([sys.executable, "-c", WARM], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True,
                           env=dict(user_environment(), PJRT_DEVICE="CPU"))
    atexit.register(run.kill)
    return run


WARMUP = _start_warmup() if XLA.available else None


def _report() -> dict:
    out, err = WARMUP.communicate(timeout=1800)
    assert WARMUP.returncode == 0, f"warm-up process failed ({WARMUP.returncode}):\n{err[-4000:]}"
    return json.loads(out.strip().splitlines()[-1])


@needs_xla
def test_default_buckets_with_k4_warm_up_within_the_default_map_count():
    report = _report()
    assert tuple(report["buckets"]) == tuple(Buckets(None, 256))
    assert report["maps"] <= MAP_BUDGET, (
        f"{report['maps']} memory maps after warm-up ({report['graphs']} graphs): "
        f"the default vm.max_map_count is {DEFAULT_MAX_MAP_COUNT}")
    step_graphs = {tuple(key): n for key, n in report["step_graphs"]}
    for bucket in report["buckets"]:
        assert step_graphs[("sample", bucket)] <= 4
        # with and without draft probabilities, each without and with the stateful selectors
        assert step_graphs[("verify", bucket, 4)] <= 4
