# Shared setup steps for scripts/demo.sh and scripts/test.sh (sourced, not run).
PYTHON="${PYTHON:-python3}"
VENV="${CORELIB_VENV:-$PWD/.venv}"
XLA_VENV="${CORELIB_XLA_VENV:-$PWD/.venv-xla}"
# torch 2.13.0's CPU wheel is what this project develops against; a plain `torch` would pull
# a multi-GB CUDA build. torch-xla 2.9.0 needs exactly torch 2.9.0, so it gets its own venv.
TORCH_PIN="torch==2.13.0"
XLA_PINS="torch==2.9.0 torch-xla==2.9.0"
# The Hugging Face integration is tested against this release.
TRANSFORMERS_PIN="transformers==5.24.0"
# Token bitmasks are checked against a grammar engine's own kernel (and benchmarked with it).
XGRAMMAR_PIN="xgrammar==0.2.9"
# Plugins in the main venv: the demo needs only cpu; the tests add the others. The TPU plugin
# needs its own torch and lives in XLA_VENV.
DEMO_PLUGINS="cpu"
TEST_PLUGINS="cpu cuda _template"

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
    pip_quiet "$venv" -e "plugins/$plugin"
  done
}

ensure_xla_venv() {
  [ -x "$XLA_VENV/bin/python" ] || "$PYTHON" -m venv "$XLA_VENV"
  # torch-xla pins its torch; the core and plugins go in without deps so nothing replaces it.
  pip_quiet "$XLA_VENV" $XLA_PINS "pydantic>=2.5" "pluggy>=1.3" "pytest>=8" numpy
  # Not the cpu plugin: it is built for the main venv's torch 2.13 (fails on 2.9).
  pip_quiet "$XLA_VENV" --no-deps -e . -e plugins/tpu
}
