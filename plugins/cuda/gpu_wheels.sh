#!/usr/bin/env bash
# Run on a machine with PyPI access, from the repo root, before copying the tree to a GPU machine:
#   bash plugins/cuda/gpu_wheels.sh            # PYTHON=... a Python with torch, for the bundle check
# The GPU image (python3 3.12, torch, Triton, nvcc, pluggy, pytest) lacks pydantic and FlashInfer,
# and a copy to it may carry 64 MiB in all. This fills .whl/ (kept out of git through
# .git/info/exclude) with, for that Python and platform:
# - the wheels of pydantic and everything it requires (pydantic-core, annotated-types,
#   typing-inspection, typing-extensions >= 4.16, newer than the one torch may have brought),
#   resolved there by gpu_check.sh with --no-index --find-links;
# - in .whl/flashinfer/, FlashInfer 0.7.4 trimmed to its Python code and the CUDA sources and
#   headers of the sampling and top-k modules it compiles with nvcc on first use
#   (plugins/cuda/flashinfer_bundle.py; the full wheel is ~101 MB), and the wheels those modules
#   import (installed there with --no-deps).
# The bundle is then checked here: installed into a scratch folder with this machine's wheels of
# the same versions, imported by a Python that sees only it and torch, and its two modules planned
# (build.ninja written, every source and header present). Last, the size of what travels: the
# tracked tree plus .whl/, against the 64 MiB limit.
set -euo pipefail
PY=${PYTHON:-python3}
LIMIT_MIB=64
FLASHINFER_PIN="flashinfer-python==0.7.4"
FLASHINFER_DEPS="apache-tvm-ffi==0.1.15.post2 numpy==2.4.6 requests==2.34.2 urllib3==2.8.0 idna==3.21
  certifi==2026.10.19.post1 charset-normalizer==3.5.3 nvidia-ml-py==13.615.71 tqdm==4.70.1 ninja==1.13.2"
GPU_TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
  --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl/flashinfer
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download -q "${GPU_TARGET[@]}" -d .whl pydantic==2.14.4 pydantic-core==2.50.5 \
  annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
"$PY" -m pip download -q --no-deps -d "$tmp" "$FLASHINFER_PIN"
"$PY" plugins/cuda/flashinfer_bundle.py trim "$tmp"/flashinfer_python-0.7.4-py3-none-any.whl .whl/flashinfer
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps "${GPU_TARGET[@]}" -d .whl/flashinfer $FLASHINFER_DEPS
mkdir -p "$tmp/check" && cp .whl/flashinfer/flashinfer_python-*.whl "$tmp/check/"
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$tmp/check" $FLASHINFER_DEPS
"$PY" plugins/cuda/flashinfer_bundle.py check "$tmp/check"
ls -la .whl .whl/flashinfer
tree_bytes=$(git ls-files -z | xargs -0 cat | wc -c)
whl_bytes=$(du -sb .whl | cut -f1)
total=$(( (tree_bytes + whl_bytes) / 1048576 ))
echo "to carry: tree $((tree_bytes / 1048576)) MiB + .whl $((whl_bytes / 1048576)) MiB = $total MiB (limit $LIMIT_MIB MiB)"
[ "$total" -lt "$LIMIT_MIB" ]
