# kdtree: `make run` (set-up + the default pipeline on the embedded tiny model), `make test` (set-up + all tests).
PYTHON ?= python3
VENV   ?= .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.kdtree-installed
NVCC   ?= $(shell command -v nvcc 2>/dev/null)
# make run's overrides: the native CPU library and the tree shape that was fastest on a 2-core CPU in the bench
# sweep (README, Benchmarks). Production GPUs want bigger budgets: `python -m kdtree.run tree.budget=64 ...`.
RUN_ARGS ?= backend=cpu tree.budget=8

.PHONY: setup native run test bench gpu-wheels clean

setup: $(STAMP)

# torch is pinned to the CPU wheel here (the test extra); a looser pin would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(VPY) -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $@

native: setup
	@if [ -f native/Makefile ]; then $(MAKE) -C native NVCC="$(NVCC)"; fi

# Serves until Ctrl-C; that ending (exit 130) is the normal one, not a make error.
run: setup native
	$(VPY) -m kdtree.run $(RUN_ARGS) || [ $$? -eq 130 ]

test: setup native
	$(VPY) -m pytest -q --durations=25 tests

bench: setup native
	$(VPY) -m pytest -q tests/bench --benchmark-enable --benchmark-only --benchmark-autosave

# The five wheels native/gpu_check.sh installs on the GPU image (python 3.12, no package registry there); then
# run native/gpu_check.sh there with .whl/ carried along (the header of native/gpu_check.sh says how).
gpu-wheels: setup
	$(VPY) -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_17_x86_64 -d .whl cffi==2.1.1 pycparser==3.12 hydra-core==1.3.8 \
	  omegaconf==2.3.1
	$(VPY) -m pip wheel -q --disable-pip-version-check --no-deps -w .whl antlr4-python3-runtime==4.9.3
	@ls .whl

clean:
	rm -rf native/build runs multirun outputs .pytest_cache
