#!/usr/bin/env bash
# What a GPU machine checks, in one go (see docs/cuda.md, "CUDA kernels"): build with the CUDA kernels,
# run the CUDA tests and the kernel unit tests, compute-sanitizer memcheck and racecheck, and
# (with --bench) the kernel benchmark. Logs go to ${OUT:-build/gpu-check}. Uses the python3
# that holds a CUDA torch; Horovod is not needed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build/gpu-check}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
status=0
step() { echo "== $1 ($(date +%T))"; }

# Compile with the system g++, for the C++ and the CUDA host code alike. The lent GPU image
# sets CXX and CUDAHOSTCXX to a wrapper, /opt/gcc/bin/g++; an extension built by it crashes
# (SIGSEGV) at the first error it raises (accordion_hvd/_build_check.py, which setup.py runs
# after every build, refuses such a build). ACCORDION_KEEP_CXX=1 keeps the environment's.
if [ -z "${ACCORDION_KEEP_CXX:-}" ] && [ -x /usr/bin/g++ ]; then
  export CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
fi

step "build"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
ACCORDION_CUDA=ON ACCORDION_CUDA_ARCHITECTURES=90 $py setup.py -q build_ext --inplace >"$out/build.log" 2>&1 \
    || { tail -40 "$out/build.log"; exit 1; }
$py -c "import accordion_hvd as a; print('with_cuda', a.with_cuda)"

step "tests"
PYTHONUNBUFFERED=1 timeout 300 $py -m pytest -q -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} tests/test_cuda_kernels.py \
    tests/test_ef_add.py tests/test_topk_ef.py tests/test_topk_ef_many.py tests/test_powersgd_ops.py \
    tests/test_powersgd_many.py tests/test_no_host_sync.py 2>&1 | tee "$out/tests.log" | tail -25
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

if [ "${1:-}" = "--bench" ]; then
  step "benchmark"
  PYTHONUNBUFFERED=1 timeout "${BENCH_TIMEOUT:-420}" $py benchmarks/kernels.py --device cuda \
      --dtypes "${BENCH_DTYPES:-float32,float16}" --reps "${BENCH_REPS:-30}" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.log"
  cp benchmarks/results/kernels-cuda-*.md "$out/" 2>/dev/null
fi
if [ -n "${PROFILE:-}" ]; then  # e.g. PROFILE="--ratio 0.1": Nsight Compute's per-kernel times
  step "ncu"
  timeout 180 ncu --print-summary per-kernel --metrics gpu__time_duration.sum $py benchmarks/profile_topk.py \
      $PROFILE >"$out/ncu.log" 2>&1
  grep -E "^  [a-zA-Z_].*\(|gpu__time_duration" "$out/ncu.log" | paste - - | awk '{$1=$1};1' | cut -c1-160
fi
if [ "${SANITIZE:-1}" = 1 ]; then
  for tool in memcheck racecheck; do
    step "compute-sanitizer $tool"
    timeout "${SAN_TIMEOUT:-240}" compute-sanitizer --tool "$tool" --error-exitcode 3 $py scripts/cuda_sanitize.py \
        >"$out/sanitize-$tool.log" 2>&1
    rc=$?; tail -4 "$out/sanitize-$tool.log"; echo "$tool exit $rc"; [ $rc -eq 0 ] || status=1
  done
fi

step "done, status $status"
exit $status
