#!/usr/bin/env bash
# A torch user's install, as the README says it (`make install-check`, run by CI): a fresh venv
# with torch only (the same torch as .venv; no Horovod), the package installed with the
# README's command, then the README's DDP hook and DiLoCo under torchrun, 2 ranks on Gloo, run
# from outside the checkout so that the installed copy is what is imported.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${INSTALL_CHECK_VENV:-$ROOT/build/install-check/venv}
start=$SECONDS
rm -rf "$VENV"
python3 -m venv "$VENV"
TORCH=$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')
"$VENV/bin/pip" install -q "torch==$TORCH" numpy
# The README's install command, as written there:
"$VENV/bin/pip" install -q setuptools wheel pybind11 cmake ninja
"$VENV/bin/pip" install -q --no-build-isolation "$ROOT"
echo "install-check: installed in $((SECONDS - start)) s"
cd "$(mktemp -d)"
OMP_NUM_THREADS=1 "$VENV/bin/torchrun" --nproc_per_node 2 --master_port 29571 "$ROOT/scripts/install_check.py"
echo "install-check: passed in $((SECONDS - start)) s"
