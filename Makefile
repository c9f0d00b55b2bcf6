# Two entry points, each working from a fresh clone: `make demo` and `make test`.
# Both install the project editable into .venv, so that .venv/bin/python imports the working tree from any
# directory. `make demo` installs only the runtime dependencies (the test extras' torch alone is 750 MB);
# `make test` and `make lint` add the test extras. Installs skip compiling every installed module to
# bytecode (--no-compile: transformers alone has thousands of files); Python compiles what it imports.
#
# setuptools emits one information-only note (its class is InformationOnly) on every editable install of a
# package whose subpackages live outside its folder (fmoe_jax.models is models/, see pyproject.toml): "be
# careful with folders in your working directory with the same name as your package". It does not apply
# here and is filtered by its message; any other warning of the build backend still shows.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := PYTHONWARNINGS="ignore:Editable installation" $(VENV)/bin/pip
DEV := $(VENV)/.installed
RUNTIME := $(VENV)/.runtime

.PHONY: demo test lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip

$(DEV): pyproject.toml | $(PY)
	$(PIP) install -q --no-compile -e ".[test]"
	touch $(DEV)

$(RUNTIME): pyproject.toml | $(PY)
	$(PIP) install -q --no-compile -e .
	touch $(RUNTIME)

demo: $(if $(wildcard $(DEV)),$(DEV),$(RUNTIME))
	$(PY) -m fmoe_jax.demo

# The tests start dozens of Python processes (two workers, CLIs, benchmarks), each importing jax, transformers
# and torch. Where the environment sets PYTHONDONTWRITEBYTECODE, none of them would leave the bytecode of what
# it compiled, and each would compile those packages' sources anew (~5 s a process here); the test run lets
# them write it into .venv.
test: $(DEV)
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -n 2 --dist loadfile  # two workers, a test file each at a time

lint: $(DEV)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build
