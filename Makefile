# Two entry points, each working from a fresh clone: `make demo` and `make test`.
# Both create .venv and install the project with its test extras first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m fmoe_jax.demo

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile  # two workers, one test file each at a time

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
