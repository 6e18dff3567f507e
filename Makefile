# kdtree: `make run` (set-up + the default pipeline on the embedded tiny model), `make test` (set-up + all tests).
PYTHON ?= python3
VENV   ?= .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.kdtree-installed
NVCC   ?= $(shell command -v nvcc 2>/dev/null)
# make run's overrides: the native CPU library and the tree shape that was fastest on a 2-core CPU in the bench
# sweep (README, Benchmarks). Production GPUs want bigger budgets: `python -m kdtree.run tree.budget=64 ...`.
RUN_ARGS ?= backend=cpu tree.budget=8

.PHONY: setup native run test bench clean

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
	$(VPY) -m pytest -q tests

bench: setup native
	$(VPY) -m pytest -q tests/bench --benchmark-enable --benchmark-only --benchmark-autosave

clean:
	rm -rf native/build runs multirun outputs .pytest_cache
