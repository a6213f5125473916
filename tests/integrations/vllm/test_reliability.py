"""With CORELIB_VLLM set an engine samples with corelib or does not start: every worker is
asked at start, each says which sampler it runs (one log line each), and the ways a runner
could keep vLLM's sampler stop the engine with the reason. Chunked prefill with seeded
requests, which crashes vLLM's CPU build, runs."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap

import pytest

import corelib
from corelib.integrations.vllm import patches

from conftest import KV_CACHE_BYTES, corelib_vllm, hf_generate, make_llm, run, runner_of, vllm_params

SCRIPT_HEAD = """
import os, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
def start():
    return LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=256,
               max_num_seqs=2, seed=0, kv_cache_memory_bytes=int(sys.argv[2]))
"""


def run_script(model_dir, body: str, **env):
    """Python ``SCRIPT_HEAD + body`` in a fresh process (engine in process unless ``env`` says
    otherwise); returns the CompletedProcess."""
    environment = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", **env)
    for name, value in env.items():
        if value is None:
            environment.pop(name)
    return subprocess.run([sys.executable, "-c", SCRIPT_HEAD + textwrap.dedent(body),
                           str(model_dir), str(KV_CACHE_BYTES)],
                          env=environment, capture_output=True, text=True, timeout=600)


# ---------------------------------------------------------------------- the start-up check
def test_every_worker_reports_the_sampler_it_runs(corelib_llm):
    (report,) = patches.check_workers(corelib_llm.llm_engine.model_executor)
    assert report["worker"].startswith("worker rank 0 (pid ")
    assert (report["backend"], report["device"]) == ("cpu", "cpu")
    assert {"sampler", "grammar bitmask -> token_bitmask", "no per-request generators",
            "flagged rows -> scheduler"} <= set(report["patched"])


def test_a_worker_with_vllms_sampler_is_an_error_while_the_variable_is_set(vllm_llm):
    """The engine built without CORELIB_VLLM, checked with it set: what a start would say."""
    with pytest.raises(RuntimeError, match=(
            "CORELIB_VLLM='cpu' is set, but this engine would not sample with corelib: worker "
            "rank 0 .*: its runner's sampler is vllm.v1.sample.sampler.Sampler: the runner was "
            "built while CORELIB_VLLM was unset")):
        patches.check_workers(vllm_llm.llm_engine.model_executor)


def test_each_reason_a_worker_gives(corelib_llm, monkeypatch):
    runner = runner_of(corelib_llm)
    assert patches.why_not_corelib(runner) is None
    with corelib_vllm(None):
        assert "CORELIB_VLLM is not set in this process" in patches.why_not_corelib(runner)
    assert patches.why_not_corelib(None) == "the worker has no model runner"
    monkeypatch.setattr(patches, "_installed", False)    # as in a process without the plugin
    monkeypatch.setenv("VLLM_PLUGINS", "other")
    assert ("vLLM did not load the 'corelib' plugin here (VLLM_PLUGINS='other' must name it"
            in patches.why_not_corelib(runner))
    monkeypatch.setattr(patches, "_installed", True)
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    assert "its model runner is vllm.v1.worker.gpu.model_runner.GPUModelRunner, not vLLM's V1" in (
        patches.why_not_corelib(V2Runner.__new__(V2Runner)))


def test_the_start_is_logged_once_per_worker(model_dir):
    result = run_script(model_dir, """
        llm = start()
        print("STARTED")
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    output = (result.stdout + result.stderr).splitlines()       # vLLM logs to stdout
    lines = [line for line in output if "samples with corelib backend" in line]
    assert len(lines) == 1
    assert "worker rank 0" in lines[0] and "'cpu' on cpu; patched: sampler" in lines[0]


def test_a_runner_module_loaded_past_corelibs_hook_stops_the_engine(model_dir):
    """Another import hook ahead of corelib's loads vLLM's V1 runner module: its runner keeps
    vLLM's sampler, and the engine refuses to start, saying so."""
    result = run_script(model_dir, """
        import importlib.machinery
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        class FirstFinder:
            def find_spec(self, name, path=None, target=None):
                if name == "vllm.v1.worker.gpu_model_runner":
                    return importlib.machinery.PathFinder.find_spec(name, path)
        sys.meta_path.insert(0, FirstFinder())
        try:
            start()
        except Exception as exc:
            print("REFUSED", exc)
    """)
    assert "REFUSED" in result.stdout, result.stderr[-3000:]
    assert ("vLLM's V1 runner module was imported without corelib's hook (another import hook "
            "loaded it first)") in result.stdout


def test_a_variable_set_after_vllm_loaded_its_plugins_still_takes_effect(model_dir):
    """vLLM loads its plugins once per process; CORELIB_VLLM set after that (but before the
    engine starts) gives corelib's sampler, not vLLM's in silence."""
    result = run_script(model_dir, """
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        os.environ["CORELIB_VLLM"] = "cpu"
        llm = start()
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        print("SAMPLER", type(runner.sampler).__name__)
    """, CORELIB_VLLM=None)
    assert "SAMPLER CorelibSampler" in result.stdout, result.stderr[-3000:]


# ---------------------------------------------------------------------- the import hook
@pytest.fixture
def scratch_modules(tmp_path, monkeypatch):
    """Importable module files in a fresh directory (name -> source), removed afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    made = []

    def write(name, source="VALUE = 1\n"):
        (tmp_path / f"{name}.py").write_text(source)
        made.append(name)
    yield write
    for name in made:
        sys.modules.pop(name, None)
    sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, "module_name", None) not in made]


def mark(module):
    module.patched = getattr(module, "patched", 0) + 1


def test_a_hook_patches_a_module_imported_while_another_hook_fires(scratch_modules):
    """corelib_hook_a is imported while a finder ahead of its hook imports corelib_hook_b
    (whose hook sits ahead of both). A hook that left sys.meta_path on firing shifted the list
    under the outer import, which then skipped the next hook: corelib_hook_a went unpatched.
    The same shift happens when another thread imports at that moment."""
    scratch_modules("corelib_hook_a")
    scratch_modules("corelib_hook_b")

    class ImportsB:
        def find_spec(self, name, path=None, target=None):
            if name == "corelib_hook_a":
                importlib.import_module("corelib_hook_b")

    patches.when_imported("corelib_hook_a", mark)
    sys.meta_path.insert(0, ImportsB())
    patches.when_imported("corelib_hook_b", mark)
    try:
        a = importlib.import_module("corelib_hook_a")
    finally:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, ImportsB)]
    assert sys.modules["corelib_hook_b"].patched == 1
    assert a.patched == 1


def test_a_hook_patches_after_a_failed_import_and_on_reload(scratch_modules, tmp_path):
    scratch_modules("corelib_hook_c", "raise ImportError('not yet')\n")
    patches.when_imported("corelib_hook_c", mark)
    with pytest.raises(ImportError, match="not yet"):
        importlib.import_module("corelib_hook_c")
    (tmp_path / "corelib_hook_c.py").write_text("VALUE = 2\n")
    importlib.invalidate_caches()
    module = importlib.import_module("corelib_hook_c")
    assert (module.VALUE, module.patched) == (2, 1)
    module = importlib.reload(module)
    assert module.patched == 2


# ---------------------------------------------------------------------- chunked prefill
LONG_PROMPTS = [[1] + [(7 * i + j) % 500 + 3 for j in range(70)] for i in range(4)]


@pytest.fixture(scope="session")
def chunked_llm(model_dir):
    """Chunked prefill in chunks of 32 tokens: 70-token prompts take three steps, and the
    tokens sampled for them in the first two are discarded."""
    return make_llm(model_dir, "cpu", max_num_batched_tokens=32, enable_chunked_prefill=True)


def test_seeded_requests_in_chunked_prefill_sample_as_corelib_does(chunked_llm, hf_model):
    """vLLM's CPU build crashed here ("CPU Generator does not use offset": the runner rewinds
    the per-request generator of a request whose token it discards); with corelib the runner
    keeps no such generators, and the seeded tokens are corelib's."""
    params = [dict(temperature=1.5, seed=3 + i) for i in range(len(LONG_PROMPTS))]
    ours = run(chunked_llm, LONG_PROMPTS, [vllm_params(max_tokens=6, **p) for p in params])
    assert runner_of(chunked_llm).input_batch.generators == {}
    theirs = hf_generate(hf_model, LONG_PROMPTS, [corelib.SamplingParams(**p) for p in params],
                         max_new_tokens=6)
    assert ours == theirs
