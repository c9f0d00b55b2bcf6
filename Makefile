# Two entry points, each working from a fresh clone: `make demo` and `make test`.
# `make test` (and `make lint`) install the project editable with its test extras: the development setup,
# whose .venv imports the working tree. `make demo` needs only the runtime dependencies (the test extras'
# torch alone is 750 MB): on a clone without the development setup it installs the project as a user would
# (not editable, so the build backend has nothing to warn about), again whenever a source file changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEV := $(VENV)/.installed
RUNTIME := $(VENV)/.runtime
SOURCES := $(shell find fmoe_jax models offload convert -type f -not -path '*/__pycache__/*' 2>/dev/null)

.PHONY: demo test lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip

$(DEV): pyproject.toml | $(PY)
	$(VENV)/bin/pip install -q -e ".[test]"
	touch $(DEV)

$(RUNTIME): pyproject.toml $(SOURCES) | $(PY)
	$(VENV)/bin/pip install -q .
	touch $(RUNTIME)

# The console script, not `python -m`: that would put the working tree first on sys.path, where
# fmoe_jax.models (models/) is not under fmoe_jax/.
demo: $(if $(wildcard $(DEV)),$(DEV),$(RUNTIME))
	$(VENV)/bin/fmoe-demo

test: $(DEV)
	$(PY) -m pytest -q -n 2 --dist loadfile  # two workers, one test file each at a time

lint: $(DEV)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build
