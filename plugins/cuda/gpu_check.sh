#!/usr/bin/env bash
# The cuda backend's GPU check: setup, the GPU tests, the benchmark, then a short table (last).
#   bash plugins/cuda/gpu_check.sh            # from the repo root, on a machine with an NVIDIA GPU
# Downloads nothing. It uses the python3 there (PYTHON=... to choose another); when pydantic is
# missing it installs pydantic and its dependencies from the wheels carried in .whl/ (made by
# plugins/cuda/gpu_wheels.sh; --no-index --find-links, so pip resolves them there), and it
# installs this tree's corelib and corelib-cuda (no deps: torch stays the machine's; no build
# isolation) into a scratch folder so the plugin's entry point exists.
#
# Budget: a GPU session has about 15 minutes of device time in all, machine start included, so
# this check stops well under 10: BUDGET (default 480 s) is split into sections, each cut off
# by `timeout` at what is left of its share, and the seconds each took are printed:
#   setup 60 s | start-up 150 s (FlashInfer's self-test: a FlashInfer without precompiled
#   kernels JIT-compiles them here, timed) | tests 200 s | benchmark what is left (<= 140 s)
# The tests cover the engine features and issue 16's checks: no host sync in verify / append /
# bitmask steps and membership changes (torch.cuda.set_sync_debug_mode("error") plus the
# pageable-copy detector), graph capture of sample and verify steps into one shared pool (its
# memory in the stats), FlashInfer's draws and chain verification against the torch path, an
# overflowing row flagged on both paths, strided draft probabilities, the Triton bitmask kernel
# (and its start-up launch) on CUDA tensors, and, with two or more GPUs, a sampler on cuda:1
# while cuda:0 is current (skipped otherwise; the summary says which).
set -uo pipefail
start=$SECONDS
BUDGET=${BUDGET:-480}
PY=${PYTHON:-python3}
OUTDIR=${OUT:-/tmp/corelib-gpu-check}
SITE=/tmp/corelib-site
mkdir -p "$OUTDIR" "$SITE"
export PYTHONUNBUFFERED=1 PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
: >"$OUTDIR/sections.txt"

# section NAME SHARE: seconds this section may take (its share, at most what the budget has left)
left() { echo $((BUDGET - (SECONDS - start))); }
limit() { local share=$1 rest; rest=$(left); [ "$rest" -lt "$share" ] && share=$rest; [ "$share" -lt 1 ] && share=1; echo "$share"; }
done_section() { echo "$1: $(($SECONDS - $2)) s (limit $3 s; $(left) s of $BUDGET left)" | tee -a "$OUTDIR/sections.txt"; }

# -- setup
t=$SECONDS; lim=$(limit 60)
if ! "$PY" -c "import pydantic" 2>/dev/null; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    timeout "$lim" "$PY" -m pip install -q --no-index --find-links .whl --no-compile --target "$SITE" \
      pydantic >"$OUTDIR/install.log" 2>&1 || { cat "$OUTDIR/install.log"; exit 3; }
  else
    echo "pydantic is missing and .whl/ holds no wheels: run plugins/cuda/gpu_wheels.sh where PyPI is reachable" >&2
    exit 3
  fi
fi
timeout "$lim" "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE" . ./plugins/cuda \
  >>"$OUTDIR/install.log" 2>&1 || { cat "$OUTDIR/install.log"; exit 3; }
"$PY" -c "import pydantic, typing_extensions, corelib, corelib_cuda" || { echo "the install left an import broken" >&2; exit 3; }
done_section setup "$t" "$lim"

# -- start-up: versions, the probe, the bitmask launch, FlashInfer's self-test (timed)
t=$SECONDS; lim=$(limit 150)
timeout "$lim" "$PY" - <<'PY' 2>&1 | tee "$OUTDIR/env.txt"
import time, torch, corelib
from corelib_cuda import CudaSampler
from corelib_cuda.probe import probe, import_flashinfer
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPUs {torch.cuda.device_count()} x "
      f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
try:
    import triton
    triton_version = triton.__version__
except Exception as exc:
    triton_version = f"unavailable ({type(exc).__name__})"
version, error = import_flashinfer()
cache = "-"
if error is None:
    from flashinfer.jit.env import has_flashinfer_jit_cache
    cache = "yes" if has_flashinfer_jit_cache() else "no (kernels JIT-compile on first use)"
print(f"triton {triton_version}; flashinfer {version or error}; precompiled flashinfer kernels: {cache}")
t0 = time.perf_counter()
print("cuda backend:", probe().reason)
print(f"probe (bitmask launch included): {time.perf_counter() - t0:.1f} s")
for attempt in ("first", "second"):
    t0 = time.perf_counter()
    sampler = CudaSampler("cuda")
    setup = ", ".join(f"{k} {v:.1f} s" for k, v in sampler.flashinfer_setup_s.items()) or "-"
    print(f"{attempt} CudaSampler: {time.perf_counter() - t0:.1f} s (FlashInfer self-test: {setup}); "
          f"path {sampler.path}; bitmask {sampler.bitmask_path}")
PY
startup_rc=${PIPESTATUS[0]}
done_section start-up "$t" "$lim"

# -- tests (the conformance classes that run on CPU tensors are CI's; here they only cost time)
t=$SECONDS; lim=$(limit 200)
timeout "$lim" "$PY" -m pytest -q -rs -s -p no:cacheprovider --import-mode=importlib plugins/cuda/tests \
  -k "not TestTorchPathOnCpu and not TestGraphRunnerOnCpu and not TestConformanceOnTheFlashInferPath" \
  2>&1 | tee "$OUTDIR/tests.log"
tests_rc=${PIPESTATUS[0]}
done_section tests "$t" "$lim"

# -- benchmark: the engine table first, so a cut-off run still measures it
t=$SECONDS; lim=$(limit 140)
timeout "$lim" "$PY" benchmarks/cuda_sampling.py --json "$OUTDIR/bench.json" 2>&1 | tee "$OUTDIR/bench.log"
bench_rc=${PIPESTATUS[0]}
done_section benchmark "$t" "$lim"

echo
echo "== corelib-cuda GPU check ($((SECONDS - start)) s of $BUDGET) =="
cat "$OUTDIR/env.txt" | head -8
cat "$OUTDIR/sections.txt"
echo "tests (rc $tests_rc): $(grep -E '(passed|failed|error)' "$OUTDIR/tests.log" | tail -1)"
grep -E '^(FAILED|ERROR)' "$OUTDIR/tests.log" | head -20
grep -E '^graph stats:' "$OUTDIR/tests.log" | head -2
if grep -q "needs two GPUs" "$OUTDIR/tests.log"; then
  echo "multi-device (sampler on cuda:1): skipped, fewer than two GPUs"
else
  echo "multi-device (sampler on cuda:1): ran with the tests above"
fi
echo "benchmark (rc $bench_rc), ms per call, V=128256; engine features (K=4):"
sed -n '/^| B | K |/,/^$/p' "$OUTDIR/bench.log" | grep '^|' || echo "(no engine table)"
echo "sampling:"
sed -n '/^| B | sort |/,$p' "$OUTDIR/bench.log" | grep '^|' || echo "(no sampling table)"
[ "$startup_rc" -eq 0 ] && [ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
