# The project's commands. `make test` and `make demo` set everything up first (idempotent;
# seconds when already done). See README.md.
VENV   ?= .venv
PY     := $(VENV)/bin/python
NP     ?= 2

.PHONY: setup build test test-fast demo cuda-check peer-tests clean help

help:
	@echo "make setup       install Open MPI, .venv (torch, Horovod 0.28.1 with MPI+Gloo) and build accordion_hvd"
	@echo "make test        set up, then run the whole test suite (incl. horovodrun with Gloo and MPI)"
	@echo "make demo        set up, then train $(NP) ranks with Accordion under horovodrun on digits (runs/demo: CSV, TensorBoard, PNGs)"
	@echo "make build       rebuild the C++/CUDA extension (incremental)"
	@echo "make cuda-check  compile every CUDA kernel for sm_80 and sm_90 (skips without nvcc)"
	@echo "make peer-tests  Horovod 0.28.1's own optimizer tests with our compressor, 2 ranks (HOROVOD_SRC=<clone of horovod>, else GitHub)"

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

# Horovod's own optimizer tests (test/parallel/test_torch.py of v0.28.1, the tests that build
# hvd.DistributedOptimizer) with our compressor injected, 2 ranks under horovodrun --gloo; the
# table at the end. Horovod's file comes from HOROVOD_SRC (a git clone or mirror of
# horovod/horovod) or from GitHub, checked against a pinned sha256, into build/peer/. Not part
# of `make test` (CI cannot reach GitHub). docs/testing.md, "Horovod's own optimizer tests".
HOROVOD_SRC  ?=
PEER_RESULTS ?= build/peer/results
peer-tests: setup
	$(PY) benchmarks/peer/run.py --results $(PEER_RESULTS) $(if $(HOROVOD_SRC),--horovod-src $(HOROVOD_SRC))

clean:
	rm -rf build accordion_hvd/_C*.so
