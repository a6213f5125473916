# Shared setup steps for scripts/demo.sh and scripts/test.sh (sourced, not run).
PYTHON="${PYTHON:-python3}"
VENV="${CORELIB_VENV:-$PWD/.venv}"
XLA_VENV="${CORELIB_XLA_VENV:-$PWD/.venv-xla}"
# torch 2.13.0's CPU wheel is what this project develops against; a plain `torch` would pull
# a multi-GB CUDA build. torch-xla 2.9.0 needs exactly torch 2.9.0, so it gets its own venv.
TORCH_PIN="torch==2.13.0"
XLA_PINS="torch==2.9.0 torch-xla==2.9.0"

pip_quiet() { "$1/bin/pip" install --quiet --disable-pip-version-check "${@:2}"; }

ensure_main_venv() {
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  pip_quiet "$VENV" "$TORCH_PIN"
  pip_quiet "$VENV" -e ".[test,plot]"
  for plugin in $MAIN_PLUGINS; do
    pip_quiet "$VENV" -e "plugins/$plugin"
  done
}

# Plugins installed into the main venv (the TPU plugin needs its own torch, see XLA_VENV).
MAIN_PLUGINS="cpu"
