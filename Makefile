# Two commands do all the set-up: `make demo` and `make test` (and `make test-fast`, the suite
# without the tests marked slow). Each creates $(VENV) if it is missing, puts torch into it,
# installs kvcached with its test extras (building the compiled core), and runs.
#
# torch: without a GPU, the CPU wheel $(TORCH_CPU) is installed. With a GPU (nvidia-smi sees
# one, or /dev/nvidia0 exists), nothing is installed over the torch you have: $(VENV) is made with
# --system-site-packages so that the system's torch (built for your CUDA) is used; if there is
# none, make stops and says how to install the one for your CUDA into $(VENV).

PYTHON ?= python3
VENV ?= .venv
TORCH_CPU ?= torch==2.13.0
# Extra pip options for the CPU wheel, e.g. --index-url https://download.pytorch.org/whl/cpu
TORCH_PIP_OPTIONS ?=
# Extra options: for pytest (ARGS="-x -k budget"), for the demo (ARGS=--quick)
ARGS ?=

PY := $(VENV)/bin/python
# Remade when setup.py, pyproject.toml or a source of the compiled core is newer: the editable
# install (and the build) again.
INSTALLED := $(VENV)/.kvcached-installed
CORE_SOURCES := $(wildcard kvcached/core/*.pyx kvcached/core/*.pxd kvcached/tp/*.pyx kvcached/tp/*.pxd)
HAS_GPU := $(shell (nvidia-smi -L >/dev/null 2>&1 || test -e /dev/nvidia0) && echo yes)

.PHONY: demo test test-fast

demo: $(INSTALLED)
	$(PY) -m kvcached.demo $(ARGS)

# Exactly what CI runs (.ci/run calls `make test`).
test: $(INSTALLED)
	$(PY) -m pytest tests benchmarks --benchmark-disable -q $(ARGS)

# The fast lane: the tests not marked slow, on two workers (pytest-xdist).
test-fast: $(INSTALLED)
	$(PY) -m pytest tests benchmarks --benchmark-disable -q -m "not slow" -n 2 $(ARGS)

$(PY):
	$(PYTHON) -m venv $(if $(HAS_GPU),--system-site-packages) $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.torch: | $(PY)
	@if $(PY) -c "import torch" 2>/dev/null; then \
	    echo "torch $$($(PY) -c 'import torch; print(torch.__version__)') is already in $(VENV): kept"; \
	elif [ -n "$(HAS_GPU)" ]; then \
	    echo "A GPU is present and $(VENV) has no torch: install the build for your CUDA into it first," >&2; \
	    echo "e.g. $(PY) -m pip install torch --index-url https://download.pytorch.org/whl/cu128," >&2; \
	    echo "then run make again (or install torch system-wide: $(VENV) sees the system's packages)." >&2; \
	    exit 1; \
	else \
	    echo "no GPU: installing the CPU wheel $(TORCH_CPU) into $(VENV)"; \
	    $(PY) -m pip install -q $(TORCH_PIP_OPTIONS) "$(TORCH_CPU)"; \
	fi
	touch $@

$(INSTALLED): setup.py pyproject.toml $(CORE_SOURCES) $(VENV)/.torch
	$(PY) -m pip install -q -e ".[test]"
	touch $@
