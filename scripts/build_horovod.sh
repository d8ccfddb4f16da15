#!/usr/bin/env bash
# Build Horovod 0.28.1 from its PyPI sdist against the venv's torch, cache the wheel, install it.
#
# Why we build it ourselves: 0.28.1 (2023) is Horovod's last release, and its sdist compiles
# the torch bindings with C++14, which torch 2.x headers reject. Upstream fixed this on
# master (PR #3998) but never released it. The fix is two lines: C++14 -> C++17 in the
# top-level CMakeLists.txt and in horovod/torch/CMakeLists.txt. With gcc 13 (Ubuntu 24.04,
# the usual GPU box) two of its headers also fail, because they use std::string and
# std::logic_error without including <string> and <stdexcept> (older libstdc++ headers pulled
# them in on the way): the script adds those two includes to both. Nothing else is patched.
#
# The wheel is cached under $ACCORDION_CACHE (default ~/.cache/accordion-hvd), keyed by the
# Horovod version, Python, torch version and GPU flavour, so a second set-up (or a new venv
# with the same torch) installs it in seconds instead of rebuilding for ~4 minutes.
#
# With a CUDA build of torch and NCCL available (the nvidia-nccl pip package that CUDA torch
# depends on, or HOROVOD_NCCL_HOME), Horovod is built with NCCL GPU operations, and the
# acceptance check then requires NCCL too. ACCORDION_HOROVOD_NCCL=off builds without.
# ACCORDION_HOROVOD_PLAN_ONLY=1 prints what would be built (flavour, GPU operations, NCCL
# paths) and stops: tests/test_setup_failures.py checks the decision with a stand-in Python.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

PY=${PY:-.venv/bin/python}
VERSION=0.28.1
CACHE=${ACCORDION_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/accordion-hvd}

read -r TORCH_VER TORCH_CUDA PYTAG <<<"$("$PY" -c 'import sys, torch; print(torch.__version__, torch.version.cuda or "cpu", "cp%d%d" % sys.version_info[:2])')"

export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
export HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1
export MAKEFLAGS=${MAKEFLAGS:--j$(nproc)}   # Horovod defaults to -j8, too many on 2 cores
# CMake 4 (pip's cmake, or the GPU image's) refuses the cmake_minimum_required(VERSION 2.8)
# of the Gloo copy inside the sdist ("Compatibility with CMake < 3.5 has been removed");
# this lets it configure. CMake 3 ignores the variable.
export CMAKE_POLICY_VERSION_MINIMUM=${CMAKE_POLICY_VERSION_MINIMUM:-3.5}

FLAVOUR=cpu
if [ "$TORCH_CUDA" != cpu ] && [ "${ACCORDION_HOROVOD_NCCL:-auto}" != off ]; then
    # NCCL from HOROVOD_NCCL_HOME, else from the nvidia-nccl wheel that CUDA torch installs.
    # That wheel ships only libnccl.so.2; Horovod's FindNCCL looks for libnccl.so, so we give
    # it a private directory holding that one symlink.
    if [ -z "${HOROVOD_NCCL_HOME:-}" ]; then
        NCCL_DIR=$("$PY" -c 'import os, nvidia.nccl as n; print(os.path.dirname(n.__file__) if n.__file__ else list(n.__path__)[0])' 2>/dev/null || true)
        if [ -n "$NCCL_DIR" ] && [ -f "$NCCL_DIR/include/nccl.h" ] && [ -f "$NCCL_DIR/lib/libnccl.so.2" ]; then
            link=${ACCORDION_NCCL_LINK_DIR:-$PWD/build/nccl-link}
            mkdir -p "$link"
            ln -sf "$NCCL_DIR"/lib/libnccl.so.2 "$link/libnccl.so"
            export HOROVOD_NCCL_INCLUDE="$NCCL_DIR/include" HOROVOD_NCCL_LIB="$link"
        fi
    fi
    if [ -n "${HOROVOD_NCCL_HOME:-}${HOROVOD_NCCL_INCLUDE:-}" ]; then
        export HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_LINK=SHARED
        FLAVOUR="cu${TORCH_CUDA}-nccl"
        say "CUDA torch and NCCL found: building Horovod with NCCL GPU operations"
    else
        say "CUDA torch but no NCCL found: building Horovod without GPU operations"
    fi
fi

if [ "${ACCORDION_HOROVOD_PLAN_ONLY:-0}" = 1 ]; then
    echo "plan: flavour=$FLAVOUR gpu_operations=${HOROVOD_GPU_OPERATIONS:-none}" \
         "nccl_include=${HOROVOD_NCCL_INCLUDE:-${HOROVOD_NCCL_HOME:-none}} nccl_lib=${HOROVOD_NCCL_LIB:-none}"
    exit 0
fi

WHEEL_DIR="$CACHE/horovod-$VERSION-$PYTAG-torch$TORCH_VER-$FLAVOUR"
wheel=$(ls "$WHEEL_DIR"/horovod-*.whl 2>/dev/null | head -n1 || true)

if [ -z "$wheel" ]; then
    say "building Horovod $VERSION from its sdist for torch $TORCH_VER ($FLAVOUR); about 4 minutes on 2 cores"
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    run_logged horovod-download "downloading the Horovod $VERSION sdist" \
        "$PY" -m pip download --no-deps --no-binary :all: "horovod==$VERSION" -d "$work"
    tar -xzf "$work/horovod-$VERSION.tar.gz" -C "$work"
    src="$work/horovod-$VERSION"
    # The patch (see the header of this file), 1: compile with C++17.
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
        "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
    grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt" \
        || die "the Horovod $VERSION sdist no longer has the line this script patches"
    # 2: the includes gcc 13 needs; harmless for older compilers.
    sed -i '0,/^#include/s//#include <stdexcept>\n#include <string>\n#include/' \
        "$src/horovod/common/group_table.h" "$src/horovod/common/common.h"
    run_logged horovod-build "building Horovod $VERSION" \
        "$PY" -m pip wheel --no-build-isolation --no-deps -w "$work/dist" "$src"
    mkdir -p "$WHEEL_DIR"
    cp "$work"/dist/horovod-*.whl "$WHEEL_DIR/"
    wheel=$(ls "$WHEEL_DIR"/horovod-*.whl | head -n1)
else
    say "using the cached Horovod wheel $wheel"
fi

run_logged horovod-install "installing Horovod" "$PY" -m pip install --force-reinstall --no-deps "$wheel"
# Its pure-Python dependencies (cloudpickle, psutil, pyyaml, packaging) come from requirements.txt.

# The acceptance check: horovodrun must see PyTorch, MPI and Gloo.
bin=$(dirname "$PY")
check=$("$bin/horovodrun" --check-build 2>&1) || die "horovodrun --check-build failed: $check"
required=(PyTorch MPI Gloo)
[ "${HOROVOD_GPU_OPERATIONS:-}" = NCCL ] && required+=(NCCL)
for fw in "${required[@]}"; do
    grep -qE "\[X\] $fw" <<<"$check" || die "Horovod was built without $fw (horovodrun --check-build)"
done
say "Horovod $VERSION ready: ${required[*]} built in"
