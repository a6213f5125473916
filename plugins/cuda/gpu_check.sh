#!/usr/bin/env bash
# The cuda backend's GPU check: setup, start-up (FlashInfer's first compile timed), the sync /
# graph / bitmask tests, the FlashInfer and torch-path tests, the benchmark, the conformance
# suite on the GPU, then a summary built from what each section left under $OUT.
#   bash plugins/cuda/gpu_check.sh                          # repo root, a machine with an NVIDIA GPU
#   CORELIB_GPU_CHECK_DRY=1 PYTHON=.venv/bin/python bash plugins/cuda/gpu_check.sh   # no GPU: dry run
#
# Downloads nothing. It uses the python3 there (PYTHON=... to choose another). What it installs
# goes into a new folder each run (`pip install --target` into a folder that exists skips the
# copy, so a rerun would import the first run's code): pydantic and its dependencies from the
# wheels in .whl/ when pydantic is missing, the trimmed FlashInfer bundle in .whl/flashinfer/
# when FlashInfer is missing (both made by plugins/cuda/gpu_wheels.sh), then this tree's corelib
# and corelib-cuda (no deps: torch stays the machine's; no build isolation).
#
# Budget: it must fit a GPU machine held for about 15 minutes in all, machine start included, so
# the check stops within BUDGET (default 480 s). Each section is cut at its share (at most what
# is left) by SIGINT, so pytest still writes its report and JUnit XML; every section writes its
# own files under $OUT as it goes, so a cut section loses only itself:
#   setup 60 s | start-up 150 s (FlashInfer's self-test: a FlashInfer without precompiled kernels
#   compiles its sampling module with nvcc here, timed) | gpu tests 90 s (host syncs, graphs,
#   the bitmask and seeded-race Triton kernels) | flashinfer + torch-path tests 60 s |
#   benchmark 130 s (each batch size printed and written to bench.json as it finishes; the
#   fourth release's "fourth" and "mirostat" configurations are timed on the default sampler
#   and its graph runner only, to stay within the share) |
#   conformance on the GPU 75 s | the top-k-first fast path's tests, what is left.
# FlashInfer's top-k module (the `top_k_first=True` fast path: CUB top-k templates) compiles for
# minutes on first use: over 200 s on an H100 machine, more than any section's share. It is built
# in the background from the end of setup on (FlashInfer's file lock makes a later user wait
# for that build rather than start a second one); the tests that construct
# `CudaSampler(top_k_first=True)` run last, once it is built, and the benchmark times
# `cuda-fast` only when the build has finished by then.
#
# What the sections write goes into a work folder; after each section it is archived into
# $OUT/gpu-check.tgz (a device machine hands back only a few files), and the summary is copied
# to $OUT/summary.txt at the end.
# TestConformanceOnCuda is left out when the sampler runs its torch path: it would repeat
# TestTorchPathOnCuda test for test. The CPU-tensor conformance classes are CI's.
#
# Dry run (CORELIB_GPU_CHECK_DRY=1): the same sections in the same order on a machine without a
# GPU (the GPU tests skip, the benchmark runs on CPU tensors at a small vocabulary, FlashInfer's
# sampling module is planned, not compiled), to check the script itself.
set -uo pipefail
start=$SECONDS
BUDGET=${BUDGET:-480}
DRY=${CORELIB_GPU_CHECK_DRY:-0}
PY=${PYTHON:-python3}
WHEELS=${CORELIB_WHEELS:-.whl}
RESULTS=${OUT:-/tmp/corelib-gpu-check}
SITE=$(mktemp -d "${TMPDIR:-/tmp}/corelib-site.XXXXXX")
OUTDIR=$(mktemp -d "${TMPDIR:-/tmp}/corelib-gpu-check.XXXXXX")
mkdir -p "$RESULTS"
# $SITE/bin: the ninja that FlashInfer's JIT build runs comes with the bundle's ninja wheel.
export PYTHONUNBUFFERED=1 PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
: >"$OUTDIR/sections.txt"
if [ "$DRY" = 1 ]; then
  DEVICE=cpu; BENCH_ARGS=(--device cpu --vocab 4096 --batch-sizes 1,4 --engine-batch-sizes 1,4 --iters 2 --repeats 1)
  # No GPU to report an architecture: FlashInfer plans its modules for an H100's.
  export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0}
else
  DEVICE=cuda; BENCH_ARGS=(--batch-sizes 1,32,128 --engine-batch-sizes 1,128 --iters 10 --repeats 3)
fi
# FlashInfer's JIT cache in $OUT's sibling, not the home folder: a rerun on a warm machine
# reuses it, a fresh machine starts cold either way.
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/corelib-flashinfer}

left() { echo $((BUDGET - (SECONDS - start))); }
limit() { local share=$1 rest; rest=$(left); [ "$rest" -lt "$share" ] && share=$rest; [ "$share" -lt 1 ] && share=1; echo "$share"; }
archive() { tar czf "$RESULTS/gpu-check.tgz.part" -C "$OUTDIR" . && mv "$RESULTS/gpu-check.tgz.part" "$RESULTS/gpu-check.tgz"; }
done_section() {  # name, start, limit, rc
  echo "$1: $((SECONDS - $2)) s (limit $3 s, rc $4$([ "$4" = 124 ] && echo ': cut at its limit'); $(left) s of $BUDGET left)" \
    | tee -a "$OUTDIR/sections.txt"
  archive
}
# SIGINT, not SIGTERM: pytest then stops, prints its summary and writes its JUnit XML. Python
# ignores SIGINT when it starts with SIGINT ignored (a background job), so the handler is
# installed explicitly; -k: killed when it has not stopped 10 s later.
cut() { local lim=$1; shift; timeout -s INT -k 10 "$lim" "$@"; }
PYTEST=(-c 'import signal, sys, pytest; signal.signal(signal.SIGINT, signal.default_int_handler); sys.exit(pytest.main(sys.argv[1:]))')
tests() {  # section name, share, pytest arguments...
  local name=$1 share=$2 t=$SECONDS lim rc; shift 2
  lim=$(limit "$share")
  cut "$lim" "$PY" "${PYTEST[@]}" -q -rs -s -p no:cacheprovider --import-mode=importlib \
    --junitxml="$OUTDIR/junit-$name.xml" "$@" 2>&1 | tee "$OUTDIR/tests-$name.log"
  rc=${PIPESTATUS[0]}
  done_section "tests-$name" "$t" "$lim" "$rc"
}

# -- setup (into a new folder: see the header)
t=$SECONDS; lim=$(limit 60); setup_rc=0
echo "installing into $SITE" | tee "$OUTDIR/install.log"
if ! "$PY" -c "import pydantic" 2>/dev/null; then
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    cut "$lim" "$PY" -m pip install -q --no-index --find-links "$WHEELS" --no-compile --target "$SITE" \
      pydantic >>"$OUTDIR/install.log" 2>&1 || setup_rc=3
  else
    echo "pydantic is missing and $WHEELS/ holds no wheels: run plugins/cuda/gpu_wheels.sh where PyPI is reachable" | tee -a "$OUTDIR/install.log" >&2
    setup_rc=3
  fi
fi
# The bundle when FlashInfer is missing, or always in a dry run (to check the bundle itself).
if compgen -G "$WHEELS/flashinfer/*.whl" >/dev/null && { [ "$DRY" = 1 ] || ! "$PY" -c "import flashinfer" 2>/dev/null; }; then
  echo "FlashInfer bundle: $(cd "$WHEELS/flashinfer" && ls *.whl | tr '\n' ' ')" | tee -a "$OUTDIR/install.log"
  bundle=("$WHEELS"/flashinfer/*.whl)
  if [ "$DRY" = 1 ]; then
    # The bundle's compiled wheels are the GPU image's Python's: a dry run under another Python
    # installs the bundle's pure wheels and imports the same versions of the others from its
    # own environment (gpu_wheels.sh checked the bundle against those versions).
    mapfile -t bundle < <("$PY" - "${bundle[@]}" <<'PY' 2>>"$OUTDIR/install.log"
import sys
try:
    from packaging import tags, utils
except ImportError:
    from pip._vendor.packaging import tags, utils
here = set(tags.sys_tags())
for path in sys.argv[1:]:
    if here & set(utils.parse_wheel_filename(path.rsplit("/", 1)[-1])[3]):
        print(path)
    else:
        print(f"dry run: {path.rsplit('/', 1)[-1]} is another Python's; its version comes from this environment", file=sys.stderr)
PY
)
  fi
  cut "$lim" "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "${bundle[@]}" \
    >>"$OUTDIR/install.log" 2>&1 || setup_rc=3
fi
# No --upgrade: the folder is new, and --upgrade would replace the bundle's bin/ (its ninja).
cut "$lim" "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE" . ./plugins/cuda \
  >>"$OUTDIR/install.log" 2>&1 || setup_rc=3
# What is imported must be this tree's code (corelib comes from the tree itself when run from
# its root), and the plugin's entry point this run's install.
"$PY" - "$SITE" <<'PY' 2>&1 | tee -a "$OUTDIR/install.log"
import filecmp, importlib.metadata as md, pathlib, sys
import pydantic, corelib, corelib_cuda
site = pathlib.Path(sys.argv[1]).resolve()
for module, tree in ((corelib, pathlib.Path("corelib")), (corelib_cuda, pathlib.Path("plugins/cuda/corelib_cuda"))):
    where = pathlib.Path(module.__file__).resolve().parent
    files = sorted(p.relative_to(tree) for p in tree.rglob("*.py"))
    differ = [str(f) for f in files if not filecmp.cmp(tree / f, where / f, shallow=False)]
    print(f"{module.__name__}: imported from {where}; {len(files) - len(differ)} of {len(files)} files match the tree")
    if differ:
        sys.exit(f"{module.__name__} is not this tree's: {differ[:5]}")
dist = pathlib.Path(md.distribution("corelib-cuda")._path).resolve()
print(f"corelib-cuda's entry point from {dist}")
if not dist.is_relative_to(site):
    sys.exit("the plugin's entry point is not this run's install")
PY
[ "${PIPESTATUS[0]}" -ne 0 ] && setup_rc=3
[ "$setup_rc" -ne 0 ] && tail -20 "$OUTDIR/install.log"
done_section setup "$t" "$lim" "$setup_rc"
[ "$setup_rc" -ne 0 ] && { "$PY" plugins/cuda/gpu_report.py "$OUTDIR" | tee "$RESULTS/summary.txt"; exit 3; }

# -- FlashInfer's top-k module, built in the background (see the header); no build in a dry run
topk_pid=
if [ "$DRY" != 1 ] && "$PY" -c "import flashinfer" 2>/dev/null; then
  timeout -k 10 "$(left)" "$PY" - >"$OUTDIR/topk-build.txt" 2>&1 <<'PY' &
import time
t0 = time.perf_counter()
from flashinfer.topk import get_topk_module
get_topk_module()
print(f"FlashInfer's top-k module (top_k_first=True): built in {time.perf_counter() - t0:.1f} s")
PY
  topk_pid=$!
fi
topk_built() { [ -n "$topk_pid" ] && ! kill -0 "$topk_pid" 2>/dev/null && grep -q "built in" "$OUTDIR/topk-build.txt"; }

# -- start-up: versions, the probe, the bitmask launch, FlashInfer's self-test (timed)
t=$SECONDS; lim=$(limit 150)
cut "$lim" "$PY" - "$DEVICE" "$OUTDIR" <<'PY' 2>&1 | tee "$OUTDIR/env.txt"
import os, pathlib, shutil, sys, time, torch, corelib
from corelib_cuda import CudaSampler
from corelib_cuda.probe import probe, import_flashinfer
device, out = sys.argv[1], pathlib.Path(sys.argv[2])
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
    import flashinfer
    from flashinfer.jit.env import has_flashinfer_jit_cache
    cache = "yes" if has_flashinfer_jit_cache() else "no (kernels JIT-compile on first use)"
    print(f"flashinfer from {pathlib.Path(flashinfer.__file__).parent}")
print(f"triton {triton_version}; flashinfer {version or error}; precompiled flashinfer kernels: {cache}")
print(f"for FlashInfer's JIT build: ninja {shutil.which('ninja')}, nvcc {shutil.which('nvcc')}")
if error is None and device == "cpu":
    # No nvcc run without a GPU: plan the modules the backend uses and check their sources.
    from flashinfer.jit.sampling import gen_sampling_module
    from flashinfer.jit.topk import gen_topk_module
    for gen in (gen_sampling_module, gen_topk_module):
        spec = gen()
        spec.write_ninja()
        missing = [str(s) for s in spec.sources if not pathlib.Path(s).is_file()]
        print(f"flashinfer module {spec.name}: planned, {len(spec.sources)} sources "
              f"({'all present' if not missing else 'MISSING ' + ', '.join(missing)}), {spec.ninja_path}")
t0 = time.perf_counter()
print("cuda backend:", probe().reason)
print(f"probe (bitmask launch included): {time.perf_counter() - t0:.1f} s")
for attempt in ("first", "second"):
    t0 = time.perf_counter()
    sampler = CudaSampler(device)
    setup = ", ".join(f"{k} {v:.1f} s" for k, v in sampler.flashinfer_setup_s.items()) or "-"
    print(f"{attempt} CudaSampler: {time.perf_counter() - t0:.1f} s (FlashInfer self-test, the first "
          f"one compiling: {setup}); path {sampler.path} ({sampler.path_reason}); bitmask {sampler.bitmask_path}; "
          f"seeded race {sampler.race_path}")
(out / "path.txt").write_text(sampler.path + "\n")
PY
startup_rc=${PIPESTATUS[0]}
done_section start-up "$t" "$lim" "$startup_rc"

# -- tests: the sync, graph and bitmask checks first, FlashInfer's and the torch path's next
# (the top-k-first tests wait for the top-k module: they run last)
tests gpu 90 plugins/cuda/tests/test_gpu.py plugins/cuda/tests/test_graph.py plugins/cuda/tests/test_bitmask.py \
  plugins/cuda/tests/test_race.py -k "not top_k_first"
tests flashinfer 60 plugins/cuda/tests/test_flashinfer_adapter.py plugins/cuda/tests/test_discovery.py \
  plugins/cuda/tests/test_torch_path.py -k "not TestConformanceOnTheFlashInferPath"

# -- benchmark: each batch size printed and in bench.json as soon as it finishes
# (cuda-fast only when the top-k module is built: constructing it would wait for the build)
t=$SECONDS; lim=$(limit 130)
fast=(); topk_built && fast=(--top-k-first)
cut "$lim" "$PY" benchmarks/cuda_sampling.py "${BENCH_ARGS[@]}" "${fast[@]}" --json "$OUTDIR/bench.json" 2>&1 | tee "$OUTDIR/bench.log"
bench_rc=${PIPESTATUS[0]}
done_section benchmark "$t" "$lim" "$bench_rc"

# -- conformance on the GPU, last (the longest section; a cut one still reports what ran)
skip="not TestTorchPathOnCpu and not TestGraphRunnerOnCpu"
[ "$(cat "$OUTDIR/path.txt" 2>/dev/null)" = flashinfer ] || skip="$skip and not TestConformanceOnCuda"
tests conformance 75 plugins/cuda/tests/test_conformance.py -k "$skip"

# -- the top-k-first fast path, once its module is built (waiting at most what is left)
if [ -n "$topk_pid" ]; then
  t=$SECONDS; lim=$(limit "$(left)")
  while kill -0 "$topk_pid" 2>/dev/null && [ $((SECONDS - t)) -lt "$lim" ]; do sleep 2; done
  if topk_built; then
    tests top-k-first "$(left)" plugins/cuda/tests/test_gpu.py -k "top_k_first"
  else
    echo "FlashInfer's top-k module: not built within the budget ($((SECONDS - start)) s after the start)" \
      | tee -a "$OUTDIR/topk-build.txt"
    done_section top-k-first "$t" "$lim" 124
  fi
fi
kill "$topk_pid" 2>/dev/null

"$PY" plugins/cuda/gpu_report.py "$OUTDIR" | tee "$OUTDIR/summary.txt"
cp "$OUTDIR/summary.txt" "$RESULTS/summary.txt"
archive
