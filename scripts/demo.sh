#!/usr/bin/env bash
# Sets up corelib with the CPU backend in .venv and runs the demo: samples a few requests on
# the auto-detected backend, then prints a short benchmark table.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
ensure_main_venv
install_plugins "$VENV" $DEMO_PLUGINS
"$VENV/bin/corelib" info
"$VENV/bin/corelib" demo "$@"
