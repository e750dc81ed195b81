# Two commands for a fresh machine:
#   make demo   set up .venv and run `msa demo`
#   make test   set up .venv, run the whole test suite and `mypy --strict src`
# and one for the external libraries' contracts:
#   make conformance   msa's adapters against the real vLLM 0.33.0 fmha_sm100 and FlashInfer
#                      0.7.2.post1 Python code, msa's vLLM plugin through vLLM 0.33.0's own plugin
#                      loader and MiniMax-M3 backends, the SGLang drop-in under SGLang 0.5.23's
#                      decode layer, on the CPU (downloads the pinned wheels once)
# and the GPU gate, on a CUDA machine (run it on the final commit of any change to a kernel, a
# launcher or a backend, and commit its record):
#   make gpu-check         every kernel path twice eagerly and in a replayed CUDA graph against the
#                          reference with NaN in every unread byte, then the `-m gpu` suite and the
#                          flaky-prone tests repeated (tests/gpu_check.py); writes GPU_CHECK_RECORD
#   make gpu-check-status  whether that record was made on the src/ of HEAD
PYTHON ?= python3
VENV   ?= .venv
# The CPU build of torch (CI and the development machines have no GPU), from PyTorch's CPU-only
# wheel index: the `+cpu` pin matches only that index's wheel, so pip never takes PyPI's CUDA
# build and its ~28 nvidia-*/CUDA packages (several GB). That step runs with `--retries 0`: where
# the index cannot be reached (a machine with a local wheel mirror, like CI) pip skips it at once
# and silently, instead of ~8 s of retries with backoff for torch and for each of its 9
# dependencies, and takes the mirror's wheel.
# On a GPU machine clear the index too, or `==2.11.0` matches the CPU index's 2.11.0+cpu:
# `make test TORCH=torch==2.11.0 TORCH_INDEX=` (PyPI's CUDA build; or TORCH_INDEX=<a CUDA index
# of PyTorch's>), or use an existing environment (`pip install -e .`).
TORCH       ?= torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.msa-installed
# conformance: the pinned wheels are cached here (vLLM's is ~336 MB) and unpacked beside
CONF_WHEELS ?= .cache/wheels
CONF_SITE   ?= .cache/conformance/site
CONF_STAMP   = $(CONF_SITE)/.conformance-installed

.PHONY: demo test test-slow typecheck pytest clean conformance gpu-check gpu-check-status

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --retries 0 $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) "$(TORCH)"
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/msa demo

pytest: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -p no:cacheprovider -m "not slow"

# the cases marked slow (larger interpreter runs, and the TP2/TP4 sm_90 spill compiles the GPU gate also
# runs; every kernel path is also covered by `make test`)
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

# the GPU machine's own python and torch (no venv): GPU_PYTHON=python3
GPU_PYTHON       ?= python3
GPU_CHECK_RECORD ?= benchmarks/results/gpu-check.txt

gpu-check:
	PYTHONPATH=src:tests:$$PYTHONPATH PYTHONUNBUFFERED=1 $(GPU_PYTHON) tests/gpu_check.py --record $(GPU_CHECK_RECORD)

# the record's first line is `src <tree hash>`; HEAD's src/ must be that tree
gpu-check-status:
	@ran=$$(sed -n 's/^src \([0-9a-f]*\).*/\1/p' $(GPU_CHECK_RECORD) 2>/dev/null | head -n 1); \
	now=$$(git rev-parse HEAD:src); \
	if [ "$$ran" = "$$now" ]; then echo "gpu-check ran on HEAD's src/ ($$now): $$(sed -n 2p $(GPU_CHECK_RECORD))"; \
	else echo "gpu-check has NOT run on HEAD's src/: the record says $${ran:-nothing}, src/ is $$now"; exit 1; fi

clean:
	rm -rf $(VENV) build src/*.egg-info .mypy_cache .pytest_cache
