#!/usr/bin/env bash
# What a GPU machine checks, in two phases that each fit a 7-minute call (docs/cuda.md):
#
#   scripts/gpu_check.sh --phase 1   build for sm_90, every CUDA test (single and bucket ops,
#                                    no host sync, the NumPy reference through the DDP hook on
#                                    CUDA tensors), compute-sanitizer memcheck on the bucket ops and
#                                    the kernels added since the first GPU run (whole, sparse chunks)
#   scripts/gpu_check.sh --phase 2   the kernel bars (benchmarks/kernels.py) and a GPU training
#                                    step, our DDP hook against DDP's (benchmarks/gpu_step.py: ResNet-50
#                                    and GPT-2 small, one GPU over NCCL, then 2 processes over Gloo);
#                                    builds first if phase 1's build is not there (phase 1 leaves
#                                    the built extension in $OUT: copy it to accordion_hvd/ and
#                                    carry it, and phase 2 skips the build)
#   scripts/gpu_check.sh --phase N --dry-run
#                                    on any machine: each step's command and time limit, and what
#                                    its CPU side costs here (start-up, imports, test collection),
#                                    so that the budget is known before a GPU is at hand
#
# Everything a phase writes goes under ${OUT:-build/gpu-check} (the device tool's $OUT comes
# back): phaseN.log (every step, timed), gpu.txt, build.log, the test and benchmark logs and
# tables. Every step has its own timeout; their sum stays under 400 s, so a phase ends inside
# its call even when a step hangs. Uses the python3 that holds a CUDA torch (or $PYTHON).
set -uo pipefail
cd "$(dirname "$0")/.."
phase="" dry=0
while [ $# -gt 0 ]; do
  case "$1" in
    --phase) phase="${2:-}"; shift 2 ;;
    --dry-run) dry=1; shift ;;
    *) echo "usage: $0 --phase 1|2 [--dry-run]" >&2; exit 2 ;;
  esac
done
[ "$phase" = 1 ] || [ "$phase" = 2 ] || { echo "usage: $0 --phase 1|2 [--dry-run] (got phase '$phase')" >&2; exit 2; }
out=${OUT:-build/gpu-check}
mkdir -p "$out"
export py=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
log="$out/phase$phase.log"
: >"$log"
status=0

# Compile with the system g++, for the C++ and the CUDA host code alike. The lent GPU image
# sets CXX and CUDAHOSTCXX to a wrapper, /opt/gcc/bin/g++; an extension built by it crashes
# (SIGSEGV) at the first error it raises (accordion_hvd/_build_check.py, which setup.py runs
# after every build, refuses such a build). ACCORDION_KEEP_CXX=1 keeps the environment's.
if [ -z "${ACCORDION_KEEP_CXX:-}" ] && [ -x /usr/bin/g++ ]; then
  export CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
fi

# step NAME LIMIT_S DRY_COMMAND -- COMMAND...: run COMMAND under LIMIT_S (or, dry, only the
# CPU-side DRY_COMMAND, "-" for none), timed, its output into $out/NAME.log, a line in the log.
step() {
  local name=$1 limit=$2 dry_cmd=$3; shift 4
  local started=$SECONDS rc
  if [ $dry = 1 ]; then
    if [ "$dry_cmd" != "-" ]; then timeout "$limit" bash -c "$dry_cmd" >"$out/$name.dry.log" 2>&1; rc=$?; else rc=0; fi
    printf '%-12s limit %4d s   CPU side here %4d s (exit %d)   %s\n' "$name" "$limit" $((SECONDS - started)) $rc "$*" | tee -a "$log"
    return 0
  fi
  echo "== $name (limit $limit s, $(date +%T))" | tee -a "$log"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  tail -n 6 "$out/$name.log"
  printf '%-12s %4d s, exit %d\n' "$name" $((SECONDS - started)) $rc | tee -a "$log"
  [ $rc -eq 0 ] || status=1
}

built() { $py -c "import accordion_hvd as a, sys; sys.exit(0 if a.with_cuda else 1)" 2>/dev/null; }
BUILD="env ACCORDION_CUDA=ON ACCORDION_CUDA_ARCHITECTURES=90 $py setup.py -q build_ext --inplace"
WITH_CUDA="import accordion_hvd as a; print('with_cuda', a.with_cuda); assert a.with_cuda"

if [ $dry = 0 ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
fi
IMPORT="$py -c 'import torch, accordion_hvd'"
CUDA_TESTS="tests/test_cuda_kernels.py tests/test_ef_add.py tests/test_topk_ef.py tests/test_topk_ef_many.py \
tests/test_powersgd_ops.py tests/test_powersgd_many.py tests/test_no_host_sync.py tests/test_quantize_ops.py \
tests/test_flag_ops.py tests/test_whole_ops.py tests/test_quantize_chunks_ops.py"

if [ "$phase" = 1 ]; then
  # ccache, where the image has one, makes a rebuild on a warm machine take seconds
  command -v ccache >/dev/null && export CC="ccache ${CC:-gcc}" CXX="ccache $CXX"
  step build 120 "$IMPORT" -- $BUILD
  step with-cuda 10 - -- $py -c "$WITH_CUDA"
  step tests 90 "$py -m pytest -q --collect-only -p no:cacheprovider $CUDA_TESTS" -- \
    $py -m pytest -q -p no:cacheprovider $CUDA_TESTS
  # six torchrun launches of about 16 s each on an H200 (2026-11-27: 60 s cut it short)
  step reference 120 "$py -m pytest -q --collect-only -p no:cacheprovider tests/test_ddp_hook.py -k numpy" -- \
    env ACCORDION_TEST_DEVICE=cuda $py -m pytest -q -p no:cacheprovider tests/test_ddp_hook.py -k numpy_reference
  step memcheck 45 "$IMPORT" -- \
    compute-sanitizer --tool memcheck --error-exitcode 3 $py scripts/cuda_sanitize.py --only buckets,whole,chunks
  # the build, for phase 2's call to carry if the machine went back in between (16 MiB come back)
  for so in accordion_hvd/_C*.so; do [ -f "$so" ] && [ "$(stat -c %s "$so")" -lt 16000000 ] && cp "$so" "$out/"; done
else
  kernels_s=90 nccl_s=190 gloo_s=90 rounds=3
  if [ $dry = 1 ] || ! built; then  # a fresh machine: build first, and the rest gets less time
    step build 120 "$IMPORT" -- $BUILD
    step with-cuda 10 - -- $py -c "$WITH_CUDA"
    kernels_s=60 nccl_s=150 gloo_s=50 rounds=2
  fi
  step kernels $kernels_s "$py benchmarks/kernels.py --help" -- \
    $py benchmarks/kernels.py --device cuda --dtypes float32 --reps "${BENCH_REPS:-15}" \
      --out "$out/kernels-cuda.md"
  # A training step, our DDP hook against DDP's own (benchmarks/gpu_step.py: every method in one
  # launch; the image has no Horovod): ResNet-50 and a GPT-2-small-sized transformer on one GPU
  # over NCCL (world 1: every hook still does its math), then 2 processes sharing the GPU over
  # Gloo (PyTorch's PowerSGD hook aborts there on CUDA tensors, 2026-11-27: left out)
  step step-nccl $nccl_s "$py benchmarks/gpu_step.py --help" -- \
    torchrun --standalone --nproc_per_node 1 benchmarks/gpu_step.py --rounds $rounds --out "$out/step-nccl"
  step step-gloo $gloo_s "$py benchmarks/gpu_step.py --help" -- \
    torchrun --standalone --nproc_per_node 2 benchmarks/gpu_step.py --backend gloo --models resnet50 --rounds 2 \
      --methods fp16,ours-default,ours-quantize8s,ours-r4 --out "$out/step-gloo"
fi
echo "== phase $phase done, status $status" | tee -a "$log"
exit $status
