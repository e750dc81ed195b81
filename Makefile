# Two commands for a fresh machine:
#   make demo   set up .venv and run `msa demo`
#   make test   set up .venv, run the whole test suite and `mypy --strict src`
PYTHON ?= python3
VENV   ?= .venv
# The CPU build of torch (CI and the development machines have no GPU). On a GPU machine with
# its own torch, run e.g. `make test TORCH=torch==2.11.0` or use an existing environment.
TORCH  ?= torch==2.13.0
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.msa-installed

.PHONY: demo test test-slow typecheck pytest clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/msa demo

pytest: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -p no:cacheprovider -m "not slow"

# the cases marked slow (larger interpreter runs; every kernel path is also covered by `make test`)
test-slow: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -p no:cacheprovider -m slow

typecheck: $(STAMP)
	$(PY) -m mypy --strict src
	$(PY) -m mypy --check-untyped-defs benchmarks
	$(VENV)/bin/ruff check src tests benchmarks

test: pytest typecheck

clean:
	rm -rf $(VENV) build src/*.egg-info .mypy_cache .pytest_cache
