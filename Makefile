# The project's commands. `make test` and `make demo` set everything up first (idempotent;
# seconds when already done). See README.md.
VENV   ?= .venv
PY     := $(VENV)/bin/python
NP     ?= 2

.PHONY: setup build test test-fast demo cuda-check clean help

help:
	@echo "make setup       install Open MPI, .venv (torch, Horovod 0.28.1 with MPI+Gloo) and build accordion_hvd"
	@echo "make test        set up, then run the whole test suite (incl. horovodrun with Gloo and MPI)"
	@echo "make demo        set up, then train $(NP) ranks with Accordion under horovodrun on digits (runs/demo: CSV, TensorBoard, PNGs)"
	@echo "make build       rebuild the C++/CUDA extension (incremental)"
	@echo "make cuda-check  compile every CUDA kernel for sm_80 and sm_90 (skips without nvcc)"

setup:
	@scripts/setup.sh

build: setup
	@$(PY) setup.py -q build_ext --inplace

test: setup
	$(PY) -m pytest -ra tests

# Unit tests only, no horovodrun.
test-fast: setup
	$(PY) -m pytest -ra -m "not horovod and not torchrun" tests

demo: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/horovodrun -np $(NP) -H localhost:$(NP) --gloo \
	    $(PY) -m accordion_hvd.train --codec powersgd --rank 1 --critical-rank 4 --epochs 15 \
	    --lr-milestones 10 --logdir runs/demo

cuda-check:
	@scripts/cuda_check.sh

clean:
	rm -rf build accordion_hvd/_C*.so
