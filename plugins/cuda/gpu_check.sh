#!/usr/bin/env bash
# The cuda backend's GPU check: the GPU tests, then the benchmark, then a short table (last).
#   bash plugins/cuda/gpu_check.sh            # from the repo root, on a machine with an NVIDIA GPU
# Downloads nothing. It uses the python3 there (PYTHON=... to choose another); when pydantic is
# missing it installs the wheels carried in .whl/ (made by plugins/cuda/gpu_wheels.sh) with
# --no-index, and it installs this tree's corelib and corelib-cuda (no deps, no build isolation)
# into a scratch folder so the plugin's entry point exists. Budget: under 8 minutes in all
# (tests 270 s and benchmark 170 s at most, each cut off by `timeout`). The tests cover the
# engine features too: verify / append / bitmask steps under torch.cuda.set_sync_debug_mode
# ("error"), graph capture of verify steps, FlashInfer's chain_speculative_sampling against the
# torch path's distribution, the Triton bitmask kernel against the reference unpacking. The
# benchmark prints the engine-feature table (bitmask cost, new samplers, verify) first, then
# the sampling table; both are repeated at the end.
set -uo pipefail
start=$SECONDS
PY=${PYTHON:-python3}
OUTDIR=${OUT:-/tmp/corelib-gpu-check}
SITE=/tmp/corelib-site
mkdir -p "$OUTDIR" "$SITE"
export PYTHONUNBUFFERED=1 PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -c "import pydantic" 2>/dev/null; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl || exit 3
  else
    echo "pydantic is missing and .whl/ holds no wheels: run plugins/cuda/gpu_wheels.sh where PyPI is reachable" >&2
    exit 3
  fi
fi
"$PY" -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE" . ./plugins/cuda \
  >"$OUTDIR/install.log" 2>&1 || { cat "$OUTDIR/install.log"; exit 3; }

"$PY" - <<'PY' | tee "$OUTDIR/env.txt"
import torch, corelib
from corelib_cuda.probe import probe
from corelib_cuda.bitmask import bitmask_path
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPU {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
print("cuda backend:", probe())
try:
    import triton
    triton_version = triton.__version__
except Exception as exc:
    triton_version = f"unavailable ({type(exc).__name__})"
print(f"triton {triton_version}; bitmask path: {bitmask_path(torch.device('cuda'))}")
PY

# The conformance classes that run on CPU tensors are CI's; here they would only cost time.
timeout 270 "$PY" -m pytest -q -rs -p no:cacheprovider --import-mode=importlib plugins/cuda/tests \
  -k "not TestTorchPathOnCpu and not TestGraphRunnerOnCpu and not TestConformanceOnTheFlashInferPath" \
  2>&1 | tee "$OUTDIR/tests.log"
tests_rc=${PIPESTATUS[0]}
timeout 170 "$PY" benchmarks/cuda_sampling.py --json "$OUTDIR/bench.json" 2>&1 | tee "$OUTDIR/bench.log"
bench_rc=${PIPESTATUS[0]}

echo
echo "== corelib-cuda GPU check ($((SECONDS - start)) s) =="
head -3 "$OUTDIR/env.txt"
echo "tests (rc $tests_rc): $(grep -E '(passed|failed|error)' "$OUTDIR/tests.log" | tail -1)"
grep -E '^(FAILED|ERROR)' "$OUTDIR/tests.log" | head -20
echo "benchmark (rc $bench_rc), ms per call, V=128256; engine features (K=4):"
sed -n '/^| B | K |/,/^$/p' "$OUTDIR/bench.log" | grep '^|' || echo "(no engine table)"
echo "sampling:"
sed -n '/^| B | sort |/,$p' "$OUTDIR/bench.log" | grep '^|' || echo "(no sampling table)"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
