#!/usr/bin/env bash
# `make cuda-check`: compile every CUDA kernel under csrc/ for Ampere (sm_80) and Hopper
# (sm_90), object files only, wherever nvcc exists, GPU or not.
#
# Kernel .cu files may use only the CUDA runtime and CUB: torch's CPU wheels ship ATen but
# their c10/cuda headers do not compile, so a .cu that included torch would only build on
# GPU machines and CI could not check it. This script enforces that rule too. (The torch
# glue, csrc/cuda/*_glue.cpp, is compiled by the real build when torch has CUDA.)
set -euo pipefail
cd "$(dirname "$0")/.."

NVCC=${NVCC:-$(command -v nvcc || true)}
[ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc
if [ -z "$NVCC" ]; then
    echo "cuda-check: SKIPPED: nvcc not found (set NVCC or put the CUDA toolkit on PATH)"
    exit 0
fi

mapfile -t sources < <(find csrc -name '*.cu' | sort)
bad=$(grep -lE '#include[[:space:]]*[<"](torch/|ATen/|c10/)' "${sources[@]}" || true)
if [ -n "$bad" ]; then
    echo "cuda-check: FAILED: these kernel files include torch headers (move that code to a *_glue.cpp):"
    echo "$bad"
    exit 1
fi

out=build/cuda-check
mkdir -p "$out"
archs=(-gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90)
echo "cuda-check: $("$NVCC" --version | tail -n1 | sed 's/^Build //'), ${#sources[@]} file(s), sm_80 + sm_90"
failed=0
for src in "${sources[@]}"; do
    obj="$out/$(basename "${src%.cu}").o"
    start=$SECONDS
    if "$NVCC" -std=c++17 -O3 -Icsrc "${archs[@]}" -Xcompiler -fPIC -c "$src" -o "$obj" 2>"$obj.log"; then
        echo "  ok      $src ($((SECONDS - start)) s)"
    else
        echo "  FAILED  $src:"; sed 's/^/    /' "$obj.log" | head -n 30
        failed=1
    fi
done
[ "$failed" -eq 0 ] && echo "cuda-check: all kernels compile for sm_80 and sm_90" || { echo "cuda-check: FAILED"; exit 1; }
