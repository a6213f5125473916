"""Several vLLM engines one after another in one process, as notebooks, evaluation scripts
and reinforcement-learning loops build them: with corelib on and numba loaded (by the cpu
backend's kernels on the first seeded step, and by vLLM's ngram drafter), every engine starts
and samples the same seeded tokens. Each case runs in a fresh interpreter, so nothing the
suite's own process loaded or patched helps it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import KV_CACHE_BYTES, NGRAM

SCRIPT = """
import gc, json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

model, speculative = sys.argv[1], json.loads(sys.argv[2])
params = SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=8, ignore_eos=True)
prompts = [TokensPrompt(prompt_token_ids=[1, 17, 42, 99, 7]), TokensPrompt(prompt_token_ids=[1, 300])]
tokens, numba_loaded = [], []
for spec in speculative:
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=4,
              seed=0, kv_cache_memory_bytes=%d, speculative_config=spec)
    tokens.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)])
    numba_loaded.append("numba" in sys.modules)
    del llm
    gc.collect()
print("RESULT " + json.dumps({"tokens": tokens, "numba": numba_loaded}))
""" % KV_CACHE_BYTES


def engines_one_after_another(model_dir, speculative: list) -> dict:
    """Start one engine per entry of ``speculative`` (a speculative_config or None) in a new
    interpreter, as a user's script does; each generates seeded tokens and is deleted."""
    env = {**os.environ, "CORELIB_VLLM": "cpu", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(model_dir), json.dumps(speculative)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    line = [row for row in done.stdout.splitlines() if row.startswith("RESULT ")][-1]
    return json.loads(line.removeprefix("RESULT "))


def test_engines_start_one_after_another_after_a_seeded_step(model_dir):
    """The first engine's seeded top-p step loads numba (corelib's cpu kernels); the engines
    after it, with and without ngram speculation, start and draw the same seeded tokens."""
    result = engines_one_after_another(model_dir, [None, None, NGRAM, None])
    assert result["numba"] == [True] * 4
    first = result["tokens"][0]
    assert all(len(row) == 8 for row in first)
    assert result["tokens"] == [first] * 4
