# The project's commands. `make test` and `make demo` set everything up first (idempotent;
# seconds when already done). See README.md.
VENV   ?= .venv
PY     := $(VENV)/bin/python
NP     ?= 2

.PHONY: setup build test test-fast demo cuda-check peer-tests install-check wheel clean help

help:
	@echo "make setup       install Open MPI, .venv (torch, Horovod 0.28.1 with MPI+Gloo) and build accordion_hvd"
	@echo "make test        set up, then run the whole test suite (incl. horovodrun with Gloo and MPI)"
	@echo "make demo        set up, then train $(NP) ranks with Accordion under horovodrun on digits (runs/demo: CSV, TensorBoard, PNGs)"
	@echo "make build       rebuild the C++/CUDA extension (incremental)"
	@echo "make cuda-check  compile every CUDA kernel for sm_80 and sm_90 (skips without nvcc)"
	@echo "make install-check  install as the README says in a fresh venv with torch only, then DDP hook and DiLoCo runs"
	@echo "make wheel       a wheel in dist/, tagged with the torch it was built against"
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

# A torch user's install as the README says it, in a fresh venv with torch only (no Horovod),
# then the DDP hook and DiLoCo under torchrun (scripts/install_check.sh; CI runs it).
install-check: setup
	@scripts/install_check.sh

# A wheel tagged with the torch its extension was built against (0.1.0+torch<version>), in dist/.
wheel: setup
	ACCORDION_WHEEL_TORCH_TAG=1 $(PY) -m pip wheel --no-build-isolation --no-deps -w dist .

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
