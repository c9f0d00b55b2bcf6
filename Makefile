# Two entry points, each working from a fresh clone: `make demo` and `make test`.
# Both install the project editable into .venv, so that .venv/bin/python imports the working tree from any
# directory. `make demo` installs only the runtime dependencies (the test extras' torch alone is 750 MB);
# `make test` and `make lint` add the test extras. Installs skip compiling every installed module to
# bytecode (--no-compile: transformers alone has thousands of files); Python compiles what it imports, and
# `make test` compiles the lot before its run (see there).
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

# Bytecode: the installs leave none (--no-compile), and where the environment sets PYTHONDONTWRITEBYTECODE no
# process writes any, so each of the dozens of Python processes the tests start (two workers, CLIs,
# benchmarks) would compile jax, transformers and torch from source (~5 s a process on this machine). The
# test run first compiles whatever is stale, once (~25 s from nothing on two cores, ~4 s when all is fresh),
# so no test process writes bytecode of its own (in a trial run that let them, concurrent writers left
# truncated files that every later import failed on). compileall's exit status is ignored: torch ships a
# helper only Python 3.12 compiles, which no test imports.
test: $(DEV)
	$(PY) -m compileall -qq -j 0 $$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") \
		fmoe_jax models offload convert research benchmarks || true
	$(PY) -m pytest -q -n 2 --dist loadfile  # two workers, one test file each at a time

lint: $(DEV)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build
