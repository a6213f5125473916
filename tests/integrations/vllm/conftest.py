"""vLLM's CPU engine, in this process, on a tiny random Llama made for the session.

This suite runs with the vLLM venv's interpreter (scripts/test.sh); elsewhere it is not
collected, unless CORELIB_REQUIRE_VLLM is set, which makes a missing vLLM an error.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
if not HAVE_VLLM:
    if os.environ.get("CORELIB_REQUIRE_VLLM"):
        raise RuntimeError("CORELIB_REQUIRE_VLLM is set but vLLM is not installed")
    collect_ignore_glob = ["test_*.py"]
else:
    # vLLM reads these when it starts.
    os.environ.update({
        "CORELIB_VLLM": "cpu",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",   # engine core and worker in this process
        "VLLM_CPU_KVCACHE_SPACE": "1",           # GiB
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    })
    # vLLM loads its plugins once per process, at the first engine: load them now, while
    # CORELIB_VLLM is set, whichever engine a test starts first.
    from vllm.plugins import load_general_plugins
    load_general_plugins()
sys.path.insert(0, str(HERE))   # tiny_llama, shared with the benchmark

MAX_NUM_SEQS = 4   # fewer than most tests' prompts: requests join and leave mid-generation


@contextlib.contextmanager
def corelib_vllm(value):
    """CORELIB_VLLM set to ``value`` (None: unset) for the duration."""
    old = os.environ.get("CORELIB_VLLM")
    if value is None:
        os.environ.pop("CORELIB_VLLM", None)
    else:
        os.environ["CORELIB_VLLM"] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("CORELIB_VLLM", None)
        else:
            os.environ["CORELIB_VLLM"] = old


def make_llm(model_dir: Path, backend, **kwargs):
    """A vLLM ``LLM`` on the tiny model; ``backend`` is CORELIB_VLLM while it starts."""
    from vllm import LLM
    options = dict(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=256,
                   max_num_seqs=MAX_NUM_SEQS, seed=0)
    options.update(kwargs)
    with corelib_vllm(backend):
        return LLM(**options)


def runner_of(llm):
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    import tiny_llama
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama.make_model(path)
    return path


@pytest.fixture(scope="session")
def hf_model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def corelib_llm(model_dir):
    """vLLM sampling with corelib's cpu backend (raw logprobs)."""
    return make_llm(model_dir, "cpu")


@pytest.fixture(scope="session")
def processed_llm(model_dir):
    """corelib's sampler with logprobs_mode="processed_logprobs"."""
    return make_llm(model_dir, "cpu", logprobs_mode="processed_logprobs")


@pytest.fixture(scope="session")
def fresh_llm(model_dir):
    """An engine for one test that needs its first generate call (unseeded generator at its
    start). Engines stay alive for the session: vLLM's engines in one process share its
    distributed state, which a shut-down engine tears down for all."""
    return make_llm(model_dir, "cpu")


@pytest.fixture(scope="session")
def vllm_llm(model_dir):
    """vLLM with its own sampler: CORELIB_VLLM unset while the engine starts."""
    return make_llm(model_dir, None)
