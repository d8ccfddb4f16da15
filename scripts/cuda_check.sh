#!/usr/bin/env bash
# `make cuda-check`: compile every CUDA kernel under csrc/ for Ampere (sm_80) and Hopper
# (sm_90), object files only, wherever nvcc exists, GPU or not.
#
# Kernel .cu files may use only the CUDA runtime and CUB: torch's CPU wheels ship ATen but
# their c10/cuda headers do not compile, so a .cu that included torch would only build on
# GPU machines and CI could not check it. This script enforces that rule too. The torch side,
# csrc/cuda/ops_cuda.cpp, is built for real only when torch has CUDA; here it is compiled (not
# linked) against torch's headers, with a stand-in for the one header that CPU wheels lack
# (c10/cuda/impl/cuda_cmake_macros.h, generated when torch is built with CUDA), and its
# functions and the kernels' are checked against the CPU build's for one defined twice.
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
    echo "cuda-check: FAILED: these kernel files include torch headers (move that code to csrc/cuda/ops_cuda.cpp):"
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

# The torch side: syntax only, with the compiler torch's extensions use.
PY=${PYTHON:-.venv/bin/python}
if torch_inc=$("$PY" -c "import torch, os; print(os.path.join(os.path.dirname(torch.__file__), 'include'))" 2>/dev/null); then
    stub="$out/stub/c10/cuda/impl"
    mkdir -p "$stub"
    [ -f "$torch_inc/c10/cuda/impl/cuda_cmake_macros.h" ] || printf '#pragma once\n' > "$stub/cuda_cmake_macros.h"
    cuda_inc=""
    for dir in "${CUDA_HOME:-}/include" "$(dirname "$(dirname "$(readlink -f "$NVCC")")")/include" /usr/local/cuda/include; do
        [ -f "$dir/cuda_runtime.h" ] && { cuda_inc=$dir; break; }
    done
    if [ -z "$cuda_inc" ]; then
        echo "  skipped csrc/cuda/ops_cuda.cpp (cuda_runtime.h not found: set CUDA_HOME)"
    elif ${CXX:-g++} -std=c++20 -c -O0 -Wall -Wextra -Wno-unused-parameter -DACCORDION_WITH_CUDA=1 \
            -I"$out/stub" -Icsrc -I"$torch_inc" -I"$torch_inc/torch/csrc/api/include" -I"$cuda_inc" \
            csrc/cuda/ops_cuda.cpp -o "$out/ops_cuda.o" 2>"$out/ops_cuda.log"; then
        echo "  ok      csrc/cuda/ops_cuda.cpp (compiled against torch's headers; not linked: CPU torch)"
        # What only a CUDA build's link would find: a function defined (strong, global) both
        # here and in the CPU build's objects, e.g. an op's glue outside its file's anonymous
        # namespace (2026-11-27: quantize_ef_, found on the GPU machine). gcc-nm reads the
        # CPU build's LTO objects; nm the kernels'.
        cpu_objs=$(find build -path '*CMakeFiles/_C.dir/csrc/*' -name '*.cpp.o' -not -path '*/cuda/*' 2>/dev/null)
        if [ -n "$cpu_objs" ] && command -v gcc-nm >/dev/null; then
            strong() { gcc-nm -g --defined-only "$@" 2>/dev/null | awk '$2 == "T" {print $3}' | sort -u; }
            dup=$(comm -12 <(strong $cpu_objs) <( (strong "$out/ops_cuda.o"; nm -g --defined-only "$out"/*.o 2>/dev/null \
                  | awk '$2 == "T" {print $3}') | sort -u) | c++filt)
            if [ -n "$dup" ]; then
                echo "  FAILED  defined in csrc/cuda and in the CPU build too (a CUDA build will not link):"
                echo "$dup" | sed 's/^/    /'
                failed=1
            else
                echo "  ok      no function defined twice across the CPU and CUDA objects"
            fi
        else
            echo "  skipped the duplicate-definition check (no CPU build under build/: make build first)"
        fi
    else
        echo "  FAILED  csrc/cuda/ops_cuda.cpp:"; grep -v 'Wc++20-extensions\|bit-fields\|view_replay' "$out/ops_cuda.log" | head -n 30
        failed=1
    fi
else
    echo "  skipped csrc/cuda/ops_cuda.cpp (no torch in $PY)"
fi
[ "$failed" -eq 0 ] && echo "cuda-check: all kernels compile for sm_80 and sm_90" || { echo "cuda-check: FAILED"; exit 1; }
