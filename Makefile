# Two commands for a fresh machine:
#   make demo   set up .venv and run `msa demo`
#   make test   set up .venv, run the whole test suite and `mypy --strict src`
# and one for the external kernel libraries' contracts:
#   make conformance   msa's adapters against the real vLLM 0.33.0 fmha_sm100 and FlashInfer
#                      0.7.2.post1 Python code, on the CPU (downloads the pinned wheels once)
PYTHON ?= python3
VENV   ?= .venv
# The CPU build of torch (CI and the development machines have no GPU). On a GPU machine with
# its own torch, run e.g. `make test TORCH=torch==2.11.0` or use an existing environment.
TORCH  ?= torch==2.13.0
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.msa-installed
# conformance: the pinned wheels are cached here (vLLM's is ~336 MB) and unpacked beside
CONF_WHEELS ?= .cache/wheels
CONF_SITE   ?= .cache/conformance/site
CONF_STAMP   = $(CONF_SITE)/.conformance-installed

.PHONY: demo test test-slow typecheck pytest clean conformance

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

$(CONF_STAMP): $(STAMP) tests/conformance/install.py
	$(PY) tests/conformance/install.py --wheels $(CONF_WHEELS) --site $(CONF_SITE)

# the real libraries' Python code with only their compiled kernels intercepted (tests/conformance);
# MSA_CONFORMANCE=1 turns a missing package into a failure instead of a skip
conformance: $(CONF_STAMP)
	MSA_CONFORMANCE=1 PYTHONPATH=$(CONF_SITE) TRITON_INTERPRET=1 $(PY) -m pytest -q -p no:cacheprovider tests/conformance

clean:
	rm -rf $(VENV) build src/*.egg-info .mypy_cache .pytest_cache
