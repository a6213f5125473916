#!/usr/bin/env bash
# Run on a machine with PyPI access, from the repo root, before copying the tree to a GPU machine:
#   bash plugins/cuda/gpu_wheels.sh
# The GPU image (python3 3.12, torch, pluggy, pytest, setuptools) lacks pydantic; this puts the
# wheels of pydantic and of everything it requires (pydantic-core, annotated-types,
# typing-inspection, typing-extensions >= 4.16, newer than the one torch may have brought) in
# .whl/ (kept out of git through .git/info/exclude), so that gpu_check.sh can install them there
# offline with their dependencies resolved. pip resolves the dependencies for the GPU machine's
# Python and platform; the pins keep the versions the project tests with. Copy .whl/ along with
# the tree. FlashInfer is not prepared here: its wheel alone is ~100 MB, more than such a copy
# allows.
set -euo pipefail
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing-extensions==4.16.0
ls -la .whl
