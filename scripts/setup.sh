#!/usr/bin/env bash
# `make setup`: take a fresh Debian machine to a working checkout, idempotently.
#
#   1. Debian packages: Open MPI runtime and headers (installed only if missing);
#   2. a virtual environment in .venv: torch (2.13.0 CPU where the interpreter has no torch;
#      an existing torch, e.g. a CUDA build, is used as it is), then requirements.txt;
#   3. Horovod 0.28.1 with PyTorch, MPI and Gloo (scripts/build_horovod.sh, wheel cached);
#   4. accordion_hvd installed editable, its extension built and not stale.
#
# Each step checks first and does nothing when already done, so a second run takes seconds.
# Each failure prints one line saying what is missing; full logs are in build/setup-logs/.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
start=$SECONDS

PYTHON=${PYTHON:-python3}
VENV=$(realpath -m "${VENV:-.venv}")
PY=$VENV/bin/python
TORCH_SPEC=${ACCORDION_TORCH_SPEC:-torch==2.13.0}

# --- 0. tools that nothing below can install for us -----------------------------------
command -v "$PYTHON" >/dev/null || die "no Python found ($PYTHON); install Python 3.9 or newer"
command -v g++ >/dev/null || command -v c++ >/dev/null \
    || die "no C++ compiler found: install g++ (apt-get install g++)"

# --- 1. Debian packages ---------------------------------------------------------------
if ! { command -v mpirun && command -v mpicxx; } >/dev/null 2>&1; then
    pkgs=(openmpi-bin libopenmpi-dev)
    command -v apt-get >/dev/null || die "Open MPI is missing and this is not a Debian/Ubuntu machine: install Open MPI (mpirun, mpicxx) yourself"
    if [ "$(id -u)" -eq 0 ]; then sudo=(); elif sudo -n true 2>/dev/null; then sudo=(sudo -n);
    else die "Open MPI is missing and installing it needs root: run 'sudo apt-get install ${pkgs[*]}'"; fi
    say "installing ${pkgs[*]}"
    run_logged apt-update "apt-get update" "${sudo[@]}" apt-get update
    run_logged apt-install "apt-get install ${pkgs[*]}" \
        env DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y --no-install-recommends "${pkgs[@]}"
fi

# --- 2. the virtual environment -------------------------------------------------------
if [ ! -x "$PY" ]; then
    if "$PYTHON" -c 'import torch' 2>/dev/null; then
        # An interpreter that already has torch (say a CUDA build on a GPU box) keeps it.
        say "creating $VENV on top of the interpreter's torch"
        run_logged venv "creating the virtual environment" "$PYTHON" -m venv --system-site-packages "$VENV"
    else
        say "creating $VENV"
        run_logged venv "creating the virtual environment (is python3-venv installed?)" "$PYTHON" -m venv "$VENV"
    fi
fi
# requirements.txt is re-installed only when it changes.
req_hash=$(sha256sum requirements.txt | cut -c1-16)
if [ "$(cat "$VENV/.requirements-installed" 2>/dev/null)" != "$req_hash" ]; then
    say "installing requirements.txt"
    run_logged pip-requirements "pip install -r requirements.txt" "$PY" -m pip install -r requirements.txt
    echo "$req_hash" >"$VENV/.requirements-installed"
fi

# Fast path: one interpreter start answers "is everything already there?" (from /, so
# the editable install itself is what is being imported).
if ready=$(cd / && "$PY" -c '
import horovod, horovod.torch as h, torch, accordion_hvd
assert horovod.__version__ == "0.28.1" and h.mpi_built() and h.gloo_built()
print("torch", torch.__version__, "| horovod", horovod.__version__)' 2>/dev/null); then
    say "ready in $((SECONDS - start)) s: $ready"
    exit 0
fi
if ! "$PY" -c 'import torch' 2>/dev/null; then
    say "installing $TORCH_SPEC (CPU build)"
    run_logged pip-torch "pip install $TORCH_SPEC" "$PY" -m pip install "$TORCH_SPEC"
fi

# --- 3. Horovod -------------------------------------------------------------------------
if ! "$PY" -c 'import horovod, horovod.torch as h; assert horovod.__version__ == "0.28.1" and h.mpi_built() and h.gloo_built()' 2>/dev/null; then
    PY="$PY" scripts/build_horovod.sh
fi

# --- 4. this package --------------------------------------------------------------------
# Importing from another directory proves the install; the import also refuses a missing
# or stale extension (accordion_hvd/_build_info.py), which we then (re)build.
if ! (cd / && "$PY" -c 'import accordion_hvd' 2>/dev/null); then
    if (cd / && "$PY" -c 'import importlib.util as u; assert u.find_spec("accordion_hvd")' 2>/dev/null); then
        say "rebuilding the accordion_hvd extension"
        run_logged build-ext "building the accordion_hvd extension" "$PY" setup.py build_ext --inplace
    else
        say "installing accordion_hvd (editable) and building its extension"
        run_logged pip-editable "building and installing accordion_hvd" \
            "$PY" -m pip install --no-build-isolation --no-deps -e .
    fi
    (cd / && "$PY" -c 'import accordion_hvd') \
        || die "accordion_hvd still does not import after building it (see build/setup-logs/)"
fi
say "ready in $((SECONDS - start)) s: $("$PY" -c 'import torch, horovod; print("torch", torch.__version__, "| horovod", horovod.__version__)')"
